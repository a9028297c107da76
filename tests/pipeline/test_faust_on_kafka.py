"""faust-streaming 0.15.3 against our Kafka 4.x: an agent, a Table with its changelog, and
recovery of the table from the changelog after a restart (the sentence gate depends on this)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.bus import ensure_topics, make_consumer, make_producer

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]
PROBE = Path(__file__).with_name("faust_probe.py")


def probe_log(datadir: Path) -> Path:
    return datadir / "probe.log"


def start_probe(settings, source: str, sink: str, datadir: Path) -> subprocess.Popen:
    # faust logs at info into a file (not a pipe nobody reads while it runs): a failure shows
    # what its consumer, recovery and agent did
    datadir.mkdir(parents=True, exist_ok=True)
    with open(probe_log(datadir), "w") as log:
        return subprocess.Popen(
            [sys.executable, str(PROBE), settings.bootstrap, settings.gate_app_id, source, sink, str(datadir)],
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )


def stop_probe(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return probe_log(Path(proc.args[-1])).read_text(errors="replace")[-12000:]


async def wait_ready(proc: subprocess.Popen, timeout: float = 90.0) -> None:
    """Until the probe's faust worker logs that it has recovered its tables and is ready."""
    log = probe_log(Path(proc.args[-1]))
    deadline = time.monotonic() + timeout
    while "[^Worker]: Ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"faust probe not ready (exit code {proc.poll()}):\n" + stop_probe(proc))
        await asyncio.sleep(0.2)


async def wait_for_committed(settings, group: str, tp: TopicPartition, offset: int, timeout: float = 90.0) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        async def poll() -> None:
            while True:
                committed = await admin.list_consumer_group_offsets(group, partitions=[tp])
                if tp in committed and committed[tp].offset >= offset:
                    return
                await asyncio.sleep(0.5)

        await asyncio.wait_for(poll(), timeout)
    finally:
        await admin.close()


async def read_values(consumer, n: int, timeout: float = 90.0) -> list[str]:
    values: list[str] = []

    async def take() -> None:
        while len(values) < n:
            for recs in (await consumer.getmany(timeout_ms=300)).values():
                values.extend(r.value.decode() for r in recs)

    await asyncio.wait_for(take(), timeout)
    return values


async def test_agent_and_table_with_changelog_survive_a_restart(make_settings, tmp_path):
    settings = make_settings()
    source, sink = f"{settings.text_topic_prefix}probe", f"{settings.synthesis_topic}"
    changelog = f"{settings.gate_app_id}-counts-changelog"
    await ensure_topics(settings, [source, sink], partitions=1)
    sink_reader = make_consumer(settings, sink, group_id=f"{settings.gate_app_id}-sink-reader")
    await sink_reader.start()
    probe = start_probe(settings, source, sink, tmp_path / "faust-1")
    try:
        async with make_producer(settings) as producer:
            for key in ["s1", "s2", "s1", "s1"]:
                await producer.send_and_wait(source, b"x", key=key.encode())
            try:
                first = await read_values(sink_reader, 4)
            except asyncio.TimeoutError:
                pytest.fail("faust agent produced nothing:\n" + stop_probe(probe))
            assert first == ["s1=1", "s2=1", "s1=2", "s1=3"]  # one partition: in order
            # faust commits source offsets every few seconds: stop only after it has, or the
            # restarted worker would rightly process those events again
            await wait_for_committed(settings, settings.gate_app_id, TopicPartition(source, 0), 4)
            stop_probe(probe)

            # the table lives in the changelog topic...
            changelog_reader = make_consumer(settings, changelog, group_id=f"{settings.gate_app_id}-cl-reader")
            await changelog_reader.start()
            try:
                changes = await read_values(changelog_reader, 1, timeout=30)
            finally:
                await changelog_reader.stop()
            assert changes

            # ...so a restarted worker recovers it and goes on counting. The event goes out once
            # the worker is ready: one sent while it was still recovering its table was, twice in
            # ~30 runs beside busy cores, never processed (faust's recovery, not this probe's
            # concern; see docs/gate.md)
            probe = start_probe(settings, source, sink, tmp_path / "faust-2")
            await wait_ready(probe)
            await producer.send_and_wait(source, b"x", key=b"s1")
            try:
                after = await read_values(sink_reader, 1)
            except asyncio.TimeoutError:
                pytest.fail("restarted faust agent produced nothing:\n" + stop_probe(probe))
            assert after == ["s1=4"]
    finally:
        stop_probe(probe)
        await sink_reader.stop()
