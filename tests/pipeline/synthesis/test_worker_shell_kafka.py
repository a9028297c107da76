"""The synthesis worker's promises under failure, through the real broker with the tiny engine:
a send the broker refuses is retried and its request stays uncommitted until the audio is
published; a sentence the engine cannot speak still ends its sentence and its turn,
with a reason; a request that breaks the contract is dead-lettered with its reason and
settled. (`--announce` and a worker started first: test_worker_cli.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import io

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from fastavro import parse_schema, schemaless_writer

from voicebus import schemas
from voicebus.bus import read_to_end
from voicebus.codecs import MAGIC, Codec
from voicebus.synthesis.worker import SynthesisWorker
from tests.pipeline.synthesis.test_worker_kafka import (
    Bus,
    complete_sentences,
    request,
    turn_done,
    turn_requests,
)
from tests.waiting import eventually

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def engine():
    from voicebus.synthesis.engine import SynthesisEngine

    engine = SynthesisEngine.tiny(seed=0)
    for _ in engine.stream("Hello.", "a", "af_heart"):  # warm once here; workers then skip it
        pass
    return engine


def total(metric) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


def outcomes(worker) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in worker.metrics.requests.collect() for s in m.samples
            if s.name.endswith("_total")}


async def set_topic_config(settings, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        [response] = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=configs)])
        errors = [r for r in response.resources if r[0] != 0]
        assert not errors, f"alter_configs {topic}: {errors}"
    finally:
        await admin.close()


async def test_a_refused_send_is_retried_and_its_request_stays_uncommitted_until_published(make_settings, engine):
    """9.3: the broker refuses the audio (the topic's max.message.bytes is below one chunk, a real
    broker-side MESSAGE_TOO_LARGE): the worker retries, does not commit the request, and once the
    topic takes the audio again the sentence arrives whole and is committed."""
    settings = make_settings(partitions=1, worker_publish_backoff_s=0.05, worker_publish_max_backoff_s=0.3)
    async with Bus(settings) as bus:
        await set_topic_config(settings, settings.audio_topic, {"max.message.bytes": "1000"})
        async with SynthesisWorker(settings, engine, worker_id="w1", warm_up=False) as worker:
            await bus.requests(turn_requests("s1", "t1", ["One."]))
            # (or settled: what the worker did before it retried, and the test then fails below)
            await eventually(lambda: total(worker.metrics.publish_retries) >= 3 or outcomes(worker), timeout_s=120,
                             what="the worker retrying the refused send")
            assert not outcomes(worker) and worker.scheduler.in_flight == 1, "still held, not settled"
            [(committed, end)] = (await worker.commit_state()).values()
            assert end == 1 and committed in (None, 0), "a request whose audio is not published is not committed"
            assert bus.of("s1") == []
            await set_topic_config(settings, settings.audio_topic, {"max.message.bytes": str(1024 * 1024 + 512)})
            await bus.wait_for(turn_done(bus, "s1", "t1"), what="the audio once the topic takes it")
            await eventually(async_committed(worker, 1), what="the request committed after its audio")
            settled = outcomes(worker)
        assert settled == {"spoken": 1.0}
        assert complete_sentences(bus.of("s1", "t1")) == {0}
        assert all(c["end_reason"] == "" for c in bus.of("s1"))


def async_committed(worker, offset: int):
    async def probe() -> bool:
        return all(committed == offset for committed, _ in (await worker.commit_state()).values())

    return probe


def contract_breaking_request() -> bytes:
    """A SynthesisRequest Avro accepts but the contract refuses (negative sentence_seq), written
    the way a careless producer without the codec's check would."""
    codec = Codec()
    buf = io.BytesIO()
    buf.write(MAGIC + codec.fingerprint_of("SynthesisRequest"))
    schemaless_writer(buf, parse_schema(schemas.load("SynthesisRequest")),
                      dataclasses.replace(request("bad", "t1", 0, "Hi."), sentence_seq=-1).to_record())
    return buf.getvalue()


async def test_a_sentence_the_engine_cannot_speak_still_ends_its_sentence_and_turn_with_a_reason(make_settings, engine):
    """10.3: the engine has no fallback voice and a request names a voice it lacks (NoVoices,
    the same on every retry). Its sentence is closed by an empty last chunk with end_reason; when
    it was the turn's last sentence, that chunk ends the turn. The request is settled as failed
    (committed); the other sentences are spoken. 10.1: a request that breaks the contract is
    dead-lettered with its reason and its offset settled."""
    settings = make_settings(partitions=1)
    strict = dataclasses.replace(engine, fallback_voice=None)
    t1 = turn_requests("s1", "t1", ["One.", "Two.", "Three."])
    t1[1] = dataclasses.replace(t1[1], voice="zz_missing")  # a failed sentence inside the turn
    t2 = turn_requests("s1", "t2", ["Four.", "Five."])
    t2[1] = dataclasses.replace(t2[1], voice="zz_missing")  # the turn's last sentence fails
    async with Bus(settings) as bus:
        await bus.raw(settings.synthesis_topic, contract_breaking_request(), b"bad")
        async with SynthesisWorker(settings, strict, worker_id="w1", warm_up=False) as worker:
            await bus.requests(t1 + t2)
            await bus.wait_for(turn_done(bus, "s1", "t1"), what="s1/t1")
            await bus.wait_for(turn_done(bus, "s1", "t2"), timeout=120, what="s1/t2 (its last sentence failed)")
            await eventually(async_committed(worker, 1 + len(t1) + len(t2)), what="every request committed")
            settled = outcomes(worker)
            failures = {s.labels["reason"]: s.value for m in worker.metrics.failures.collect() for s in m.samples
                        if s.name.endswith("_total")}
        assert settled == {"spoken": 3.0, "failed": 2.0}
        assert failures == {"no-voices": 2.0}
        for turn, failed_seq in (("t1", 1), ("t2", 1)):
            [closing] = [c for c in bus.of("s1", turn) if c["sentence_seq"] == failed_seq]
            assert closing["pcm"] == b"" and closing["is_last_chunk"] and closing["end_reason"] == "no-voices"
            assert closing["is_last_in_turn"] == (turn == "t2")
        assert complete_sentences(bus.of("s1", "t1")) == {0, 1, 2}
        [end_of_t1] = [c for c in bus.of("s1", "t1") if c["is_last_in_turn"]]
        assert end_of_t1["sentence_seq"] == 2 and end_of_t1["end_reason"] == ""
        assert bus.of("bad") == []
        [dead] = await eventually(lambda: read_to_end(settings, [settings.deadletter_topic]), what="the dead letter")
        headers = dict(dead.headers)
        assert headers["voicebus.error.reason"] == b"contract-violation"
        assert headers["voicebus.error.stage"] == b"worker"
        assert b"sentence_seq -1" in headers["voicebus.error.message"]


@pytest.fixture
def own_broker(tmp_path):
    """A broker of this test alone (it is stopped and started again mid-test; the session's
    broker is shared)."""
    from voicebus.ops.broker import QUICK_START_JVM_OPTIONS, LocalKafka, fetch_jars
    from voicebus.ops.daemon import free_port
    from voicebus.settings import Settings

    shared = Settings.from_env()
    port, controller_port = free_port(), free_port()
    while controller_port == port:
        controller_port = free_port()
    broker = LocalKafka(tmp_path / "kafka", fetch_jars(shared.kafka_dir, shared.kafka_version), port=port,
                        controller_port=controller_port, jvm_options=QUICK_START_JVM_OPTIONS, die_with_parent=True)
    try:
        broker.start(timeout=180)
        yield broker
    finally:
        broker.stop()


async def test_audio_whose_broker_went_down_is_published_after_the_restart_and_only_then_committed(
        own_broker, engine, tmp_path):
    """9.3 with the broker itself down: a request whose audio cannot be sent (refused, then the
    broker stopped and started again) is still held uncommitted when the broker is back, and its
    audio arrives, whole, once the topic takes it; only then is it committed."""
    from voicebus.settings import Settings

    settings = Settings(bootstrap=own_broker.bootstrap, partitions=1, cache_dir=tmp_path / "cache",
                        worker_publish_backoff_s=0.05, worker_publish_max_backoff_s=0.5,
                        worker_session_timeout_ms=6000)
    async with Bus(settings) as bus:
        await set_topic_config(settings, settings.audio_topic, {"max.message.bytes": "1000"})
        async with SynthesisWorker(settings, engine, worker_id="w1", warm_up=False) as worker:
            await bus.requests(turn_requests("s1", "t1", ["One."]))
            await eventually(lambda: total(worker.metrics.publish_retries) >= 1 or outcomes(worker), timeout_s=120,
                             what="the first refused send")
            assert not outcomes(worker), "a refused send settles nothing"
            await asyncio.to_thread(own_broker.stop)
            refused_before = total(worker.metrics.publish_retries)
            await asyncio.to_thread(own_broker.start, 180)
            await eventually(lambda: total(worker.metrics.publish_retries) > refused_before + 2, timeout_s=120,
                             what="sends retried across the broker's restart")
            await eventually(lambda: worker.assigned, timeout_s=120, what="the partition back after the restart")
            [(committed, end)] = (await worker.commit_state()).values()
            assert end == 1 and committed in (None, 0), "audio not published: the request is not committed"
            assert bus.of("s1") == [] and "failed" not in outcomes(worker)
            await set_topic_config(settings, settings.audio_topic, {"max.message.bytes": str(1024 * 1024 + 512)})
            await bus.wait_for(turn_done(bus, "s1", "t1"), timeout=180, what="the audio after the restart")
            await eventually(async_committed(worker, 1), timeout_s=120, what="the request committed after its audio")
            settled = outcomes(worker)
        assert settled.get("spoken") == 1.0 and "failed" not in settled
        assert complete_sentences(bus.of("s1", "t1")) == {0}


async def test_tentative_requests_confirmed_withdrawn_and_failed_through_the_broker(make_settings, engine):
    """Speculative release at the worker (docs/worker.md): a confirmed tentative sentence is
    published once confirmed, with the turn's end its confirmation carries; a withdrawn one
    never is, and its replacement speaks under the same sentence_seq; a tentative sentence the
    engine cannot speak still ends its sentence (and turn) once confirmed, with its reason."""
    settings = make_settings(partitions=1)
    strict = dataclasses.replace(engine, fallback_voice=None)

    def tentative(turn, seq, text, **extra):
        return dataclasses.replace(request("s1", turn, seq, text), tentative=True, **extra)

    def settlement(turn, seq, *, tentative=False, last=False, text=""):
        return dataclasses.replace(request("s1", turn, seq, text, last=last), tentative=tentative)

    async with Bus(settings) as bus:
        async with SynthesisWorker(settings, strict, worker_id="w1", warm_up=False) as worker:
            await bus.requests([tentative("t1", 0, "One."), settlement("t1", 0),
                                tentative("t1", 1, "Two."), settlement("t1", 1, tentative=True),  # withdrawn
                                settlement("t1", 1, text="Two words.", last=True)])
            await bus.wait_for(turn_done(bus, "s1", "t1"), what="s1/t1")
            # a failing tentative sentence, synthesized and parked before its confirmation
            await bus.requests([tentative("t2", 0, "Three.", voice="zz_missing")])
            await eventually(lambda: worker.scheduler.parked, what="the failed tentative sentence parked")
            assert bus.of("s1", "t2") == []
            await bus.requests([settlement("t2", 0, last=True)])
            await bus.wait_for(turn_done(bus, "s1", "t2"), what="s1/t2")
            await eventually(async_committed(worker, 7), what="every request committed")
            settled = outcomes(worker)
        assert settled == {"spoken": 2.0, "settlement": 3.0, "retracted": 1.0, "failed": 1.0}
        t1 = bus.of("s1", "t1")
        assert complete_sentences(t1) == {0, 1} and len({c["request_received_at_us"] for c in t1
                                                          if c["sentence_seq"] == 1}) == 1
        [withdrawn_at] = {c["request_received_at_us"] for c in t1 if c["sentence_seq"] == 1}
        assert withdrawn_at > max(c["request_received_at_us"] for c in t1 if c["sentence_seq"] == 0)
        [end_of_t1] = [c for c in t1 if c["is_last_in_turn"]]
        assert end_of_t1["sentence_seq"] == 1
        [closing] = bus.of("s1", "t2")
        assert closing["is_last_chunk"] and closing["is_last_in_turn"] and closing["end_reason"] == "no-voices"


class HeldEngine:
    """The tiny engine, except that a sentence starting with "Held" waits until the test releases
    it (the test decides how long a synthesis takes, as a slow CPU or a 16 KiB sentence would)."""

    def __init__(self, engine) -> None:
        import threading

        self._engine = engine
        self.held = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream_timed(self, *args, **kwargs):  # what the worker calls (in its synthesis thread)
        text = kwargs.get("text", args[0] if args else "")
        if text.startswith("Held"):
            self.held.set()
            self.release.wait(120)
        yield from self._engine.stream_timed(*args, **kwargs)


async def test_a_full_worker_stays_in_its_group_however_long_its_synthesis_takes(make_settings, engine):
    """Found by `voicebus bench hostile`: a worker whose requests in flight took longer than
    max.poll.interval.ms did not poll, left its group, dropped its work and did it again."""
    settings = make_settings(worker_max_in_flight=1, partitions=1)
    held = HeldEngine(engine)
    worker = SynthesisWorker(settings, held, warm_up=False, max_poll_interval_ms=1500)
    async with Bus(settings) as bus:
        await worker.start()
        try:
            await eventually(lambda: worker.assigned, what="the worker got its partition")
            await bus.requests([request("s", "t1", 0, "Held back."), request("s", "t1", 1, "Then this.", last=True)])
            await eventually(held.held.is_set, timeout_s=60, what="the first sentence in synthesis")
            # full (1 in flight), paused, and held for well over max.poll.interval.ms (1.5 s)
            await eventually(lambda: worker.polls_while_paused >= 5 or worker.revocations, timeout_s=60,
                             what="five polls while full, or the worker leaving its group")
            assert worker.revocations == 0 and worker.assigned, "a full worker left its group"
            held.release.set()
            await bus.wait_for(turn_done(bus, "s", "t1"), what="the turn's last chunk")
        finally:
            held.release.set()
            await worker.stop()
    assert worker.revocations == 0  # it never left its group: each sentence spoken once, by it
    assert complete_sentences(bus.of("s", "t1")) == {0, 1}
    assert len({c["worker_id"] for c in bus.of("s", "t1")}) == 1


class FaultyEngine:
    """The tiny engine, except that a sentence starting with "Faulty" raises `fault` (MemoryError,
    a device error) the first `times` times it is synthesized, after `after_chunks` of its audio."""

    def __init__(self, engine, fault: BaseException, times: int, after_chunks: int = 0) -> None:
        self._engine, self.fault, self.left, self.after_chunks = engine, fault, times, after_chunks
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream_timed(self, *args, **kwargs):
        text = kwargs.get("text", args[0] if args else "")
        if not text.startswith("Faulty"):
            yield from self._engine.stream_timed(*args, **kwargs)
            return
        self.calls += 1
        for i, timed in enumerate(self._engine.stream_timed(*args, **kwargs)):
            if self.left and i == self.after_chunks:
                self.left -= 1
                raise self.fault
            yield timed


async def test_a_transient_fault_before_any_audio_is_tried_again_and_the_sentence_spoken(make_settings, engine):
    """Before: any exception of the engine (out of memory, a CUDA error) settled its sentence as
    failed, never tried again."""
    settings = make_settings(worker_publish_backoff_s=0.01)
    faulty = FaultyEngine(engine, MemoryError("CUDA out of memory"), times=2)
    async with Bus(settings) as bus, SynthesisWorker(settings, faulty, warm_up=False) as worker:
        await bus.requests([request("s", "t1", 0, "Faulty at first, then fine.", last=True)])
        await bus.wait_for(turn_done(bus, "s", "t1"), what="the turn's last chunk")
    chunks = bus.of("s", "t1")
    assert faulty.calls == 3 and complete_sentences(chunks) == {0}
    assert not any(c["end_reason"] for c in chunks)
    assert len({c["chunk_seq"] for c in chunks}) == len(chunks), "a chunk published twice"
    assert total(worker.metrics.speak_retries) == 2 and total(worker.metrics.failures) == 0


async def test_a_fault_that_persists_or_comes_after_audio_fails_the_sentence_with_a_reason(make_settings, engine):
    settings = make_settings(worker_publish_backoff_s=0.01, worker_speak_attempts=2)
    always = FaultyEngine(engine, RuntimeError("device lost"), times=10)
    async with Bus(settings) as bus, SynthesisWorker(settings, always, warm_up=False) as worker:
        await bus.requests([request("s", "t1", 0, "Faulty every time.", last=True)])
        await bus.wait_for(turn_done(bus, "s", "t1"), what="the turn's last chunk")
    assert always.calls == 2 and bus.of("s", "t1")[-1]["end_reason"] == "engine-error"
    assert outcomes(worker).get("failed") == 1
    late = FaultyEngine(engine, RuntimeError("device lost"), times=1, after_chunks=1)
    async with Bus(settings) as bus, SynthesisWorker(settings, late, warm_up=False) as worker:
        await bus.requests([request("s", "t2", 0, "Faulty after some of its audio went out.", last=True)])
        await bus.wait_for(turn_done(bus, "s", "t2"), what="the turn's last chunk")
    assert late.calls == 1, "audio already published: trying again would make it twice"
    assert bus.of("s", "t2")[-1]["end_reason"] == "engine-error"
