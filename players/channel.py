"""One connected player on the edge: its bounded outbox of frames (`ClientChannel`, `OutFrame`),
the slow-client rules applied to it (skip the oldest sentence when full, close a sender that
stalls), the rate limits of what it sends, and why it was closed (`ClientClosed`).

`voicebus.players.router.SessionRouter` owns the channels and fills them; the edge's sender task
(`voicebus.players.edge`) drains each one to its socket. The clock is passed in.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from voicebus.clock import now_us
from voicebus.players import protocol
from voicebus.players.metrics import EdgeMetrics
from voicebus.ratelimit import TokenBucket


class ClientClosed(Exception):
    """The channel was closed by the edge; `code` and `reason` say why."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code} {reason}")
        self.code, self.reason = code, reason


@dataclass
class OutFrame:
    """One queued frame. Audio frames carry their turn/sentence so they can be dropped by cancel
    or skip, the consume time for the overhead metric, and (first chunk of a sentence) the
    timeline that is sent right after them and the chunk's trace context (opaque here: the
    edge's ``on_timeline_sent`` hook records the send, `voicebus.tracing`)."""

    payload: bytes | str
    turn_id: str | None = None
    sentence: int = -1
    consumed_ns: int = 0
    timeline: dict | None = None
    trace: Any = None
    # the frame as the socket sends it (with its timeline, if any, right after), built once and
    # shared by every client of the session; None: it goes through the sender only
    wire: bytes | None = None
    sent_at_us: int = 0  # the timeline's sent_at_us, when `wire` carries one

    @property
    def is_audio(self) -> bool:
        return isinstance(self.payload, bytes)


class ClientChannel:
    """A connected player: its bounded outbox and its per-connection state. ``clock`` (monotonic
    seconds, the router's) times the stall rule and the cancel rate limit."""

    def __init__(self, client_id: str, session_id: str, max_frames: int, stall_timeout_s: float, metrics: EdgeMetrics,
                 cancel_bucket: TokenBucket | None = None, clock: Callable[[], float] = time.monotonic,
                 message_bucket: TokenBucket | None = None):
        self.client_id, self.session_id = client_id, session_id
        self.clock = clock
        # the client's cancels: a listen-only client cannot flood the bus (docs/edge.md, "Bounds")
        self.cancel_bucket = cancel_bucket or TokenBucket(2.0, 5, clock)
        # its reports and pings: each costs the edge work (a report is published on the bus)
        self.message_bucket = message_bucket or TokenBucket(20.0, 50, clock)
        self.max_frames, self.stall_timeout_s = max_frames, stall_timeout_s
        self.metrics = metrics
        self.outbox: deque[OutFrame] = deque()
        self.announced_turns: set[str] = set()
        self.skipped: set[tuple[str, int]] = set()
        self.closed: ClientClosed | None = None
        self.last_progress = clock()
        self.on_close: Callable[[], Any] | None = None  # the edge: interrupt a sender blocked on the socket
        # the edge (tracing on): told (frame, sent_at_us) once a sentence's first audio and timeline went out
        self.on_timeline_sent: Callable[[OutFrame, int], Any] | None = None
        # the edge: write these bytes to the socket if it takes them at once (True), else leave
        # them (False); set, frames with a wire form skip the outbox while the player keeps up
        self.write_now: Callable[[bytes], bool] | None = None
        self._sending = False  # the sender task holds a frame it has not finished sending
        self._held: list[OutFrame] | None = None  # the frames of one fan-out (`hold` .. `release`)
        self._wakeup = asyncio.Event()

    # --- producer side (the router) -------------------------------------------------------
    def push(self, frame: OutFrame, front: bool = False) -> None:
        if self.closed:
            return
        if frame.is_audio and (frame.turn_id, frame.sentence) in self.skipped:
            self.metrics.drops.labels("skipped-sentence").inc()
            return
        if (frame.wire is not None and not front and not self.outbox and not self._sending
                and self.write_now is not None):
            # Nothing waits for this player and its sender is idle: the frame goes to the socket
            # now (nothing is ahead of it, so the order holds), without waking the sender.
            if self._held is not None:
                self._held.append(frame)
                return
            if self._write([frame]) is not None:
                return
        elif self._held:
            self._queue_held()  # what was held is older than this frame
        self._enqueue(frame, front)

    def hold(self) -> None:
        """Frames that would be written now wait for `release` and go out in one write (one
        chunk's turn start, words, audio, timeline and turn end: one system call, not five)."""
        if self._held is None:
            self._held = []

    def release(self) -> int:
        """Write the frames held since `hold`; queued instead when the socket is busy now.
        Returns how many audio frames were written, for the caller to observe together
        (`EdgeMetrics.observe_sent_many`)."""
        held, self._held = self._held, None
        if not held or self.closed:
            return 0
        if not self.outbox and not self._sending:
            written = self._write(held, observe=False)
            if written is not None:
                return written
        for frame in held:
            self._enqueue(frame)
        return 0

    def _queue_held(self) -> None:
        held, self._held = self._held or [], []
        for frame in held:
            self._enqueue(frame)

    def _write(self, frames: list[OutFrame], observe: bool = True) -> int | None:
        """Hand `frames` (with wire forms) to the socket at once: None when it would not take them,
        else how many audio frames went (observed here unless `observe` is False)."""
        assert self.write_now is not None
        if not self.write_now(frames[0].wire if len(frames) == 1 else b"".join(f.wire for f in frames)):
            return None
        audio = 0
        for frame in frames:
            if frame.is_audio and frame.consumed_ns:
                audio += 1
                if observe:
                    self.metrics.observe_sent((time.perf_counter_ns() - frame.consumed_ns) / 1e9)
            if frame.timeline is not None and self.on_timeline_sent is not None:
                self.on_timeline_sent(frame, frame.sent_at_us)
        self.last_progress = self.clock()
        return audio

    def _enqueue(self, frame: OutFrame, front: bool = False) -> None:
        if self.closed:
            return
        if self.outbox and self.clock() - self.last_progress > self.stall_timeout_s:
            self.close(protocol.CLOSE_TOO_SLOW, f"client made no progress for {self.stall_timeout_s:g} s")
            return
        if len(self.outbox) >= self.max_frames:
            self._skip_oldest_sentence()
        if len(self.outbox) >= self.max_frames:  # nothing left to skip: only control frames wait
            self.close(protocol.CLOSE_TOO_SLOW, f"client outbox full ({self.max_frames} frames)")
            return
        if not self.outbox:
            # The stall clock runs only while frames wait: an idle client (nothing to send for
            # a while, e.g. between turns) has made no progress because none was possible.
            self.last_progress = self.clock()
        if front:
            self.outbox.appendleft(frame)
        else:
            self.outbox.append(frame)
        self._wakeup.set()

    def _skip_oldest_sentence(self) -> None:
        oldest = next(((f.turn_id, f.sentence) for f in self.outbox if f.is_audio), None)
        if oldest is None:
            return
        kept = deque(f for f in self.outbox if not (f.is_audio and (f.turn_id, f.sentence) == oldest))
        self.metrics.drops.labels("slow-client").inc(len(self.outbox) - len(kept))
        self.outbox = kept
        self.skipped.add(oldest)
        if len(self.skipped) > 1024:  # bounded: old entries only matter while their turn streams
            self.skipped.pop()
        self.outbox.append(OutFrame(protocol.encode_control(protocol.SKIP, turn_id=oldest[0], sentence_seq=oldest[1])))

    def drop_turn(self, turn_id: str | None) -> int:
        """Drop queued audio of `turn_id` (None: all audio); returns how many frames."""
        before = len(self.outbox)
        self.outbox = deque(f for f in self.outbox if not (f.is_audio and (turn_id is None or f.turn_id == turn_id)))
        return before - len(self.outbox)

    def close(self, code: int, reason: str) -> None:
        if self.closed is None:
            self.closed = ClientClosed(code, reason)
            self.metrics.disconnects.labels(reason.split(" ")[0] if code != protocol.CLOSE_TOO_SLOW else "too-slow").inc()
            self.outbox.clear()
            self._wakeup.set()
            if self.on_close is not None:
                self.on_close()

    # --- consumer side (the sender task) --------------------------------------------------
    async def next_frame(self) -> OutFrame:
        """The next frame to send; raises `ClientClosed` once the edge closed this channel."""
        while True:
            if self.closed:
                raise self.closed
            if self.outbox:
                return self.outbox.popleft()
            self._wakeup.clear()
            await self._wakeup.wait()

    async def run_sender(self, send_bytes: Callable[[bytes], Awaitable[Any]], send_str: Callable[[str], Awaitable[Any]]) -> None:
        """Drain the outbox into the socket until closed (raises `ClientClosed`)."""
        while True:
            frame = await self.next_frame()
            self._sending = True  # until it is sent, a new frame queues behind it
            try:
                if frame.is_audio:
                    await send_bytes(frame.payload)
                    if frame.consumed_ns:
                        self.metrics.observe_sent((time.perf_counter_ns() - frame.consumed_ns) / 1e9)
                    if frame.timeline is not None:
                        sent_at_us = now_us()
                        await send_str(protocol.encode_control(protocol.TIMELINE, **frame.timeline, sent_at_us=sent_at_us))
                        if self.on_timeline_sent is not None:
                            self.on_timeline_sent(frame, sent_at_us)
                else:
                    await send_str(frame.payload)
            finally:
                self._sending = False
            self.last_progress = self.clock()
