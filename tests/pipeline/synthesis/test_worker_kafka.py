"""The synthesis worker through the real broker (tests/conftest.py starts it) with the tiny
random-weight engine: requests in, chunks out in order; cancel purges queued and in-flight work;
two workers share the load; a worker killed mid-turn leaves no lost sentence."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest

from voicebus.ops.daemon import free_port
from voicebus.bus import ensure_topics, make_consumer, make_producer, publish, read_to_end
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.schemas.messages import SynthesisRequest
from voicebus.synthesis.worker import SynthesisWorker
from tests.waiting import eventually

pytestmark = pytest.mark.kafka

REPO_ROOT = Path(__file__).resolve().parents[3]
# one-word sentences: the tiny engine's decoder is full size, and this machine's 2 cores are shared
SENTENCES = ["One.", "Two.", "Three.", "Four.", "Five.", "Six."]
WAIT_S = 300.0


@pytest.fixture(scope="module")
def engine():
    from voicebus.synthesis.engine import SynthesisEngine

    engine = SynthesisEngine.tiny(seed=0)
    for _ in engine.stream("Hello.", "a", "af_heart"):  # warm once here; workers then skip it
        pass
    return engine


def request(session, turn, seq, text, last=False):
    t = now_us()
    return SynthesisRequest(session_id=session, turn_id=turn, agent_id="test", sentence_seq=seq, text=text,
                            language="a", voice="af_heart", speed=1.0, is_last_in_turn=last,
                            first_token_at_us=t - 3000, text_complete_at_us=t - 2000, released_at_us=t - 1000)


def turn_requests(session, turn, texts):
    return [request(session, turn, i, text, last=i == len(texts) - 1) for i, text in enumerate(texts)]


def cancel_event(session, turn):
    return {"session_id": session, "turn_id": turn, "action": "CANCEL", "reason": "barge-in", "source": "test",
            "issued_at_us": now_us()}


class Bus:
    """A producer and an audio-topic reader for one test; owns both."""

    def __init__(self, settings):
        self.settings = settings
        self.codec = Codec()
        self.chunks: list[dict] = []
        self._producer = make_producer(settings)
        self._audio = make_consumer(settings, settings.audio_topic, group_id=None, auto_offset_reset="earliest")
        self._reader: asyncio.Task | None = None

    async def __aenter__(self):
        try:
            await ensure_topics(self.settings)
            await self._producer.start()
            await self._audio.start()
        except BaseException:
            await self.__aexit__()
            raise
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc):
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._audio.stop()
        await self._producer.stop()

    async def _read(self):
        while True:
            batch = await self._audio.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    self.chunks.append(self.codec.decode(record.value, expect="AudioChunk").value)

    async def requests(self, values):
        for value in values:
            await publish(self._producer, self.codec, self.settings.synthesis_topic, "SynthesisRequest", value)

    async def cancel(self, session, turn):
        await publish(self._producer, self.codec, self.settings.control_topic, "ControlEvent", cancel_event(session, turn))

    async def raw(self, topic, value: bytes, key: bytes):
        await self._producer.send_and_wait(topic, value, key=key)

    def of(self, session, turn=None):
        return [c for c in self.chunks if c["session_id"] == session and (turn is None or c["turn_id"] == turn)]

    async def wait_for(self, condition, timeout=WAIT_S, what="condition"):
        await eventually(condition, timeout_s=timeout, what=what, detail=lambda: f"{len(self.chunks)} chunks so far")


async def _all_committed(worker) -> dict | None:
    """The worker's commit state once every assigned partition is committed to its end, else None."""
    commits = await worker.commit_state()
    return commits if all(committed == end for committed, end in commits.values()) else None


def turn_done(bus, session, turn):
    return lambda: any(c["is_last_in_turn"] for c in bus.of(session, turn))


def complete_sentences(chunks) -> set[int]:
    """Sentences of which one worker published every chunk 0..last."""
    by_sentence_worker = defaultdict(list)
    for c in chunks:
        by_sentence_worker[(c["sentence_seq"], c["worker_id"])].append(c)
    done = set()
    for (seq, _), cs in by_sentence_worker.items():
        seqs = sorted(c["chunk_seq"] for c in cs)
        last = [c for c in cs if c["is_last_chunk"]]
        if last and seqs == list(range(last[0]["chunk_seq"] + 1)):
            done.add(seq)
    return done


async def test_requests_in_chunks_out_in_order_per_session(make_settings, engine):
    settings = make_settings(worker_max_in_flight=2, partitions=2)
    async with Bus(settings) as bus:
        # a turn cancelled just before the worker starts: the worker must not speak it
        await bus.requests(turn_requests("early", "gone", SENTENCES[:2]))
        await bus.cancel("early", "gone")
        await bus.raw(settings.synthesis_topic, b"not avro", b"s1")  # dead-lettered, not fatal
        metrics_port = free_port()
        async with SynthesisWorker(settings, engine, worker_id="w1", warm_up=False, metrics_port=metrics_port) as worker:
            await bus.requests(turn_requests("s1", "t1", SENTENCES[:2]))
            await bus.requests(turn_requests("s2", "t1", SENTENCES[2:3] + [""]))  # "" = end-of-turn marker
            await bus.requests(turn_requests("early", "later", SENTENCES[3:4]))
            for session, turn in [("s1", "t1"), ("s2", "t1"), ("early", "later")]:
                await bus.wait_for(turn_done(bus, session, turn), what=f"{session}/{turn}")
            # the commit task commits what is settled on its own interval: wait for it to land
            commits = await eventually(
                lambda: _all_committed(worker), what="every settled request committed")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{settings.edge_host}:{metrics_port}/metrics") as response:
                    metrics_text = await response.text()
                async with http.get(f"http://{settings.edge_host}:{metrics_port}/healthz") as response:
                    health_status, health = response.status, await response.json()
        assert worker.scheduler.peak_in_flight == 2, "8 requests through a worker holding at most 2"
        assert bus.of("early", "gone") == []
        for session, n in [("s1", 2), ("s2", 2)]:
            chunks = bus.of(session)
            order = [(c["sentence_seq"], c["chunk_seq"]) for c in chunks]
            assert order == sorted(order), "chunks of a session arrive in order"
            assert complete_sentences(chunks) == set(range(n))
            assert [c["is_last_in_turn"] for c in chunks].count(True) == 1
            for c in chunks:
                assert c["worker_id"] == "w1"
                assert (c["released_at_us"] <= c["request_received_at_us"] <= c["synthesis_started_at_us"]
                        <= c["audio_ready_at_us"] <= c["published_at_us"])
                assert c["pcm"] or (c["is_last_chunk"] and session == "s2")
        assert 'voicebus_worker_requests_total{outcome="spoken"} 5.0' in metrics_text
        assert 'voicebus_worker_requests_total{outcome="cancelled"} 2.0' in metrics_text
        assert 'voicebus_records_dead_lettered_total{reason="malformed",stage="worker"} 1.0' in metrics_text \
            or 'voicebus_records_dead_lettered_total{stage="worker",reason="malformed"} 1.0' in metrics_text
        assert health_status == 200 and health["healthy"] and health["restarts"] == 0
        assert set(health["tasks"]) == {"control", "fetch", "synthesis", "commit", "lag"}
        assert "voicebus_worker_queue_depth 0.0" in metrics_text
        assert "voicebus_worker_realtime_factor_count 4.0" in metrics_text  # the sentences with audio
        assert "voicebus_worker_consumer_lag" in metrics_text
        marker = [c for c in bus.of("s2") if c["sentence_seq"] == 1]
        assert len(marker) == 1 and marker[0]["pcm"] == b"" and marker[0]["is_last_in_turn"]
        assert len(commits) == 2
        assert all(committed == end for committed, end in commits.values()), f"all settled requests committed: {commits}"
        dead = await eventually(lambda: read_to_end(settings, [settings.deadletter_topic]), what="the dead letter")
        assert [r.value for r in dead] == [b"not avro"]


async def test_cancel_purges_queued_and_in_flight_work(make_settings, engine):
    settings = make_settings(worker_max_in_flight=8, partitions=1)
    # the first sentence has two pieces (the engine cuts the first at 8 words): the cancel lands
    # while the second piece is synthesized
    texts = ["One two three four five six seven eight, nine ten.", "Two.", "Three.", "Four."]
    async with Bus(settings) as bus:
        async with SynthesisWorker(settings, engine, worker_id="w1", warm_up=False) as worker:
            await bus.requests(turn_requests("s1", "t1", texts))
            await bus.wait_for(lambda: bus.of("s1", "t1"), what="first chunk of t1")
            await bus.cancel("s1", "t1")
            await bus.requests(turn_requests("s1", "t2", SENTENCES[:1]))
            await bus.wait_for(turn_done(bus, "s1", "t2"), what="the next turn")
            observation = next(o for o in worker.cancel_log if o.turn_id == "t1")
            outcomes = {s.labels["outcome"]: s.value for m in worker.metrics.requests.collect() for s in m.samples
                        if s.name.endswith("_total")}
        cancelled = bus.of("s1", "t1")
        assert all(c["published_at_us"] <= observation.seen_at_us for c in cancelled), \
            "no chunk of a cancelled turn after the worker saw the cancel"
        assert not any(c["is_last_in_turn"] for c in cancelled)
        assert {c["sentence_seq"] for c in cancelled} == {0}
        assert observation.purged == 3  # queued sentences skipped without synthesis
        assert outcomes.get("cancelled", 0) + outcomes.get("stopped", 0) == 4
        assert outcomes.get("spoken") == 1  # the next turn
        assert complete_sentences(bus.of("s1", "t2")) == {0}


async def test_a_worker_slower_than_real_time_says_so_and_measures_it(make_settings, engine, caplog):
    # The worker's clock (injected) moves 10 s at every reading: each sentence looks made far
    # slower than it plays, as on a CPU too slow for the model.
    readings = itertools.count()
    settings = make_settings(worker_max_in_flight=2, partitions=1)
    async with Bus(settings) as bus:
        async with SynthesisWorker(settings, engine, worker_id="slow", warm_up=False,
                                   clock_us=lambda: now_us() + next(readings) * 10_000_000) as worker:
            await bus.requests(turn_requests("s1", "t1", SENTENCES[:3]))
            await bus.wait_for(turn_done(bus, "s1", "t1"), what="the turn")
    [warning] = [r for r in caplog.records if "slower than it plays" in r.getMessage()]
    assert warning.levelname == "WARNING" and "VOICEBUS_SYNTHESIS_THREADS" in warning.getMessage()
    registry = worker.metrics.registry
    assert registry.get_sample_value("voicebus_worker_realtime_factor_count") == 3
    assert registry.get_sample_value("voicebus_worker_realtime_factor_bucket", {"le": "1.0"}) == 0  # all above 1
    assert worker.speed.slow


def partition_of(session: str, partitions: int) -> int:
    from aiokafka.partitioner import murmur2

    return (murmur2(session.encode()) & 0x7FFFFFFF) % partitions


async def test_two_workers_share_the_load(make_settings, engine):
    settings = make_settings(worker_max_in_flight=2, partitions=4)
    async with Bus(settings) as bus:
        async with SynthesisWorker(settings, engine, worker_id="wA", warm_up=False) as a, \
                SynthesisWorker(settings, engine, worker_id="wB", warm_up=False) as b:
            # settled: during the rebalance one worker may still report its old, full assignment
            await bus.wait_for(lambda: a.assigned and b.assigned and len(a.assigned | b.assigned) == 4
                               and not a.assigned & b.assigned, timeout=WAIT_S, what="both workers assigned")
            sessions = []
            for owner in (a, b):
                owned = {tp.partition for tp in owner.assigned}
                sessions += [s for s in (f"s{i}" for i in range(200)) if partition_of(s, 4) in owned][:2]
            for session in sessions:
                await bus.requests(turn_requests(session, "t1", SENTENCES[:1]))
            for session in sessions:
                await bus.wait_for(turn_done(bus, session, "t1"), what=f"{session}/t1")
        workers = {c["worker_id"] for c in bus.chunks}
        assert workers == {"wA", "wB"}
        for session in sessions:
            chunks = bus.of(session)
            assert len({c["worker_id"] for c in chunks}) == 1
            assert complete_sentences(chunks) == {0}


async def test_worker_killed_mid_turn_leaves_no_lost_sentence(make_settings, engine, tmp_path):
    settings = make_settings(worker_max_in_flight=2, partitions=1, worker_session_timeout_ms=6000)
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT)}
    async with Bus(settings) as bus:
        await ensure_topics(settings)
        log_path = tmp_path / "doomed.log"
        log_file = log_path.open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "voicebus.synthesis.cli", "--tiny", "--worker-id", "doomed"],
            cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            await bus.requests(turn_requests("s1", "t1", SENTENCES))
            # kill it once it has finished sentence 0 (committed) and begun sentence 1
            await bus.wait_for(lambda: any(c["worker_id"] == "doomed" and c["sentence_seq"] >= 1 for c in bus.chunks),
                               timeout=WAIT_S, what="the subprocess worker's second sentence")
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log_file.close()
        stderr = log_path.read_text()
        spoken_by_doomed = complete_sentences([c for c in bus.chunks if c["worker_id"] == "doomed"])
        assert len(spoken_by_doomed) < len(SENTENCES), f"killed too late to be mid-turn:\n{stderr[-2000:]}"
        async with SynthesisWorker(settings, engine, worker_id="survivor", warm_up=False):
            await bus.wait_for(turn_done(bus, "s1", "t1"), timeout=WAIT_S, what="the rest of the turn")
        assert complete_sentences(bus.of("s1", "t1")) == set(range(len(SENTENCES))), "no sentence lost"
        survivor = [c for c in bus.chunks if c["worker_id"] == "survivor"]
        assert survivor, "the partition moved to the surviving worker"
        # the survivor starts at the first uncommitted request: sentence 0, finished and committed a
        # whole forward pass before the kill, is not spoken again
        assert 0 in spoken_by_doomed
        assert min(c["sentence_seq"] for c in survivor) >= 1
