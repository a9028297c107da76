"""The edge's link to the bus: its Kafka clients, owned by the edge app's cleanup_ctx.

`KafkaLink` is the edge's membership in the edges' consumer group (it owns the sessions of the
partitions it is assigned), its audio consumer of those partitions, its follower of every control
partition and of the edge directory, and one producer for cancels, playback reports, what was
heard and directory claims (docs/edge.md, "Sharded edges"). The edge app (`voicebus.players.edge`)
starts and stops it; the doors use it through the app's `LINK_KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener

from voicebus.bus import farewell, make_consumer, seek_to_beginning_quietly
from voicebus.clock import now_us
from voicebus.codecs import codec_for
from voicebus.retry import Backoff, retrying
from voicebus.schemas.messages import AudioChunk, Message, TurnHeard
from voicebus.settings import Settings
from voicebus.shell import ControlFollower, RecordFailure, RecordPolicy, Supervisor
from voicebus.topics import edge_group_id, partition_of, session_key
from voicebus.tracing import StageTracer, tracer_for
from voicebus.players import protocol
from voicebus.players.metrics import EdgeMetrics
from voicebus.players.router import SessionRouter
from voicebus.players.shard import (DIRECTORY_PARTITION, DirectoryRecordError, EdgeDirectory, directory_headers,
                                    directory_key, directory_record, new_edge_id, public_url, redirect_origins)

log = logging.getLogger(__name__)

# How many times an edge writes its directory claim before it goes on without it.
CLAIM_ATTEMPTS = 20


class EdgeStartError(RuntimeError):
    """The edge cannot shard its audio topic as configured (its partition count differs from the
    control topic's: sessions would not be co-partitioned)."""


class NoOwner(Exception):
    """No edge owns the session's partition now (a rebalance): the player should try again soon."""

    code = "no-owner"
    close_code = protocol.CLOSE_TRY_AGAIN_LATER


class KafkaLink:
    """The edge's Kafka clients, owned by the app's cleanup_ctx (docs/edge.md, "Sharded edges"):

    * a **membership** consumer in the edges' consumer group (`voicebus.topics.edge_group_id`),
      subscribed to the control topic with its partitions paused: owning control partition p means
      owning every session on p (the gate's mechanism, docs/gate.md);
    * an **audio** consumer without a group, assigned partition p of the audio topic for every owned
      p (at the end of a partition it just took, where it was for one it kept);
    * a `ControlFollower` with its own consumer of every control partition (control never waits
      behind audio, and a session that moves here finds its cancels applied already);
    * a **directory** follower (`voicebus.players.shard.EdgeDirectory`) and one producer for cancels,
      playback reports, the directory claims and dead letters.

    Every record goes through one `RecordPolicy` (stage ``edge``): a record that cannot be decoded,
    breaks the contract (a negative sentence_seq, ...) or makes the router raise is dead-lettered
    with its reason and the edge goes on with the next one. The tasks run under a `Supervisor`:
    a task that dies anyway is restarted, and ``/healthz`` says so."""

    def __init__(self, settings: Settings, router: SessionRouter, metrics: EdgeMetrics,
                 tracer: StageTracer | None = None) -> None:
        self.settings, self.router, self.metrics = settings, router, metrics
        self.tracer = tracer if tracer is not None else tracer_for(settings, "edge")
        self.codec = codec_for(settings)
        self.edge_id = new_edge_id(settings)
        self.url = public_url(settings)
        self.group = edge_group_id(settings)
        self.directory = EdgeDirectory(self.group, settings.edge_secret, redirect_origins(settings))
        self.owned: set[int] = set()
        self.partitions = 0
        self.producer: Any = None
        self.consumer: Any = None  # the audio consumer
        self.membership: Any = None
        self.directory_consumer: Any = None
        self.policy: RecordPolicy | None = None
        self.follower: ControlFollower | None = None
        self.supervisor = Supervisor("edge", registry=metrics.registry)
        self._positions: dict[Any, int] = {}  # owned audio partition -> next offset to route
        self._lock = asyncio.Lock()  # one audio batch, reassignment or backfill hand-over at a time
        self._deferred: dict[bytes, list] = {}  # session key -> live records held while its backfill runs
        self._backfills: dict[str, asyncio.Task] = {}
        self._backfill_slots = asyncio.Semaphore(4)
        self._taken_at: dict[int, float] = {}  # owned partition -> when this edge took it (loop time)
        self._changed = asyncio.Event()  # replaced on every change of ownership or of the directory
        self._assigned = asyncio.Event()
        self.ready = asyncio.Event()

    async def start(self) -> None:

        from voicebus.bus import await_group_coordinator, ensure_topics, make_producer, register_schemas

        s = self.settings
        await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.heard_topic,
                                s.deadletter_topic, s.edges_topic])
        # Confluent framing: the schemas it writes registered now, off the event loop
        await register_schemas(self.codec, {s.control_topic: "ControlEvent", s.playback_topic: "PlaybackReport",
                                            s.heard_topic: "TurnHeard"})
        self.producer = make_producer(s)
        await self.producer.start()
        self.partitions = len(await self.producer.partitions_for(s.audio_topic))
        control = len(await self.producer.partitions_for(s.control_topic))
        if control != self.partitions:
            raise EdgeStartError(f"{s.audio_topic} has {self.partitions} partitions and {s.control_topic} {control}: "
                                 f"edges own sessions by partition number and need both co-partitioned")
        self.policy = RecordPolicy("edge", s, self.codec, self.producer, on_error=self._on_bad_record,
                                   registry=self.metrics.registry)
        # Cancels first: caught up to the end of the control topic before any audio is read.
        self.follower = ControlFollower(s, self.policy, self.router.apply_control, lookback_s=s.edge_cancel_lookback_s)
        await self.follower.start()
        await self._open_consumer()
        await self._open_directory()
        await await_group_coordinator(s, self.group)  # a fresh broker: no error lines at start
        session_ms = s.edge_session_timeout_ms
        self.membership = make_consumer(
            s, group_id=self.group, enable_auto_commit=False, auto_offset_reset="latest",
            session_timeout_ms=session_ms, heartbeat_interval_ms=max(300, session_ms // 5),
            rebalance_timeout_ms=max(session_ms, 10_000))
        await self.membership.start()
        self.membership.subscribe([s.control_topic], listener=_Membership(self))
        self.supervisor.start("membership", self._membership_loop)
        async with asyncio.timeout(max(30.0, 3 * session_ms / 1000)):
            await self._assigned.wait()  # this edge knows what it owns (maybe nothing: more edges than partitions)
        self.supervisor.start("control", self.follower.follow)
        self.supervisor.start("audio", self._consume)
        self.supervisor.start("directory", self._follow_directory)
        self.supervisor.start("heard", self._heard_loop)
        self.ready.set()
        log.info("edge %s (%s) owns %s of %s, follows %s, from %s", self.edge_id, self.url, sorted(self.owned),
                 s.audio_topic, s.control_topic, s.bootstrap)

    async def stop(self) -> None:
        await self.supervisor.stop()
        for task in list(self._backfills.values()):
            task.cancel()
        # Every farewell is bounded (`voicebus.bus.farewell`): with no broker answering, leaving the
        # group, the directory tombstone and the producer's flush would each retry for minutes.
        if self.membership is not None:
            membership, self.membership = self.membership, None
            # leaves the group: the others take its partitions now
            await farewell(membership.stop(), f"edge {self.edge_id} leaving its group")
        if self.producer is not None and self.ready.is_set():
            # out of the directory: no player is sent to a stopped edge
            key = directory_key(self.group, self.edge_id)
            await farewell(self.producer.send_and_wait(self.settings.edges_topic, None, key=key,
                                                       partition=DIRECTORY_PARTITION,
                                                       headers=directory_headers(self.settings.edge_secret, key, None)),
                           f"edge {self.edge_id} leaving the directory")
        if self.follower is not None:
            await farewell(self.follower.stop(), f"edge {self.edge_id} stopping its control follower")
        await farewell(self._close_consumer(), f"edge {self.edge_id} stopping its audio consumer")
        if self.directory_consumer is not None:
            consumer, self.directory_consumer = self.directory_consumer, None
            await farewell(consumer.stop(), f"edge {self.edge_id} stopping its directory consumer")
        if self.producer is not None:
            await farewell(self.producer.stop(), f"edge {self.edge_id} flushing its producer")

    @property
    def healthy(self) -> bool:
        """Started, and every task is running (not dead, not waiting to be restarted)."""
        return self.ready.is_set() and bool(self.supervisor.health()) and self.supervisor.healthy

    def health(self) -> dict[str, dict[str, Any]]:
        """Per task: running, restarts, last error (for ``/healthz``)."""
        return self.supervisor.health()

    def shard(self) -> dict[str, Any]:
        """This edge's share, for ``/healthz``: its id, URL, owned partitions and the directory."""
        owners = {}
        for p in range(self.partitions):
            claim = self.directory.owner(p)
            owners[str(p)] = claim.edge_id if claim else None
        return {"edge_id": self.edge_id, "url": self.url, "owned": sorted(self.owned), "partitions": self.partitions,
                "owners": owners}

    async def _on_bad_record(self, failure: RecordFailure) -> None:
        self.metrics.bad_records.inc()
        assert self.policy is not None
        await self.policy.dead_letter(failure)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- ownership -------------------------------------------------------------------------------
    def partition_of(self, session_id: str) -> int:
        return partition_of(session_id, self.partitions)

    async def owner_url(self, session_id: str) -> str | None:
        """None when this edge owns the session (serve it); else the public URL of the edge that
        does. Waits up to `edge_owner_wait_s` while nobody else is known to own it (a rebalance),
        then raises `NoOwner`."""
        p = self.partition_of(session_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.edge_owner_wait_s
        while True:
            changed = self._changed
            if p in self.owned:
                return None
            claim = self.directory.owner(p)
            if claim is not None and claim.edge_id != self.edge_id:
                return claim.url
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoOwner(f"no edge owns partition {p} of session {session_id!r} now (a rebalance?); try again")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def _membership_loop(self) -> None:
        """Keep the membership consumer polling (its partitions are paused: nothing is fetched);
        rebalances run in its callbacks (`_Membership`)."""
        while True:
            await self.membership.getmany(timeout_ms=1000)

    async def _reassign(self, partitions: set[int]) -> None:
        """(The membership's assignment.) Read the audio of the owned partitions; tell the players
        of sessions that moved away to reconnect; claim the partitions in the directory."""
        async with self._lock:
            moved_out, moved_in = self.owned - partitions, partitions - self.owned
            self.owned = set(partitions)
            now = asyncio.get_running_loop().time()
            for p in moved_in:
                self._taken_at[p] = now
            await self._assign_audio(fresh=moved_in)
            for tp in [tp for tp in self._positions if tp.partition not in self.owned]:
                del self._positions[tp]
            if moved_out:
                closed = self.router.move_out(lambda sid: self.partition_of(sid) in moved_out)
                self.metrics.moved.inc(len(closed))
                for key in [k for k in self._deferred if partition_of(k.decode("utf-8", "replace"), self.partitions)
                            in moved_out]:
                    self._deferred.pop(key, None)
        self.metrics.owned_partitions.set(len(self.owned))
        log.info("edge %s: owns %s of %s (took %s, gave up %s)", self.edge_id, sorted(self.owned),
                 self.settings.audio_topic, sorted(moved_in), sorted(moved_out))
        await self._claim()
        self._assigned.set()
        self._notify()

    async def _claim(self) -> None:
        """Write this edge's directory record (its URL and owned partitions), retrying a failure
        (0.1 s doubling to 2 s, `CLAIM_ATTEMPTS` tries; then the edge goes on without it)."""
        from aiokafka.errors import KafkaError

        key, value = directory_record(self.group, self.edge_id, self.url, self.owned)

        def retried(exc: BaseException, _attempt: int, wait_s: float) -> None:
            log.warning("edge %s: directory claim failed (%s); retrying in %.1f s", self.edge_id, exc, wait_s)

        try:
            async for attempt in retrying(wait=Backoff(0.1, 2.0), retry_on=KafkaError, attempts=CLAIM_ATTEMPTS,
                                          on_retry=retried):
                with attempt:
                    await self.producer.send_and_wait(self.settings.edges_topic, value, key=key,
                                                      partition=DIRECTORY_PARTITION,
                                                      headers=directory_headers(self.settings.edge_secret, key, value))
        except KafkaError as exc:
            log.warning("edge %s: directory claim failed (%s); not retried after %d tries", self.edge_id, exc,
                        CLAIM_ATTEMPTS)

    async def _assign_audio(self, fresh: set[int] = frozenset()) -> None:
        """(Under the lock.) Assign partition p of the audio topic for every owned p: a partition
        just taken (or never read) from its end, a kept one where this edge stopped."""
        from aiokafka import TopicPartition

        if self.consumer is None:
            return
        tps = [TopicPartition(self.settings.audio_topic, p) for p in sorted(self.owned)]
        self.consumer.assign(tps)  # replaces the assignment and forgets positions: seek every one
        for tp in tps:
            if tp.partition in fresh or tp not in self._positions:
                await self.consumer.seek_to_end(tp)
                # resolved now, so "owned" means nothing published from here on is missed
                self._positions[tp] = await self.consumer.position(tp)
            else:
                self.consumer.seek(tp, self._positions[tp])

    # --- the directory -----------------------------------------------------------------------------
    async def _open_directory(self) -> None:
        """Read the edge directory from its beginning to its end (then `_follow_directory`)."""
        from aiokafka import TopicPartition

        s = self.settings
        tp = TopicPartition(s.edges_topic, DIRECTORY_PARTITION)
        self.directory_consumer = consumer = make_consumer(
            s, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        consumer.assign([tp])
        end = (await seek_to_beginning_quietly(consumer, [tp]))[tp]  # a new directory topic too
        async with asyncio.timeout(15):
            while await consumer.position(tp) < end:
                await self._apply_directory(await consumer.getmany(tp, timeout_ms=200))

    async def _follow_directory(self) -> None:
        while True:
            if await self._apply_directory(await self.directory_consumer.getmany(timeout_ms=1000)):
                self._notify()

    async def _apply_directory(self, batch: dict) -> bool:
        """Apply directory records; a malformed or forged one is dead-lettered with its reason and
        counted (`voicebus_records_dead_lettered{stage="edge"}`), and changes nothing."""
        applied = False
        for records in batch.values():
            for record in records:
                try:
                    self.directory.apply(record.key, record.value, record.offset, record.headers or ())
                    applied = True
                except DirectoryRecordError as exc:
                    assert self.policy is not None
                    await self.policy.fail(record, exc)
        return applied

    # --- audio -------------------------------------------------------------------------------------
    async def _open_consumer(self) -> None:
        """The audio consumer: no consumer group (the membership consumer says which partitions
        are this edge's), assigned the owned partitions where the previous consumer stopped (a
        restart after the task died)."""
        self.consumer = make_consumer(self.settings, group_id=None)
        await self.consumer.start()
        try:
            async with self._lock:
                await self._assign_audio()
        except BaseException:
            await self._close_consumer()
            raise

    async def routed(self) -> dict:
        """Owned audio partition -> the next offset to route, every record before it handed to the
        router; empty while a backfill holds live records back (they are routed after it)."""
        async with self._lock:
            return {} if any(self._deferred.values()) else dict(self._positions)

    async def _close_consumer(self) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            await consumer.stop()

    async def _consume(self) -> None:
        """Route audio records of the owned partitions until cancelled. Each record's failure is
        the policy's; if the loop itself dies (its consumer failed), the Supervisor restarts it with
        a new consumer."""
        assert self.policy is not None
        if self.consumer is None:
            await self._open_consumer()
        try:
            while True:
                if not self.consumer.assignment():
                    await asyncio.sleep(0.05)  # nothing owned: no fetch to wait in
                    continue
                batches = await self.consumer.getmany(timeout_ms=100)
                consumed_ns, received_us = time.perf_counter_ns(), now_us()
                async with self._lock:
                    for tp, records in batches.items():
                        if tp.partition not in self.owned:
                            continue  # fetched before it moved away
                        for record in records:
                            if record.offset < self._positions.get(tp, 0):
                                continue  # routed already (a seek back after a reassignment)
                            self.metrics.consumed_bytes.inc(len(record.value or b""))
                            self._positions[tp] = record.offset + 1
                            held = self._deferred.get(record.key)
                            if held is not None:  # its backfill runs: routed after the older records
                                held.append(record)
                                continue
                            await self._route(record, consumed_ns, received_us)
        except BaseException:
            await self._close_consumer()
            raise

    async def _route(self, record: Any, consumed_ns: int, received_us: int) -> None:
        def route(decoded: Any) -> None:
            chunk: AudioChunk = decoded.typed
            self.router.route(chunk, consumed_ns, received_us, self._trace_of(chunk, record))

        await self.policy.process(record, "AudioChunk", route)

    def recently_taken(self, session_id: str) -> bool:
        """Whether this edge took the session's partition less than `edge_resume_lookback_s` ago
        (it started, or a rebalance moved the partition here): audio published before then may
        be a turn its player has not heard any of yet, so even a player without ``resume`` is
        served from the partition, re-read."""
        taken = self._taken_at.get(self.partition_of(session_id))
        return taken is not None and asyncio.get_running_loop().time() - taken < self.settings.edge_resume_lookback_s

    async def backfill(self, session_id: str) -> None:
        """Before a player resumes a session this edge holds nothing of (it moved here, or the
        player comes from an edge that died): re-read the last `edge_resume_lookback_s` of the
        session's partition and route its records, so the replay buffer holds what the old owner's
        did. Live records of the session that arrive meanwhile wait and follow, in order. Several
        players of one session share one backfill."""
        task = self._backfills.get(session_id)
        if task is None:
            task = self._backfills[session_id] = asyncio.create_task(self._backfill(session_id),
                                                                     name=f"edge-backfill-{session_id}")
            task.add_done_callback(lambda _t: self._backfills.pop(session_id, None))
        await asyncio.shield(task)

    async def _backfill(self, session_id: str) -> None:
        from aiokafka import TopicPartition

        s = self.settings
        key = session_key(session_id)
        tp = TopicPartition(s.audio_topic, self.partition_of(session_id))
        async with self._backfill_slots:
            async with self._lock:
                stop = self._positions.get(tp)
                if stop is None or not self.router.hold(session_id):
                    return  # not ours, or its state is here already
                self._deferred[key] = []
            consumer = make_consumer(s, group_id=None, enable_auto_commit=False)
            routed = 0
            try:
                await consumer.start()
                consumer.assign([tp])
                since_ms = now_us() // 1000 - int(s.edge_resume_lookback_s * 1000)
                found = (await consumer.offsets_for_times({tp: since_ms})).get(tp)
                consumer.seek(tp, min(found.offset, stop) if found is not None else stop)
                async with asyncio.timeout(15):
                    while await consumer.position(tp) < stop:
                        for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                            if record.offset >= stop:
                                break
                            if record.key != key:
                                continue
                            self.metrics.backfill_bytes.inc(len(record.value or b""))
                            async with self._lock:
                                if await self._replay_record(record):
                                    routed += 1
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - the player is served from now on
                log.warning("edge %s: re-reading session %s from %s failed (%r); serving it from now on",
                            self.edge_id, session_id, tp, exc)
            finally:
                await consumer.stop()
                async with self._lock:
                    for record in self._deferred.pop(key, []):
                        await self._route(record, time.perf_counter_ns(), now_us())
            log.info("edge %s: session %s re-read from %s (%d chunks, up to offset %d)", self.edge_id, session_id,
                     tp, routed, stop)

    async def _replay_record(self, record: Any) -> bool:
        """(Under the lock.) One re-read record to the router; a bad one was dead-lettered when it
        was first read, so here it is only skipped."""
        try:
            decoded = self.policy.decode(record, "AudioChunk")
            self.router.route(decoded.typed, time.perf_counter_ns(), now_us())
            return True
        except Exception as exc:  # noqa: BLE001 - one bad record costs itself only
            log.debug("edge: skipping re-read record %s[%s]@%s: %r", record.topic, record.partition, record.offset, exc)
            return False

    def _trace_of(self, chunk: AudioChunk, record: Any) -> Any:
        """Tracing on: the trace context of a sentence's first chunk (the one the edge's send span hangs under)."""
        if not self.tracer.enabled or chunk.chunk_seq != 0:
            return None
        return self.tracer.context_of(record.headers)

    async def publish(self, topic: str, message_type: str, value: "Message | dict",
                      headers: list[tuple[str, bytes]] | None = None) -> None:
        from voicebus.bus import publish

        await publish(self.producer, self.codec, topic, message_type, value, headers)

    async def publish_heard(self, heard: TurnHeard) -> None:
        """Publish one TurnHeard; a failure is logged (the report it came from is on the
        playback topic, so what was heard can still be rebuilt)."""
        from aiokafka.errors import KafkaError

        from voicebus.codecs import CodecError

        try:
            await self.publish(self.settings.heard_topic, "TurnHeard", heard)
        except (KafkaError, CodecError) as exc:
            log.warning("could not publish TurnHeard of %s/%s: %s", heard.session_id, heard.turn_id, exc)

    async def _heard_loop(self) -> None:
        """Publish the turns whose wait for more players' heard reports is over."""
        while True:
            for heard in self.router.heard.due(now_us()):
                await self.publish_heard(heard)
            self.router.stop_overdue()  # preempted turns whose preempter was not heard in time
            await asyncio.sleep(0.05)


class _Membership(ConsumerRebalanceListener):
    """The membership consumer's rebalance callbacks. aiokafka's protocol is eager (every partition
    is revoked, then the new assignment is given): the edge goes on serving its partitions through
    the revoke and acts on the assignment only, so a partition that stays costs nothing."""

    def __init__(self, link: KafkaLink) -> None:
        self.link = link

    async def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    async def on_partitions_assigned(self, assigned: Any) -> None:
        link = self.link
        if link.membership is not None and assigned:
            link.membership.pause(*assigned)  # membership only: control is followed by the ControlFollower
        try:
            await link._reassign({tp.partition for tp in assigned})
        except Exception:  # noqa: BLE001 - aiokafka would swallow it; the edge must not be left half-assigned
            log.exception("edge %s: taking the assignment %s failed", link.edge_id, sorted(tp.partition for tp in assigned))
            raise
