"""Kafka clients as the pipeline uses them: one place that sets producer/consumer options,
creates topics, publishes encoded messages and dead-letters bad records.

Every client made here has an owner that stops it (`async with` or an explicit `stop()`).

Durability is set here for every stage at once: producers wait for every in-sync replica
(acks=all) and are idempotent (a retried send is written once), and `ensure_topics` creates
topics with the replication, ``min.insync.replicas``, retention and cleanup policy of
`voicebus.topics` (docs/kafka.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (KafkaError, KafkaTimeoutError, NodeNotReadyError, NotControllerError, RequestTimedOutError,
                             TopicAlreadyExistsError)

from voicebus.codecs import CONFLUENT, Codec, Decoded
from voicebus.schemas.messages import Message, typed
from voicebus.settings import Settings, reveal

if TYPE_CHECKING:
    from voicebus.acls import Acl
from voicebus.topics import Durability, durability, fixed_topics, session_key, topic_configs

log = logging.getLogger(__name__)

# Latency over throughput: a voice pipeline sends small events and wants each one now
# (linger 0). Nothing acknowledged may be lost when a broker dies: acks=all waits for every
# in-sync replica (at least min.insync.replicas of them), and idempotence makes the producer's own
# retries after a leader change write each record once. Its cost is in docs/benchmarks.md.
PRODUCER_OPTIONS: dict[str, Any] = {"linger_ms": 0, "acks": "all", "enable_idempotence": True}


class TopicCreationError(RuntimeError):
    """The broker refused to create a topic (other than because it already exists)."""


class BusConnectionError(ConnectionError):
    """No Kafka client could connect: the message says where, how and why (never a secret)."""


def describe_security(settings: Settings) -> str:
    """How this process connects, for messages: e.g. ``SASL_SSL (SCRAM-SHA-512 as 'gate')``."""
    protocol = settings.kafka_security_protocol
    if protocol.startswith("SASL_"):
        return f"{protocol} ({settings.kafka_sasl_mechanism} as {settings.kafka_sasl_username!r})"
    return protocol


class AclCreationError(RuntimeError):
    """The cluster refused an ACL (e.g. no authorizer is configured, or the principal may not)."""


async def create_acls(settings: Settings, acls: "Iterable[Acl]") -> int:
    """Grant `acls` (ALLOW, from any host) on the cluster, as this process's principal (an admin:
    creating ACLs needs ALTER on the cluster). Idempotent: an existing ACL is granted again
    without error. The number of ACLs sent."""
    from aiokafka.errors import for_code

    from voicebus.kafka_compat import create_acls as send

    acls = list(acls)
    if not acls:
        return 0
    admin = make_admin(settings)
    await admin.start()
    try:
        allow = 3
        results = await send(admin, [(a.resource, a.name, a.pattern, a.principal, "*", a.operation, allow)
                                     for a in acls])
    finally:
        await admin.close()
    failed = [f"{acl.describe()}: {for_code(code).__name__} {message or ''}".strip()
              for acl, (code, message) in zip(acls, results) if code]
    if failed:
        raise AclCreationError(f"{len(failed)} of {len(acls)} ACLs refused: " + "; ".join(failed[:5]))
    return len(acls)


async def diagnose_connection(settings: Settings, timeout_s: float = 10.0) -> str:
    """Why a client cannot reach the bus: one connection to the first bootstrap server with this
    process's security settings, its failure put in words (aiokafka's bootstrap error names only
    the hosts). The message names the listener, the protocol and mechanism; never a password."""
    import ssl

    from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed

    from voicebus.kafka_compat import open_connection

    first = settings.bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    where = f"Kafka at {first} over {describe_security(settings)}"
    try:
        connection = await asyncio.wait_for(
            open_connection(client_options(settings), host.strip("[]"), int(port), timeout_s), timeout_s)
    except SaslAuthenticationFailed as exc:
        reason = str(exc).split(":", 1)[-1].strip()
        return f"{where}: authentication failed: {reason}"
    except ssl.SSLCertVerificationError as exc:
        return (f"{where}: the broker's TLS certificate is not trusted ({exc.verify_message}); "
                f"set VOICEBUS_KAFKA_SSL_CAFILE to the CA that signed it")
    except ssl.SSLError as exc:
        return f"{where}: TLS failed ({exc.reason or exc}); is the listener {settings.kafka_security_protocol}?"
    except (KafkaConnectionError, ConnectionError) as exc:
        return (f"{where}: the broker closed the connection ({exc}); is that listener "
                f"{settings.kafka_security_protocol}? A secured listener drops a client of another protocol")
    except (OSError, asyncio.TimeoutError) as exc:
        return f"{where}: nothing answers ({exc!r})"
    connection.close()
    return f"{where}: a connection succeeds now"


def client_options(settings: Settings) -> dict[str, Any]:
    """What every Kafka client of voicebus is built with: the bootstrap servers and the bus's
    security (``VOICEBUS_KAFKA_SECURITY_PROTOCOL`` and the SASL and TLS settings). Every producer,
    consumer and admin client of every stage, the CLI and the SDK is built from these, here or
    through `make_producer`, `make_consumer` and `make_admin`."""
    from aiokafka.helpers import create_ssl_context

    protocol = settings.kafka_security_protocol
    options: dict[str, Any] = {"bootstrap_servers": settings.bootstrap, "security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        key_password = reveal(settings.kafka_ssl_key_password) or None
        options["ssl_context"] = create_ssl_context(
            cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None,
            certfile=str(settings.kafka_ssl_certfile) if settings.kafka_ssl_certfile else None,
            keyfile=str(settings.kafka_ssl_keyfile) if settings.kafka_ssl_keyfile else None,
            password=key_password)
    if protocol.startswith("SASL_"):
        # a user refused later, while the client runs, is reported (voicebus.credentials)
        from voicebus.credentials import BUS_ACCESS
        from voicebus.kafka_compat import watch_connections

        watch_connections(BUS_ACCESS.note)
        options.update(sasl_mechanism=settings.kafka_sasl_mechanism,
                       sasl_plain_username=settings.kafka_sasl_username,
                       sasl_plain_password=reveal(settings.kafka_sasl_password))
    return options


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    options = {**PRODUCER_OPTIONS, "max_request_size": settings.max_message_bytes, **overrides}
    return AIOKafkaProducer(**client_options(settings), **options)


def make_admin(settings: Settings, **overrides: Any) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**client_options(settings), **overrides)


def make_consumer(settings: Settings, *topics: str, group_id: str | None = None, **overrides: Any) -> AIOKafkaConsumer:
    options: dict[str, Any] = {
        "group_id": group_id,
        "auto_offset_reset": "earliest" if group_id else "latest",
        "enable_auto_commit": True,
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
        "max_partition_fetch_bytes": settings.max_message_bytes,
        **overrides,
    }
    from voicebus.kafka_compat import stop_fetches_quietly

    stop_fetches_quietly()  # a consumer stopped while a fetch backs off still stops
    return AIOKafkaConsumer(*topics, **client_options(settings), **options)


# A broker that just died stays in the cluster metadata until the controller fences it (seconds);
# an admin request the client sends to it fails with these (and aiokafka's retriable errors, e.g.
# a connection refused). Retried until this long has passed.
ADMIN_RETRY_S = 30.0
ADMIN_REQUEST_TIMEOUT_MS = 10_000
RETRIABLE_ADMIN_ERRORS = (NodeNotReadyError, RequestTimedOutError, NotControllerError, KafkaTimeoutError,
                           asyncio.TimeoutError)
_RETRIABLE_TOPIC_ERROR_CODES = {RequestTimedOutError.errno, NotControllerError.errno}


class _RetriableTopicError(Exception):
    """A per-topic error in a CreateTopics response that a later attempt may not get."""


async def ensure_topics(settings: Settings, names: Iterable[str] | None = None, partitions: int | None = None,
                        retry_s: float = ADMIN_RETRY_S) -> None:
    """Create `names` (default: every fixed topic) if missing; idempotent.

    Each new topic gets the replication of `voicebus.topics.durability` for the brokers the
    cluster reports now, its class's retention and cleanup policy, and min.insync.replicas.
    Topics that exist are left as they are (Kafka never changes a topic's replication by itself;
    docs/kafka.md says how to alter one). A refusal raises `TopicCreationError`.

    A request that reaches a broker that is down while others answer (one just killed, still in
    the metadata) is retried with a fresh client for up to `retry_s` seconds; no broker answering
    at all still fails at once (aiokafka's `KafkaConnectionError`).
    """
    from voicebus.retry import retrying
    from tenacity import wait_incrementing

    def retried(exc: BaseException, attempt: int, _wait_s: float) -> None:
        log.warning("creating topics: %r (a broker is down?); retrying (attempt %d)", exc, attempt + 1)

    names = list(names) if names is not None else fixed_topics(settings)
    retriable = (*RETRIABLE_ADMIN_ERRORS, _RetriableTopicError)
    try:
        # waits of 0.1 s, 0.2 s, ... up to 1 s: a broker just killed leaves the metadata soon
        async for attempt in retrying(wait=wait_incrementing(start=0.1, increment=0.1, max=1.0), retry_on=retriable,
                                      deadline_s=retry_s, on_retry=retried):
            with attempt:
                await _ensure_topics_once(settings, names, partitions)
                # inside the retries: its admin listing, too, may reach a broker just killed
                await _await_leaders(settings, names)
    except retriable as exc:
        raise TopicCreationError(f"topics not created within {retry_s:.0f} s: {exc!r}") from exc


# How long `ensure_topics` waits for the leaders of its topics' partitions to serve requests.
LEADER_WAIT_S = 30.0


async def _await_leaders(settings: Settings, names: list[str], timeout_s: float = LEADER_WAIT_S) -> None:
    """Return once every partition of `names` has a leader that answers ListOffsets. Right after
    a topic is created (by this stage or by another starting beside it) the metadata already
    names leaders that answer NotLeaderForPartition for a few hundred milliseconds: a consumer
    resetting its offsets then logs an ERROR per retry (the gate, then the edge in
    test_start_order) and a producer retries its first sends with back-off. ``end_offsets``
    retries that quietly. Past `timeout_s` (a leader gone with its broker) the stage goes on
    with a warning: its clients retry on their own, as they would have without this wait."""
    tps = await partitions_of(settings, names)
    if not tps:
        return
    consumer = make_consumer(settings, enable_auto_commit=False)
    await consumer.start()
    try:
        await asyncio.wait_for(consumer.end_offsets(tps), timeout_s)
    except (KafkaError, asyncio.TimeoutError) as exc:
        log.warning("topics %s: not every partition's leader answered within %.0f s (%r); going on",
                    ", ".join(names), timeout_s, exc)
    finally:
        await consumer.stop()


async def seek_to_beginning_quietly(consumer: AIOKafkaConsumer, tps: list) -> dict:
    """Position `consumer` at the beginning of `tps` (assigned) and return their end offsets.

    Offsets are asked explicitly, not through ``seek_to_beginning``: a just-created topic's leader
    may not serve ListOffsets yet (NotLeaderForPartition), which ``end_offsets`` and
    ``beginning_offsets`` retry quietly while ``seek_to_beginning``'s offset reset logs an ERROR
    per retry (test_start_order caught one from the gate on a loaded machine)."""
    ends = await consumer.end_offsets(tps)
    for tp, offset in (await consumer.beginning_offsets(tps)).items():
        consumer.seek(tp, offset)
    return ends


async def partitions_of(settings: Settings, topics: Iterable[str]) -> list:
    """Every partition (``TopicPartition``) of `topics`; a topic that does not exist has none."""
    from aiokafka.structs import TopicPartition

    admin = make_admin(settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [t for t in topics if t in existing]
        described = await admin.describe_topics(wanted) if wanted else []
    finally:
        await admin.close()
    return [TopicPartition(d["topic"], p["partition"]) for d in described for p in d.get("partitions", ())]


async def topics_matching(settings: Settings, pattern: "str | re.Pattern[str]") -> list[str]:
    """The topics whose name matches the regex `pattern` now, sorted."""
    admin = make_admin(settings)
    await admin.start()
    try:
        return sorted(t for t in await admin.list_topics() if re.match(pattern, t))
    finally:
        await admin.close()


async def end_offsets(settings: Settings, topics: Iterable[str]) -> dict:
    """``TopicPartition`` -> the offset the next record written to it will get, for every
    partition of `topics` now."""
    tps = await partitions_of(settings, topics)
    if not tps:
        return {}
    consumer = make_consumer(settings, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.end_offsets(tps)
    finally:
        await consumer.stop()


async def committed_offsets(settings: Settings, group_id: str) -> dict:
    """``TopicPartition`` -> the offset consumer group `group_id` has committed (none: absent).
    No coordinator yet (no group has committed on this cluster, or it is still electing one):
    nothing is known to be committed, so nothing is returned."""
    from aiokafka.errors import GroupCoordinatorNotAvailableError

    admin = make_admin(settings)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group_id)
    except GroupCoordinatorNotAvailableError:
        return {}
    finally:
        await admin.close()
    return {tp: meta.offset for tp, meta in committed.items() if meta.offset >= 0}


async def read_to_end(settings: Settings, topics: Iterable[str]) -> list:
    """Every record now on `topics`, from the beginning to the end offsets they had when asked, in
    order per partition (aiokafka ``ConsumerRecord``s, undecoded). A topic that does not exist
    is skipped. One fetch is not enough for this: it returns what one fetch response carried, not
    every partition to its end."""
    tps = await partitions_of(settings, topics)
    if not tps:
        return []
    out: list = []
    consumer = make_consumer(settings, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(tps)
        ends = await seek_to_beginning_quietly(consumer, tps)
        while behind := [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(*behind, timeout_ms=500)).items():
                out.extend(r for r in records if r.offset < ends[tp])
    finally:
        await consumer.stop()
    return out


# How long a stopping stage waits for each Kafka farewell (leave the group, a last record, flush
# the producer) before it gives up on it: with no broker reachable each of them would otherwise
# retry for minutes, and a SIGTERMed process kept running (bench chaos left an orphaned edge).
FAREWELL_TIMEOUT_S = 5.0


async def farewell(step: Any, what: str, timeout_s: float = FAREWELL_TIMEOUT_S) -> bool:
    """Await `step` (a stopping client's coroutine) for at most `timeout_s`; whether it finished.
    A Kafka error or the timeout is logged as a warning (what was not done, and why) and the stop
    goes on: a stage must stop even when no broker answers."""
    from aiokafka.errors import KafkaError

    try:
        await asyncio.wait_for(step, timeout_s)
        return True
    except asyncio.TimeoutError:
        log.warning("stopping: %s did not finish within %.0f s (no broker answering?); going on", what, timeout_s)
    except KafkaError as exc:
        log.warning("stopping: %s failed (%s); going on", what, exc)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this stop itself is cancelled
        # aiokafka's consumer.stop() without a broker ends in a CancelledError of its own tasks
        log.warning("stopping: %s was cancelled inside the client (no broker answering?); going on", what)
    return False


async def await_group_coordinator(settings: Settings, group_id: str, timeout_s: float = 60.0) -> bool:
    """Wait (quietly) until the cluster has a coordinator for `group_id`; whether it has one.

    On a new cluster Kafka creates ``__consumer_offsets`` on the first group request and answers
    GroupCoordinatorNotAvailable until that topic's partitions have leaders (a second or so).
    aiokafka's group consumer logs each such retry at ERROR, so a stage started first on a fresh
    broker would print errors although nothing is wrong. Every stage with a consumer group asks
    here first (start in any order); after `timeout_s` it goes on and lets the
    consumer retry (and log) as usual."""
    from aiokafka.errors import KafkaError

    from voicebus.retry import retrying

    attempts = retrying(wait=0.2, retry_on=(KafkaError, asyncio.TimeoutError), deadline_s=timeout_s,
                        retry_if=lambda exc: getattr(exc, "retriable", isinstance(exc, asyncio.TimeoutError)))
    admin = make_admin(settings, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS)
    await admin.start()
    try:
        async for attempt in attempts:
            with attempt:
                await admin.find_coordinator(group_id)
        return True
    except (KafkaError, asyncio.TimeoutError) as exc:  # not retriable, or past the deadline
        log.info("no coordinator for group %s yet (%r): the consumer will retry", group_id, exc)
        return False
    finally:
        await admin.close()


async def _ensure_topics_once(settings: Settings, names: list[str], partitions: int | None) -> None:
    admin = make_admin(settings, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in names if n not in existing]
        if not missing:
            return
        durable = await cluster_durability(settings, admin)
        wanted = [
            NewTopic(n, num_partitions=partitions or settings.partitions,
                     replication_factor=durable.replication_factor,
                     topic_configs=topic_configs(settings, n, durable))
            for n in missing
        ]
        try:
            response = await admin.create_topics(wanted)
        except TopicAlreadyExistsError:
            return  # a concurrent creator won the race: that's fine
        errors = [err for err in response.topic_errors if err[1] not in (0, TopicAlreadyExistsError.errno)]
        described = [f"{err[0]}: error {err[1]}" + (f" ({err[2]})" if len(err) > 2 and err[2] else "")
                     for err in errors]
        if errors and all(err[1] in _RETRIABLE_TOPIC_ERROR_CODES for err in errors):
            raise _RetriableTopicError("; ".join(described))
        if errors:
            raise TopicCreationError("Kafka refused to create " + "; ".join(described))
        await _wait_until_described(admin, missing)
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


async def _wait_until_described(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """Until the metadata of just-created topics names a leader for every partition, so callers
    (and a stage starting before anyone else) do not begin with "unknown topic" retries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        if all(t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
               for t in described):
            return
        if loop.time() > deadline:
            log.warning("topics %s have no leader for every partition after %.0f s", names, timeout_s)
            return
        await asyncio.sleep(0.05)


async def cluster_durability(settings: Settings, admin: AIOKafkaAdminClient) -> Durability:
    """`voicebus.topics.durability` for the brokers the cluster reports (alive, not fenced)."""
    brokers = len((await admin.describe_cluster())["brokers"])
    durable = durability(settings, brokers)
    if not settings.replication_factor and brokers == 2:  # e.g. a 3-broker cluster with one down
        log.warning("the cluster reports 2 brokers: new topics get 2 replicas, not 3")
    return durable


async def publish(producer: AIOKafkaProducer, codec: Codec, topic: str, message_type: str,
                  value: "Message | Mapping[str, Any]", headers: list[tuple[str, bytes]] | None = None) -> None:
    """Encode `value` (a typed `Message` or a record dict) and send it keyed by its session id
    (with `headers`, e.g. a turn's trace context); returns once the broker acked."""
    if isinstance(value, Message):
        value = value.to_record()
    await producer.send_and_wait(topic, codec.encode(message_type, value, topic), key=session_key(value["session_id"]),
                                 headers=headers)


@dataclass(frozen=True)
class DecodedRecord:
    """A consumer record that decoded cleanly: where it came from, its key and its message
    (`typed`: as the contract's object, what a stage's handler works with)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    message: Decoded

    @cached_property
    def typed(self) -> Any:
        """The message as its typed object (`voicebus.schemas.messages.typed`): a `TextEvent`,
        `ControlEvent`, `SynthesisRequest`, `AudioChunk`, ...; the decoded dict for a type with
        no class. Built once, on first use."""
        return typed(self.message.type, self.message.value)
