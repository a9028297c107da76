"""Start in any order: the stages started by hand, as a user does, each with its
own `voicebus` command, on a new broker (a fresh one of this test's own: no topic, not even
``__consumer_offsets``, exists yet): the edge first, then the gate, then the synthesis worker
(the gate before the worker), and no agent until all three run. Nothing loops on a missing
topic, nothing logs an error (on a fresh broker aiokafka's group consumer logged
GroupCoordinatorNotAvailable at ERROR until `voicebus.bus.await_group_coordinator`), and the
first agent's first turn (its topic made by `voicebus say`) is heard.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from voicebus.ops.broker import QUICK_START_JVM_OPTIONS, LocalKafka
from voicebus.ops.daemon import free_port
from voicebus.gate.app import READY_LINE
from voicebus.synthesis.cli import WORKER_READY_LINE
from voicebus.topics import fixed_topics
from voicebus.players.listener import Listener
from tests.conftest import _settings_factory, distinct_free_ports
from tests.waiting import eventually

pytestmark = pytest.mark.kafka

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bare_broker(kafka_jars, tmp_path_factory):
    """A new single-node broker for this test alone."""
    port, controller_port = distinct_free_ports(2)
    broker = LocalKafka(tmp_path_factory.mktemp("bare-kafka"), kafka_jars, port=port, controller_port=controller_port,
                        jvm_options=QUICK_START_JVM_OPTIONS, die_with_parent=True)
    try:
        broker.start(timeout=120)
        yield _settings_factory(broker.bootstrap, broker.port, broker.controller_port, tmp_path_factory)
    finally:
        broker.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.load(response).get("kafka") == "ready"
    except OSError:
        return False


async def _line(proc, prefix: str, log: Path, timeout: float = 240) -> str:
    """The first stdout line of `proc` that starts with `prefix`."""
    async def read() -> str:
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"the process exited before {prefix!r}:\n{log.read_text()[-3000:]}")
            if line.startswith(prefix):
                return line
    return await asyncio.wait_for(read(), timeout)


async def test_edge_gate_worker_started_by_hand_before_any_agent_log_no_error_and_speak_the_first_turn(
        bare_broker, tmp_path):
    settings = bare_broker(edge_port=free_port(), partitions=2)
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        assert not set(await admin.list_topics()) & {*fixed_topics(settings), "__consumer_offsets"}, "a bare broker"
    finally:
        await admin.close()
    commands = {
        "edge": ["edge"],
        "gate": ["gate", "--announce", "--log-level", "INFO"],
        "worker": ["worker", "--tiny", "--announce", "--worker-id", "by-hand"],
    }
    procs: dict[str, asyncio.subprocess.Process] = {}
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    try:
        for name, args in commands.items():  # in this order, each once the one before is up
            with logs[name].open("w") as err:
                procs[name] = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "voicebus", *args, cwd=REPO_ROOT, env=env,
                    stdout=subprocess.PIPE, stderr=err)
            if name == "edge":
                health = f"http://127.0.0.1:{settings.edge_port}/healthz"
                await eventually(lambda: asyncio.to_thread(_healthy, health), timeout_s=240,
                                 what="the edge's Kafka link ready")
            else:
                await _line(procs[name], READY_LINE if name == "gate" else WORKER_READY_LINE, logs[name])
        async with Listener(f"http://127.0.0.1:{settings.edge_port}", "by-hand", settings.edge_secret) as listener:
            say = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "voicebus", "say", "The first words. And a second sentence.",
                "--agent", "newcomer", "--session", "by-hand", "--turn", "t1",
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            said = (await asyncio.wait_for(say.communicate(), 120))[0].decode()
            assert say.returncode == 0, said
            heard = await listener.wait_turn_end("t1", timeout=240)
        assert {sentence for _, sentence, _, _ in heard.frames} == {0, 1}, heard
        for name, proc in procs.items():
            assert proc.returncode is None, f"{name} exited:\n{logs[name].read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.terminate()
        for proc in procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
    for name, log in logs.items():
        text = log.read_text()
        lines = text.splitlines()
        assert not [line for line in lines if "not found in cluster metadata" in line], (name, text[-3000:])
        assert " ERROR " not in text and "Traceback" not in text, (name, text[-3000:])
        # aiokafka may warn about a leader election or two while brand-new topics get their leaders
        warnings = [line for line in lines if " WARNING aiokafka" in line]
        assert len(warnings) < 20, (name, warnings)
