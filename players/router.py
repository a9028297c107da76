"""The edge's pure core: which client gets which audio, in which order, and what is dropped.

`SessionRouter` is fed decoded AudioChunks and ControlEvents (by the Kafka shell in
`players.edge`, or directly by tests and the benchmark) and the clients' cancels. It keeps:

* per session: the turns it has seen (a small per-session turn number for the binary header) and a
  bounded **replay buffer** of the active turn, so a client that reconnects mid-turn gets the rest
  of the turn from the start of a sentence (see `docs/edge.md`);
* per client: a `ClientChannel`, a bounded outbox of frames drained by one sender task.

Slow-client policy (**skip to the next sentence, then disconnect**): when a client's outbox is
full, the oldest sentence in it is dropped whole (its queued frames and its later chunks), and the
client gets a ``skip`` message; a client whose sender has made no progress for
`stall_timeout_s` while frames wait is closed with 4429. Memory per client is therefore bounded
by the outbox size, whatever the client does.

Control overtakes data: a cancel removes the turn's queued audio from every outbox of the
session and puts ``stop`` at the head of each outbox.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

from pipeline.cancel import CancelRegistry
from pipeline.clock import now_us
from players import protocol
from players.metrics import EdgeMetrics
from schemas.contract import AudioEncoding, ControlAction

TIMELINE_FIELDS = (
    "first_token_at_us", "text_complete_at_us", "released_at_us", "request_received_at_us",
    "synthesis_started_at_us", "audio_ready_at_us", "published_at_us",
)


class UnroutableChunk(ValueError):
    """A decoded AudioChunk the edge cannot turn into an audio frame (odd PCM16 length, unknown
    encoding). The Kafka shell dead-letters it; nothing is queued."""

    reason = "unroutable-chunk"


class ClientClosed(Exception):
    """The channel was closed by the edge; `code` and `reason` say why."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code} {reason}")
        self.code, self.reason = code, reason


@dataclass
class OutFrame:
    """One queued frame. Audio frames carry their turn/sentence so they can be dropped by cancel
    or skip, the consume time for the overhead metric, and (first chunk of a sentence) the
    timeline that is sent right after them."""

    payload: bytes | str
    turn_id: str | None = None
    sentence: int = -1
    consumed_ns: int = 0
    timeline: dict | None = None

    @property
    def is_audio(self) -> bool:
        return isinstance(self.payload, bytes)


class ClientChannel:
    """A connected player: its bounded outbox and its per-connection state."""

    def __init__(self, client_id: str, session_id: str, max_frames: int, stall_timeout_s: float, metrics: EdgeMetrics):
        self.client_id, self.session_id = client_id, session_id
        self.max_frames, self.stall_timeout_s = max_frames, stall_timeout_s
        self.metrics = metrics
        self.outbox: deque[OutFrame] = deque()
        self.announced_turns: set[str] = set()
        self.skipped: set[tuple[str, int]] = set()
        self.closed: ClientClosed | None = None
        self.last_progress = time.monotonic()
        self.on_close: Callable[[], Any] | None = None  # the edge: interrupt a sender blocked on the socket
        self._wakeup = asyncio.Event()

    # --- producer side (the router) -------------------------------------------------------
    def push(self, frame: OutFrame, front: bool = False) -> None:
        if self.closed:
            return
        if frame.is_audio and (frame.turn_id, frame.sentence) in self.skipped:
            self.metrics.drops.labels("skipped-sentence").inc()
            return
        if self.outbox and time.monotonic() - self.last_progress > self.stall_timeout_s:
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
            self.last_progress = time.monotonic()
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
            if frame.is_audio:
                await send_bytes(frame.payload)
                if frame.consumed_ns:
                    self.metrics.observe_sent((time.perf_counter_ns() - frame.consumed_ns) / 1e9)
                if frame.timeline is not None:
                    await send_str(protocol.encode_control(protocol.TIMELINE, **frame.timeline, sent_at_us=now_us()))
            else:
                await send_str(frame.payload)
            self.last_progress = time.monotonic()


@dataclass
class _Turn:
    turn_id: str
    number: int
    started_at_us: int | None
    sample_rate: int
    ended: bool = False
    stopped: bool = False
    # replay buffer: (sentence_seq, encoded frame), in arrival order
    replay: deque = field(default_factory=deque)


@dataclass
class _Session:
    turns: "OrderedDict[str, _Turn]" = field(default_factory=OrderedDict)
    clients: dict[str, ClientChannel] = field(default_factory=dict)
    turn_numbers: Iterable[int] = field(default_factory=lambda: itertools.count(1))


class SessionRouter:
    """Routes chunks to the clients of their session; owns cancel state and replay buffers."""

    def __init__(
        self,
        metrics: EdgeMetrics | None = None,
        client_queue_frames: int = 256,
        replay_frames: int = 512,
        stall_timeout_s: float = 10.0,
        max_sessions: int = 10_000,
        turns_per_session: int = 4,
    ) -> None:
        self.metrics = metrics or EdgeMetrics()
        self.cancels = CancelRegistry()
        self.client_queue_frames, self.replay_frames = client_queue_frames, replay_frames
        self.stall_timeout_s, self.max_sessions, self.turns_per_session = stall_timeout_s, max_sessions, turns_per_session
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._client_ids = itertools.count(1)

    # --- sessions and clients -------------------------------------------------------------
    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session()
            self._evict_sessions()
        self._sessions.move_to_end(session_id)
        return session

    def _evict_sessions(self) -> None:
        if len(self._sessions) <= self.max_sessions:
            return
        for sid in [s for s, st in self._sessions.items() if not st.clients][: len(self._sessions) - self.max_sessions]:
            del self._sessions[sid]
        self.metrics.sessions.set(len(self._sessions))

    def connect(self, session_id: str, resume: dict | None = None) -> ClientChannel:
        """Attach a new client to `session_id`; queue the rest of the active turn for it.

        `resume` = {"turn_id", "sentence_seq"} (what the player was playing when it lost the
        connection): replay that turn from the start of that sentence. Without it: every turn
        that has not ended, from the earliest sentence still buffered."""
        session = self._session(session_id)
        channel = ClientChannel(
            f"c{next(self._client_ids)}", session_id, self.client_queue_frames, self.stall_timeout_s, self.metrics
        )
        session.clients[channel.client_id] = channel
        self.metrics.clients.inc()
        self.metrics.sessions.set(len(self._sessions))
        for turn in session.turns.values():
            if self.cancels.is_cancelled(session_id, turn.turn_id):
                continue
            if resume and resume.get("turn_id") == turn.turn_id:
                from_sentence = int(resume.get("sentence_seq") or 0)
            elif not turn.ended:
                from_sentence = 0
            else:
                continue
            frames = [(s, f) for s, f in turn.replay if s >= from_sentence]
            if not frames:
                continue
            self._announce(channel, turn)
            for sentence, frame in frames:
                channel.push(OutFrame(frame, turn.turn_id, sentence))
            if turn.ended:
                channel.push(OutFrame(protocol.encode_control(protocol.TURN_END, turn_id=turn.turn_id, turn=turn.number)))
        return channel

    def disconnect(self, channel: ClientChannel) -> None:
        session = self._sessions.get(channel.session_id)
        if session is not None and session.clients.pop(channel.client_id, None) is not None:
            self.metrics.clients.dec()
        channel.close(protocol.CLOSE_NORMAL, "disconnected")

    def clients_of(self, session_id: str) -> list[ClientChannel]:
        session = self._sessions.get(session_id)
        return list(session.clients.values()) if session else []

    def active_turns(self, session_id: str) -> list[str]:
        session = self._sessions.get(session_id)
        return [t.turn_id for t in session.turns.values() if not t.ended] if session else []

    def turn_started_at(self, session_id: str, turn_id: str) -> int | None:
        session = self._sessions.get(session_id)
        turn = session.turns.get(turn_id) if session else None
        return turn.started_at_us if turn else None

    def update_queue_gauges(self) -> None:
        depths = [len(c.outbox) for s in self._sessions.values() for c in s.clients.values()]
        self.metrics.queue_depth.set(sum(depths))
        self.metrics.queue_depth_max.set(max(depths, default=0))

    # --- data -----------------------------------------------------------------------------
    def _announce(self, channel: ClientChannel, turn: _Turn) -> None:
        if turn.turn_id not in channel.announced_turns:
            channel.announced_turns.add(turn.turn_id)
            if len(channel.announced_turns) > 64:
                channel.announced_turns.pop()
            channel.push(OutFrame(protocol.encode_control(
                protocol.TURN_START, turn_id=turn.turn_id, turn=turn.number, sample_rate=turn.sample_rate
            )))

    def route(self, chunk: dict, consumed_ns: int | None = None, edge_received_at_us: int | None = None) -> int:
        """Queue one decoded AudioChunk for the clients of its session; returns how many got it."""
        consumed_ns = consumed_ns or time.perf_counter_ns()
        edge_received_at_us = edge_received_at_us or now_us()
        session_id, turn_id = chunk["session_id"], chunk["turn_id"]
        started = chunk.get("first_token_at_us") or None
        if len(chunk["pcm"]) % 2 or chunk.get("encoding", AudioEncoding.PCM16LE) not in protocol.ENCODINGS:
            raise UnroutableChunk(
                f"chunk {session_id}/{turn_id}/{chunk['sentence_seq']}/{chunk['chunk_seq']}: "
                f"{len(chunk['pcm'])} bytes of {chunk.get('encoding')} is not whole PCM16LE samples"
            )
        # Only chunks the edge accepts count in the latency histograms: a rejected one says nothing
        # about the pipeline's speed and would skew the per-stage counts.
        self.metrics.observe_chunk(chunk, edge_received_at_us)
        self.cancels.observe(session_id, turn_id)  # a later session cancel covers it
        if self.cancels.is_cancelled(session_id, turn_id):
            self.metrics.drops.labels("cancelled").inc()
            return 0
        session = self._session(session_id)
        turn = session.turns.get(turn_id)
        if turn is None:
            turn = session.turns[turn_id] = _Turn(turn_id, next(session.turn_numbers), started, chunk.get("sample_rate", 24000))
            while len(session.turns) > self.turns_per_session:
                session.turns.popitem(last=False)
        elif turn.ended:
            self.metrics.drops.labels("after-turn-end").inc()
            return 0
        flags = (
            (protocol.FLAG_LAST_IN_SENTENCE if chunk["is_last_chunk"] else 0)
            | (protocol.FLAG_LAST_IN_TURN if chunk.get("is_last_in_turn") else 0)
            | (protocol.FLAG_FIRST_IN_SENTENCE if chunk["chunk_seq"] == 0 else 0)
        )
        frame = protocol.encode_audio(protocol.AudioFrame(
            turn.number, chunk["sentence_seq"], chunk["chunk_seq"], chunk.get("sample_rate", 24000), chunk["pcm"], flags,
            protocol.ENCODINGS[chunk.get("encoding", AudioEncoding.PCM16LE)],
        ))
        turn.replay.append((chunk["sentence_seq"], frame))
        self._trim_replay(turn)
        timeline = None
        if chunk["chunk_seq"] == 0:
            timeline = {"turn_id": turn_id, "turn": turn.number, "sentence_seq": chunk["sentence_seq"],
                        **{k: chunk.get(k, 0) for k in TIMELINE_FIELDS}, "edge_received_at_us": edge_received_at_us}
        for channel in session.clients.values():
            self._announce(channel, turn)
            channel.push(OutFrame(frame, turn_id, chunk["sentence_seq"], consumed_ns, timeline))
        if chunk.get("is_last_in_turn"):
            turn.ended = True
            end = protocol.encode_control(protocol.TURN_END, turn_id=turn_id, turn=turn.number)
            for channel in session.clients.values():
                channel.push(OutFrame(end))
        self._reap_closed(session)
        return len(session.clients)

    def _trim_replay(self, turn: _Turn) -> None:
        # Bounded: past the cap, the oldest *whole* sentence goes, so a replay always starts at
        # a sentence boundary.
        while len(turn.replay) > self.replay_frames:
            oldest = turn.replay[0][0]
            while turn.replay and turn.replay[0][0] == oldest:
                turn.replay.popleft()

    def _reap_closed(self, session: _Session) -> None:
        for cid in [cid for cid, c in session.clients.items() if c.closed]:
            del session.clients[cid]
            self.metrics.clients.dec()

    # --- control --------------------------------------------------------------------------
    def cancel(self, session_id: str, turn_id: str | None, turn_ids: list[str] | tuple[str, ...] = (),
               source: str = "bus") -> int:
        """Apply a cancel (one turn, the listed turns, or every turn of the session seen so far):
        later chunks of the turn(s) are dropped, queued audio goes now and every client of the
        session is told to stop. Returns the number of frames dropped."""
        self.cancels.cancel(session_id, turn_id, turn_ids)
        self.metrics.cancels.labels(source).inc()
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        # Not yet stopped only: the edge's own cancel comes back from the bus, stop once.
        hit = [t for t in session.turns.values()
               if not t.stopped and self.cancels.is_cancelled(session_id, t.turn_id)]
        dropped = 0
        for turn in hit:
            turn.replay.clear()
            turn.ended = turn.stopped = True
        for channel in session.clients.values():
            for turn in hit:
                dropped += channel.drop_turn(turn.turn_id)
                channel.push(OutFrame(protocol.encode_control(
                    protocol.STOP, turn_id=turn.turn_id, turn=turn.number, reason="cancel")), front=True)
        self.metrics.drops.labels("cancelled").inc(dropped)
        return dropped

    def apply_control(self, event: dict) -> int:
        if event.get("action") != ControlAction.CANCEL:
            return 0
        return self.cancel(event["session_id"], event.get("turn_id"), event.get("turn_ids") or (),
                           source=event.get("source") or "bus")
