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
- `ChunkAssembler` turns the engine's PCM stream into AudioChunk dicts of ``chunk_ms``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

from voicebus.cancel import CancelRegistry
from voicebus.clock import now_us
from voicebus.audio_codec import AudioFormat
from voicebus.schemas.contract import AudioEncoding
from voicebus.schemas.messages import ControlEvent

BYTES_PER_SAMPLE = 2  # PCM16LE mono


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
    def of(cls, request: dict) -> "RequestKey":
        return cls(request["session_id"], request["turn_id"], int(request["sentence_seq"]))


@dataclass(eq=False)
class SynthesisJob:
    """One accepted request. `origin` is the shell's handle (topic-partition and offset)."""

    request: dict
    received_at_us: int
    origin: Hashable | None = None
    key: RequestKey = field(init=False)
    started_at_us: int = 0
    stop_requested: bool = False  # set on the loop thread, read by the synthesis thread
    stop_reason: Outcome | None = None
    # Speculative release: chunks made while the request is tentative and unconfirmed, and
    # whether its synthesis has ended (a parked job only has held chunks left to publish).
    held: list[dict] = field(default_factory=list)
    synthesized: bool = False
    parked_outcome: Outcome | None = None  # the outcome to settle with once its held chunks are out

    def __post_init__(self) -> None:
        self.key = RequestKey.of(self.request)

    @property
    def unconfirmed(self) -> bool:
        """Tentative and not confirmed yet: its chunks must be held, not published."""
        return bool(self.request.get("tentative"))

    @property
    def session_id(self) -> str:
        return self.key.session_id

    @property
    def is_end_marker(self) -> bool:
        """An empty-text request that only closes the turn: one empty last chunk, no synthesis."""
        return not self.request["text"].strip()

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
    def submit(self, request: dict, *, received_at_us: int | None = None, origin: Hashable | None = None) -> SynthesisJob:
        """Accept a request. Returns its job; a duplicate or an already-cancelled request is
        settled at once (and does not take a slot), and so is the settlement of a tentative one."""
        job = SynthesisJob(request, received_at_us if received_at_us is not None else self.clock_us(), origin)
        self.cancels.observe(job.session_id, request["turn_id"])  # a later session cancel covers it
        held = self._tentative.get(job.key)
        if held is not None:
            if not request.get("tentative") and not request["text"].strip():
                # confirmed: the held job's request becomes final (it carries the turn's end)
                del self._tentative[job.key]
                held.request = {**held.request, "tentative": False,
                                "is_last_in_turn": bool(request.get("is_last_in_turn"))}
                self._on_settled(job, Outcome.SETTLEMENT)
                return job
            self._retract(held)  # withdrawn, or replaced by this request
            if not request["text"].strip():
                self._on_settled(job, Outcome.SETTLEMENT)
                return job
        elif request.get("tentative") and not request["text"].strip():
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
        return self.cancels.is_cancelled(job.session_id, job.request["turn_id"])

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


class ChunkAssembler:
    """Cuts the PCM16 stream of one request into AudioChunk dicts of `chunk_ms`, each encoded as
    `audio` says (`voicebus.audio_codec`: PCM16 as is, or whole Opus packets, the chunk then
    rounded to whole frames; one encoder per request, flushed with its last audio).

    One full chunk is held back until more audio (or the end) arrives, so the last chunk of the
    sentence can carry ``is_last_chunk``. Where the engine pauses to decode more of the sentence
    (the end of a window or piece: ``feed(..., pause=True)``) nothing is held: the held chunk and
    the remainder go out at once (the remainder cut to whole Opus frames), since the audio after
    the pause is the sentence's end, not them; held, they left a player with one chunk to play
    while the next window decoded (bench ttfa: 40-100 ms of silence after a turn's first chunk).
    A remainder shorter than a quarter chunk is appended to the last chunk instead of going out
    as a tiny chunk of its own.

    Word timings fed with the audio (samples from the sentence's start) go out on the chunk
    whose audio holds the word's start, so a player has a word before it renders its start;
    a word starting beyond the audio fed so far waits for the chunk that holds it (the last
    chunk takes every word left)."""

    def __init__(self, job: SynthesisJob, *, chunk_ms: int, sample_rate: int, worker_id: str = "",
                 audio: AudioFormat | None = None, clock_us: Callable[[], int] = now_us) -> None:
        if chunk_ms <= 0:
            raise ValueError("chunk_ms must be positive")
        self.job = job
        self.sample_rate = sample_rate
        self.worker_id = worker_id
        self.audio = audio or AudioFormat(AudioEncoding.PCM16LE, sample_rate)
        if self.audio.sample_rate != sample_rate:
            raise ValueError(f"audio format at {self.audio.sample_rate} Hz for a {sample_rate} Hz engine")
        self.chunk_bytes = self.audio.chunk_bytes(chunk_ms)
        self._encoder = self.audio.encoder()
        self.clock_us = clock_us  # epoch µs: synthesis start and each chunk's audio ready
        self.synthesis_started_at_us = clock_us()
        self._last_ready_us: int | None = None  # when the audio fed last was ready
        self._fed_bytes = 0  # PCM fed so far
        self._buffer = bytearray()
        self._held: tuple[bytes, int] | None = None  # (pcm, audio_ready_at_us)
        self._next_seq = 0
        self._words: deque[dict] = deque()  # timed words not yet on a chunk, by start
        self._built_samples = 0  # samples of the chunks built so far
        self.finished = False

    @property
    def fed_bytes(self) -> int:
        """PCM bytes of engine output fed so far (0: nothing of the sentence was made yet)."""
        return self._fed_bytes

    def feed(self, pcm: bytes, words: Iterable[Any] = (), pause: bool = False) -> list[dict]:
        """Add engine output (and the word timings that came with it: `WordTiming`s or their
        records); returns the chunks now ready to publish, in order. ``pause``: the engine decodes
        more of this sentence before its next output, so all that is whole goes out now."""
        if self.finished:
            raise RuntimeError("feed after finish")
        ready_at = self._last_ready_us = self.clock_us()
        for word in words:
            self._words.append(word if isinstance(word, dict) else word.as_record())
        self._buffer += pcm
        self._fed_bytes += len(pcm)
        out: list[dict] = []
        while len(self._buffer) >= self.chunk_bytes:
            piece = bytes(self._buffer[: self.chunk_bytes])
            del self._buffer[: self.chunk_bytes]
            if self._held is not None:
                out.append(self._build(*self._held, last=False))
            self._held = (piece, ready_at)
        if pause:
            if self._held is not None:
                out.append(self._build(*self._held, last=False))
                self._held = None
            whole = len(self._buffer) - len(self._buffer) % self.audio.unit_bytes
            if whole >= self.chunk_bytes // 4:
                out.append(self._build(bytes(self._buffer[:whole]), ready_at, last=False))
                del self._buffer[:whole]
        return out

    @property
    def realtime_factor(self) -> float | None:
        """Seconds from synthesis start to the last audio fed, over the seconds of audio fed (None
        before any audio): above 1 the sentence was made slower than it plays."""
        if self._last_ready_us is None or self._fed_bytes < BYTES_PER_SAMPLE:
            return None
        audio_s = self._fed_bytes // BYTES_PER_SAMPLE / self.sample_rate
        return max(0, self._last_ready_us - self.synthesis_started_at_us) / 1e6 / audio_s

    def finish(self, end_reason: str = "") -> list[dict]:
        """The end of the sentence: the remaining chunk(s), the last flagged. A sentence with no
        audio at all (an end-of-turn marker) yields one empty last chunk.

        ``end_reason`` (not empty) says the sentence ends early, its audio incomplete: the audio
        made so far goes out and then one empty last chunk carrying the reason, so a player that
        keys chunks by sequence sees the sentence (and, for the turn's last sentence, the turn)
        end, and why."""
        if self.finished:
            return []
        self.finished = True
        ready_at = self.clock_us()
        rest = bytes(self._buffer[: len(self._buffer) - len(self._buffer) % BYTES_PER_SAMPLE])
        self._buffer.clear()
        out: list[dict] = []
        if end_reason:
            # the audio made so far ends here (an encoder is flushed with it), before the closing chunk
            if self._held is not None:
                out.append(self._build(self._held[0] + rest, self._held[1], last=False, audio_ends=True))
            elif rest:
                out.append(self._build(rest, ready_at, last=False, audio_ends=True))
            self._held = None
            out.append(self._build(b"", ready_at, last=True, end_reason=end_reason))
            return out
        if self._held is None:
            return [self._build(rest, ready_at, last=True)]
        held_pcm, held_at = self._held
        self._held = None
        if len(rest) < self.chunk_bytes // 4:
            return [self._build(held_pcm + rest, held_at, last=True)]
        out.append(self._build(held_pcm, held_at, last=False))
        out.append(self._build(rest, ready_at, last=True))
        return out

    def _build(self, pcm: bytes, ready_at_us: int, *, last: bool, end_reason: str = "",
               audio_ends: bool = False) -> dict:
        r = self.job.request
        # words are placed by the samples fed (PCM), whatever the encoding on the bus
        self._built_samples += len(pcm) // BYTES_PER_SAMPLE
        words = []
        while self._words and (last or self._words[0]["start"] < self._built_samples):
            words.append(self._words.popleft())
        payload = self._encoder.encode(pcm, last=last or audio_ends)
        chunk = {
            "session_id": r["session_id"],
            "turn_id": r["turn_id"],
            "sentence_seq": int(r["sentence_seq"]),
            "chunk_seq": self._next_seq,
            "is_last_chunk": last,
            "is_last_in_turn": bool(last and r.get("is_last_in_turn", False)),
            "sample_rate": self.sample_rate,
            "encoding": self.audio.encoding,
            "pcm": payload,
            "worker_id": self.worker_id,
            "first_token_at_us": int(r.get("first_token_at_us", 0)),
            "text_complete_at_us": int(r.get("text_complete_at_us", 0)),
            "released_at_us": int(r.get("released_at_us", 0)),
            "request_received_at_us": self.job.received_at_us,
            "synthesis_started_at_us": self.synthesis_started_at_us,
            "audio_ready_at_us": ready_at_us,
            "published_at_us": 0,  # stamped by the shell just before sending
            "end_reason": end_reason,
            "words": words,
        }
        self._next_seq += 1
        return chunk


def chunk_duration_ms(chunk: dict) -> float:
    return len(chunk["pcm"]) / BYTES_PER_SAMPLE / chunk["sample_rate"] * 1000.0


def synthesis_args(job: SynthesisJob, opening_clause_min_words: int = 0) -> dict[str, Any]:
    """The engine `stream` keyword arguments of a job's request. A turn's first sentence may end
    its first piece at its first clause (`opening_clause_min_words`): its first audio is the turn's."""
    r = job.request
    opening = opening_clause_min_words if r.get("sentence_seq") == 0 else 0
    return {"text": r["text"], "language": r["language"], "voice": r["voice"], "speed": float(r.get("speed") or 1.0),
            "first_clause_min_words": opening}
