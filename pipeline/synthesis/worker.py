"""The synthesis worker on the bus: SynthesisRequests in, AudioChunks out, cancel-aware.

Owns the Kafka shell around the pure core of `pipeline.synthesis.scheduler`:

- a consumer in the workers' group on ``settings.synthesis_topic`` (partitions by session keep a
  session's sentences in order; add workers for throughput); auto-commit is off and a request's
  offset is committed only once it is settled (its audio fully published, or skipped), so a
  worker killed mid-turn loses no sentence: its partitions move to another worker, which starts
  again from the last committed offset (at-least-once: a sentence cut off mid-way is spoken
  again in full, chunks keyed by session/turn/sentence_seq/chunk_seq);
- its own group-less consumer on ``settings.control_topic`` reading every partition, so every
  worker sees every cancel. It starts ``worker_cancel_lookback_s`` in the past (by timestamp)
  and the worker does not fetch a single request before it has caught up with the control
  topic's end, so a cancel issued just before the worker started is not missed. It runs as its
  own task: control is never behind the data backlog;
- synthesis in a one-thread executor so the loop keeps reading control events; before each
  chunk is sent the loop checks the cancel state it updates itself, so no chunk of a cancelled
  turn is published after the worker has seen the cancel;
- backpressure: at most ``worker_max_in_flight`` requests queued or running; when full, the
  partitions are paused and requests wait on Kafka (nothing is dropped), see docs/worker.md;
- Prometheus metrics (queue depth, in flight, consumer lag, outcomes, cancel-to-last-chunk) in a
  registry owned by the worker, served on ``/metrics`` when a port is given.

Run it with `run_worker(settings, engine)`, `voicebus worker`, or as a process:
``python -m pipeline.synthesis.worker [--tiny] [--metrics-port P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.cancel import CancelRegistry
from pipeline.clock import now_us
from pipeline.codecs import Codec, codec_for
from pipeline.settings import Settings
from pipeline.synthesis.scheduler import (
    COMMITTABLE,
    ChunkAssembler,
    OffsetTracker,
    Outcome,
    SynthesisJob,
    SynthesisScheduler,
    synthesis_args,
)

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.structs import TopicPartition

    from pipeline.synthesis.engine import SynthesisEngine

log = logging.getLogger(__name__)

WORKER_GROUP_SUFFIX = "-workers"
CONTROL_CATCH_UP_TIMEOUT_S = 15.0
REVOKE_GRACE_S = 5.0  # how long a revoked partition's running sentence may finish before it is cut
_END = object()


class WorkerError(RuntimeError):
    """The worker could not start (broker unreachable, control topic unreadable, ...)."""


def worker_group_id(settings: Settings) -> str:
    """The consumer group of all synthesis workers of one deployment."""
    return settings.synthesis_topic + WORKER_GROUP_SUFFIX


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerMetrics:
    """The worker's Prometheus metrics, in a registry of their own (no global state)."""

    def __init__(self, worker_id: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}
        self.queue_depth = Gauge("voicebus_worker_queue_depth", "Requests accepted, waiting for synthesis", **labels)
        self.in_flight = Gauge("voicebus_worker_in_flight", "Requests queued or being synthesized", **labels)
        self.max_in_flight = Gauge("voicebus_worker_max_in_flight", "Bound on requests in flight", **labels)
        self.paused = Gauge("voicebus_worker_fetch_paused", "1 while fetching is paused (full)", **labels)
        self.consumer_lag = Gauge(
            "voicebus_worker_consumer_lag", "Requests on the broker not yet fetched (highwater - position)",
            ["partition"], **labels)
        self.uncommitted = Gauge(
            "voicebus_worker_uncommitted", "Requests fetched whose offsets are not committed yet", **labels)
        self.requests = Counter("voicebus_worker_requests", "Requests settled, by outcome", ["outcome"], **labels)
        self.chunks = Counter("voicebus_worker_chunks_published", "Audio chunks published", **labels)
        self.deadletters = Counter("voicebus_worker_deadletters", "Records dead-lettered", **labels)
        self.cancels_seen = Counter("voicebus_worker_cancels_seen", "Cancel events applied", **labels)
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        self.cancel_to_last_chunk = Histogram(
            "voicebus_worker_cancel_to_last_chunk_seconds",
            "From a cancel seen to the broker's ack of the turn's last chunk (0 when no send was on its way)",
            buckets=buckets, **labels)
        self.cancel_to_stopped = Histogram(
            "voicebus_worker_cancel_to_synthesis_stopped_seconds",
            "From a cancel seen to the running synthesis of the turn returning", buckets=buckets, **labels)
        self.first_chunk = Histogram(
            "voicebus_worker_request_to_first_chunk_seconds",
            "From a request received to its first chunk published",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), **labels)
        self.max_in_flight.set(0)
        self.worker_id = worker_id


@dataclass
class CancelObservation:
    """What one cancel did on this worker (kept for logs, tests and the benchmark)."""

    session_id: str
    turn_id: str | None
    seen_at_us: int
    purged: int
    stopped: int
    last_chunk_published_at_us: int = 0  # ack of a send already on its way when the cancel was seen
    synthesis_stopped_at_us: int = 0

    @property
    def cancel_to_last_chunk_ms(self) -> float:
        return max(0, self.last_chunk_published_at_us - self.seen_at_us) / 1000.0


class SynthesisWorker:
    """One worker: owns its producer, both consumers, the executor, its tasks and the metrics
    server. Use ``async with SynthesisWorker(...)`` or `start`/`stop`."""

    def __init__(
        self,
        settings: Settings,
        engine: "SynthesisEngine",
        *,
        worker_id: str | None = None,
        metrics_port: int | None = None,
        codec: Codec | None = None,
        warm_up: bool = True,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id or new_worker_id()
        self.metrics_port = metrics_port
        self.warm_up = warm_up
        self.codec = codec or codec_for(settings)
        self.metrics = WorkerMetrics(self.worker_id)
        self.metrics.max_in_flight.set(settings.worker_max_in_flight)
        self.cancels = CancelRegistry()
        self.scheduler = SynthesisScheduler(settings.worker_max_in_flight, self.cancels, on_settled=self._on_settled)
        self.offsets = OffsetTracker()
        self.cancel_log: deque[CancelObservation] = deque(maxlen=1000)
        self.assigned: set["TopicPartition"] = set()
        self.ready = asyncio.Event()  # control caught up, data consumer subscribed
        self._wake = asyncio.Event()  # something to synthesize, or a slot freed
        self._to_commit: dict["TopicPartition", int] = {}
        self._commit_wanted = asyncio.Event()
        self._producer: "AIOKafkaProducer | None" = None
        self._data: "AIOKafkaConsumer | None" = None
        self._control: "AIOKafkaConsumer | None" = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self._metrics_runner: Any = None
        self._observations: dict[SynthesisJob, CancelObservation] = {}  # running job -> its cancel
        self._stopping = False

    @property
    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks)

    # --- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> "SynthesisWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        from pipeline.bus import ensure_topics, make_consumer, make_producer

        s = self.settings
        try:
            await ensure_topics(s, [s.synthesis_topic, s.control_topic, s.audio_topic, s.deadletter_topic])
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"synth-{self.worker_id}")
            self._producer = make_producer(s)
            await self._producer.start()
            self._control = AIOKafkaConsumer(
                bootstrap_servers=s.bootstrap, group_id=None, enable_auto_commit=False,
                fetch_max_wait_ms=s.fetch_max_wait_ms, max_partition_fetch_bytes=s.max_message_bytes)
            await self._control.start()
            await self._seek_control_to_lookback()
            if self.warm_up:
                await self._warm_up_engine()
            await self._catch_up_control()
            # from here on control is read continuously, before the first request is fetched
            self._tasks.append(asyncio.create_task(self._control_loop(), name=f"{self.worker_id}-control"))
            self._data = make_consumer(
                s, group_id=worker_group_id(s), enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=s.worker_session_timeout_ms,
                heartbeat_interval_ms=max(100, s.worker_session_timeout_ms // 3),
                max_poll_records=max(1, s.worker_max_in_flight))
            self._data.subscribe([s.synthesis_topic], listener=_Rebalance(self))
            await self._data.start()
            if self.metrics_port is not None:
                await self._start_metrics_server(self.metrics_port)
        except BaseException:
            await self.stop()
            raise
        self._tasks += [
            asyncio.create_task(self._fetch_loop(), name=f"{self.worker_id}-fetch"),
            asyncio.create_task(self._synthesis_loop(), name=f"{self.worker_id}-synthesis"),
            asyncio.create_task(self._commit_loop(), name=f"{self.worker_id}-commit"),
            asyncio.create_task(self._lag_loop(), name=f"{self.worker_id}-lag"),
        ]
        self.ready.set()
        log.info("worker %s ready (group %s, max in flight %d)", self.worker_id, worker_group_id(s), s.worker_max_in_flight)

    async def stop(self) -> None:
        """Stop every task and client this worker owns. Running synthesis is asked to stop;
        its request stays uncommitted and is redone by whoever gets the partition next."""
        self._stopping = True
        for job in self.scheduler.running:
            job.request_stop(Outcome.DROPPED)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._data is not None:
            with contextlib.suppress(Exception):
                await self._commit_pending()
            await self._data.stop()  # leaves the group: partitions move at once
            self._data = None
        if self._control is not None:
            await self._control.stop()
            self._control = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self._executor is not None:
            # the running forward pass (asked to stop) finishes in its thread; don't block the loop
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
            self._executor = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    async def _warm_up_engine(self) -> None:
        """One short sentence before joining the group, so the first real request does not pay
        for G2P and model initialisation (seconds on a CPU)."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        def speak_once() -> None:
            for _ in self.engine.stream("Hello.", self.settings.default_language, self.settings.default_voice):
                pass

        await loop.run_in_executor(self._executor, speak_once)
        log.info("engine warmed up in %.2f s", loop.time() - started)

    # --- control -----------------------------------------------------------------------------
    async def _seek_control_to_lookback(self) -> None:
        from aiokafka.structs import TopicPartition

        assert self._control is not None
        topic = self.settings.control_topic
        assert self._producer is not None
        partitions = await self._producer.partitions_for(topic)  # waits for the topic's metadata
        if not partitions:
            raise WorkerError(f"control topic {topic!r} has no partitions")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self._control.assign(tps)
        since_ms = (now_us() // 1000) - int(self.settings.worker_cancel_lookback_s * 1000)
        found = await self._control.offsets_for_times({tp: since_ms for tp in tps})
        for tp in tps:
            hit = found.get(tp)
            if hit is None:
                await self._control.seek_to_end(tp)
            else:
                self._control.seek(tp, hit.offset)

    async def _catch_up_control(self) -> None:
        """Apply every control event up to the control topic's end as of now, before any request
        is fetched, so requests of turns cancelled just before the start are skipped."""
        assert self._control is not None
        tps = list(self._control.assignment())
        ends = await self._control.end_offsets(tps)
        deadline = asyncio.get_running_loop().time() + CONTROL_CATCH_UP_TIMEOUT_S
        while True:
            behind = [tp for tp in tps if await self._control.position(tp) < ends[tp]]
            if not behind:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise WorkerError(f"control topic not caught up after {CONTROL_CATCH_UP_TIMEOUT_S}s: {behind}")
            batch = await self._control.getmany(*behind, timeout_ms=200)
            for records in batch.values():
                for record in records:
                    await self._apply_control_record(record)

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            batch = await self._control.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    await self._apply_control_record(record)

    async def _apply_control_record(self, record: Any) -> None:
        from pipeline.bus import decode_or_dead_letter

        assert self._producer is not None
        decoded = await decode_or_dead_letter(self._producer, self.settings, self.codec, record, expect="ControlEvent")
        if decoded is None:
            self.metrics.deadletters.inc()
            return
        event = decoded.value
        seen_at = now_us()
        purged, stopped = self.scheduler.apply_control(event)
        if event.get("action") != "CANCEL":
            return
        self.metrics.cancels_seen.inc()
        observation = CancelObservation(event["session_id"], event.get("turn_id"), seen_at, len(purged), len(stopped))
        self.cancel_log.append(observation)
        for job in stopped:
            self._observations[job] = observation
        if not stopped:
            self.metrics.cancel_to_last_chunk.observe(0.0)
        log.info("cancel %s/%s seen: %d queued request(s) skipped, %d running stopped",
                 event["session_id"], event.get("turn_id") or "*", len(purged), len(stopped))
        self._wake.set()

    # --- data --------------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        from pipeline.bus import decode_or_dead_letter

        assert self._data is not None and self._producer is not None
        consumer = self._data
        paused = False
        while True:
            free = self.scheduler.free_slots
            if free == 0:
                if not paused:
                    # stop fetching: requests wait on the broker, not in this process
                    consumer.pause(*consumer.assignment())
                    paused = True
                    self.metrics.paused.set(1)
                self._wake.clear()
                await self._wake.wait()
                continue
            if paused:
                consumer.resume(*consumer.assignment())
                paused = False
                self.metrics.paused.set(0)
            batch = await consumer.getmany(timeout_ms=200, max_records=free)
            for tp, records in batch.items():
                for record in records:
                    if tp not in self.assigned:
                        continue  # revoked while this batch was in hand: the new owner reads it
                    received_at = now_us()
                    self.offsets.track(tp, record.offset)
                    decoded = await decode_or_dead_letter(
                        self._producer, self.settings, self.codec, record, expect="SynthesisRequest")
                    if decoded is None:
                        self.metrics.deadletters.inc()
                        self._settle_offset(tp, record.offset)
                        continue
                    self.scheduler.submit(decoded.value, received_at_us=received_at, origin=(tp, record.offset))
            self._update_depth()
            self._wake.set()

    async def _synthesis_loop(self) -> None:
        while True:
            job = self.scheduler.next_job()
            self._update_depth()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outcome = await self._speak(job)
            except asyncio.CancelledError:
                job.request_stop(Outcome.DROPPED)
                self.scheduler.finish(job)
                raise
            except Exception:
                log.exception("synthesis of %s failed; skipped", job.key)
                outcome = Outcome.FAILED
            self.scheduler.finish(job, outcome)
            self._wake.set()  # a slot is free

    async def _speak(self, job: SynthesisJob) -> Outcome:
        """Synthesize one request and publish its chunks; returns SPOKEN unless stopped."""
        loop = asyncio.get_running_loop()
        assembler = ChunkAssembler(job, chunk_ms=self.settings.chunk_ms, sample_rate=self.engine.sample_rate,
                                   worker_id=self.worker_id)
        if job.is_end_marker:
            try:
                await self._publish_all(job, assembler.finish())
            finally:
                self._observe_cancel_end(job)
            return Outcome.SPOKEN
        stream = self.engine.stream(chunk_ms=self.settings.chunk_ms, should_stop=job.should_stop,
                                    **synthesis_args(job, self.settings.opening_clause_min_words))
        try:
            while not job.stop_requested:
                pcm = await loop.run_in_executor(self._executor, next, stream, _END)
                if pcm is _END:
                    break
                if not await self._publish_all(job, assembler.feed(pcm)):
                    break
            if not job.stop_requested:
                await self._publish_all(job, assembler.finish())
        finally:
            with contextlib.suppress(Exception):
                await loop.run_in_executor(self._executor, stream.close)
            self._observe_cancel_end(job)
        return Outcome.SPOKEN

    def _observe_cancel_end(self, job: SynthesisJob) -> None:
        """A job stopped by a cancel has returned: record how long the cancel took to bite."""
        observation = self._observations.pop(job, None)
        if observation is None:
            return
        observation.synthesis_stopped_at_us = now_us()
        self.metrics.cancel_to_stopped.observe(max(0, observation.synthesis_stopped_at_us - observation.seen_at_us) / 1e6)
        self.metrics.cancel_to_last_chunk.observe(observation.cancel_to_last_chunk_ms / 1000.0)
        log.info("cancel %s/%s: last chunk acknowledged %.1f ms after the cancel was seen, synthesis stopped after %.1f ms",
                 observation.session_id, observation.turn_id or "*", observation.cancel_to_last_chunk_ms,
                 (observation.synthesis_stopped_at_us - observation.seen_at_us) / 1000.0)

    async def _publish_all(self, job: SynthesisJob, chunks: list[dict]) -> bool:
        """Publish chunks in order; False (and nothing more sent) once the job must stop. The
        check runs on the loop that applies cancels, right before each send."""
        from pipeline.bus import publish

        assert self._producer is not None
        for chunk in chunks:
            if job.stop_requested or self.scheduler.is_cancelled(job):
                job.request_stop(Outcome.STOPPED)
                return False
            chunk["published_at_us"] = now_us()
            await publish(self._producer, self.codec, self.settings.audio_topic, "AudioChunk", chunk)
            self.metrics.chunks.inc()
            observation = self._observations.get(job)
            if observation is not None:
                # this send was already on its way when the cancel was seen: it is the turn's
                # last chunk, and its acknowledgement ends the cancel's tail
                observation.last_chunk_published_at_us = now_us()
            elif chunk["chunk_seq"] == 0:
                self.metrics.first_chunk.observe(max(0, chunk["published_at_us"] - job.received_at_us) / 1e6)
        return True

    # --- settlement and commits --------------------------------------------------------------
    def _on_settled(self, job: SynthesisJob, outcome: Outcome) -> None:
        self.metrics.requests.labels(outcome.value).inc()
        if job.origin is not None and outcome in COMMITTABLE:
            tp, offset = job.origin
            self._settle_offset(tp, offset)

    def _settle_offset(self, tp: "TopicPartition", offset: int) -> None:
        commit_at = self.offsets.settle(tp, offset)
        if commit_at is not None:
            self._to_commit[tp] = commit_at
            self._commit_wanted.set()

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self._commit_pending()

    async def _commit_pending(self) -> None:
        from aiokafka.errors import KafkaError

        if not self._to_commit or self._data is None:
            return
        offsets = {tp: off for tp, off in self._to_commit.items() if tp in self.assigned}
        self._to_commit.clear()
        if not offsets:
            return
        try:
            await self._data.commit(offsets)
        except (KafkaError, AssertionError) as exc:
            # a rebalance is in progress; the new owner starts from the previous commit and the
            # dedupe/at-least-once rules apply
            log.warning("commit of %s failed: %s", offsets, exc)
        self._update_depth()

    async def commit_state(self) -> dict[int, tuple[int | None, int]]:
        """Per assigned partition: (committed offset of the workers' group, end offset)."""
        assert self._data is not None
        tps = sorted(self.assigned)
        ends = await self._data.end_offsets(tps)
        return {tp.partition: (await self._data.committed(tp), ends[tp]) for tp in tps}

    # --- rebalance ---------------------------------------------------------------------------
    async def on_revoked(self, revoked: set["TopicPartition"]) -> None:
        """Partitions leave this worker: drop their queued requests (uncommitted: the next owner
        reads them), give a running sentence `REVOKE_GRACE_S` to finish, commit what is done."""
        revoked = set(revoked)
        if not revoked:
            return

        def from_revoked(job: SynthesisJob) -> bool:
            return job.origin is not None and job.origin[0] in revoked

        queued_dropped = len(self.scheduler.drop_queued(from_revoked))
        self._update_depth()
        running = [j for j in self.scheduler.running if from_revoked(j)]
        deadline = asyncio.get_running_loop().time() + REVOKE_GRACE_S
        while running and asyncio.get_running_loop().time() < deadline and not self._stopping:
            await asyncio.sleep(0.02)
            running = [j for j in self.scheduler.running if from_revoked(j)]
        for job in running:
            job.request_stop(Outcome.DROPPED)
        await self._commit_pending()
        self.assigned -= revoked
        self.offsets.forget(revoked)
        log.info("partitions revoked: %s (%d queued dropped, %d running cut)",
                 sorted(tp.partition for tp in revoked), queued_dropped, len(running))

    def on_assigned(self, assigned: set["TopicPartition"]) -> None:
        self.assigned |= set(assigned)
        if self._data is not None and self.scheduler.free_slots == 0:
            self._data.pause(*assigned)  # full: don't prefetch the new partitions either
        log.info("partitions assigned: %s", sorted(tp.partition for tp in assigned))
        self._wake.set()

    # --- metrics -----------------------------------------------------------------------------
    def _update_depth(self) -> None:
        self.metrics.queue_depth.set(self.scheduler.queue_depth)
        self.metrics.in_flight.set(self.scheduler.in_flight)
        self.metrics.uncommitted.set(sum(self.offsets.unsettled(tp) for tp in self.assigned))

    async def _lag_loop(self) -> None:
        assert self._data is not None
        while True:
            await asyncio.sleep(1.0)
            for tp in list(self.assigned):
                highwater = self._data.highwater(tp)
                if highwater is None:
                    continue
                with contextlib.suppress(Exception):
                    position = await self._data.position(tp)
                    self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, highwater - position))
            self._update_depth()

    async def _start_metrics_server(self, port: int) -> None:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        async def metrics(_request: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        self._metrics_runner = runner
        site = web.TCPSite(runner, self.settings.edge_host, port)
        await site.start()
        log.info("worker metrics on http://%s:%d/metrics", self.settings.edge_host, port)


class _Rebalance:
    """aiokafka rebalance listener forwarding to the worker."""

    def __init__(self, worker: SynthesisWorker) -> None:
        from aiokafka import ConsumerRebalanceListener

        ConsumerRebalanceListener.register(type(self))
        self.worker = worker

    async def on_partitions_revoked(self, revoked) -> None:
        await self.worker.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        self.worker.on_assigned(assigned)


async def run_worker(
    settings: Settings,
    engine: "SynthesisEngine",
    *,
    metrics_port: int | None = None,
    stop: asyncio.Event | None = None,
    worker_id: str | None = None,
) -> int:
    """Run one worker until `stop` is set or the task is cancelled; it stops everything it owns."""
    async with SynthesisWorker(settings, engine, worker_id=worker_id, metrics_port=metrics_port) as worker:
        stop_wait = asyncio.ensure_future((stop or asyncio.Event()).wait())
        try:
            # the worker's own tasks only end by failing: stop then too, with an error status
            done, _ = await asyncio.wait([stop_wait, *worker.tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        failed = [t for t in done if t is not stop_wait and not t.cancelled() and t.exception() is not None]
        for task in failed:
            log.error("worker task %s failed: %r", task.get_name(), task.exception())
    return 1 if failed else 0


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny random-weight engine (real kokoro code; for tests and demos)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve Prometheus metrics on http://<edge_host>:P/metrics")
    parser.add_argument("--worker-id", default=None, help="name in AudioChunk.worker_id (default host-pid-random)")


def worker_command(args: argparse.Namespace, settings: Settings) -> int:
    """`voicebus worker`: run one synthesis worker until SIGINT/SIGTERM."""
    from pipeline.synthesis.engine import SynthesisEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_worker(settings, engine, metrics_port=args.metrics_port, stop=stop, worker_id=args.worker_id)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.synthesis.worker", description=__doc__.splitlines()[0])
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    return worker_command(args, Settings.from_env())


if __name__ == "__main__":
    sys.exit(main())
