"""A second implementation reads us, and we read it: confluent-kafka's Avro serde with the real
schema registry (Apicurio, `schema_registry` fixture) on the real broker.

* What the agents SDK and the worker's publish path write with ``VOICEBUS_WIRE_FORMAT=confluent``
  (text, control and audio topics) is read by confluent-kafka's `Consumer` + `AvroDeserializer` +
  `SchemaRegistryClient`, which know nothing of voicebus.
* What confluent-kafka's `AvroSerializer` writes is read by the consumer loop every stage uses
  (`voicebus.shell.RecordPolicy.records`, default single-object writer settings with a registry url):
  nothing is dead-lettered, and a record with an id the registry does not know is.
"""

from __future__ import annotations

import asyncio
import struct
import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from voicebus import schemas
from voicebus.agents.sdk import Publisher, cancel_event
from voicebus.bus import ensure_topics, make_consumer, make_producer, publish
from voicebus.shell import RecordPolicy
from voicebus.codecs import CONFLUENT, codec_for
from voicebus.topics import session_key, text_topic
from voicebus.schemas.contract import AudioEncoding
from tests.waiting import eventually

pytestmark = [pytest.mark.kafka, pytest.mark.registry]


def read_with_confluent_kafka(bootstrap: str, registry_url: str, topics: list[str], count: int,
                              timeout_s: float = 60.0) -> list[tuple[str, bytes, bytes, dict]]:
    """(topic, key, raw value, value decoded by AvroDeserializer) of `count` records."""
    import time

    deserializer = AvroDeserializer(SchemaRegistryClient({"url": registry_url, "timeout": 30}))
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"cc-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    got = []
    try:
        consumer.subscribe(topics)
        deadline = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            assert message.error() is None, message.error()
            value = deserializer(message.value(), SerializationContext(message.topic(), MessageField.VALUE))
            got.append((message.topic(), message.key(), message.value(), value))
    finally:
        consumer.close()
    assert len(got) >= count, f"confluent-kafka read {len(got)} of {count} records in {timeout_s} s"
    return got


def audio_chunk(session_id: str, turn_id: str) -> dict:
    return {
        "session_id": session_id, "turn_id": turn_id, "sentence_seq": 0, "chunk_seq": 0,
        "is_last_chunk": True, "is_last_in_turn": True, "sample_rate": 24000,
        "encoding": AudioEncoding.PCM16LE.value, "pcm": bytes(range(200)) * 4, "worker_id": "w1",
        "first_token_at_us": 1, "text_complete_at_us": 2, "released_at_us": 3, "request_received_at_us": 4,
        "synthesis_started_at_us": 5, "audio_ready_at_us": 6, "published_at_us": 7,
    }


async def test_confluent_kafka_reads_what_the_pipeline_writes_in_confluent_framing(make_settings, registry_url):
    settings = make_settings(wire_format=CONFLUENT, registry_url=registry_url)
    topic = text_topic(settings, "assistant")
    async with Publisher(settings, "assistant") as agent:
        async with agent.turn("s-1", "t-1", language="en") as turn:
            await turn.tokens(iter(["Hello", " there", "."]))
        await agent.cancel("s-1", "t-1", reason="barge-in")
    # the worker's publish path: voicebus.bus.publish with the stage's codec
    chunk = audio_chunk("s-1", "t-1")
    await ensure_topics(settings, [settings.audio_topic])
    producer = make_producer(settings)
    await producer.start()
    try:
        await publish(producer, codec_for(settings), settings.audio_topic, "AudioChunk", chunk)
    finally:
        await producer.stop()

    got = await asyncio.to_thread(read_with_confluent_kafka, settings.bootstrap, registry_url,
                                  [topic, settings.control_topic, settings.audio_topic], 6)
    assert all(raw[0] == 0 for _, _, raw, _ in got), "every record is Confluent-framed"
    text = [v for t, _, _, v in got if t == topic]
    assert [(v["seq"], v["kind"], v["text"], v["language"]) for v in text] == [
        (0, "TOKEN", "Hello", "en"), (1, "TOKEN", " there", "en"), (2, "TOKEN", ".", "en"),
        (3, "END_OF_TURN", "", "en")]
    [control] = [v for t, _, _, v in got if t == settings.control_topic]
    assert (control["session_id"], control["turn_id"], control["action"]) == ("s-1", "t-1", "CANCEL")
    [(_, key, _, audio)] = [g for g in got if g[0] == settings.audio_topic]
    assert key == session_key("s-1") and {k: audio[k] for k in chunk} == chunk


async def test_the_pipeline_reads_what_confluent_kafkas_avro_serializer_writes(make_settings, registry_url):
    # a reader mid-migration: it still writes single-object, and reads both framings
    settings = make_settings(registry_url=registry_url)
    topic = text_topic(settings, "foreign")
    await ensure_topics(settings, [topic, settings.control_topic, settings.deadletter_topic])
    client = SchemaRegistryClient({"url": registry_url, "timeout": 30})
    text_ser = AvroSerializer(client, (schemas.SCHEMA_DIR / schemas.CURRENT["TextEvent"]).read_text())
    control_ser = AvroSerializer(client, (schemas.SCHEMA_DIR / schemas.CURRENT["ControlEvent"]).read_text())
    events = [
        {"session_id": "s-9", "turn_id": "t-9", "agent_id": "foreign", "seq": i, "kind": kind, "text": text,
         "claim_id": None, "language": "en", "voice": None, "floor": None, "priority": 0, "speed": None, "lexicon": None, "produced_at_us": 100 + i}
        for i, (kind, text) in enumerate([("TOKEN", "Bonjour"), ("TOKEN", "."), ("END_OF_TURN", "")])
    ]
    cancel = cancel_event("s-9", "t-9", reason="barge-in", source="kafka-connect").to_record()

    producer = Producer({"bootstrap.servers": settings.bootstrap})
    try:
        for event in events:
            producer.produce(topic, key=session_key("s-9"),
                             value=text_ser(event, SerializationContext(topic, MessageField.VALUE)))
        producer.produce(settings.control_topic, key=session_key("s-9"), value=control_ser(
            cancel, SerializationContext(settings.control_topic, MessageField.VALUE)))
        # and one record naming a schema id the registry never issued: dead-lettered, not fatal
        producer.produce(topic, key=session_key("s-9"), value=b"\x00" + struct.pack(">I", 999_999) + b"\x02")
        assert producer.flush(30) == 0
    finally:
        producer.close()

    consumer = make_consumer(settings, topic, settings.control_topic, group_id=f"g-{uuid.uuid4().hex[:8]}")
    dead = make_consumer(settings, settings.deadletter_topic, auto_offset_reset="earliest")
    ours = make_producer(settings)
    for client_ in (consumer, dead, ours):
        await client_.start()
    received = []

    async def consume():
        async for record in RecordPolicy("interop", settings, codec_for(settings), ours).records(consumer):
            received.append(record)

    task = asyncio.create_task(consume())
    try:
        await eventually(lambda: len(received) >= 4, timeout_s=60, what="4 decoded records")
        dead_letter = await asyncio.wait_for(dead.getone(), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for client_ in (consumer, dead, ours):
            await client_.stop()

    text = [r.message for r in received if r.topic == topic]
    assert [d.value for d in text] == events
    assert all(d.schema_id is not None and not d.older_writer for d in text)
    [control] = [r.message for r in received if r.topic == settings.control_topic]
    assert control.type == "ControlEvent" and control.value["turn_id"] == "t-9"
    assert control.value["source"] == "kafka-connect"
    headers = dict(dead_letter.headers)
    assert headers["voicebus.error.reason"] == b"unknown-schema-id"
    assert dead_letter.value[:5] == b"\x00" + struct.pack(">I", 999_999)
