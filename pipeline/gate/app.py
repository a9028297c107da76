"""The gate's Kafka shell (aiokafka): agents' text topics in, synthesis requests out.

The pure core (`voicebus.gate.core.GateSession`) decides; this module owns everything Kafka:

- **Co-partitioning.** Every text topic, the control topic and the gate's changelog have
  ``settings.partitions`` partitions and are keyed by session id, so session S lives on the same
  partition number p everywhere. Workers of one ``settings.gate_app_id`` form one consumer group
  subscribed to the **control topic only**: owning control partition p means owning every session
  on p. Partition p of every agent text topic is read by a second consumer with **no group**
  (manual ``assign``), so a new agent topic costs a local ``assign`` of more partitions: no
  rebalance, nobody waits. A text topic with another partition count cannot be co-partitioned:
  it is refused (error log, counter ``voicebus_gate_topics_refused_total``); a text record whose
  key hashes to another partition is dead-lettered (reason ``wrong-partition``).
- **Discovery** (`voicebus.shell.TopicDiscovery`): the agent registry topic (written by the SDK)
  followed from its beginning, and a periodic listing of topics matching the text prefix.
- **State.** Each owned session's `GateSession` lives in memory; its state (``to_state()``) is
  written to the compacted changelog (``settings.gate_changelog_topic``) on partition p, followed
  by one record under a reserved key holding the next offset of every text topic's partition p.
  Per event: apply -> send the requests and await their acks -> write the state and positions.
  A crash in between re-applies the event on the old state, which gives the same requests with
  the same sentence_seq; the core's (agent, turn, seq) guard makes a later re-delivery harmless.
  The control consumer commits its own offsets (every ``commit_interval_s``, and on revoke).
- **Rebalance.** On revoke of p: p leaves the owned set at once (no new event of p starts, the
  timer skips it), an event of p in flight finishes (we still own p until the callback returns),
  then p's sessions and text partitions are dropped. On assignment of p: changelog partition p is
  read to its end (states and text positions), then the text partitions are sought there (no
  stored position: their beginning). `READY_LINE` is printed after that (with ``--announce``).
- **Bad input** goes through `voicebus.shell.RecordPolicy` (stage ``gate``): dead-lettered with
  its reason; a turn the gate failed on still ends (`GateSession.end_failed_turn`).
- **Tracing** (off by default, `voicebus.tracing`): the trace context of a turn's first text
  record is kept in memory per (session, turn); each request it releases gets a ``gate.hold``
  span (sentence complete .. released, the core's stamps) and carries that span's context in its
  headers to the worker.
- **Health**: with ``metrics_port`` (``--metrics-port``), ``/healthz`` (`health`: ready, each
  supervised task's restarts and last error; 503 while one is down) and ``/metrics``.
- **Timer** (every ``timer_interval_s``): hold timeouts (`GateSession.tick`) and idle-session
  expiry (`GateSession.expire`, then a tombstone on the changelog) for owned sessions.

Run it: ``voicebus gate`` or ``python -m voicebus.gate.cli`` (`voicebus.gate.cli` owns the
arguments and the signals), or `GateWorker` in an event loop of your own.
docs/gate.md has the design and the alternatives weighed.

Size: about 880 lines, most of them the one `GateWorker`: its control loop, text loop, timer,
recovery and fencing share the owned partitions, the sessions and the changelog positions, and the
exactly-once rule (apply, send and await the acks, write state and positions) spans them all. The
decisions are `voicebus.gate.core`, the shared plumbing `voicebus.shell`, the command line
`voicebus.gate.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from aiokafka.abc import ConsumerRebalanceListener

from voicebus.credentials import BUS_ACCESS
from voicebus.bus import (await_group_coordinator, ensure_topics, make_consumer, make_producer, read_to_end,
                          register_schemas,
                          seek_to_beginning_quietly)
from voicebus.clock import now_us
from voicebus.codecs import CodecError, codec_for
from voicebus import tracing
from voicebus.gate.core import GateConfig, GateSession
from voicebus.schemas.contract import FloorEventKind
from voicebus.schemas.messages import ControlEvent, FloorEvent, SynthesisRequest, TextEvent
from voicebus.retry import Backoff, retrying
from voicebus.settings import Settings
from voicebus.shell import RecordPolicy, Supervisor, TopicDiscovery, serve_health
from voicebus.topics import fixed_topics, session_key, text_topic_pattern
from voicebus.tracing import StageTracer, tracer_for

log = logging.getLogger(__name__)

READY_LINE = "voicebus-gate assigned"  # printed (JSON list of "topic:partition" after it) when ready
RECOVERY_TIMEOUT_S = 60.0  # reading a changelog partition to its end; then the recovery is retried
TEXT_BATCH_RECORDS = 100  # text records per batch at most: a control event waits for one batch at most
MAX_TRACED_TURNS = 10_000  # turn trace contexts kept (tracing on); the oldest are forgotten beyond
POSITIONS_KEY = b"\x00gate.positions"  # changelog key of a partition's text positions (no session
# id can be it: ids have no control characters, schemas/contract.py)


class GateStartError(RuntimeError):
    """The gate cannot run against these topics (e.g. a partition count it cannot co-partition)."""


class GateFull(ValueError):
    """A new session past ``gate_max_sessions`` with no idle session to forget in its place."""

    reason = "gate-full"  # the dead-letter header's reason


class WrongPartition(ValueError):
    """A text record on a partition other than the one its session key hashes to."""

    reason = "wrong-partition"


class PartitionRevoked(Exception):
    """The partition of the event being handled was revoked while its output was retried."""


async def stored_positions(settings: Settings) -> dict[tuple[str, int], int]:
    """(text topic, partition) -> the next offset the gate will apply, as its changelog says now.
    The gate writes a partition's positions only after the broker acknowledged every request the
    records before them made: a text record below its position has had all its effects."""
    out: dict[tuple[str, int], int] = {}
    for record in await read_to_end(settings, [settings.gate_changelog_topic]):
        if record.key == POSITIONS_KEY and record.value is not None:
            out.update({(topic, record.partition): offset for topic, offset in json.loads(record.value).items()})
    return out


def _tp(topic: str, partition: int) -> Any:
    from aiokafka.structs import TopicPartition

    return TopicPartition(topic, partition)


def in_produced_order(fetched: dict) -> Iterator[tuple[Any, Any]]:
    """A fetch's records as (partition, record): each partition's in offset order, the partitions
    interleaved by record timestamp (the producer's clock; ties in fetch order).

    A session's turns come from several agents' topics. Applied partition by partition, a batch
    holding two agents' turns (a gate catching up after a restart, topics discovered late, any
    backlog) would open the second agent's turn after the first had ended, or before the first
    had opened: the floor would go in fetch order, not in the order the turns opened, as it does
    on a quiet gate that sees one record at a time. A producer that stamps its records wrongly
    moves only its own records within one batch; every record is still applied."""
    return heapq.merge(*([(tp, r) for r in records] for tp, records in fetched.items()),
                       key=lambda item: -1 if item[1].timestamp is None else item[1].timestamp)


@dataclass
class _Batch:
    """The effects of one fetched batch of text records, committed together."""

    entries: dict = field(default_factory=dict)  # session id -> _Entry touched
    applied: dict = field(default_factory=dict)  # session id -> [(event, now_us)] applied in order
    requests: list = field(default_factory=list)
    controls: list = field(default_factory=list)  # (message type, value): cancels and floor events to publish
    evicted: list = field(default_factory=list)  # (session id, partition) forgotten for a new one: tombstones
    positions: dict = field(default_factory=dict)  # (topic, p) -> next offset


@dataclass
class _Entry:
    """One owned session: the live core object, the state last written, its partition."""

    session: GateSession
    state: str | None  # the state as the changelog holds it, JSON (None: nothing written yet)
    partition: int
    due_us: int | None = None  # the next hold timeout or the idle expiry, whichever is first


class GateWorker:
    """One gate worker. `start()`/`stop()` in a running loop, or `run()` to block until SIGTERM."""

    def __init__(
        self,
        settings: Settings,
        *,
        commit_interval_s: float = 1.0,
        session_timeout_s: float = 10.0,
        timer_interval_s: float = 0.2,
        discovery_interval_s: float | None = None,
        announce: bool = False,
        clock_us: Callable[[], int] = now_us,
        monotonic: Callable[[], float] = time.monotonic,
        registry: Any = None,
        out: Any = None,
        tracer: StageTracer | None = None,
        metrics_port: int | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.settings = settings
        self.config = GateConfig.from_settings(settings)
        self.codec = codec_for(settings)
        self.commit_interval_s = commit_interval_s
        self.session_timeout_s = session_timeout_s
        self.timer_interval_s = timer_interval_s
        self.discovery_interval_s = (settings.topic_discovery_interval_s if discovery_interval_s is None
                                     else discovery_interval_s)
        self.clock_us = clock_us
        self.monotonic = monotonic
        # Zombie fencing: the loop's last sign of life (the timer's wake-ups) and whether it was
        # seen stalled for longer than half the session timeout (a paused process, a frozen VM).
        self._alive_at = monotonic()
        self._stalled = False
        self.fenced = 0  # outputs refused because the group had moved on (what a test can wait on)
        self._announce = announce
        self._out = out
        self.metrics_port = metrics_port  # /healthz and /metrics on it (voicebus.shell.serve_health)
        self._http_runner = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self._refused_counter = Counter("voicebus_gate_topics_refused", "Text topics the gate refused, by reason",
                                        ["reason"], registry=self.registry)
        self._control_applied = Counter("voicebus_gate_control_events", "Control events applied (after the "
                                        "record policy took them)", registry=self.registry)
        self._floor_events = Counter("voicebus_gate_floor_events", "Floor events of sessions' turns: granted, "
                                     "queued, preempting, cut, refused", ["event"], registry=self.registry)
        self._floor_wait = Histogram("voicebus_gate_floor_wait_seconds", "How long a turn waited for the "
                                     "floor before it was granted (0: at once)", registry=self.registry,
                                     buckets=(0.0, 0.1, 0.5, 1, 2, 5, 10, 30, 60))
        self._turn_warnings = Counter("voicebus_gate_turn_warnings", "Turns granted with a warning of how they are "
                                      "spoken (the FloorEvent's warnings), by code", ["code"], registry=self.registry)
        self._sessions_evicted = Counter("voicebus_gate_sessions_evicted", "Idle sessions forgotten to make room "
                                         "for a new one (VOICEBUS_GATE_MAX_SESSIONS)", registry=self.registry)
        self._sessions_refused = Counter("voicebus_gate_sessions_refused", "Events of new sessions refused: the "
                                         "gate was full and no session idle", registry=self.registry)
        self._unencodable = Counter("voicebus_gate_requests_unencodable", "Requests sent with empty text because "
                                    "the contract refused them", registry=self.registry)
        self._pattern = re.compile(text_topic_pattern(settings))
        self._lock = asyncio.Lock()  # one event, tick or rebalance step at a time
        self._owned: set[int] = set()
        self._sessions: dict[str, _Entry] = {}
        self._text_topics: set[str] = set()
        self.refused_topics: dict[str, str] = {}
        self._positions: dict[tuple[str, int], int] = {}  # (text topic, p) -> next offset to apply
        self._stored_positions: dict[int, dict[str, int]] = {}  # p -> positions as recovered/written
        self._dirty_positions: set[int] = set()
        self._control_done: dict[int, int] = {}  # control partition -> next offset applied
        self._control_committed: dict[int, int] = {}
        self.ticks_done = 0  # timer ticks completed, their effects acknowledged (what a test can wait on)
        self.producer = None
        self.control = None
        self.text = None
        self.changelog = None
        self.policy: RecordPolicy | None = None
        self.discovery: TopicDiscovery | None = None
        self.supervisor = Supervisor("gate", registry=self.registry)
        self.ready = asyncio.Event()
        self.revoked_partitions = 0
        self.recovery_error: str | None = None  # why owned partitions are not served yet (/healthz)
        self.recovery_failures = 0
        self._stopping = asyncio.Event()  # set by stop: a recovery being retried gives up
        self.tracer = tracer if tracer is not None else tracer_for(settings, "gate")
        # (session, turn) -> the trace context its first text record carried (tracing on only).
        # Shell memory, not the changelog: after a failover the turn's next record brings it again.
        self._turn_traces: OrderedDict[tuple[str, str], Any] = OrderedDict()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self._stopping.clear()
        await ensure_topics(s, fixed_topics(s))  # start in any order: no "topic not found" loops
        # Confluent framing: the schemas it writes registered now, off the event loop
        await register_schemas(self.codec, {s.synthesis_topic: "SynthesisRequest", s.control_topic: "ControlEvent",
                                            s.floor_topic: "FloorEvent"})
        self.producer = make_producer(s)
        await self.producer.start()
        try:
            for topic in (s.control_topic, s.gate_changelog_topic):
                n = len(await self.producer.partitions_for(topic))
                if n != s.partitions:
                    raise GateStartError(
                        f"{topic} has {n} partitions, the gate co-partitions by number and needs "
                        f"settings.partitions = {s.partitions}")
            self.policy = RecordPolicy("gate", s, self.codec, self.producer, registry=self.registry)
            common = dict(enable_auto_commit=False, auto_offset_reset="earliest")
            self.text = make_consumer(s, group_id=None, **common)
            self.changelog = make_consumer(s, group_id=None, **common)
            session_ms = int(self.session_timeout_s * 1000)
            self.control = make_consumer(
                s, group_id=s.gate_app_id, session_timeout_ms=session_ms,
                heartbeat_interval_ms=max(300, session_ms // 5), rebalance_timeout_ms=max(session_ms, 10_000),
                **common)
            await self.text.start()
            await self.changelog.start()
            await await_group_coordinator(s, s.gate_app_id)  # a fresh broker: no error lines at start
            await self.control.start()
            # Known text topics first, so the first assignment already reads them.
            self.discovery = TopicDiscovery(s, self._pattern.pattern, self._on_topics, self.producer,
                                            interval_s=self.discovery_interval_s, policy_stage="gate",
                                            registry=self.registry)
            await self.discovery.start()
            self.control.subscribe([s.control_topic], listener=_Listener(self))
            self.supervisor.start("control", self._control_loop)
            self.supervisor.start("text", self._text_loop)
            self.supervisor.start("timer", self._timer_loop)
            self.supervisor.start("registry", self.discovery.follow_registry)
            self.supervisor.start("listing", self.discovery.poll_listing)
            if self.metrics_port is not None:
                self._http_runner = await serve_health(s.edge_host, self.metrics_port, self.health, self.registry)
                log.info("gate metrics on http://%s:%d/metrics, health on /healthz", s.edge_host, self.metrics_port)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Finish the event in hand, commit control positions, leave the group, stop every client."""
        self._stopping.set()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None
        async with self._lock:
            await self.supervisor.stop()
            if self.control is not None:
                await self._commit_control(force=True)
        for name in ("control", "text", "changelog"):
            client = getattr(self, name)
            setattr(self, name, None)
            if client is not None:
                try:
                    await client.stop()
                except Exception as exc:  # noqa: BLE001 - stopping anyway; the others must stop too
                    log.error("gate: stopping the %s consumer failed: %s", name, exc)
        if self.discovery is not None:
            await self.discovery.stop()
            self.discovery = None
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` says: healthy while ready and every supervised task runs; each task's
        restarts and last error (a task that died and was restarted shows here)."""
        tasks = self.supervisor.health()
        refused = BUS_ACCESS.refusal_of(self.settings)
        return {"stage": "gate",
                "healthy": (self.ready.is_set() and self.supervisor.healthy and self.recovery_error is None
                            and refused is None),
                "ready": self.ready.is_set(), "restarts": sum(t["restarts"] for t in tasks.values()),
                "tasks": tasks, "partitions": sorted(self._owned), "sessions": len(self._sessions),
                "recovery_error": self.recovery_error, "credentials_refused": refused}

    # --- topics ----------------------------------------------------------------------------------
    async def _on_topics(self, names: set[str]) -> None:
        """Discovery found text topics: read partition p of each new one for every owned p."""
        new: list[str] = []
        for topic in sorted(names - self._text_topics - set(self.refused_topics)):
            n = len(await self.producer.partitions_for(topic))
            if n != self.settings.partitions:
                reason = f"{n} partitions, not {self.settings.partitions}: it cannot be co-partitioned"
                self.refused_topics[topic] = reason
                self._refused_counter.labels("partition-count").inc()
                log.error("gate: refusing text topic %s (%s); recreate it with %d partitions",
                          topic, reason, self.settings.partitions)
                continue
            new.append(topic)
        if not new:
            return
        async with self._lock:
            self._text_topics.update(new)
            await self._assign_text()
        log.info("gate: reading new text topics %s", new)

    async def _assign_text(self) -> None:
        """(Under the lock.) Assign partition p of every text topic for every owned p, each at
        its position: where this worker is, else the changelog's, else the beginning. No network
        round trip: the lock holds every session up while this runs."""
        from aiokafka.structs import TopicPartition

        if self.text is None:
            return  # stopping
        tps = [TopicPartition(t, p) for t in sorted(self._text_topics) for p in sorted(self._owned)]
        for tp in tps:
            if (tp.topic, tp.partition) not in self._positions:
                # No stored position: from the beginning. Offset 0 says so without a round trip
                # under the lock: past a retention cut the consumer's reset (earliest) moves it
                # to the log start, and every record there is >= 0.
                stored = self._stored_positions.get(tp.partition, {}).get(tp.topic)
                self._positions[(tp.topic, tp.partition)] = 0 if stored is None else stored
        self.text.assign(tps)  # replaces the assignment and forgets positions: seek every one
        for tp in tps:
            self.text.seek(tp, self._positions[(tp.topic, tp.partition)])

    # --- rebalance -------------------------------------------------------------------------------
    async def _revoke(self, partitions: set[int]) -> None:
        self._owned -= partitions  # at once: no event of these partitions starts from now on
        async with self._lock:  # an event in flight finishes: we own p until this returns
            await self._commit_control(force=True, only=partitions)
            for sid in [sid for sid, e in self._sessions.items() if e.partition in partitions]:
                del self._sessions[sid]
            for key in [k for k in self._positions if k[1] in partitions]:
                del self._positions[key]
            for p in partitions:
                self._stored_positions.pop(p, None)
                self._dirty_positions.discard(p)
                self._control_done.pop(p, None)
                self._control_committed.pop(p, None)
            await self._assign_text()
            self.revoked_partitions += len(partitions)
        if partitions:
            log.info("gate: partitions %s revoked", sorted(partitions))

    async def _assign(self, partitions: set[int]) -> None:
        # aiokafka swallows a callback's error: the partitions would sit unread. Any failure (a
        # broker error, a changelog partition not read in time, a state record this gate cannot
        # load) leaves them unserved until the recovery succeeds, so /healthz says why (503) and
        # it is tried again for as long as the gate runs.
        def failed(exc: BaseException, attempt: int, wait_s: float) -> None:
            self.recovery_error = f"recovering partitions {sorted(partitions)}: {type(exc).__name__}: {exc}"[:500]
            self.recovery_failures += 1
            log.error("gate: recovering partitions %s failed (%r); retrying in %.1f s", sorted(partitions), exc, wait_s)

        async def pause(seconds: float) -> None:  # the consumer's stop waits for this callback: never sleep through it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

        if self._stopping.is_set():
            return
        try:
            async for attempt in retrying(wait=Backoff(0.2, 5.0), stop=self._stopping.is_set, on_retry=failed,
                                          sleep=pause):
                with attempt:
                    async with self._lock:
                        new = partitions - self._owned
                        await self._recover(new)
                        self._owned |= new
                        await self._assign_text()
        except Exception:  # noqa: BLE001 - the last failure, the gate stopping: nothing left to serve
            if not self._stopping.is_set():
                raise
            return
        self.recovery_error = None
        if self._stopping.is_set():
            return
        log.info("gate: partitions %s assigned and recovered (%d sessions)", sorted(partitions), len(self._sessions))
        self.ready.set()
        if self._announce:
            assigned = sorted([f"{self.settings.control_topic}:{p}" for p in self._owned]
                              + [f"{t}:{p}" for t, p in self._positions])
            print(READY_LINE, json.dumps(assigned), file=self._out or sys.stdout, flush=True)

    async def _recover(self, partitions: set[int]) -> None:
        """(Under the lock.) Read changelog partitions to their end: sessions and positions."""
        from aiokafka.errors import KafkaTimeoutError
        from aiokafka.structs import TopicPartition

        if not partitions:
            return
        tps = [TopicPartition(self.settings.gate_changelog_topic, p) for p in sorted(partitions)]
        self.changelog.assign(tps)
        ends = await seek_to_beginning_quietly(self.changelog, tps)  # a new changelog too
        states: dict[str, tuple[int, str | None]] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECOVERY_TIMEOUT_S
        while True:
            behind = [tp for tp in tps if await self.changelog.position(tp) < ends[tp]]
            if not behind:
                break
            if loop.time() > deadline:
                raise KafkaTimeoutError(f"changelog partitions {behind} not read to their end in {RECOVERY_TIMEOUT_S} s")
            for tp, records in (await self.changelog.getmany(*behind, timeout_ms=500)).items():
                for r in records:
                    if r.key == POSITIONS_KEY:
                        self._stored_positions[tp.partition] = json.loads(r.value)
                    elif r.key is not None:
                        states[r.key.decode("utf-8")] = (tp.partition, r.value.decode("utf-8") if r.value else None)
        self.changelog.assign([])
        for sid, (p, stored) in states.items():
            if stored is None:
                continue  # a tombstone: the session expired
            session = GateSession.from_state(sid, self.config, json.loads(stored))
            self._sessions[sid] = entry = _Entry(session, stored, p)
            entry.due_us = self._due(session)

    # --- loops -----------------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_commit = loop.time()
        while True:
            batch = await self.control.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    async with self._lock:
                        if tp.partition not in self._owned:
                            continue  # fetched before a revoke
                        try:
                            await self._process_control(record, tp.partition)
                        except PartitionRevoked as exc:
                            log.info("gate: %s", exc)
                            continue
                        self._control_done[tp.partition] = record.offset + 1
            if loop.time() - last_commit >= self.commit_interval_s:
                async with self._lock:
                    await self._commit_control()
                last_commit = loop.time()

    async def _text_loop(self) -> None:
        async with self._lock:
            await self._assign_text()  # a restarted loop goes on from the positions applied
        while True:
            if not self.text.assignment():
                await asyncio.sleep(0.05)  # nothing owned yet: no fetch to wait in
                continue
            fetched = await self.text.getmany(timeout_ms=500, max_records=TEXT_BATCH_RECORDS)
            if fetched:
                async with self._lock:
                    await self._process_text_batch(fetched)

    async def _process_text_batch(self, fetched: dict) -> None:
        """(Under the lock.) Every text record fetched, applied in the order the agents produced
        them (`in_produced_order`), then their effects in one go: all requests sent and acked,
        then each touched session's state and each partition's positions written once. At one
        record per fetch (a quiet gate) that is the per-event order; under load it turns two
        broker round trips per event into two per batch, so the gate keeps up instead of falling
        behind."""
        batch = _Batch()
        dropped: set[tuple[str, int]] = set()
        for tp, record in in_produced_order(fetched):
            key = (tp.topic, tp.partition)
            if key in dropped:
                continue
            if tp.partition not in self._owned or key not in self._positions:
                dropped.add(key)  # fetched before a revoke: none of the rest of it either
                continue
            if record.offset < batch.positions.get(key, self._positions[key]):
                continue  # applied already (a seek back after a reassignment)
            await self.policy.process(record, "TextEvent",
                                      lambda decoded: self._apply_in_batch(decoded, record, tp.partition, batch))
            batch.positions[key] = record.offset + 1
        try:
            await self._commit_batch(batch)
        except BaseException as exc:
            # Nothing of the batch counts: sessions back to their stored state, partitions read
            # again from the stored positions (a revoked partition is gone anyway).
            for sid, entry in batch.entries.items():
                entry.session = self._restored(sid, entry)
            for topic, p in batch.positions:
                if (topic, p) in self._positions and p in self._owned:
                    self.text.seek(_tp(topic, p), self._positions[(topic, p)])
            if isinstance(exc, PartitionRevoked):
                log.info("gate: %s", exc)
                return
            raise

    def _apply_in_batch(self, decoded: Any, record: Any, partition: int, batch: "_Batch") -> None:
        event: TextEvent = decoded.typed
        sid = event.session_id
        if self._partition_of(sid) != partition:
            raise WrongPartition(f"session {sid!r} hashes to partition {self._partition_of(sid)}, "
                                 f"its record is on {record.topic}[{partition}]")
        if sid not in self._sessions and len(self._sessions) >= self.settings.gate_max_sessions:
            self._make_room(sid, batch)
        entry = self._entry(sid, partition)
        if self.tracer.enabled:
            self._remember_trace(sid, event.turn_id, record.headers)
        now = self.clock_us()
        try:
            requests = entry.session.apply(event, now)
        except Exception as exc:
            # The core may have half-applied the event: rebuild the session from its stored
            # state and this batch's earlier events (deterministic, their requests are already
            # in the batch), then make sure the turn still ends. The policy dead-letters it.
            session = self._restored(sid, entry)
            for earlier, at in batch.applied.get(sid, []):
                session.apply(earlier, at)
            entry.session = session
            closing = session.end_failed_turn(event, now, exc)
            batch.entries[sid] = entry
            batch.requests.extend(closing)
            batch.controls.extend(self._session_controls(session))
            raise
        batch.entries[sid] = entry
        batch.applied.setdefault(sid, []).append((event, now))
        batch.requests.extend(requests)
        batch.controls.extend(self._session_controls(entry.session))

    async def _commit_batch(self, batch: "_Batch") -> None:
        if not batch.entries and not batch.positions:
            return
        now = self.clock_us()
        states: dict[str, str] = {}
        for sid, entry in batch.entries.items():
            more, states[sid] = entry.session.shed(now)
            batch.requests.extend(more)
            batch.controls.extend(self._session_controls(entry.session))
        partitions = ({p for _, p in batch.positions} | {e.partition for e in batch.entries.values()}
                      | {p for _, p in batch.evicted})
        # The cancels first: a cut turn is dropped downstream no later than its preempter arrives.
        await self._send_retrying(partitions, [
            *self._control_records(batch.controls),
            *[(self.settings.synthesis_topic, session_key(r.session_id), self._encode_request(r), None,
               self._request_headers(r)) for r in batch.requests]])
        previous = {key: self._positions[key] for key in batch.positions}
        self._positions.update(batch.positions)
        topic = self.settings.gate_changelog_topic
        try:
            await self._send_retrying(partitions, [
                *[(topic, session_key(sid), None, p) for sid, p in batch.evicted],
                *[(topic, session_key(sid), states[sid].encode("utf-8"), entry.partition)
                  for sid, entry in batch.entries.items()],
                *[(topic, POSITIONS_KEY, self._positions_record(p), p) for p in sorted(partitions)],
            ])
        except BaseException:
            self._positions.update(previous)
            raise
        for p in partitions:
            self._dirty_positions.discard(p)
        for sid, entry in batch.entries.items():
            entry.state = states[sid]
            entry.due_us = self._due(entry.session)

    async def _timer_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timer_interval_s)
            self._note_alive()
            await self.tick()

    def _note_alive(self) -> None:
        now = self.monotonic()
        if now - self._alive_at > self.session_timeout_s / 2:
            self._stalled = True  # long enough for the group to have given our partitions away
        self._alive_at = now

    async def _fence(self, partitions: set[int]) -> None:
        """After a stall: prove this worker still owns `partitions` before any output, by
        committing their control positions with its group generation (the broker refuses a
        stale one). A zombie (paused, then resumed after its partitions moved) gets
        `PartitionRevoked`, so it publishes nothing of what it fetched before it learns of the
        rebalance: neither requests nor state."""
        from aiokafka.errors import KafkaError
        from aiokafka.structs import OffsetAndMetadata, TopicPartition

        if not (self._stalled or self.monotonic() - self._alive_at > self.session_timeout_s / 2):
            return
        if not partitions <= self._owned:
            # The group's expulsion reached the revoke callback first (it drops the partitions at
            # once, then waits for this batch): with nothing left to commit, the check below
            # would pass vacuously.
            self.fenced += 1
            raise PartitionRevoked(f"fenced after a stall: partitions {sorted(partitions - self._owned)} revoked")
        offsets = {}
        for p in sorted(partitions):
            tp = TopicPartition(self.settings.control_topic, p)
            offset = self._control_done.get(p)
            if offset is None:
                offset = await self.control.position(tp)
            offsets[tp] = OffsetAndMetadata(offset, "")
        try:
            if offsets:
                await self.control.commit(offsets)
        except KafkaError as exc:
            self.fenced += 1
            raise PartitionRevoked(f"fenced after a stall: partitions {sorted(partitions)} may have moved ({exc})") from exc
        self._stalled = False
        self._alive_at = self.monotonic()

    async def tick(self) -> None:
        """Hold timeouts and idle expiry of the owned sessions that are due; pending positions."""
        now = self.clock_us()
        for sid in [sid for sid, e in self._sessions.items() if e.due_us is not None and e.due_us <= now]:
            async with self._lock:
                entry = self._sessions.get(sid)
                if entry is None or entry.partition not in self._owned:
                    continue
                now = self.clock_us()
                expiry = entry.session.expires_at_us()
                try:
                    if expiry is not None and expiry <= now:
                        requests = entry.session.expire(now)
                        controls = self._session_controls(entry.session)
                        if controls:
                            await self._send_retrying(entry.partition, self._control_records(controls))
                        await self._emit(requests, entry.partition)
                        await self._write(entry.partition, sid, None)
                        del self._sessions[sid]
                        log.info("gate: session %s expired (idle for %.0f s)", sid, self.settings.gate_session_idle_s)
                    else:
                        requests = entry.session.tick(now)
                        await self._commit_effects(entry, sid, requests, now, self._session_controls(entry.session))
                except PartitionRevoked as exc:
                    log.info("gate: %s", exc)
        async with self._lock:
            for p in sorted(self._dirty_positions & self._owned):
                try:
                    await self._write_positions(p)
                except PartitionRevoked as exc:
                    log.info("gate: %s", exc)
        self.ticks_done += 1

    # --- one control record ---------------------------------------------------------------------
    async def _process_control(self, record: Any, partition: int) -> None:
        """(Under the lock.) One control record through the record policy, then its effects."""
        effects: list[tuple[_Entry, str, list[dict], list[tuple[str, Any]]]] = []
        room = _Batch()  # a session this cancel makes room for: the evicted one's tombstone

        def handle(decoded: Any) -> None:
            event: ControlEvent = decoded.typed
            sid = event.session_id
            if sid not in self._sessions and len(self._sessions) >= self.settings.gate_max_sessions:
                # A cancel of a session the gate does not hold is remembered (its turns may come
                # later), so it is a new session too, under the same bound as text's.
                self._make_room(sid, room)
            entry = self._entry(sid, partition)
            try:
                requests = entry.session.apply(event, self.clock_us())
            except Exception:
                entry.session = self._restored(sid, entry)  # it may be half-applied
                raise  # the policy dead-letters it
            effects.append((entry, sid, requests, self._session_controls(entry.session)))

        if await self.policy.process(record, "ControlEvent", handle):
            self._control_applied.inc()
        for evicted, at in room.evicted:
            await self._write(at, evicted, None)
        for entry, sid, requests, controls in effects:
            await self._commit_effects(entry, sid, requests, self.clock_us(), controls)

    async def _commit_effects(self, entry: _Entry, sid: str, requests: list[SynthesisRequest], now: int,
                              controls: list[tuple[str, Any]] = ()) -> None:
        """(Under the lock.) Send the control events (the resolution of a whole-session cancel,
        the cancels of turns the floor cut) and the requests, then store the state (bounded) and
        positions."""
        try:
            more, encoded = entry.session.shed(now)
            controls = [*controls, *self._session_controls(entry.session)]
            if controls:
                # Later stages drop these turns even if they had not seen them yet. They come back
                # to this worker too, where they only cancel turns already cancelled.
                await self._send_retrying(entry.partition, self._control_records(controls))
            await self._emit(requests + more, entry.partition)
            await self._write(entry.partition, sid, encoded.encode("utf-8"))
            entry.state = encoded
            entry.due_us = self._due(entry.session)
        except BaseException:
            entry.session = self._restored(sid, entry)
            raise

    def _make_room(self, sid: str, batch: "_Batch") -> None:
        """(Under the lock.) Room for new session `sid`: forget the least recently active idle
        session (its tombstone goes out with the batch), or refuse `sid` (`GateFull`)."""
        idle = [(e.session.last_event_us, other) for other, e in self._sessions.items()
                if e.session.idle and other not in batch.entries]
        if not idle:
            self._sessions_refused.inc()
            raise GateFull(f"the gate holds {len(self._sessions)} sessions, none idle "
                           f"(VOICEBUS_GATE_MAX_SESSIONS={self.settings.gate_max_sessions}): session {sid!r} refused")
        _, oldest = min(idle)
        batch.evicted.append((oldest, self._sessions.pop(oldest).partition))
        self._sessions_evicted.inc()
        log.info("gate: session %s forgotten (idle) to make room for %s", oldest, sid)

    def _session_controls(self, session: GateSession) -> list[tuple[str, ControlEvent | FloorEvent]]:
        """What `session`'s last call produced for the bus besides requests: its control events
        (resolutions, the floor's cuts) and its floor events (counted here), tagged with their
        message type for `_control_records`."""
        for event in session.floor_events:
            self._floor_events.labels(event.event.lower()).inc()
            if event.event == FloorEventKind.GRANTED:
                self._floor_wait.observe(event.waited_us / 1e6)
                for warning in event.warnings:  # once per turn: a turn is granted once
                    self._turn_warnings.labels(warning.partition(":")[0]).inc()
            log.debug("gate: session %s turn %s floor %s (waited %.3f s) %s", session.session_id,
                      event.turn_id, event.event, event.waited_us / 1e6, event.reason)
        out = [("ControlEvent", c) for c in session.controls] + [("FloorEvent", e) for e in session.floor_events]
        session.controls, session.floor_events = [], []
        return out

    def _control_records(self, controls: list[tuple[str, Any]]) -> list[tuple]:
        """The records of `_session_controls`' (type, ControlEvent or FloorEvent) pairs."""
        topics = {"ControlEvent": self.settings.control_topic, "FloorEvent": self.settings.floor_topic}
        return [(topics[kind], session_key(message.session_id), self.codec.encode(kind, message, topics[kind]), None)
                for kind, message in controls]

    def _restored(self, sid: str, entry: _Entry) -> GateSession:
        """The session as last stored (the live object may hold a half-applied event)."""
        return GateSession.from_state(sid, self.config, json.loads(entry.state) if entry.state else None)

    def _entry(self, sid: str, partition: int) -> _Entry:
        entry = self._sessions.get(sid)
        if entry is None:
            entry = self._sessions[sid] = _Entry(GateSession(sid, self.config), None, partition)
        return entry

    def _due(self, session: GateSession) -> int | None:
        times = [t for t in (session.next_deadline_us(), session.expires_at_us()) if t is not None]
        return min(times) if times else None

    def _partition_of(self, session_id: str) -> int:
        from aiokafka.partitioner import DefaultPartitioner

        n = self.settings.partitions
        return DefaultPartitioner()(session_key(session_id), list(range(n)), list(range(n)))

    # --- output ----------------------------------------------------------------------------------
    async def _emit(self, requests: list[SynthesisRequest], partition: int) -> None:
        """Send requests and wait for every ack; on a send failure retry with backoff for as long
        as `partition` is owned (a revoked partition's output is the new owner's job)."""
        if not requests:
            return
        records = [(self.settings.synthesis_topic, session_key(r.session_id), self._encode_request(r), None,
                    self._request_headers(r)) for r in requests]
        await self._send_retrying(partition, records)

    def _remember_trace(self, sid: str, turn_id: str, headers: Any) -> None:
        """The turn's trace context, from the first of its records that carries one."""
        key = (sid, turn_id)
        if key in self._turn_traces:
            return
        context = self.tracer.context_of(headers)
        if context is None:
            return
        self._turn_traces[key] = context
        while len(self._turn_traces) > MAX_TRACED_TURNS:
            self._turn_traces.popitem(last=False)

    def _request_headers(self, request: SynthesisRequest) -> list[tuple[str, bytes]] | None:
        """Tracing on: the request's ``gate.hold`` span (its sentence complete .. released, the
        core's own stamps) under its turn's trace, and that span's context for the worker."""
        if not self.tracer.enabled:
            return None
        key = (request.session_id, request.turn_id)
        parent = self._turn_traces.get(key)
        tentative, last = request.tentative, request.is_last_in_turn
        if last and not tentative:
            self._turn_traces.pop(key, None)
        released = request.released_at_us
        hold = self.tracer.record(
            tracing.GATE_HOLD, parent, request.text_complete_at_us or released, released,
            **{tracing.SESSION: key[0], tracing.TURN: key[1], tracing.SENTENCE: request.sentence_seq,
               tracing.AGENT: request.agent_id, "voicebus.chars": len(request.text),
               "voicebus.tentative": tentative or None, "voicebus.last_in_turn": last})
        return self.tracer.headers(hold)

    def _encode_request(self, request: SynthesisRequest) -> bytes:
        """The request encoded. One the contract refuses (a gate bug: the core splits long text)
        still goes out, with empty text, so its turn keeps its numbering and still ends."""
        try:
            return self.codec.encode("SynthesisRequest", request, self.settings.synthesis_topic)
        except CodecError as exc:
            self._unencodable.inc()
            log.error("gate: request %s/%s#%s cannot be encoded (%s); sent with empty text", request.session_id,
                      request.turn_id, request.sentence_seq, exc)
            return self.codec.encode("SynthesisRequest", replace(request, text=""), self.settings.synthesis_topic)

    async def _write(self, partition: int, sid: str, value: bytes | None) -> None:
        """The session's state (None: a tombstone) and then the partition's text positions."""
        topic = self.settings.gate_changelog_topic
        await self._send_retrying(partition, [(topic, session_key(sid), value, partition),
                                              (topic, POSITIONS_KEY, self._positions_record(partition), partition)])
        self._dirty_positions.discard(partition)

    async def _write_positions(self, partition: int) -> None:
        await self._send_retrying(partition, [(self.settings.gate_changelog_topic, POSITIONS_KEY,
                                               self._positions_record(partition), partition)])
        self._dirty_positions.discard(partition)

    def _positions_record(self, partition: int) -> bytes:
        positions = dict(self._stored_positions.get(partition, {}))  # topics not read now stay
        positions.update({t: o for (t, p), o in self._positions.items() if p == partition})
        self._stored_positions[partition] = positions
        return json.dumps(positions, separators=(",", ":")).encode()

    async def _send_retrying(self, partition: int | set[int], records: list[tuple]) -> None:
        """Send and wait for every ack; on a failure retry the lot with backoff while every
        partition they belong to is still owned (else `PartitionRevoked`: the new owner's job).
        A record is (topic, key, value, partition) or (topic, key, value, partition, headers)."""
        from aiokafka.errors import KafkaError

        partitions = {partition} if isinstance(partition, int) else partition
        await self._fence(partitions)
        try:
            async for attempt in retrying(
                    wait=Backoff(0.1, 5.0), retry_on=KafkaError, retry_if=lambda _: partitions <= self._owned,
                    on_retry=lambda exc, n, wait_s: log.warning("gate: send failed (%s); retrying in %.1f s", exc, wait_s)):
                with attempt:
                    futures = [await self.producer.send(t, v, key=k, partition=p, headers=h[0] if h else None)
                               for t, k, v, p, *h in records]
                    for fut in futures:
                        await fut  # acked before the state that produced it is written
        except KafkaError as exc:  # not retried: a partition was revoked meanwhile
            raise PartitionRevoked(f"partitions {sorted(partitions - self._owned)} revoked while "
                                   f"their output failed: {exc}") from exc

    async def _commit_control(self, force: bool = False, only: set[int] | None = None) -> None:
        """(Under the lock.) Commit the control positions applied (those not committed yet)."""
        from aiokafka.errors import KafkaError
        from aiokafka.structs import OffsetAndMetadata, TopicPartition

        if self.control is None:
            return  # stopping
        todo = {p: o for p, o in self._control_done.items()
                if (only is None or p in only) and self._control_committed.get(p) != o}
        if not todo:
            return
        offsets = {TopicPartition(self.settings.control_topic, p): OffsetAndMetadata(o, "") for p, o in todo.items()}
        try:
            await self.control.commit(offsets)
            self._control_committed.update(todo)
        except KafkaError as exc:
            # A rebalance raced the commit: the next owner re-applies those control events, which
            # is harmless (a cancel applied twice is one cancel).
            log.warning("gate: control commit failed (%s)", exc)


class _Listener(ConsumerRebalanceListener):
    """The control consumer's rebalance callbacks, handed to the worker."""

    def __init__(self, worker: GateWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.worker._revoke({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self.worker._assign({tp.partition for tp in assigned})
