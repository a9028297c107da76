"""The pure core of a synthesis worker: which request is synthesized next, and what goes out.

No Kafka and no engine here; `voicebus.synthesis.worker` wraps this in the bus shell. The clock
(epoch µs) is passed in (``clock_us``), as in the gate's core.

- `SynthesisScheduler` holds the SynthesisRequests a worker has accepted: bounded work in flight
  (queued + being synthesized), one request at a time per session so a session's sentences stay
  in order, round-robin across sessions so one long turn does not delay another session's first
  sentence, cancel through `CancelRegistry` (queued requests of a cancelled turn are skipped
  without synthesis, running ones are flagged to stop), and dedupe of a request already
  completed (same session, turn, sentence_seq) so a re-delivered request is not spoken twice.
  Speculative release (docs/worker.md): a tentative request is synthesized at once but its chunks
  are held (`SynthesisJob.held`) until a request with its key settles it at intake: empty text
  and tentative false confirms it (the held chunks go out, the rest streams), anything else
  retracts it (nothing of it is ever published; a replacement takes its place in the session's
  order). A tentative job whose synthesis ends before it is settled is *parked*: it no longer
  takes a slot (so the fetch that brings its settlement is never blocked), but its session stays
  blocked until the settlement comes.
  Every accepted request is *settled* exactly once through the `on_settled` callback, with an
  `Outcome`; the shell commits offsets from there.
  Each change that can free a slot or make a job ready advances `SynthesisScheduler.changes`,
  which the shell's fetch and synthesis loops wait on (`Changes`).
- `OffsetTracker` turns settlements that happen out of offset order (sessions share partitions)
  into the contiguous offset a partition may commit.
- `synthesis_args`: the engine arguments of a job's request. What goes out of a job's audio,
  its `AudioChunk`s, is `voicebus.synthesis.chunks.ChunkAssembler`.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Iterable

from voicebus.cancel import CancelRegistry
from voicebus.clock import now_us
from voicebus.schemas.messages import AudioChunk, ControlEvent, SynthesisRequest



class Changes:
    """A generation count that tasks wait on, for the loops that share one scheduler.

    A task looks at the state, notes `generation` (no await in between), and waits for a change
    after it: a change made after its look wakes it even when it came before the wait began.
    (One ``asyncio.Event`` that both the fetch and the synthesis loop cleared lost such wakeups:
    the synthesis loop's "slot free" was cleared by its own "nothing to do" before the fetch
    loop's wait had started, and both slept, the partitions paused, until the next control event.)
    Nothing here is cleared, so any number of tasks may wait; single-threaded use, as the scheduler."""

    def __init__(self) -> None:
        self.generation = 0
        self._waiters: list[asyncio.Future] = []

    def notify(self) -> None:
        self.generation += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, seen: int, timeout_s: float | None = None) -> bool:
        """Until a change after generation `seen`: True, or False once `timeout_s` passed without one."""
        if self.generation != seen:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)


def _notifies(method: Callable) -> Callable:
    """A scheduler method after which its `changes` advance (whatever it returns or raises)."""

    @functools.wraps(method)
    def wrapped(self: "SynthesisScheduler", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.changes.notify()

    return wrapped


class SchedulerFull(RuntimeError):
    """`submit` was called with no free slot: the shell must stop fetching when full."""


class Outcome(enum.Enum):
    SPOKEN = "spoken"  # synthesized and every chunk published
    CANCELLED = "cancelled"  # its turn was cancelled before synthesis started: skipped
    STOPPED = "stopped"  # its turn was cancelled while it was being synthesized
    DUPLICATE = "duplicate"  # already completed (or queued) here: not spoken again
    DROPPED = "dropped"  # its partition was revoked: another worker will redo it; do not commit
    RETRACTED = "retracted"  # a tentative request withdrawn or replaced: nothing of it was published
    SETTLEMENT = "settlement"  # a confirmation or withdrawal of a tentative request, applied at intake
    FAILED = "failed"  # the engine cannot speak it (same answer on every retry): its sentence is
    # closed with an end_reason and skipped, so one bad sentence blocks nothing. Never a failed
    # publish: the shell retries those, uncommitted, until the broker takes them


# Outcomes after which the request's offset may be committed.
COMMITTABLE = frozenset({Outcome.SPOKEN, Outcome.CANCELLED, Outcome.STOPPED, Outcome.DUPLICATE, Outcome.FAILED,
                         Outcome.RETRACTED, Outcome.SETTLEMENT})


@dataclass(frozen=True)
class RequestKey:
    session_id: str
    turn_id: str
    sentence_seq: int

    @classmethod
    def of(cls, request: SynthesisRequest) -> "RequestKey":
        return cls(request.session_id, request.turn_id, request.sentence_seq)


@dataclass(eq=False)
class SynthesisJob:
    """One accepted request. `origin` is the shell's handle (topic-partition and offset)."""

    request: SynthesisRequest
    received_at_us: int
    origin: Hashable | None = None
    key: RequestKey = field(init=False)
    started_at_us: int = 0
    stop_requested: bool = False  # set on the loop thread, read by the synthesis thread
    stop_reason: Outcome | None = None
    # Speculative release: chunks made while the request is tentative and unconfirmed, and
    # whether its synthesis has ended (a parked job only has held chunks left to publish).
    held: list[AudioChunk] = field(default_factory=list)
    synthesized: bool = False
    parked_outcome: Outcome | None = None  # the outcome to settle with once its held chunks are out

    def __post_init__(self) -> None:
        self.key = RequestKey.of(self.request)

    @property
    def unconfirmed(self) -> bool:
        """Tentative and not confirmed yet: its chunks must be held, not published."""
        return self.request.tentative

    @property
    def session_id(self) -> str:
        return self.key.session_id

    @property
    def is_end_marker(self) -> bool:
        """An empty-text request that only closes the turn: one empty last chunk, no synthesis."""
        return not self.request.text.strip()

    def should_stop(self) -> bool:
        """Polled by the engine between chunks (from the synthesis thread)."""
        return self.stop_requested

    def request_stop(self, reason: Outcome) -> None:
        if not self.stop_requested:
            self.stop_requested = True
            self.stop_reason = reason


class SynthesisScheduler:
    """Bounded, per-session-ordered, cancel-aware queue of synthesis jobs (single-threaded use:
    call it from the event loop only; only `SynthesisJob.should_stop` is read from threads)."""

    def __init__(
        self,
        max_in_flight: int,
        cancels: CancelRegistry | None = None,
        on_settled: Callable[[SynthesisJob, Outcome], None] | None = None,
        remember_completed: int = 100_000,
        clock_us: Callable[[], int] = now_us,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.clock_us = clock_us  # epoch µs: the jobs' received and started stamps
        self.cancels = cancels if cancels is not None else CancelRegistry()
        self._on_settled = on_settled or (lambda job, outcome: None)
        self._queues: OrderedDict[str, deque[SynthesisJob]] = OrderedDict()  # round-robin order
        self._running: dict[str, SynthesisJob] = {}  # session -> its job being synthesized
        self._parked: dict[str, SynthesisJob] = {}  # session -> its synthesized, unconfirmed tentative job
        self._tentative: dict[RequestKey, SynthesisJob] = {}  # unsettled tentative jobs (queued, running, parked)
        self._active_keys: set[RequestKey] = set()  # queued or running
        self._completed: OrderedDict[RequestKey, None] = OrderedDict()
        self._remember_completed = remember_completed
        self.peak_in_flight = 0  # the most requests ever held at once (the bound, checked)
        self.changes = Changes()  # advanced when a slot frees up or a job may be ready

    # --- sizes -------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def running(self) -> list[SynthesisJob]:
        return list(self._running.values())

    @property
    def in_flight(self) -> int:
        return self.queue_depth + len(self._running)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_in_flight - self.in_flight)

    # --- intake ------------------------------------------------------------------------------
    @_notifies
    def submit(self, request: SynthesisRequest, *, received_at_us: int | None = None, origin: Hashable | None = None) -> SynthesisJob:
        """Accept a request. Returns its job; a duplicate or an already-cancelled request is
        settled at once (and does not take a slot), and so is the settlement of a tentative one."""
        job = SynthesisJob(request, received_at_us if received_at_us is not None else self.clock_us(), origin)
        self.cancels.observe(job.session_id, request.turn_id)  # a later session cancel covers it
        held = self._tentative.get(job.key)
        if held is not None:
            if not request.tentative and not request.text.strip():
                # confirmed: the held job's request becomes final (it carries the turn's end)
                del self._tentative[job.key]
                held.request = replace(held.request, tentative=False, is_last_in_turn=request.is_last_in_turn)
                self._on_settled(job, Outcome.SETTLEMENT)
                return job
            self._retract(held)  # withdrawn, or replaced by this request
            if not request.text.strip():
                self._on_settled(job, Outcome.SETTLEMENT)
                return job
        elif request.tentative and not request.text.strip():
            self._on_settled(job, Outcome.SETTLEMENT)  # withdrawal of one never held here
            return job
        if job.key in self._active_keys or job.key in self._completed:
            self._on_settled(job, Outcome.DUPLICATE)
            return job
        if self._is_cancelled(job):
            self._remember(job.key)
            self._on_settled(job, Outcome.CANCELLED)
            return job
        if self.free_slots == 0:
            raise SchedulerFull(f"{self.in_flight} requests in flight (max {self.max_in_flight})")
        self._queues.setdefault(job.session_id, deque()).append(job)
        self._active_keys.add(job.key)
        if job.unconfirmed:
            self._tentative[job.key] = job
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return job

    def next_job(self) -> SynthesisJob | None:
        """The next job to synthesize: the head of the next session (round-robin) that has no job
        running. Queued jobs of cancelled turns met on the way are settled as CANCELLED."""
        for session_id, job in list(self._parked.items()):
            if not job.unconfirmed:  # confirmed: its held chunks go out now
                del self._parked[session_id]
                self._running[session_id] = job
                return job
        for session_id in list(self._queues):
            if session_id in self._running or session_id in self._parked:
                continue
            queue = self._queues[session_id]
            while queue:
                job = queue.popleft()
                if self._is_cancelled(job):
                    self._settle(job, Outcome.CANCELLED)
                    self.changes.notify()  # a slot freed
                    continue
                if not queue:
                    del self._queues[session_id]
                else:
                    self._queues.move_to_end(session_id)  # fairness: other sessions go first next
                job.started_at_us = self.clock_us()
                self._running[session_id] = job
                return job
            del self._queues[session_id]
        return None

    @_notifies
    def finish(self, job: SynthesisJob, outcome: Outcome | None = None) -> Outcome:
        """A running job ended. Its outcome is its stop reason if it was asked to stop, else
        `outcome` (default SPOKEN)."""
        if self._running.get(job.session_id) is not job:
            raise ValueError(f"{job.key} is not running")
        del self._running[job.session_id]
        final = job.stop_reason if job.stop_requested and job.stop_reason else (outcome or Outcome.SPOKEN)
        self._settle(job, final)
        return final

    @_notifies
    def park(self, job: SynthesisJob) -> None:
        """A running tentative job was synthesized before its settlement came: it waits, holding
        its chunks but no slot; its session's next job waits behind it."""
        if self._running.get(job.session_id) is not job:
            raise ValueError(f"{job.key} is not running")
        del self._running[job.session_id]
        job.synthesized = True
        self._parked[job.session_id] = job

    @property
    def parked(self) -> list[SynthesisJob]:
        return list(self._parked.values())

    def _retract(self, job: SynthesisJob) -> None:
        """Drop an unsettled tentative job: nothing of it is published. Its key is free at once
        (a replacement with the same key follows), and it is not remembered as completed."""
        self._tentative.pop(job.key, None)
        self._active_keys.discard(job.key)
        job.held.clear()
        if self._parked.get(job.session_id) is job:
            del self._parked[job.session_id]
            self._on_settled(job, Outcome.RETRACTED)
        elif self._running.get(job.session_id) is job:
            job.request_stop(Outcome.RETRACTED)  # settled when the synthesis loop finishes it
        else:
            queue = self._queues.get(job.session_id)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.session_id]
            self._on_settled(job, Outcome.RETRACTED)

    # --- control -----------------------------------------------------------------------------
    @_notifies
    def apply_control(self, event: ControlEvent) -> tuple[list[SynthesisJob], list[SynthesisJob]]:
        """Apply a ControlEvent. Returns (queued jobs purged, running jobs asked to stop); the
        purged ones are settled as CANCELLED here, the running ones when they `finish`."""
        self.cancels.apply(event)
        session_id = event.session_id
        purged: list[SynthesisJob] = []
        queue = self._queues.get(session_id)
        if queue:
            keep: deque[SynthesisJob] = deque()
            for job in queue:
                (purged if self._is_cancelled(job) else keep).append(job)
            if keep:
                self._queues[session_id] = keep
            else:
                del self._queues[session_id]
            for job in purged:
                self._settle(job, Outcome.CANCELLED)
        parked = self._parked.get(session_id)
        if parked is not None and self._is_cancelled(parked):
            del self._parked[session_id]
            self._tentative.pop(parked.key, None)
            parked.held.clear()
            self._settle(parked, Outcome.CANCELLED)
            purged.append(parked)
        stopped: list[SynthesisJob] = []
        running = self._running.get(session_id)
        if running is not None and self._is_cancelled(running):
            running.request_stop(Outcome.STOPPED)
            stopped.append(running)
        return purged, stopped

    @_notifies
    def drop_queued(self, predicate: Callable[[SynthesisJob], bool]) -> list[SynthesisJob]:
        """Forget queued jobs matching `predicate`, settled DROPPED (not committed: another worker
        redoes them). Used when partitions are revoked; running jobs are the shell's to stop."""
        dropped: list[SynthesisJob] = []
        for session_id in list(self._queues):
            queue = self._queues[session_id]
            keep = deque(j for j in queue if not predicate(j))
            dropped.extend(j for j in queue if predicate(j))
            if keep:
                self._queues[session_id] = keep
            else:
                del self._queues[session_id]
        for session_id, job in list(self._parked.items()):
            if predicate(job):
                del self._parked[session_id]
                dropped.append(job)
        for job in dropped:
            self._active_keys.discard(job.key)
            self._tentative.pop(job.key, None)
            self._on_settled(job, Outcome.DROPPED)
        return dropped

    def is_cancelled(self, job: SynthesisJob) -> bool:
        return self._is_cancelled(job)

    # --- internals ---------------------------------------------------------------------------
    def _is_cancelled(self, job: SynthesisJob) -> bool:
        return self.cancels.is_cancelled(job.session_id, job.request.turn_id)

    def _settle(self, job: SynthesisJob, outcome: Outcome) -> None:
        if outcome is Outcome.RETRACTED:
            # `_retract` freed its key already (a replacement may hold it now): forget nothing
            self._on_settled(job, outcome)
            return
        self._tentative.pop(job.key, None)
        self._active_keys.discard(job.key)
        if outcome is not Outcome.DROPPED:
            self._remember(job.key)
        self._on_settled(job, outcome)

    def _remember(self, key: RequestKey) -> None:
        self._completed[key] = None
        self._completed.move_to_end(key)
        while len(self._completed) > self._remember_completed:
            self._completed.popitem(last=False)


class OffsetTracker:
    """Per-partition commit watermark over records settled out of order.

    `track` every record fetched (in offset order per partition), `settle` it when done; `settle`
    returns the offset to commit (last contiguous settled offset + 1) when it advanced."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, OrderedDict[int, bool]] = {}

    def track(self, partition: Hashable, offset: int) -> None:
        self._pending.setdefault(partition, OrderedDict())[offset] = False

    def settle(self, partition: Hashable, offset: int) -> int | None:
        pending = self._pending.get(partition)
        if pending is None or offset not in pending:
            return None  # partition forgotten (revoked) meanwhile
        pending[offset] = True
        advanced: int | None = None
        while pending:
            first, done = next(iter(pending.items()))
            if not done:
                break
            pending.popitem(last=False)
            advanced = first + 1
        return advanced

    def forget(self, partitions: Iterable[Hashable]) -> None:
        for p in partitions:
            self._pending.pop(p, None)

    def unsettled(self, partition: Hashable) -> int:
        return sum(1 for done in self._pending.get(partition, {}).values() if not done)


def synthesis_args(job: SynthesisJob, opening_clause_min_words: int = 0) -> dict[str, Any]:
    """The engine `stream` keyword arguments of a job's request. A turn's first sentence may end
    its first piece at its first clause (`opening_clause_min_words`): its first audio is the turn's."""
    r = job.request
    opening = opening_clause_min_words if r.sentence_seq == 0 else 0
    return {"text": r.text, "language": r.language, "voice": r.voice, "speed": float(r.speed or 1.0),
            "first_clause_min_words": opening}
