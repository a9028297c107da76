"""`voicebus worker --announce`: the documented readiness signal of a synthesis worker process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from voicebus.synthesis.cli import WORKER_READY_LINE
from tests.pipeline.synthesis.test_worker_kafka import REPO_ROOT, SENTENCES, Bus, turn_done, turn_requests

pytestmark = pytest.mark.kafka


async def test_the_worker_announces_once_it_consumes_and_a_request_sent_after_is_spoken(make_settings, tmp_path):
    """Started before anything else (no topic exists yet), the worker creates the topics it uses,
    announces once it has joined its group, speaks what comes later, logs no error meanwhile and
    stops cleanly on SIGTERM."""
    settings = make_settings(partitions=1)
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT)}
    err_path = tmp_path / "worker.err"
    with err_path.open("w") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "voicebus", "worker", "--tiny", "--announce", "--worker-id", "announced",
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 240)).decode()
        assert line.startswith(WORKER_READY_LINE + " "), (line, err_path.read_text()[-3000:])
        ready = json.loads(line[len(WORKER_READY_LINE):])
        assert ready["worker_id"] == "announced" and ready["topic"] == settings.synthesis_topic
        assert ready["partitions"] == [0]
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
        await admin.start()
        try:
            topics = set(await admin.list_topics())
        finally:
            await admin.close()
        assert {settings.synthesis_topic, settings.control_topic, settings.audio_topic,
                settings.deadletter_topic} <= topics, "the worker created the topics it uses"
        async with Bus(settings) as bus:
            await bus.requests(turn_requests("s1", "t1", SENTENCES[:1]))
            await bus.wait_for(turn_done(bus, "s1", "t1"), timeout=120, what="the announced worker's turn")
            assert {c["worker_id"] for c in bus.chunks} == {"announced"}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert await proc.stdout.read() == b""  # announced once
        logged = err_path.read_text()
        assert " ERROR " not in logged and "Traceback" not in logged, logged[-3000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
