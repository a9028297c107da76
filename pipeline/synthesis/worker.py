"""The synthesis worker on the bus: SynthesisRequests in, AudioChunks out, cancel-aware.

Owns the Kafka shell around the pure core of `voicebus.synthesis.scheduler`: fetch, speak,
publish, commit. The plumbing every stage shares comes from `voicebus.shell`; the metrics from
`voicebus.synthesis.metrics`; arguments, signals and the process entry from
`voicebus.synthesis.cli`.

- a consumer in the workers' group on ``settings.synthesis_topic`` (partitions by session keep a
  session's sentences in order; add workers for throughput); auto-commit is off and a request's
  offset is committed only once it is settled (its audio fully published, or skipped), so a
  worker killed mid-turn loses no sentence: its partitions move to another worker, which starts
  again from the last committed offset (at-least-once: a sentence cut off mid-way is spoken
  again in full, chunks keyed by session/turn/sentence_seq/chunk_seq);
- every record goes through the shell's `RecordPolicy` (stage ``worker``): a request that cannot
  be decoded or breaks the contract is dead-lettered with its reason and its offset settled;
- a `ControlFollower` (every control partition, ``worker_cancel_lookback_s`` back, caught up
  before the first request is fetched), so every worker sees every cancel and a cancel issued just
  before the worker started is not missed;
- synthesis in a one-thread executor so the loop keeps applying control events; before each
  chunk is sent the loop checks the cancel state it updates itself, so no chunk of a cancelled
  turn is published after the worker has seen the cancel;
- publishing never gives up: a send that fails (broker down, timeout, any `KafkaError`) is
  retried with backoff until it succeeds or the worker stops, and the request stays uncommitted
  meanwhile. Only a deterministic failure (text the engine cannot speak, a contract violation)
  settles a request as failed; its sentence is then closed by a last chunk carrying
  ``end_reason`` (the turn's last chunk when it was the turn's last sentence), so the player
  still learns that the turn ended and why audio is missing;
- backpressure: at most ``worker_max_in_flight`` requests queued or running; when full, the
  partitions are paused and requests wait on Kafka (nothing is dropped), see docs/worker.md;
- every long-running task runs under the shell's `Supervisor` (a task that dies is restarted
  and counted); ``/healthz`` reports it and ``/metrics`` serves the worker's registry, when a
  port is given.

Size: about 720 lines, most of them the one `SynthesisWorker`: its fetch, synthesis, publish and
commit loops share the consumer, the producer, the scheduler and the offsets, and each fault rule
(retries, fencing, cancels) spans several loops. The decisions are in
`voicebus.synthesis.scheduler` and `voicebus.synthesis.chunks`, the metrics in
`voicebus.synthesis.metrics`, the command line in `voicebus.synthesis.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web
from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from voicebus import tracing
from voicebus.audio_codec import audio_format
from voicebus.credentials import BUS_ACCESS
from voicebus.bus import await_group_coordinator, ensure_topics, make_consumer, make_producer, publish, register_schemas
from voicebus.cancel import CancelRegistry
from voicebus.clock import now_us
from voicebus.codecs import Codec, CodecError, codec_for
from voicebus.lifecycle import Owned
from voicebus.retry import Backoff, retrying
from voicebus.settings import Settings
from voicebus.shell import ControlFollower, RecordFailure, RecordPolicy, Supervisor, serve_health
from voicebus.topics import worker_group_id
from voicebus.synthesis.engine import EngineError, NoVoices
from voicebus.synthesis.metrics import CancelObservation, RealTimeWatch, WorkerMetrics
from voicebus.synthesis.chunks import ChunkAssembler
from voicebus.synthesis.scheduler import (
    COMMITTABLE,
    OffsetTracker,
    Outcome,
    SynthesisJob,
    SynthesisScheduler,
    synthesis_args,
)
from voicebus.tracing import LiveSpan, StageTracer, TraceParent, tracer_for
from voicebus.schemas import contract
from voicebus.schemas.messages import AudioChunk, ControlEvent

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from voicebus.synthesis.engine import SynthesisEngine

__all__ = [
    "CancelObservation", "SynthesisWorker", "WorkerError", "WorkerMetrics", "new_worker_id",
    "speak_failure_reason", "worker_group_id",
]

log = logging.getLogger(__name__)

MAX_POLL_INTERVAL_MS = 300_000  # Kafka's default max.poll.interval.ms: a full worker polls well within it
MAX_TRACED_REQUESTS = 10_000  # request trace contexts kept (tracing on); the oldest forgotten beyond
REVOKE_GRACE_S = 5.0  # how long a revoked partition's running sentence may finish before it is cut
_END = object()

# What the engine raises for text it cannot speak: the same request fails the same way on every
# worker and every retry, so it is settled as failed (committed) at once. Any other exception of
# the engine (out of memory, a device error) is tried again, up to ``worker_speak_attempts``
# times while none of the sentence's audio was made, then settled the same way (reason
# engine-error, logged with its traceback): retrying forever a request the model chokes on would
# wedge its session for good.
SPEAK_FAILURES: tuple[type[BaseException], ...] = (EngineError, CodecError, contract.UnknownLanguage, ValueError)


class WorkerError(RuntimeError):
    """The worker could not start (broker unreachable, control topic unreadable, ...)."""


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def speak_failure_reason(error: BaseException) -> str:
    """The short reason a request could not be spoken: ``AudioChunk.end_reason`` and a metric label."""
    if isinstance(error, contract.UnknownLanguage):
        return "unknown-language"
    if isinstance(error, NoVoices):
        return "no-voices"
    if isinstance(error, CodecError):
        return error.reason
    if isinstance(error, ValueError):
        return "invalid-request"
    return "engine-error"


class SynthesisWorker(Owned):
    """One worker: owns its producer, both consumers, the executor, its tasks and the HTTP
    server. Use ``async with SynthesisWorker(...)`` or `start`/`stop`.

    ``on_ready`` is called once, with the partitions first assigned (possibly none), when the
    worker consumes: control caught up and the group joined."""

    def __init__(
        self,
        settings: Settings,
        engine: "SynthesisEngine",
        *,
        worker_id: str | None = None,
        metrics_port: int | None = None,
        codec: Codec | None = None,
        warm_up: bool = True,
        on_ready: Callable[[list[int]], None] | None = None,
        tracer: StageTracer | None = None,
        max_poll_interval_ms: int = MAX_POLL_INTERVAL_MS,
        clock_us: Callable[[], int] = now_us,
    ) -> None:
        self.settings = settings
        self.clock_us = clock_us  # epoch µs: every stamp this worker puts on a chunk or a cancel
        self.engine = engine
        self.max_poll_interval_ms = max_poll_interval_ms
        self.polls_while_paused = 0  # polls of a full worker (they keep it in its group)
        self.revocations = 0  # partitions revoked from this worker, in all
        self.worker_id = worker_id or new_worker_id()
        self.metrics_port = metrics_port
        self.warm_up = warm_up
        self.on_ready = on_ready
        self.codec = codec or codec_for(settings)
        # the encoding of every chunk it publishes; a bad setting fails here, before any consumer
        self.audio = audio_format(settings, engine.sample_rate)
        self.metrics = WorkerMetrics(self.worker_id)
        self.speed = RealTimeWatch()
        self.metrics.max_in_flight.set(settings.worker_max_in_flight)
        self.policy = RecordPolicy("worker", settings, self.codec, None, on_error=self._dead_letter,
                                   registry=self.metrics.registry)
        self.supervisor = Supervisor("worker", registry=self.metrics.registry)
        self.cancels = CancelRegistry()
        self.scheduler = SynthesisScheduler(settings.worker_max_in_flight, self.cancels, on_settled=self._on_settled,
                                            clock_us=clock_us)
        self.offsets = OffsetTracker()
        self.cancel_log: deque[CancelObservation] = deque(maxlen=1000)
        self.assigned: set[TopicPartition] = set()
        self.ready = asyncio.Event()  # control caught up, data consumer subscribed
        self._to_commit: dict[TopicPartition, int] = {}
        self._commit_wanted = asyncio.Event()
        self._producer: "AIOKafkaProducer | None" = None
        self._data: "AIOKafkaConsumer | None" = None
        self._follower: ControlFollower | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._http_runner: web.AppRunner | None = None
        self._observations: dict[SynthesisJob, CancelObservation] = {}  # running job -> its cancel
        self._announced = False
        self._stopping = False
        self.tracer = tracer if tracer is not None else tracer_for(settings, "worker")
        # tracing on: a request's trace context by its origin (partition, offset), until settled;
        # and the open synthesis span of a job being spoken
        self._traces: OrderedDict[Any, TraceParent] = OrderedDict()
        self._synthesis_spans: dict[SynthesisJob, LiveSpan] = {}

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        try:
            # the worker creates every topic it uses: it may start before any gate or agent
            await ensure_topics(s, [s.synthesis_topic, s.control_topic, s.audio_topic, s.deadletter_topic])
            await register_schemas(self.codec, {s.audio_topic: "AudioChunk"})  # off the loop (Confluent framing)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"synth-{self.worker_id}")
            self._producer = make_producer(s)
            await self._producer.start()
            self.policy.producer = self._producer
            if self.warm_up:
                await self._warm_up_engine()
            # control is caught up before the first request is fetched, then followed on its own
            self._follower = ControlFollower(s, self.policy, self._apply_control,
                                             lookback_s=s.worker_cancel_lookback_s)
            await self._follower.start()
            self.supervisor.start("control", self._follower.follow)
            self._data = make_consumer(
                s, group_id=worker_group_id(s), enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=s.worker_session_timeout_ms,
                heartbeat_interval_ms=max(100, s.worker_session_timeout_ms // 3),
                max_poll_records=max(1, s.worker_max_in_flight), max_poll_interval_ms=self.max_poll_interval_ms)
            self._data.subscribe([s.synthesis_topic], listener=_Rebalance(self))
            await await_group_coordinator(s, worker_group_id(s))  # a fresh broker: no error lines at start
            await self._data.start()
            if self.metrics_port is not None:
                await self._start_http_server(self.metrics_port)
            self.supervisor.start("fetch", self._fetch_loop)
            self.supervisor.start("synthesis", self._synthesis_loop)
            self.supervisor.start("commit", self._commit_loop)
            self.supervisor.start("lag", self._lag_loop)
        except BaseException:
            await self.stop()
            raise
        self.ready.set()
        log.info("worker %s started (group %s, max in flight %d)", self.worker_id, worker_group_id(s),
                 s.worker_max_in_flight)

    async def stop(self) -> None:
        """Stop every task and client this worker owns. Running synthesis is asked to stop;
        its request stays uncommitted and is redone by whoever gets the partition next."""
        self._stopping = True
        for job in self.scheduler.running:
            job.request_stop(Outcome.DROPPED)
        await self.supervisor.stop()
        if self._data is not None:
            await self._commit_pending()
            await self._data.stop()  # leaves the group: partitions move at once
            self._data = None
        if self._follower is not None:
            await self._follower.stop()
            self._follower = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
            self.policy.producer = None
        if self._executor is not None:
            # the running forward pass (asked to stop) finishes in its thread; don't block the loop
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
            self._executor = None
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None

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

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` says: ready, every supervised task running, restarts so far."""
        tasks = self.supervisor.health()
        refused = BUS_ACCESS.refusal_of(self.settings)
        healthy = self.ready.is_set() and not self._stopping and self.supervisor.healthy and refused is None
        return {"stage": "worker", "worker_id": self.worker_id, "healthy": healthy, "ready": self.ready.is_set(),
                "restarts": sum(t["restarts"] for t in tasks.values()), "tasks": tasks,
                "partitions": sorted(tp.partition for tp in self.assigned), "credentials_refused": refused}

    def in_hand(self) -> str:
        """What this worker holds right now, in a line (a test's or an operator's "why not done"):
        the requests running and parked, the queue's depth, and per partition the offsets fetched
        but not settled."""
        sched = self.scheduler
        unsettled = {f"{tp.topic}[{tp.partition}]": n for tp in self.assigned if (n := self.offsets.unsettled(tp))}
        return (f"running {[str(j.key) for j in sched.running]}, parked {[str(j.key) for j in sched.parked]}, "
                f"queued {sched.queue_depth}, unsettled offsets {unsettled}, paused "
                f"{sorted(tp.partition for tp in self._data.paused()) if self._data is not None else []}")

    # --- control -----------------------------------------------------------------------------
    def _apply_control(self, event: ControlEvent) -> None:
        seen_at = self.clock_us()
        purged, stopped = self.scheduler.apply_control(event)
        if not event.is_cancel:
            return
        self.metrics.cancels_seen.inc()
        observation = CancelObservation(event.session_id, event.turn_id, seen_at, len(purged), len(stopped))
        self.cancel_log.append(observation)
        for job in stopped:
            self._observations[job] = observation
        if not stopped:
            self.metrics.cancel_to_last_chunk.observe(0.0)
        log.info("cancel %s/%s seen: %d queued request(s) skipped, %d running stopped",
                 event.session_id, event.turn_id or "*", len(purged), len(stopped))

    # --- data --------------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        assert self._data is not None
        consumer = self._data
        while True:
            free = self.scheduler.free_slots
            if free == 0:
                seen = self.scheduler.changes.generation  # what a slot freed from now on advances
                # stop fetching: requests wait on the broker, not in this process
                consumer.pause(*consumer.assignment())
                self.metrics.paused.set(1)
                await self._wait_while_full(consumer, seen)
                continue
            paused = consumer.paused()  # asked of the consumer: right after a restart of this task too
            if paused:
                consumer.resume(*paused)
                self.metrics.paused.set(0)
            batch = await consumer.getmany(timeout_ms=200, max_records=free)
            for tp, records in batch.items():
                for record in records:
                    if tp not in self.assigned:
                        continue  # revoked while this batch was in hand: the new owner reads it
                    await self._take(tp, record)
            self._update_depth()

    async def _wait_while_full(self, consumer: "AIOKafkaConsumer", seen: int) -> None:
        """Until the scheduler changed after generation `seen` (a slot freed, partitions changed),
        polling every third of the poll interval.

        A consumer that does not poll for ``max_poll_interval_ms`` (Kafka's max.poll.interval.ms,
        300 s) leaves its group: its partitions move, and the work it holds is dropped and done
        again. Eight long sentences (an agent sending 16 KiB ones, a slow CPU) take longer than
        that: without these polls the worker left its group over and over and its sessions
        stalled (found by `voicebus bench hostile`). A poll of paused partitions returns nothing;
        anything it does return (a partition assigned in between) is taken, a few over the bound."""
        interval_s = self.max_poll_interval_ms / 3000
        while not await self.scheduler.changes.wait(seen, interval_s):
            batch = await consumer.getmany(timeout_ms=0)
            self.polls_while_paused += 1
            for tp, records in batch.items():
                for record in records:
                    if tp in self.assigned:
                        await self._take(tp, record)

    async def _take(self, tp: TopicPartition, record: Any) -> None:
        """One fetched record through the record policy into the scheduler. A record the policy
        refuses was dead-lettered (with its reason): its offset is settled at once."""
        received_at = self.clock_us()
        self.offsets.track(tp, record.offset)
        if self.tracer.enabled:
            context = self.tracer.context_of(record.headers)
            if context is not None:
                self._traces[(tp, record.offset)] = context
                while len(self._traces) > MAX_TRACED_REQUESTS:
                    self._traces.popitem(last=False)

        def submit(decoded: Any) -> None:
            self.scheduler.submit(decoded.typed, received_at_us=received_at,
                                  origin=(tp, record.offset))

        if not await self.policy.process(record, "SynthesisRequest", submit):
            self._settle_offset(tp, record.offset)

    async def _dead_letter(self, failure: RecordFailure) -> None:
        """The policy's error callback: dead-letter the record (bounded: a dead letter that cannot be
        written is skipped and counted, `RecordPolicy.dead_letter`); the caller settles its offset."""
        await self.policy.dead_letter(failure)

    async def _synthesis_loop(self) -> None:
        while True:
            job = self.scheduler.next_job()
            self._update_depth()
            if job is None:
                await self.scheduler.changes.wait(self.scheduler.changes.generation)
                continue
            try:
                outcome = await self._speak(job)
                if outcome is None:  # a tentative job synthesized before its settlement came
                    self.scheduler.park(job)  # it no longer takes a slot: the fetch may go on
                    continue
            except BaseException:
                # cancelled (the worker stops) or a bug: the request is not committed; the
                # supervisor restarts this task and the partition's next owner redoes it
                job.request_stop(Outcome.DROPPED)
                self.scheduler.finish(job)
                raise
            self.scheduler.finish(job, outcome)  # a slot is free: the fetch may go on

    async def _synthesize(self, job: SynthesisJob, assembler: ChunkAssembler, loop: asyncio.AbstractEventLoop) -> None:
        """Run the engine on `job` in the executor, publishing what the assembler makes of its
        output as it comes; the engine's exceptions propagate (the stream is closed either way)."""
        stream = self.engine.stream_timed(chunk_ms=self.settings.chunk_ms, should_stop=job.should_stop,
                                          **synthesis_args(job, self.settings.opening_clause_min_words))
        try:
            while not job.stop_requested:
                timed = await loop.run_in_executor(self._executor, next, stream, _END)
                if timed is _END:
                    break
                if not await self._publish_all(job, assembler.feed(timed.pcm, timed.words, timed.pause)):
                    break
        finally:
            # ValueError: the generator is still executing a cancelled step; RuntimeError: the
            # executor is already shut down (the worker stops). Either way the stream is dropped.
            with contextlib.suppress(ValueError, RuntimeError):
                await loop.run_in_executor(self._executor, stream.close)

    async def _speak(self, job: SynthesisJob) -> Outcome | None:
        """Synthesize one request and publish its chunks. SPOKEN once every chunk is acknowledged
        (or the job was asked to stop: the scheduler then settles it with the stop's reason);
        FAILED when the engine cannot speak it, after its closing chunk is acknowledged. None:
        a tentative request was synthesized but is not confirmed yet (the caller parks it; its
        chunks stay held). A parked job that was confirmed comes back here to publish them."""
        if job.synthesized:
            await self._publish_all(job, [])
            return job.parked_outcome or Outcome.SPOKEN
        loop = asyncio.get_running_loop()
        assembler = ChunkAssembler(job, chunk_ms=self.settings.chunk_ms, sample_rate=self.engine.sample_rate,
                                   worker_id=self.worker_id, audio=self.audio, clock_us=self.clock_us)
        if job.is_end_marker:
            try:
                await self._publish_all(job, assembler.finish())
            finally:
                self._observe_cancel_end(job)
            return Outcome.SPOKEN
        if self.tracer.enabled:
            self._open_synthesis_span(job, assembler.synthesis_started_at_us)
        try:
            attempts = self.settings.worker_speak_attempts

            def speak_retried(exc: BaseException, attempt: int, wait_s: float) -> None:
                self.metrics.speak_retries.labels(type(exc).__name__).inc()
                log.warning("%s: synthesis failed (%s: %s), attempt %d of %d; trying again in %.1f s", job.key,
                            type(exc).__name__, exc, attempt, attempts, wait_s)

            # Out of memory, a device error: nothing of the sentence was made yet, so it is made
            # again from the start (no audio twice); the same text failing the same way every time
            # is failed after the last attempt. A fault about the text, audio already made, or the
            # job asked to stop: the error is raised at once.
            async for attempt in retrying(
                    wait=Backoff(self.settings.worker_publish_backoff_s, self.settings.worker_publish_max_backoff_s),
                    retry_if=lambda exc: not isinstance(exc, SPEAK_FAILURES) and not assembler.fed_bytes,
                    attempts=attempts, stop=lambda: job.stop_requested, on_retry=speak_retried):
                with attempt:
                    await self._synthesize(job, assembler, loop)
            if not job.stop_requested:
                await self._publish_all(job, assembler.finish())
                self._observe_speed(assembler)
            if job.unconfirmed and not job.stop_requested:
                return None
        except Exception as exc:  # noqa: BLE001 - the engine's failure of this text: reported, settled
            # Publishing never raises here (`_send` retries); what reaches this is the engine's (or
            # the codec's) answer to this request after its attempts.
            reason = speak_failure_reason(exc)
            self.metrics.failures.labels(reason).inc()
            log.log(logging.WARNING if isinstance(exc, SPEAK_FAILURES) else logging.ERROR,
                    "%s cannot be spoken (%s: %s); its sentence is closed with end_reason %r%s", job.key,
                    type(exc).__name__, exc, reason,
                    " and its turn ended" if job.request.is_last_in_turn else "",
                    exc_info=None if isinstance(exc, SPEAK_FAILURES) else exc)
            # the audio already made goes out, then a last chunk that says why the rest is missing
            await self._publish_all(job, assembler.finish(end_reason=reason))
            if job.unconfirmed and not job.stop_requested:
                # its closing chunk is held with the rest: it goes out (and the job is settled
                # FAILED) once confirmed, so the sentence still ends for the player
                job.parked_outcome = Outcome.FAILED
                return None
            return Outcome.FAILED
        finally:
            self._observe_cancel_end(job)
            span = self._synthesis_spans.pop(job, None)
            if span is not None:
                span.end(self.clock_us(), **{"voicebus.stopped": job.stop_reason.value if job.stop_reason else None})
        return Outcome.SPOKEN

    def _observe_speed(self, assembler: ChunkAssembler) -> None:
        """A sentence was made whole: its real-time factor, and a warning when this worker has
        become slower than real time (`RealTimeWatch`)."""
        factor = assembler.realtime_factor
        if factor is None:
            return
        self.metrics.realtime_factor.observe(factor)
        median = self.speed.observe(factor)
        if median is not None:
            log.warning("worker %s makes speech slower than it plays (real-time factor %.2f, median of its last "
                        "sentences): its listeners hear gaps inside sentences; give it more threads on free cores "
                        "(VOICEBUS_SYNTHESIS_THREADS), a CPU with AMX or AVX-512 BF16 (bfloat16) or a GPU (docs/worker.md)",
                        self.worker_id, median)

    def _open_synthesis_span(self, job: SynthesisJob, started_at_us: int) -> None:
        """Tracing on: the request's ``synthesis.queue`` span (received .. synthesis start) and
        its ``synthesis`` span, open until the job's last chunk is published (or it stops)."""
        parent = self._traces.get(job.origin)
        if parent is None:
            return
        attributes = {tracing.SESSION: job.session_id, tracing.TURN: job.key.turn_id,
                      tracing.SENTENCE: job.request.sentence_seq, tracing.WORKER: self.worker_id}
        self.tracer.record(tracing.SYNTHESIS_QUEUE, parent, job.received_at_us, started_at_us, **attributes)
        self._synthesis_spans[job] = self.tracer.start(tracing.SYNTHESIS, parent, started_at_us,
                                                       **attributes, **{"voicebus.chars": len(job.request.text)})

    def _chunk_trace(self, job: SynthesisJob, chunk: AudioChunk) -> tuple[LiveSpan | None, list[tuple[str, bytes]] | None]:
        """Tracing on: a chunk's headers. The first chunk of a sentence gets a ``publish`` span
        (audio ready .. acknowledged) and carries its context; the others carry the synthesis
        span's (or, published after a tentative confirmation, the request's)."""
        synthesis = self._synthesis_spans.get(job)
        parent = synthesis.context if synthesis is not None else self._traces.get(job.origin)
        if parent is None or chunk.chunk_seq != 0:
            return None, self.tracer.headers(parent)
        span = self.tracer.start(tracing.PUBLISH, parent, chunk.audio_ready_at_us or self.clock_us(),
                                 **{tracing.SESSION: job.session_id, tracing.TURN: job.key.turn_id,
                                    tracing.SENTENCE: job.request.sentence_seq, "voicebus.bytes": len(chunk.pcm)})
        return span, self.tracer.headers(span.context)

    def _observe_cancel_end(self, job: SynthesisJob) -> None:
        """A job stopped by a cancel has returned: record how long the cancel took to bite."""
        observation = self._observations.pop(job, None)
        if observation is None:
            return
        observation.synthesis_stopped_at_us = self.clock_us()
        self.metrics.cancel_to_stopped.observe(max(0, observation.synthesis_stopped_at_us - observation.seen_at_us) / 1e6)
        self.metrics.cancel_to_last_chunk.observe(observation.cancel_to_last_chunk_ms / 1000.0)
        log.info("cancel %s/%s: last chunk acknowledged %.1f ms after the cancel was seen, synthesis stopped after %.1f ms",
                 observation.session_id, observation.turn_id or "*", observation.cancel_to_last_chunk_ms,
                 (observation.synthesis_stopped_at_us - observation.seen_at_us) / 1000.0)

    async def _publish_all(self, job: SynthesisJob, chunks: list[AudioChunk]) -> bool:
        """Publish chunks in order; False (and nothing more sent) once the job must stop. Chunks
        of an unconfirmed tentative job are held instead; the first publish after its
        confirmation sends the held ones first (the turn's end, which the confirmation carries,
        set on the last chunk)."""
        if job.unconfirmed:
            job.held.extend(chunks)
            return not job.stop_requested
        if job.held:
            last_in_turn = job.request.is_last_in_turn
            held = [replace(chunk, is_last_in_turn=chunk.is_last_chunk and last_in_turn) for chunk in job.held]
            chunks, job.held = held + list(chunks), []
        for chunk in chunks:
            sent = await self._send(job, chunk)
            if sent is None:
                return False
            self.metrics.chunks.inc()
            observation = self._observations.get(job)
            if observation is not None:
                # this send was already on its way when the cancel was seen: it is the turn's
                # last chunk, and its acknowledgement ends the cancel's tail
                observation.last_chunk_published_at_us = self.clock_us()
            elif sent.chunk_seq == 0:
                self.metrics.first_chunk.observe(max(0, sent.published_at_us - job.received_at_us) / 1e6)
        return True

    async def _send(self, job: SynthesisJob, chunk: AudioChunk) -> AudioChunk | None:
        """Send one chunk until the broker acknowledges it. The chunk as sent (its
        ``published_at_us`` stamped) once acknowledged; None when the job must stop first
        (cancelled, revoked, the worker stopping). The cancel check runs on the loop that applies
        cancels, right before each attempt. A failed send (broker down, timeout) is retried with
        backoff: the request stays uncommitted, nothing is skipped."""
        assert self._producer is not None
        span, headers = self._chunk_trace(job, chunk) if self.tracer.enabled else (None, None)

        def retried(exc: BaseException, _attempt: int, wait_s: float) -> None:
            self.metrics.publish_retries.labels(type(exc).__name__).inc()
            log.warning("publishing chunk %d of %s failed (%r); retrying in %.1f s (not committed)",
                        chunk.chunk_seq, job.key, exc, wait_s)

        async for attempt in retrying(
                wait=Backoff(self.settings.worker_publish_backoff_s, self.settings.worker_publish_max_backoff_s),
                retry_on=KafkaError, on_retry=retried):
            with attempt:
                if job.stop_requested or self.scheduler.is_cancelled(job):
                    job.request_stop(Outcome.STOPPED)  # keeps an earlier reason (DROPPED) if there is one
                    if span is not None:
                        span.end(self.clock_us(), **{"voicebus.stopped": True})
                    return None
                sent = replace(chunk, published_at_us=self.clock_us())
                await publish(self._producer, self.codec, self.settings.audio_topic, "AudioChunk", sent, headers)
        if span is not None:
            span.end(self.clock_us())
        return sent

    # --- settlement and commits --------------------------------------------------------------
    def _on_settled(self, job: SynthesisJob, outcome: Outcome) -> None:
        self.metrics.requests.labels(outcome.value).inc()
        if self._traces:
            self._traces.pop(job.origin, None)
        if job.origin is not None and outcome in COMMITTABLE:
            tp, offset = job.origin
            self._settle_offset(tp, offset)

    def _settle_offset(self, tp: TopicPartition, offset: int) -> None:
        commit_at = self.offsets.settle(tp, offset)
        if commit_at is not None:
            self._to_commit[tp] = max(commit_at, self._to_commit.get(tp, 0))
            self._commit_wanted.set()

    async def _commit_loop(self) -> None:
        # Not one operation retried but a loop for the worker's life whose failures in a row set
        # the wait, and a commit that succeeds starts the doubling again: it counts them itself
        # and takes each wait from `Backoff`, the policy the retried operations use.
        backoff = Backoff(self.settings.worker_publish_backoff_s, self.settings.worker_publish_max_backoff_s)
        failures = 0
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            if await self._commit_pending():
                failures = 0
                continue
            failures += 1
            await asyncio.sleep(backoff.after(failures))  # the offsets stay pending: tried again
            self._commit_wanted.set()

    async def _commit_pending(self) -> bool:
        """Commit the settled offsets of the partitions still assigned. False when the commit
        failed; the offsets then stay pending (a later commit carries them)."""
        if not self._to_commit or self._data is None:
            return True
        offsets = {tp: off for tp, off in self._to_commit.items() if tp in self.assigned}
        self._to_commit.clear()
        if not offsets:
            return True
        try:
            await self._data.commit(offsets)
        except (KafkaError, AssertionError) as exc:
            # the broker is away or a rebalance is in progress: keep the offsets for the next try
            # (a partition that moves meanwhile is dropped from them by `on_revoked`)
            for tp, off in offsets.items():
                self._to_commit[tp] = max(off, self._to_commit.get(tp, 0))
            self.metrics.commit_retries.inc()
            log.warning("commit of %s failed (%r); kept for the next commit", offsets, exc)
            return False
        finally:
            self._update_depth()
        return True

    async def commit_state(self) -> dict[int, tuple[int | None, int]]:
        """Per assigned partition: (committed offset of the workers' group, end offset)."""
        assert self._data is not None
        tps = sorted(self.assigned)
        ends = await self._data.end_offsets(tps)
        return {tp.partition: (await self._data.committed(tp), ends[tp]) for tp in tps}

    # --- rebalance ---------------------------------------------------------------------------
    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
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
        for origin in [o for o in self._traces if o[0] in revoked]:
            del self._traces[origin]
        for tp in revoked:
            self._to_commit.pop(tp, None)
        self.revocations += len(revoked)
        log.info("partitions revoked: %s (%d queued dropped, %d running cut)",
                 sorted(tp.partition for tp in revoked), queued_dropped, len(running))

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.assigned |= set(assigned)
        if self._data is not None and self.scheduler.free_slots == 0:
            self._data.pause(*assigned)  # full: don't prefetch the new partitions either
        log.info("partitions assigned: %s", sorted(tp.partition for tp in assigned))
        if not self._announced:
            self._announced = True
            if self.on_ready is not None:
                self.on_ready(sorted(tp.partition for tp in self.assigned))
        self.scheduler.changes.notify()  # a paused fetch pauses the new partitions too

    # --- metrics and health ------------------------------------------------------------------
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
                try:
                    position = await self._data.position(tp)
                except (KafkaError, AssertionError, KeyError) as exc:  # revoked meanwhile
                    log.debug("no position for %s: %r", tp, exc)
                    continue
                self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, highwater - position))
            self._update_depth()

    async def _start_http_server(self, port: int) -> None:
        self._http_runner = await serve_health(self.settings.edge_host, port, self.health, self.metrics.registry)
        log.info("worker metrics on http://%s:%d/metrics, health on /healthz", self.settings.edge_host, port)


class _Rebalance(ConsumerRebalanceListener):
    """aiokafka rebalance listener forwarding to the worker."""

    def __init__(self, worker: SynthesisWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked) -> None:
        await self.worker.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        self.worker.on_assigned(assigned)
