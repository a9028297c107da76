"""The plumbing every Kafka shell shares (gate, synthesis worker, edge, recorder), in one place.

- `RecordPolicy`: what happens to one consumer record. It is decoded and checked against the
  contract (`voicebus.codecs`, `voicebus.schemas.contract`), then handed to the stage's handler. Any
  failure of that one record (undecodable, breaks the contract, or the handler raises) goes to the
  one error callback, which by default dead-letters the record unchanged with the reason in its
  headers, counts it (``voicebus_records_dead_lettered_total{stage,reason}``) and logs it; the
  stage goes on with the next record. A typed error (one with a ``reason``) is expected input; an
  untyped one is a bug and is logged with its traceback, but it too costs only its own record.
  The callback is injectable (quix-streams' error-callback shape): tests collect failures with it.
  A dead letter can itself not wedge the stage: its copy is capped below the producer's request
  size (the payload truncated, a digest of the original kept in the headers), each write is tried
  ``deadletter_attempts`` times within ``deadletter_timeout_s`` (tenacity), and a record whose
  dead letter still fails is skipped and counted (``voicebus_records_skipped_total{stage,reason}``).
- `Supervisor`: owns a stage's long-running tasks. A task that dies anyway (a bug outside any one
  record, the broker gone for longer than a client retries) is restarted with backoff, the restart
  is counted, and `health()` says so for ``/healthz``.
- `serve_health`: ``/healthz`` (the stage's `Supervisor` health: 200 while every task runs, 503
  otherwise, with each task's restarts and last error) and ``/metrics`` on a port of the stage's
  own, for the stages that have no web server of their own (gate, synthesis worker).
- `ControlFollower`: the one way a stage that must see every cancel reads the control topic: a
  consumer of its own (no group) on every control partition, from ``lookback_s`` back by
  timestamp (or from the end), caught up to the topic's end before `start` returns, then followed
  in its own supervised task. Control never waits behind data because it is never in the same
  consumer as data: stages check the cancel state the follower updates before acting on data.
- `TopicDiscovery`: topics of a family (the agents' text topics) as they appear: the agent
  registry topic followed from its beginning (what the SDK writes, `register_topic`), and a
  periodic listing of the broker's topics for producers that do not register.

Layering: stages -> shell -> bus, codecs -> voicebus.schemas.contract, settings.

Size: about 620 lines: the plumbing every stage shares (record policy, supervisor, control
follower, topic discovery) is kept in one module on purpose, so that gate, worker and edge have one
mechanism for each, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from voicebus.bus import DecodedRecord, make_consumer, seek_to_beginning_quietly, topics_matching
from voicebus.clock import now_us
from voicebus.codecs import Codec, CodecError, deadletter_headers
from voicebus.settings import Settings

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

log = logging.getLogger(__name__)

HANDLER_ERROR = "handler-error"  # the reason of an untyped exception raised by a handler (a bug)
DEADLETTER_HEADROOM = 16 * 1024  # bytes of a dead letter's request left for its key, headers and framing
DEADLETTER_MAX_KEY = 1024  # a longer key is cut (the record's partition in the dead-letter topic is the cut key's)


def capped_copy(key: bytes | None, value: bytes | None, max_request_bytes: int) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """A dead letter's key and value, cut to fit one request of `max_request_bytes`, and the
    headers that say what was cut: the original's size and SHA-256, so it can still be matched."""
    headers: list[tuple[str, bytes]] = []
    limit = max(1024, max_request_bytes - DEADLETTER_HEADROOM)
    if value is not None and len(value) > limit:
        headers += [("voicebus.error.truncated", str(len(value)).encode()),
                    ("voicebus.error.sha256", hashlib.sha256(value).hexdigest().encode())]
        value = value[:limit]
    if key is not None and len(key) > DEADLETTER_MAX_KEY:
        headers += [("voicebus.error.key_truncated", str(len(key)).encode()),
                    ("voicebus.error.key_sha256", hashlib.sha256(key).hexdigest().encode())]
        key = key[:DEADLETTER_MAX_KEY]
    return key, value, headers


# --- the record policy -----------------------------------------------------------------------


@dataclass(frozen=True)
class RecordFailure:
    """One record that a stage could not take, and why."""

    stage: str
    record: Any  # an aiokafka ConsumerRecord (topic, partition, offset, key, value, headers)
    error: BaseException

    @property
    def reason(self) -> str:
        return getattr(self.error, "reason", None) or HANDLER_ERROR

    @property
    def expected(self) -> bool:
        """Bad input (a typed error with a reason), not a bug in the stage."""
        return getattr(self.error, "reason", None) is not None


ErrorCallback = Callable[[RecordFailure], Awaitable[None]]
Handler = Callable[[DecodedRecord], Awaitable[Any] | Any]


class RecordPolicy:
    """Decode, check, handle one record; a failure goes to `on_error` and never escapes.

    ``on_error`` defaults to `dead_letter`. The policy needs a started producer for that (its
    owner starts and stops it); ``registry`` is the stage's Prometheus registry, where the
    dead-letter counter is registered.
    """

    def __init__(
        self,
        stage: str,
        settings: Settings,
        codec: Codec,
        producer: "AIOKafkaProducer | None",
        *,
        on_error: ErrorCallback | None = None,
        registry: Any = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.stage = stage
        self.settings = settings
        self.codec = codec
        self.producer = producer
        self.on_error: ErrorCallback = on_error or self.dead_letter
        registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter(
            "voicebus_records_dead_lettered", "Records a stage could not take, by reason",
            ["stage", "reason"], registry=registry)
        self.skipped = Counter(
            "voicebus_records_skipped", "Records a stage could not take and could not dead-letter either, by reason",
            ["stage", "reason"], registry=registry)

    async def records(self, consumer: "AIOKafkaConsumer", expect: str | None = None) -> AsyncIterator[DecodedRecord]:
        """Every record `consumer` receives that decodes and checks, in order; the others go to the
        error callback. Ends when the consumer stops (or the caller stops iterating)."""
        async for record in consumer:
            decoded = await self.accept(record, expect)
            if decoded is not None:
                yield decoded

    def decode(self, record: Any, expect: str | None = None) -> DecodedRecord:
        """The record decoded and checked; raises `CodecError` (use `process` or `accept`)."""
        decoded = self.codec.decode(record.value, expect=expect)
        return DecodedRecord(record.topic, record.partition, record.offset, record.key,
                             record.timestamp, decoded)

    async def accept(self, record: Any, expect: str | None = None) -> DecodedRecord | None:
        """The record decoded and checked, or None once a failure was handed to `on_error`. A
        writer schema the codec must fetch from the registry is fetched in a thread first: the
        event loop (every other session of the stage) never waits on the registry."""
        schema_id = self.codec.unresolved_schema_id(record.value)
        if schema_id is not None:
            await asyncio.to_thread(self.codec.prefetch, schema_id)
        try:
            return self.decode(record, expect)
        except CodecError as exc:
            await self.fail(record, exc)
            return None

    async def process(self, record: Any, expect: str | None, handle: Handler) -> bool:
        """Decode, check and handle one record. True when the handler took it; False when the
        record failed (and went to `on_error`). Only cancellation propagates."""
        decoded = await self.accept(record, expect)
        if decoded is None:
            return False
        try:
            result = handle(decoded)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one record's failure must not end the stage
            await self.fail(record, exc)
            return False
        return True

    async def fail(self, record: Any, error: BaseException) -> None:
        failure = RecordFailure(self.stage, record, error)
        if not failure.expected:
            log.error("%s: handling %s[%s]@%s raised (a bug; the record is dead-lettered)",
                      self.stage, record.topic, record.partition, record.offset, exc_info=error)
        self.failures.labels(self.stage, failure.reason).inc()
        await self.on_error(failure)

    async def dead_letter(self, failure: RecordFailure) -> bool:
        """The default error callback: the record to the dead-letter topic with the reason, the
        stage and the source in its headers (cut to fit one request, `capped_copy`). Tried
        ``deadletter_attempts`` times, each within ``deadletter_timeout_s``; then the record is
        skipped and counted, and the stage goes on. True once the dead letter is written."""
        from aiokafka.errors import KafkaError

        from voicebus.retry import Backoff, retrying

        record = failure.record
        if self.producer is None:
            raise RuntimeError(f"{self.stage}: no producer to dead-letter {record.topic}[{record.partition}]@{record.offset}")
        s = self.settings
        headers = deadletter_headers(failure.error, record.topic, record.partition, record.offset)
        # the reason the counter uses (an untyped error is "handler-error", not the codec's "unhandled")
        headers = [(k, failure.reason.encode()) if k == "voicebus.error.reason" else (k, v) for k, v in headers]
        headers.append(("voicebus.error.stage", self.stage.encode()))
        key, value, cut = capped_copy(record.key, record.value, s.max_message_bytes)
        try:
            async for attempt in retrying(wait=Backoff(0.1, 2.0), retry_on=(KafkaError, asyncio.TimeoutError),
                                          attempts=s.deadletter_attempts):
                with attempt:
                    await asyncio.wait_for(self.producer.send_and_wait(s.deadletter_topic, value, key=key,
                                                                       headers=headers + cut), s.deadletter_timeout_s)
        except (KafkaError, asyncio.TimeoutError) as exc:
            self.skipped.labels(self.stage, failure.reason).inc()
            log.error("%s: %s[%s]@%s (%s) could not be dead-lettered to %s after %d tries (%r): skipped",
                      self.stage, record.topic, record.partition, record.offset, failure.reason,
                      s.deadletter_topic, s.deadletter_attempts, exc)
            return False
        log.warning("%s: dead-lettered %s[%s]@%s (%s): %s", self.stage, record.topic, record.partition,
                    record.offset, failure.reason, failure.error)
        return True


# --- supervised tasks --------------------------------------------------------------------------


@dataclass
class TaskHealth:
    name: str
    restarts: int = 0
    last_error: str | None = None
    last_error_at_us: int | None = None
    running: bool = False


@dataclass
class Supervisor:
    """Runs a stage's long-lived tasks; restarts one that raises, with backoff; reports health.

    ``clock`` and ``sleep`` are injectable (tests drive the backoff without waiting)."""

    stage: str
    min_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    registry: Any = None
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _health: dict[str, TaskHealth] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self._restarts = Counter(
            "voicebus_task_restarts", "Long-running tasks restarted after dying, by task",
            ["stage", "task"], registry=self.registry if self.registry is not None else CollectorRegistry())

    def start(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run ``factory()`` as task ``name`` until `stop`; restart it whenever it raises."""
        if name in self._tasks:
            raise ValueError(f"{self.stage}: task {name!r} already runs")
        health = self._health[name] = TaskHealth(name)
        self._tasks[name] = asyncio.create_task(self._run(name, factory, health), name=f"{self.stage}-{name}")

    async def _run(self, name: str, factory: Callable[[], Awaitable[None]], health: TaskHealth) -> None:
        # Not one operation retried but a task restarted for the stage's life, whose deaths in a
        # row set the wait and a long run starts the doubling again: it counts them itself and
        # takes each wait from `Backoff`, the policy the retried operations use.
        from voicebus.retry import Backoff

        backoff, deaths = Backoff(self.min_backoff_s, self.max_backoff_s), 0
        while True:
            started = self.clock()
            health.running = True
            try:
                await factory()
                log.info("%s: task %s returned", self.stage, name)
                health.running = False
                return
            except asyncio.CancelledError:
                health.running = False
                raise
            except Exception as exc:  # noqa: BLE001 - the task is restarted and the death reported
                health.running = False
                health.restarts += 1
                health.last_error = f"{type(exc).__name__}: {exc}"
                health.last_error_at_us = now_us()
                self._restarts.labels(self.stage, name).inc()
                if self.clock() - started > 10 * self.max_backoff_s:
                    deaths = 0  # it had been running well: start the backoff again
                deaths += 1
                wait_s = backoff.after(deaths)
                log.error("%s: task %s died (restart %d in %.1f s)", self.stage, name, health.restarts,
                          wait_s, exc_info=exc)
            await self.sleep(wait_s)

    def health(self) -> dict[str, dict[str, Any]]:
        return {n: {"running": h.running, "restarts": h.restarts, "last_error": h.last_error,
                    "last_error_at_us": h.last_error_at_us} for n, h in self._health.items()}

    @property
    def healthy(self) -> bool:
        """Every task is running: none has ended, none is dead and waiting for its restart (a
        restarted one counts as running again). What each stage's ``/healthz`` reports."""
        waiting = any(not h.running and h.restarts for h in self._health.values())
        return all(not t.done() for t in self._tasks.values()) and not waiting

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()


async def serve_health(host: str, port: int, health: Callable[[], dict[str, Any]], registry: Any) -> Any:
    """Serve ``/healthz`` (``health()`` as JSON; 200 when its ``healthy`` is true, else 503) and
    ``/metrics`` (``registry``, Prometheus text) on ``host:port``. Returns the started
    ``aiohttp.web.AppRunner``: the caller owns it and calls ``cleanup()`` when it stops."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        body = health()
        return web.Response(text=json.dumps(body), content_type="application/json",
                            status=200 if body.get("healthy") else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


# --- the control follower ----------------------------------------------------------------------


class ControlCatchUpError(RuntimeError):
    """The control topic could not be read up to its end in time at start."""


class ControlFollower:
    """Every control event, to ``on_event`` as a typed `ControlEvent`, for a stage that must see
    all of them.

    `start` assigns every control partition to a consumer of its own, seeks ``lookback_s`` back
    by timestamp (0: to the end), applies everything up to the end as of now, and only then
    returns, so a cancel issued just before the stage started is not missed. `follow` (run it
    under the stage's `Supervisor`) applies the rest as it comes. Each record goes through the
    stage's `RecordPolicy`. The follower owns its consumer; `stop` stops it.

    ``topic`` and ``message_type`` follow another topic the same way (the agents SDK follows
    what listeners heard, TurnHeard on ``settings.heard_topic``).
    """

    def __init__(
        self,
        settings: Settings,
        policy: RecordPolicy,
        on_event: Callable[[Any], Awaitable[Any] | Any],
        *,
        lookback_s: float = 0.0,
        catch_up_timeout_s: float = 15.0,
        clock_us: Callable[[], int] = now_us,
        topic: str | None = None,
        message_type: str = "ControlEvent",
    ) -> None:
        self.settings = settings
        self.topic = topic or settings.control_topic
        self.message_type = message_type
        self.policy = policy
        self.on_event = on_event
        self.lookback_s = lookback_s
        self.catch_up_timeout_s = catch_up_timeout_s
        self.clock_us = clock_us
        self.consumer: "AIOKafkaConsumer | None" = None
        self.applied = 0
        self._next: dict = {}  # partition -> the next offset to apply (where a reopen resumes)
        self._broken = False

    async def start(self) -> None:
        from aiokafka.structs import TopicPartition

        if self.policy.producer is None:
            raise ControlCatchUpError("the control follower needs the stage's started producer")
        partitions = await self.policy.producer.partitions_for(self.topic)  # waits for metadata
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self.consumer = await self._open(tps)
        try:
            if self.lookback_s > 0:
                since_ms = self.clock_us() // 1000 - int(self.lookback_s * 1000)
                found = await self.consumer.offsets_for_times({tp: since_ms for tp in tps})
                for tp in tps:
                    hit = found.get(tp)
                    if hit is None:
                        await self.consumer.seek_to_end(tp)
                    else:
                        self.consumer.seek(tp, hit.offset)
            else:
                await self.consumer.seek_to_end(*tps)
            await self._catch_up(tps)
        except BaseException:
            await self.stop()
            raise

    async def _open(self, tps: list) -> "AIOKafkaConsumer":
        s = self.settings
        consumer = make_consumer(s, group_id=None, enable_auto_commit=False)
        await consumer.start()
        consumer.assign(tps)
        return consumer

    async def _catch_up(self, tps: list) -> None:
        assert self.consumer is not None
        ends = await self.consumer.end_offsets(tps)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.catch_up_timeout_s
        while True:
            behind = [tp for tp in tps if await self.consumer.position(tp) < ends[tp]]
            if not behind:
                return
            if loop.time() > deadline:
                raise ControlCatchUpError(
                    f"{self.topic} not caught up after {self.catch_up_timeout_s}s: {behind}")
            await self._apply(await self.consumer.getmany(*behind, timeout_ms=200))

    async def follow(self) -> None:
        """Apply control events as they come, until cancelled. If the consumer fails, the next
        call (the supervisor's restart) reopens a fresh one where the failed one stopped."""
        assert self.consumer is not None, "start() first"
        if self._broken:
            await self._reopen()
        try:
            while True:
                await self._apply(await self.consumer.getmany(timeout_ms=500))
        except asyncio.CancelledError:
            raise
        except Exception:
            self._broken = True
            raise

    async def _reopen(self) -> None:
        assert self.consumer is not None
        tps = sorted(self.consumer.assignment())
        positions = {tp: self._next.get(tp) for tp in tps}
        with contextlib.suppress(Exception):  # it failed already; its own errors are not news
            await self.consumer.stop()
        self.consumer = await self._open(tps)
        for tp, offset in positions.items():
            if offset is None:
                await self.consumer.seek_to_end(tp)
            else:
                self.consumer.seek(tp, offset)
        self._broken = False
        log.warning("control follower reopened its consumer at %s", {tp.partition: o for tp, o in positions.items()})

    async def _apply(self, batch: dict) -> None:
        for tp, records in batch.items():
            for record in records:
                if await self.policy.process(record, self.message_type, lambda d: self.on_event(d.typed)):
                    self.applied += 1
                self._next[tp] = record.offset + 1

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None


# --- topic discovery ---------------------------------------------------------------------------


def registry_record(agent_id: str, topic: str) -> tuple[bytes, bytes]:
    """The agent registry's record for one agent's text topic: (key, value)."""
    return agent_id.encode("utf-8"), json.dumps({"agent_id": agent_id, "topic": topic}).encode("utf-8")


async def register_topic(producer: "AIOKafkaProducer", settings: Settings, agent_id: str, topic: str) -> None:
    """Tell every follower of the agent registry (the gate) that `topic` carries `agent_id`'s
    text. Returns once the broker acked."""
    key, value = registry_record(agent_id, topic)
    await producer.send_and_wait(settings.agents_topic, value, key=key)


class TopicDiscovery:
    """Topics matching a pattern, as they appear, handed to ``on_topics(names)``.

    Two sources: (a) the registry topic (``settings.agents_topic``, compacted, key agent id,
    value JSON with its ``topic``), read from its beginning by a consumer of its own (no group),
    so a registered topic reaches ``on_topics`` within a fetch; (b) a listing of the broker's
    topics every ``interval_s``, for producers that create topics without registering. `start`
    reads the registry to its end and lists once before it returns, so the caller knows every
    topic that exists; then run `follow_registry` and `poll_listing` under the stage's
    `Supervisor`. A registry record naming a topic that does not match the pattern is refused
    (error log, counter ``voicebus_registry_records_refused_total``). ``on_topics`` gets only
    names it has not been given before."""

    def __init__(
        self,
        settings: Settings,
        pattern: str,
        on_topics: Callable[[set[str]], Awaitable[Any]],
        producer: "AIOKafkaProducer",
        *,
        interval_s: float = 2.0,
        policy_stage: str = "discovery",
        registry: Any = None,
        catch_up_timeout_s: float = 15.0,
    ) -> None:
        import re

        from prometheus_client import CollectorRegistry, Counter

        self.settings = settings
        self.pattern = re.compile(pattern)
        self.on_topics = on_topics
        self.producer = producer
        self.interval_s = interval_s
        self.stage = policy_stage
        self.catch_up_timeout_s = catch_up_timeout_s
        self.known: set[str] = set()
        self.consumer: "AIOKafkaConsumer | None" = None
        registry = registry if registry is not None else CollectorRegistry()
        self._refused = Counter("voicebus_registry_records_refused", "Registry records naming no valid topic",
                                ["stage"], registry=registry)
        self.listing_failures = Counter("voicebus_topic_listing_failures",
                                        "Periodic listings of the broker's topics that failed (a broker down)",
                                        ["stage"], registry=registry)

    async def start(self) -> None:
        from aiokafka.structs import TopicPartition

        s = self.settings
        partitions = await self.producer.partitions_for(s.agents_topic)
        tps = [TopicPartition(s.agents_topic, p) for p in sorted(partitions)]
        self.consumer = make_consumer(s, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
        await self.consumer.start()
        try:
            self.consumer.assign(tps)
            ends = await seek_to_beginning_quietly(self.consumer, tps)  # a new registry topic too
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.catch_up_timeout_s
            found: set[str] = set()
            while behind := [tp for tp in tps if await self.consumer.position(tp) < ends[tp]]:
                if loop.time() > deadline:
                    raise ControlCatchUpError(f"{s.agents_topic} not read to its end in {self.catch_up_timeout_s}s")
                found |= self._topics_in(await self.consumer.getmany(*behind, timeout_ms=200))
            found |= await self._list()
            await self._hand_over(found)
        except BaseException:
            await self.stop()
            raise

    async def follow_registry(self) -> None:
        assert self.consumer is not None, "start() first"
        while True:
            found = self._topics_in(await self.consumer.getmany(timeout_ms=1000))
            if found:
                await self._hand_over(found)

    async def poll_listing(self) -> None:
        """List the broker's topics every ``interval_s``. A listing that fails because a broker is
        away (one just died and is still in the metadata, or none answers) is reported (warning,
        ``voicebus_topic_listing_failures_total``) and tried again at the next interval: the
        next listing finds whatever this one missed, so a broker failover is no task death."""
        from aiokafka.errors import KafkaError

        from voicebus.bus import RETRIABLE_ADMIN_ERRORS

        while True:
            await asyncio.sleep(self.interval_s)
            try:
                found = await self._list()
            except (KafkaError, *RETRIABLE_ADMIN_ERRORS) as exc:
                if not (isinstance(exc, RETRIABLE_ADMIN_ERRORS) or exc.retriable):
                    raise  # not a broker away: the Supervisor restarts the task and reports it
                self.listing_failures.labels(self.stage).inc()
                log.warning("%s: listing the broker's topics failed (%r; a broker away?); next listing in %.1f s",
                            self.stage, exc, self.interval_s)
                continue
            await self._hand_over(found)

    async def _list(self) -> set[str]:
        return set(await topics_matching(self.settings, self.pattern))

    def _topics_in(self, batch: dict) -> set[str]:
        found: set[str] = set()
        for records in batch.values():
            for record in records:
                if record.value is None:
                    continue  # a tombstone: the agent left; its topic stays readable until deleted
                try:
                    topic = json.loads(record.value)["topic"]
                except (ValueError, KeyError, TypeError) as exc:
                    self._refused.labels(self.stage).inc()
                    log.error("%s: registry record %s[%s]@%s refused: not a registry record (%r)", self.stage,
                              record.topic, record.partition, record.offset, exc)
                    continue
                if isinstance(topic, str) and self.pattern.match(topic):
                    found.add(topic)
                else:  # another deployment's prefix sharing the registry, or garbage: not ours
                    self._refused.labels(self.stage).inc()
                    log.warning("%s: registry record %s[%s]@%s names %r, which does not match %s", self.stage,
                                record.topic, record.partition, record.offset, topic, self.pattern.pattern)
        return found

    async def _hand_over(self, found: set[str]) -> None:
        new = found - self.known
        if new:
            await self.on_topics(new)
            self.known |= new

    async def stop(self) -> None:
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            await consumer.stop()
