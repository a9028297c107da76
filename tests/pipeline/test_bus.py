"""The bus through the real broker: round trips, per-key order, consumer groups, dead-lettering."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from voicebus.bus import (TopicCreationError, committed_offsets, end_offsets, ensure_topics,
                          make_consumer, make_producer, publish, read_to_end, topics_matching)
from voicebus.codecs import MAGIC, Codec
from voicebus.settings import Settings
from voicebus.shell import RecordPolicy
from voicebus.topics import (AUDIO_RETENTION, DEADLETTER_RETENTION, EVENT_RETENTION, fixed_topics, session_key,
                             text_topic, text_topic_pattern)
from tests.waiting import eventually

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def text_event(session: str, seq: int, text: str = "hi", turn: str = "t1") -> dict:
    return {
        "session_id": session, "turn_id": turn, "agent_id": "a1", "seq": seq, "kind": "TOKEN",
        "text": text, "claim_id": None, "language": None, "voice": None, "floor": None, "priority": 0, "speed": None, "lexicon": None,
        "produced_at_us": 1_700_000_000_000_000 + seq,
    }


async def consume_n(consumer: AIOKafkaConsumer, n: int, timeout: float = 60.0) -> list:
    records = []

    async def take() -> None:
        while len(records) < n:
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)

    await asyncio.wait_for(take(), timeout)
    return records


async def test_ensure_topics_is_idempotent_and_uses_configured_partitions(make_settings):
    settings = make_settings(partitions=3)
    await ensure_topics(settings)
    await ensure_topics(settings)  # second call: nothing to create, no error
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(fixed_topics(settings))
    finally:
        await admin.close()
    assert {t["topic"]: len(t["partitions"]) for t in described} == {n: 3 for n in fixed_topics(settings)}


async def topic_config(settings, topic: str) -> dict[str, str]:
    """The topic's effective configs as the broker reports them, once its metadata has the topic
    (the controller creates it; the broker learns of it a moment later: error 3 until then)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        async def described():
            (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
            (resource,) = response.resources
            return resource if resource[0] != 3 else None  # 3: UNKNOWN_TOPIC_OR_PARTITION

        resource = await eventually(described, timeout_s=30, interval_s=0.1, what=f"{topic} in the broker's metadata")
    finally:
        await admin.close()
    assert resource[0] == 0, resource[1]
    return {entry[0]: entry[1] for entry in resource[4]}


async def test_topics_are_created_with_their_class_retention_and_min_isr(make_settings):
    settings = make_settings()
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic, settings.deadletter_topic])
    audio, control, dlq = [await topic_config(settings, t)
                           for t in (settings.audio_topic, settings.control_topic, settings.deadletter_topic)]
    assert audio["retention.ms"] == str(AUDIO_RETENTION.retention_ms)
    assert audio["segment.ms"] == str(AUDIO_RETENTION.segment_ms)
    assert control["retention.ms"] == str(EVENT_RETENTION.retention_ms)
    assert dlq["retention.ms"] == str(DEADLETTER_RETENTION.retention_ms)
    for configs in (audio, control, dlq):
        assert configs["cleanup.policy"] == "delete"
        assert configs["min.insync.replicas"] == "1"  # one broker: one replica, one in sync


async def test_a_topic_kafka_refuses_to_create_raises(make_settings):
    settings = make_settings()
    with pytest.raises(TopicCreationError, match="no spaces here"):
        await ensure_topics(settings, ["no spaces here"])


async def test_producers_wait_for_all_replicas_and_are_idempotent(make_settings):
    settings = make_settings()
    topic = settings.control_topic
    await ensure_topics(settings, [topic])
    async with make_producer(settings) as producer:
        # aiokafka keeps these private; they are what the broker is sent
        assert producer._sender._acks == -1  # acks=all
        assert producer._txn_manager is not None  # idempotence: a producer id and sequence numbers
        await producer.send_and_wait(topic, b"x", key=b"s1")
        assert producer._txn_manager.producer_id >= 0


async def test_content_and_per_key_order_survive_the_round_trip(make_settings):
    settings = make_settings(partitions=4)
    codec = Codec()
    topic = text_topic(settings, "a1")
    await ensure_topics(settings, [topic])
    sessions = [f"s{i}" for i in range(6)]
    sent = {s: [text_event(s, seq, text=f"{s} token {seq} é✓") for seq in range(25)] for s in sessions}

    async with make_producer(settings) as producer:
        # interleave sessions so order per key is the property under test, not send order overall
        for seq in range(25):
            for s in sessions:
                await publish(producer, codec, topic, "TextEvent", sent[s][seq])

    consumer = make_consumer(settings, topic, group_id=f"{settings.gate_app_id}-reader")
    await consumer.start()
    try:
        records = await consume_n(consumer, 25 * len(sessions))
    finally:
        await consumer.stop()

    received: dict[str, list[dict]] = {s: [] for s in sessions}
    partition_of: dict[str, set[int]] = {s: set() for s in sessions}
    for rec in sorted(records, key=lambda r: (r.partition, r.offset)):
        value = codec.decode(rec.value, expect="TextEvent").value
        assert rec.key == session_key(value["session_id"])
        received[value["session_id"]].append(value)
        partition_of[value["session_id"]].add(rec.partition)
    for s in sessions:
        assert received[s] == sent[s]  # same content, same order
        assert len(partition_of[s]) == 1  # one session, one partition
    assert len(set().union(*partition_of.values())) > 1  # sessions did spread over partitions


async def test_read_to_end_reads_every_partition_to_its_end(make_settings):
    settings = make_settings(partitions=3, max_message_bytes=64 * 1024)
    topic = text_topic(settings, "a1")
    await ensure_topics(settings, [topic])
    value = b"x" * 16 * 1024  # 4 records fill one partition's fetch: the read needs many fetches
    async with make_producer(settings) as producer:
        for i in range(60):
            await producer.send_and_wait(topic, value + str(i).encode(), key=f"s{i % 6}".encode())
    records = await read_to_end(settings, [topic, "no-such-topic"])
    assert sorted(r.value[len(value):] for r in records) == sorted(str(i).encode() for i in range(60))
    per_partition: dict[int, list[int]] = {}
    for r in records:
        per_partition.setdefault(r.partition, []).append(r.offset)
    assert len(per_partition) > 1 and all(offsets == list(range(len(offsets))) for offsets in per_partition.values())


async def test_topics_are_led_when_ensure_topics_returns(make_settings, caplog):
    """A consumer that resets its offsets right after `ensure_topics` finds every leader serving:
    no "Failed fetch offsets ... NotLeaderForPartition" ERROR (the edge logged one in
    test_start_order; without the wait this failed on every run here, 12 fresh partitions)."""
    settings = make_settings(partitions=12)
    topics = [text_topic(settings, f"fresh{i}") for i in range(2)]
    await ensure_topics(settings, topics)
    consumer = make_consumer(settings, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(12)]
        consumer.assign(tps)
        with caplog.at_level(logging.ERROR, logger="aiokafka"):
            await consumer.seek_to_end()
            for tp in tps:
                assert await consumer.position(tp) == 0
    finally:
        await consumer.stop()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_end_and_committed_offsets_and_topics_by_pattern(make_settings):
    """What tests and `PipelineStack.drained` observe: where each partition ends, where a group
    has committed, which topics match a pattern."""
    settings = make_settings(partitions=2)
    topic, other = text_topic(settings, "a1"), text_topic(settings, "a2")
    await ensure_topics(settings, [topic, other])
    assert await topics_matching(settings, text_topic_pattern(settings)) == sorted([topic, other])
    async with make_producer(settings) as producer:
        for i in range(5):
            await producer.send_and_wait(topic, b"x", partition=i % 2)
    ends = await end_offsets(settings, [topic, "no-such-topic"])
    assert ends == {TopicPartition(topic, 0): 3, TopicPartition(topic, 1): 2}
    group = f"{topic}.readers"
    assert await committed_offsets(settings, group) == {}
    consumer = make_consumer(settings, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.commit({TopicPartition(topic, 0): 2})
    finally:
        await consumer.stop()
    assert await committed_offsets(settings, group) == {TopicPartition(topic, 0): 2}


async def test_two_consumers_in_a_group_split_partitions_and_one_takes_over(make_settings):
    settings = make_settings()
    topic = settings.synthesis_topic
    await ensure_topics(settings, [topic], partitions=4)
    group = f"{settings.gate_app_id}-workers"
    all_partitions = {TopicPartition(topic, p) for p in range(4)}

    first = make_consumer(settings, topic, group_id=group, session_timeout_ms=10_000, heartbeat_interval_ms=500)
    second = make_consumer(settings, topic, group_id=group, session_timeout_ms=10_000, heartbeat_interval_ms=500)

    async def until(predicate, timeout: float = 60.0) -> None:
        async def poll() -> None:
            while not predicate():
                # getmany drives the group protocol (joins, heartbeats, rebalances)
                await asyncio.gather(*(c.getmany(timeout_ms=100) for c in active))

        await asyncio.wait_for(poll(), timeout)

    await first.start()
    await second.start()
    active = [first, second]
    try:
        # A split: both hold partitions, together all of them, none twice. While the second
        # member joins, the first can still report its old full assignment for a moment (it has
        # not yet processed the rebalance), so wait for the settled state instead of sampling it.
        await until(lambda: first.assignment() and second.assignment()
                    and first.assignment() | second.assignment() == all_partitions
                    and not first.assignment() & second.assignment())

        codec = Codec()
        async with make_producer(settings) as producer:
            await first.stop()  # leaves the group; the survivor must take over its partitions
            active = [second]
            await until(lambda: second.assignment() == all_partitions)
            for i in range(20):
                await publish(producer, codec, topic, "SynthesisRequest", synthesis_request(f"s{i}", i))
        got = await consume_n(second, 20)
        assert sorted(codec.decode(r.value).value["sentence_seq"] for r in got) == list(range(20))
    finally:
        await first.stop()
        await second.stop()


def synthesis_request(session: str, seq: int) -> dict:
    return {
        "session_id": session, "turn_id": "t1", "agent_id": "a1", "sentence_seq": seq,
        "text": f"Sentence {seq}.", "language": "en", "voice": "af_heart", "speed": 1.0,
        "is_last_in_turn": False, "first_token_at_us": 1, "text_complete_at_us": 2, "released_at_us": 3,
    }


async def test_malformed_records_are_dead_lettered_while_good_ones_flow(make_settings):
    settings = make_settings(max_text_bytes=64)
    codec = Codec(max_text_bytes=64)
    topic = text_topic(settings, "a1")
    await ensure_topics(settings, [topic, settings.deadletter_topic], partitions=1)

    good = codec.encode("TextEvent", text_event("s1", 0, "fine"))
    header = MAGIC + codec.fingerprint_of("TextEvent")
    # invalid UTF-8: a well-formed record whose text bytes are not UTF-8 (same length as "fine")
    invalid_utf8 = good.replace(b"fine", b"\xff\xfe\xfd\xfc")
    oversized = Codec(max_text_bytes=10_000).encode("TextEvent", text_event("s1", 2, "x" * 100))
    bad = {
        "malformed": b"this is not avro",
        "unknown-fingerprint": MAGIC + b"\x01" * 8 + good[len(header):],
        "invalid-utf8": invalid_utf8,
        "oversized-text": oversized,
    }
    assert invalid_utf8 != good

    async with make_producer(settings) as producer:
        await producer.send_and_wait(topic, good, key=b"s1")
        for reason, payload in bad.items():
            await producer.send_and_wait(topic, payload, key=b"s1")
        await producer.send_and_wait(topic, codec.encode("TextEvent", text_event("s1", 5, "still flowing")), key=b"s1")

        consumer = make_consumer(settings, topic, group_id=f"{settings.gate_app_id}-dl")
        await consumer.start()
        seen = []
        try:
            async def read_good() -> None:
                async for rec in RecordPolicy("test", settings, codec, producer).records(consumer, expect="TextEvent"):
                    seen.append(rec.message.value["text"])
                    if len(seen) == 2:
                        return

            await asyncio.wait_for(read_good(), 60)
        finally:
            await consumer.stop()
    assert seen == ["fine", "still flowing"]

    dl = make_consumer(settings, settings.deadletter_topic, group_id=f"{settings.gate_app_id}-dlr")
    await dl.start()
    try:
        letters = await consume_n(dl, len(bad))
    finally:
        await dl.stop()
    by_reason = {}
    for rec in letters:
        headers = {k: v.decode() for k, v in rec.headers}
        assert headers["voicebus.source.topic"] == topic
        assert headers["voicebus.error.message"]
        by_reason[headers["voicebus.error.reason"]] = rec
    assert set(by_reason) == set(bad)
    for reason, payload in bad.items():
        assert by_reason[reason].value == payload  # the original bytes, unchanged
        assert by_reason[reason].key == b"s1"


async def test_pattern_subscription_sees_a_new_agent_topic(make_settings):
    """aiokafka's pattern subscription (what faust's own `pattern=` lacks) works on this broker."""
    settings = make_settings()
    codec = Codec()
    consumer = make_consumer(settings, group_id=f"{settings.gate_app_id}-pattern", metadata_max_age_ms=500)
    consumer.subscribe(pattern=text_topic_pattern(settings))
    await consumer.start()
    try:
        topics = [text_topic(settings, "alpha"), text_topic(settings, "beta")]
        await ensure_topics(settings, topics, partitions=1)
        async with make_producer(settings) as producer:
            for i, topic in enumerate(topics):
                await publish(producer, codec, topic, "TextEvent", text_event(f"s{i}", 0, topic))

        async def both() -> set[str]:
            got: set[str] = set()
            while len(got) < 2:
                batch = await consumer.getmany(timeout_ms=200)
                for recs in batch.values():
                    got.update(codec.decode(r.value).value["text"] for r in recs)
            return got

        assert await asyncio.wait_for(both(), 60) == set(topics)
        assert all(re.match(text_topic_pattern(settings), t) for t in topics)
    finally:
        await consumer.stop()


@pytest.mark.parametrize("client", ["AIOKafkaProducer(", "AIOKafkaConsumer(", "AIOKafkaAdminClient("])
def test_only_the_bus_module_builds_kafka_clients(client):
    """Every client comes from `make_producer`, `make_consumer` or `make_admin` (all built on
    `client_options`), so the bus's security settings reach every one, and acks=all and
    idempotence hold for every producer. The one exception is the local broker's own readiness
    check, which asks a broker it started on loopback before any settings apply."""
    root = Path(__file__).resolve().parents[2]
    builders = sorted(
        str(path.relative_to(root))
        for package in ("pipeline", "agents", "players")
        for path in (root / package).rglob("*.py")
        if client in path.read_text()
    )
    expected = ["pipeline/bus.py", "pipeline/ops/cluster.py"] if client == "AIOKafkaAdminClient(" else ["pipeline/bus.py"]
    assert builders == expected


def test_client_options_carry_the_bus_security_to_every_client(tmp_path):
    import ssl

    from pydantic import SecretStr

    from voicebus.bus import client_options

    plain = client_options(Settings(bootstrap="b:9092"))
    assert plain == {"bootstrap_servers": "b:9092", "security_protocol": "PLAINTEXT"}
    sasl = client_options(Settings(bootstrap="b:9096", kafka_security_protocol="SASL_SSL",
                                   kafka_sasl_mechanism="SCRAM-SHA-256", kafka_sasl_username="agent-a",
                                   kafka_sasl_password=SecretStr("pw")))
    assert {k: v for k, v in sasl.items() if k != "ssl_context"} == {
        "bootstrap_servers": "b:9096", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "agent-a", "sasl_plain_password": "pw"}
    assert isinstance(sasl["ssl_context"], ssl.SSLContext) and sasl["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert "ssl_context" in client_options(Settings(kafka_security_protocol="SSL"))
    assert "sasl_mechanism" not in client_options(Settings(kafka_security_protocol="SSL"))
