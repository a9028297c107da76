"""Kafka clients as the pipeline uses them: one place that sets producer/consumer options,
creates topics, publishes encoded messages and dead-letters bad records.

Every client made here has an owner that stops it (`async with` or an explicit `stop()`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from pipeline.codecs import CONFLUENT, Codec, CodecError, Decoded, deadletter_headers
from pipeline.settings import Settings
from pipeline.topics import fixed_topics, session_key

log = logging.getLogger(__name__)

# Latency over throughput: a voice pipeline sends small events and wants each one now.
PRODUCER_OPTIONS: dict[str, Any] = {"linger_ms": 0, "acks": 1, "enable_idempotence": False}


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    options = {**PRODUCER_OPTIONS, "max_request_size": settings.max_message_bytes, **overrides}
    return AIOKafkaProducer(bootstrap_servers=settings.bootstrap, **options)


def make_consumer(settings: Settings, *topics: str, group_id: str | None = None, **overrides: Any) -> AIOKafkaConsumer:
    options: dict[str, Any] = {
        "group_id": group_id,
        "auto_offset_reset": "earliest" if group_id else "latest",
        "enable_auto_commit": True,
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
        "max_partition_fetch_bytes": settings.max_message_bytes,
        **overrides,
    }
    return AIOKafkaConsumer(*topics, bootstrap_servers=settings.bootstrap, **options)


async def ensure_topics(settings: Settings, names: Iterable[str] | None = None, partitions: int | None = None) -> None:
    """Create `names` (default: every fixed topic) if missing; idempotent."""
    names = list(names) if names is not None else fixed_topics(settings)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(n, num_partitions=partitions or settings.partitions, replication_factor=settings.replication_factor)
            for n in names
            if n not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass  # a concurrent creator won the race: that's fine
    finally:
        await admin.close()


async def register_schemas(codec: Codec, topics: Mapping[str, str]) -> None:
    """With Confluent framing, register each topic's schema (``{topic: message type}``) now,
    off the event loop, so the first record a stage writes does not wait for the registry.
    A no-op in single-object framing."""
    if codec.framing != CONFLUENT:
        return
    for topic, message_type in topics.items():
        await asyncio.to_thread(codec.register, topic, message_type)


async def publish(producer: AIOKafkaProducer, codec: Codec, topic: str, message_type: str, value: Mapping[str, Any]) -> None:
    """Encode `value` and send it keyed by its session id; returns once the broker acked."""
    await producer.send_and_wait(topic, codec.encode(message_type, value, topic), key=session_key(value["session_id"]))


async def dead_letter(producer: AIOKafkaProducer, settings: Settings, record: Any, error: Exception) -> None:
    """Send a bad consumer record, unchanged, to the dead-letter topic with the reason in headers."""
    headers = deadletter_headers(error, record.topic, record.partition, record.offset)
    await producer.send_and_wait(settings.deadletter_topic, record.value, key=record.key, headers=headers)
    log.warning("dead-lettered %s[%s]@%s: %s", record.topic, record.partition, record.offset, error)


async def decode_or_dead_letter(
    producer: AIOKafkaProducer, settings: Settings, codec: Codec, record: Any, expect: str | None = None
) -> Decoded | None:
    """Decode a consumer record; on a `CodecError` dead-letter it and return None (never raise)."""
    try:
        return codec.decode(record.value, expect=expect)
    except CodecError as exc:
        await dead_letter(producer, settings, record, exc)
        return None


@dataclass(frozen=True)
class DecodedRecord:
    """A consumer record that decoded cleanly: where it came from, its key and its message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    message: Decoded


async def decoded_records(
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    settings: Settings,
    codec: Codec,
    expect: str | None = None,
) -> AsyncIterator[DecodedRecord]:
    """Yield every good record `consumer` receives, decoded; dead-letter the bad ones and go on.

    The caller owns (starts and stops) both clients; this loop ends when the consumer is stopped
    or the caller stops iterating.
    """
    async for record in consumer:
        decoded = await decode_or_dead_letter(producer, settings, codec, record, expect=expect)
        if decoded is not None:
            yield DecodedRecord(record.topic, record.partition, record.offset, record.key, record.timestamp, decoded)
