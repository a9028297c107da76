"""The shells' shared plumbing: the record policy, the supervisor and the control follower."""

from __future__ import annotations

import asyncio

import pytest

from voicebus.bus import ensure_topics, make_consumer, make_producer, publish
from voicebus.codecs import Codec
from voicebus.shell import ControlFollower, RecordPolicy, Supervisor
from tests.foreign import foreign_encode
from tests.waiting import eventually


def control(session: str, turn: str | None = "t1", turn_ids=()) -> dict:
    return {"session_id": session, "turn_id": turn, "action": "CANCEL", "reason": "", "source": "test",
            "issued_at_us": 1, "turn_ids": list(turn_ids)}


class Record:
    """The fields of an aiokafka ConsumerRecord that the policy reads (pure tests)."""

    def __init__(self, value: bytes, offset: int = 0) -> None:
        self.topic, self.partition, self.offset, self.key, self.timestamp = "t", 0, offset, b"k", 0
        self.value, self.headers = value, ()


async def test_one_bad_record_costs_only_itself_and_every_failure_reaches_the_callback(make_settings):
    codec, failures, handled = Codec(), [], []

    async def collect(failure):
        failures.append((failure.reason, failure.expected, failure.record.offset))

    def handle(decoded):
        if decoded.message.value["session_id"] == "boom":
            raise KeyError("a bug in the handler")
        handled.append(decoded.message.value["session_id"])

    policy = RecordPolicy("test", make_settings(), codec, None, on_error=collect)
    records = [
        Record(b"not avro", 0),
        Record(foreign_encode("ControlEvent", {**control("s"), "issued_at_us": -5}), 1),  # breaks the contract
        Record(codec.encode("ControlEvent", control("boom")), 2),
        Record(codec.encode("TextEvent", {"session_id": "s", "turn_id": "t", "agent_id": "a", "seq": 0,
                                          "kind": "TOKEN", "text": "x", "claim_id": None, "language": None,
                                          "voice": None, "produced_at_us": 0}), 3),  # wrong type
        Record(codec.encode("ControlEvent", control("fine")), 4),
    ]
    results = [await policy.process(r, "ControlEvent", handle) for r in records]
    assert results == [False, False, False, False, True]
    assert handled == ["fine"]
    assert failures == [("malformed", True, 0), ("contract-violation", True, 1), ("handler-error", False, 2),
                        ("wrong-type", True, 3)]
    assert policy.failures.labels("test", "handler-error")._value.get() == 1


def test_a_decoded_record_hands_its_message_as_the_contracts_typed_object(make_settings):
    from voicebus.schemas.contract import ControlAction
    from voicebus.schemas.messages import ControlEvent

    codec = Codec()
    decoded = RecordPolicy("test", make_settings(), codec, None).decode(
        Record(codec.encode("ControlEvent", control("s", turn_ids=("t0",)))), "ControlEvent")
    event = decoded.typed
    assert isinstance(event, ControlEvent) and event.action is ControlAction.CANCEL
    assert (event.session_id, event.turn_id, event.turn_ids) == ("s", "t1", ("t0",))
    assert decoded.typed is event  # built once, whatever reads it


async def test_a_topic_listing_that_finds_no_broker_is_reported_and_tried_again_not_a_task_death():
    """bench chaos, broker_leader: the gate's listing reached the broker just killed and its task
    died (an ERROR traceback, a restart) on every failover. A listing that cannot reach a broker
    is now a warning and a counter, and the next interval lists again. Here no broker listens
    at all (a refused connection: the same retriable error)."""
    from voicebus.ops.daemon import free_port
    from voicebus.settings import Settings
    from voicebus.shell import TopicDiscovery

    found: list[set[str]] = []

    async def on_topics(names: set[str]) -> None:
        found.append(names)

    discovery = TopicDiscovery(Settings(bootstrap=f"127.0.0.1:{free_port()}"), r"x\.", on_topics, None,
                               interval_s=0.01, policy_stage="test")
    supervisor = Supervisor("test", min_backoff_s=0.01)
    supervisor.start("listing", discovery.poll_listing)
    failures = discovery.listing_failures.labels("test")
    await eventually(lambda: failures._value.get() >= 2, what="two failed listings", timeout_s=60)
    health = supervisor.health()["listing"]
    await supervisor.stop()
    assert health["restarts"] == 0 and health["last_error"] is None, health
    assert not found


@pytest.mark.kafka
async def test_the_default_callback_dead_letters_with_reason_and_stage(make_settings):
    settings = make_settings()
    await ensure_topics(settings, [settings.deadletter_topic])
    async with make_producer(settings) as producer:
        policy = RecordPolicy("edge", settings, Codec(), producer)
        assert not await policy.process(Record(b"junk", 7), "AudioChunk", lambda d: None)
    consumer = make_consumer(settings, settings.deadletter_topic, auto_offset_reset="earliest")
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), 30)
    finally:
        await consumer.stop()
    headers = dict(record.headers)
    assert record.value == b"junk" and record.key == b"k"
    assert headers["voicebus.error.reason"] == b"malformed" and headers["voicebus.error.stage"] == b"edge"
    assert headers["voicebus.source.offset"] == b"7"


async def test_a_task_that_dies_is_restarted_with_backoff_and_reported():
    waits: list[float] = []

    async def no_wait(seconds: float) -> None:
        waits.append(seconds)

    runs = 0
    done = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise RuntimeError(f"death {runs}")
        done.set()
        await asyncio.Event().wait()  # then runs until stopped

    supervisor = Supervisor("test", sleep=no_wait)
    supervisor.start("flaky", flaky)
    await asyncio.wait_for(done.wait(), 5)
    health = supervisor.health()["flaky"]
    assert health["restarts"] == 3 and health["running"] and health["last_error"] == "RuntimeError: death 3"
    assert waits == [0.1, 0.2, 0.4] and supervisor.healthy
    await supervisor.stop()
    assert not supervisor.health()["flaky"]["running"]


async def test_a_task_waiting_for_its_restart_is_not_healthy():
    backoff = asyncio.Event()

    async def held(seconds: float) -> None:
        await backoff.wait()

    async def dies() -> None:
        raise RuntimeError("gone")

    supervisor = Supervisor("test", sleep=held)
    supervisor.start("dies", dies)
    await eventually(lambda: supervisor.health()["dies"]["restarts"] == 1, what="the first death")
    assert not supervisor.healthy  # dead and not yet restarted: /healthz must say 503
    await supervisor.stop()


@pytest.mark.kafka
async def test_the_control_follower_applies_the_lookback_before_start_returns_then_follows(make_settings):
    settings = make_settings(partitions=3)
    await ensure_topics(settings, [settings.control_topic, settings.deadletter_topic])
    codec, seen = Codec(), []
    async with make_producer(settings) as producer:
        for i in range(6):
            await publish(producer, codec, settings.control_topic, "ControlEvent", control(f"before{i}"))
        await producer.send_and_wait(settings.control_topic, b"junk", key=b"before0")
        follower = ControlFollower(settings, RecordPolicy("test", settings, codec, producer),
                                   lambda event: seen.append(event.session_id), lookback_s=60)
        await follower.start()
        try:
            assert sorted(seen) == [f"before{i}" for i in range(6)]  # caught up before start returned
            supervisor = Supervisor("test")
            supervisor.start("control", follower.follow)
            await publish(producer, codec, settings.control_topic, "ControlEvent", control("after"))
            await eventually(lambda: "after" in seen, timeout_s=30, what="a control event after start")
            await supervisor.stop()
        finally:
            await follower.stop()
    assert follower.applied == 7


@pytest.mark.kafka
async def test_a_control_follower_whose_consumer_died_is_restarted_where_it_stopped(make_settings):
    """Regression: the supervisor restarted `follow` on the same dead consumer, which failed
    again at once, for good: the stage saw no cancel any more."""
    settings = make_settings(partitions=2)
    await ensure_topics(settings, [settings.control_topic, settings.deadletter_topic])
    codec, seen = Codec(), []
    async with make_producer(settings) as producer:
        follower = ControlFollower(settings, RecordPolicy("test", settings, codec, producer),
                                   lambda event: seen.append(event.session_id))
        await follower.start()
        supervisor = Supervisor("test", min_backoff_s=0.01)
        try:
            supervisor.start("control", follower.follow)
            await publish(producer, codec, settings.control_topic, "ControlEvent", control("one"))
            await eventually(lambda: "one" in seen, timeout_s=30, what="the first event")
            await follower.consumer.stop()  # the consumer dies under the running follower
            await eventually(lambda: supervisor.health()["control"]["restarts"] >= 1, timeout_s=30,
                             what="the follower's restart")
            await publish(producer, codec, settings.control_topic, "ControlEvent", control("two"))
            await eventually(lambda: "two" in seen, timeout_s=30, what="an event after the restart")
            assert seen == ["one", "two"]  # nothing applied twice, nothing missed
        finally:
            await supervisor.stop()
            await follower.stop()


# --- a dead letter that cannot be written never wedges the stage -----------------------------------


@pytest.mark.kafka
async def test_a_missing_dead_letter_topic_skips_the_record_within_its_bound_and_counts_it(make_settings):
    """Before: the write waited on the missing topic's metadata and then raised out of the stage's
    loop (the worker retried it forever with its partition stopped)."""
    settings = make_settings(deadletter_attempts=2, deadletter_timeout_s=1.0)  # the topic is never created
    producer = make_producer(settings)
    await producer.start()
    try:
        policy = RecordPolicy("test", settings, Codec(), producer)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await policy.process(Record(b"not avro"), "ControlEvent", lambda d: None) is False
        assert loop.time() - started < 2 * 1.0 + 2.0
    finally:
        await producer.stop()
    assert policy.skipped.labels("test", "malformed")._value.get() == 1
    assert policy.failures.labels("test", "malformed")._value.get() == 1


@pytest.mark.kafka
async def test_a_record_near_the_size_limit_is_dead_lettered_cut_with_a_digest(make_settings):
    """Before: its dead-letter copy plus headers was larger than one request, every write failed."""
    import hashlib

    from voicebus.bus import read_to_end

    settings = make_settings()
    await ensure_topics(settings, [settings.deadletter_topic])
    huge = b"\xff" + bytes(settings.max_message_bytes - 200)  # not avro, just under the limit
    record = Record(huge, offset=7)
    record.key = b"s" * 5000
    producer = make_producer(settings)
    await producer.start()
    try:
        policy = RecordPolicy("test", settings, Codec(), producer)
        assert await policy.process(record, "ControlEvent", lambda d: None) is False
    finally:
        await producer.stop()
    [letter] = await read_to_end(settings, [settings.deadletter_topic])
    headers = dict(letter.headers)
    assert headers["voicebus.error.reason"] == b"malformed"
    assert headers["voicebus.error.truncated"] == str(len(huge)).encode()
    assert headers["voicebus.error.sha256"] == hashlib.sha256(huge).hexdigest().encode()
    assert headers["voicebus.source.offset"] == b"7" and int(headers["voicebus.error.key_truncated"]) == 5000
    assert len(letter.value) < settings.max_message_bytes and huge.startswith(letter.value)
    assert policy.skipped.labels("test", "malformed")._value.get() == 0


def test_a_small_record_is_dead_lettered_whole():
    from voicebus.shell import capped_copy

    assert capped_copy(b"k", b"v" * 100, 1024 * 1024) == (b"k", b"v" * 100, [])


async def test_a_registry_that_does_not_answer_never_stalls_the_stage_s_event_loop():
    """Regression: a Confluent-framed record naming a schema id the codec had not seen was looked
    up with a blocking HTTP call on the event loop: a registry that did not answer froze every
    session of the stage for the whole timeout. The lookup now runs in a thread."""
    import struct
    import time

    from voicebus.settings import Settings

    # A real socket that accepts and never answers: the registry hangs.
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = Settings(registry_url=f"http://127.0.0.1:{port}", registry_timeout_s=1.0)
    from voicebus.codecs import codec_for

    failures = []

    async def collect(failure):
        failures.append(failure)

    policy = RecordPolicy("test", settings, codec_for(settings), None, on_error=collect)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    started = time.monotonic()
    try:
        record = Record(b"\x00" + struct.pack(">I", 4242) + b"\x02")
        assert await policy.accept(record, "ControlEvent") is None
        took = time.monotonic() - started
    finally:
        ticking.cancel()
        server.close()
    assert took >= 0.9, "the registry's timeout was not waited out"
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"
    assert [f.reason for f in failures] == ["registry-unavailable"]
