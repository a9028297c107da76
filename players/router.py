"""The edge's pure core: which client gets which audio, in which order, and what is dropped.

`SessionRouter` is fed decoded AudioChunks and ControlEvents (by the Kafka shell in
`voicebus.players.edge`, or directly by tests and the benchmark) and the clients' cancels. It keeps state
only for the sessions this edge serves (a client attached now, or within the grace window after
the last one left); chunks of any other session are counted and dropped unframed. For those:

* per session: the turns it has seen (a small per-session turn number for the binary header) and a
  bounded **replay buffer** of its recent turns, so a client that reconnects mid-turn gets the
  rest of the turn from the start of a sentence (see `docs/edge.md`); all replay buffers together
  stay under a byte limit;
* per turn: what was forwarded, so each (turn, sentence_seq, chunk_seq) reaches a client once;
* per client: a `voicebus.players.channel.ClientChannel`, a bounded outbox of frames drained
  by one sender task, and a token bucket for its cancels. Connections per edge and per session are limited
  (`ConnectionRefused`).

Fan-out: a chunk's frame, its control messages and their wire form (`SessionRouter.wire`, set by
the edge: the WebSocket frame) are built once per chunk and shared by every client of the
session. A client whose outbox is empty, whose sender is idle and whose socket takes bytes at once
gets the chunk's frames written to its socket in one write, without waking its sender task
(`ClientChannel.write_now`); any other client queues them in its outbox as before.

Slow-client policy (**skip to the next sentence, then disconnect**): when a client's outbox is
full, the oldest sentence in it is dropped whole (its queued frames and its later chunks), and the
client gets a ``skip`` message; a client whose sender has made no progress for
`stall_timeout_s` while frames wait is closed with 4429. Memory per client is therefore bounded
by the outbox size, whatever the client does.

Control overtakes data: a cancel removes the turn's queued audio from every outbox of the
session and puts ``stop`` at the head of each outbox.

Size: about 610 lines, most of them the one `SessionRouter`: sessions, turns, the replay buffers,
cancels and the fan-out decide on the same per-session state, which is the edge's pure core. One
player's outbox is `voicebus.players.channel`; what was heard, `voicebus.players.heard`.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from voicebus.cancel import CancelRegistry
from voicebus.clock import now_us
from voicebus.players import protocol
from voicebus.players.heard import HeardTracker
from voicebus.players.channel import ClientChannel, OutFrame
from voicebus.players.metrics import EdgeMetrics
from voicebus.ratelimit import TokenBucket
from voicebus.schemas.contract import CANCEL_SOURCES, LIMITS, metric_label
from voicebus.schemas.messages import AudioChunk, ControlEvent

TIMELINE_FIELDS = (
    "first_token_at_us", "text_complete_at_us", "released_at_us", "request_received_at_us",
    "synthesis_started_at_us", "audio_ready_at_us", "published_at_us",
)


DEFERRED_STOP_S = 5.0  # a preempted turn stops at the latest this long after its cut reached the edge


class UnroutableChunk(ValueError):
    """A decoded AudioChunk the edge cannot turn into an audio frame (odd PCM16 length, unknown
    encoding). The Kafka shell dead-letters it; nothing is queued."""

    reason = "unroutable-chunk"


class ConnectionRefused(Exception):
    """A new client the edge will not serve now (a connection limit). `code` is the error code the
    client gets; it is closed with 1013 (try again later)."""

    close_code = protocol.CLOSE_TRY_AGAIN_LATER

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# A sentence whose last chunk was forwarded: every later copy of it is a duplicate.
SENTENCE_DONE = 2**31
# Sentences per turn whose forwarded high-water mark is remembered; older ones count as done.
TRACKED_SENTENCES = 1024


@dataclass
class _Turn:
    turn_id: str
    number: int
    started_at_us: int | None
    sample_rate: int
    ended: bool = False
    stopped: bool = False
    end_reason: str = ""
    # replay buffer: (sentence_seq, encoded frame), in arrival order
    replay: deque = field(default_factory=deque)
    replay_bytes: int = 0
    session_id: str = ""
    # once-only delivery: per sentence, the highest chunk_seq forwarded (SENTENCE_DONE after its
    # last chunk); sentences below `done_below` are all done (the map is bounded).
    forwarded: dict[int, int] = field(default_factory=dict)
    done_below: int = 0
    start_frame: OutFrame | None = None  # its turn_start message, built once for all its clients

    def high_water(self, sentence: int) -> int:
        return SENTENCE_DONE if sentence < self.done_below else self.forwarded.get(sentence, -1)

    def mark(self, sentence: int, chunk: int, last: bool) -> None:
        self.forwarded[sentence] = SENTENCE_DONE if last else chunk
        while len(self.forwarded) > TRACKED_SENTENCES:
            oldest = min(self.forwarded)
            del self.forwarded[oldest]
            self.done_below = max(self.done_below, oldest + 1)


@dataclass
class _Session:
    turns: "OrderedDict[str, _Turn]" = field(default_factory=OrderedDict)
    clients: dict[str, ClientChannel] = field(default_factory=dict)
    turn_numbers: Iterable[int] = field(default_factory=lambda: itertools.count(1))


class SessionRouter:
    """Routes chunks to the clients of their session; owns cancel state and replay buffers.

    It keeps state (turns, frames, replay) only for the sessions it *serves*: a client is attached
    now, or left less than `grace_s` ago (for a reconnect with resume). Chunks of any other
    session are counted and dropped without being framed. ``clock`` (monotonic seconds) is
    injectable: the grace window, the stall rule and the cancel rate limit are tested without waiting.
    """

    def __init__(
        self,
        metrics: EdgeMetrics | None = None,
        client_queue_frames: int = 256,
        replay_frames: int = 512,
        stall_timeout_s: float = 10.0,
        max_sessions: int = 10_000,
        turns_per_session: int = 4,
        *,
        replay_max_bytes: int = 64 * 1024 * 1024,
        grace_s: float = 30.0,
        max_clients: int = 1000,
        max_clients_per_session: int = 8,
        cancel_rate_per_s: float = 2.0,
        cancel_burst: int = 5,
        message_rate_per_s: float = 20.0,
        message_burst: int = 50,
        heard_wait_ms: int = 500,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics or EdgeMetrics()
        self.heard = HeardTracker(wait_us=heard_wait_ms * 1000)
        self.cancels = CancelRegistry()
        self.client_queue_frames, self.replay_frames = client_queue_frames, replay_frames
        self.stall_timeout_s, self.max_sessions, self.turns_per_session = stall_timeout_s, max_sessions, turns_per_session
        self.replay_max_bytes, self.grace_s = replay_max_bytes, grace_s
        self.max_clients, self.max_clients_per_session = max_clients, max_clients_per_session
        self.awaiting_hello = 0  # sockets accepted that have not said hello yet (counted against max_clients)
        self.cancel_rate_per_s, self.cancel_burst = cancel_rate_per_s, cancel_burst
        self.message_rate_per_s, self.message_burst = message_rate_per_s, message_burst
        self.clock = clock
        # the edge: a message (bytes: audio, str: control) as its sockets send it (a WebSocket
        # frame); set, each frame of a fan-out is framed once and may be written at once (`ClientChannel`)
        self.wire: Callable[[bytes | str], bytes] | None = None
        self.replay_bytes = 0  # all replay buffers together
        # turns holding replay frames, least recently appended to first: the byte limit's eviction order
        self._replaying: OrderedDict[tuple[str, str], _Turn] = OrderedDict()
        self.n_clients = 0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently active first
        self._idle: OrderedDict[str, float] = OrderedDict()  # sessions without a client -> since when
        self._client_ids = itertools.count(1)
        # Preemptions waiting for the new turn's first audio (the floor): (session, new turn) ->
        # the turns to stop then, and the deadline (clock seconds) after which they stop anyway.
        self._deferred_stops: OrderedDict[tuple[str, str], tuple[list[str], float]] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: Any, metrics: EdgeMetrics | None = None, **overrides: Any) -> "SessionRouter":
        """A router with the edge's bounds from `Settings` (docs/edge.md, "Bounds")."""
        values: dict[str, Any] = dict(
            client_queue_frames=settings.client_queue_frames, replay_frames=2 * settings.client_queue_frames,
            replay_max_bytes=settings.edge_replay_max_bytes, grace_s=settings.edge_session_grace_s,
            max_clients=settings.edge_max_clients, max_clients_per_session=settings.edge_max_clients_per_session,
            cancel_rate_per_s=settings.edge_cancel_rate_per_s, cancel_burst=settings.edge_cancel_burst,
            message_rate_per_s=settings.edge_message_rate_per_s, message_burst=settings.edge_message_burst,
            heard_wait_ms=settings.edge_heard_wait_ms,
        )
        values.update(overrides)
        return cls(metrics, **values)

    # --- sessions and clients -------------------------------------------------------------
    def served(self, session_id: str) -> bool:
        """Whether this edge keeps state for `session_id` (a client now or within the grace window)."""
        self._expire_idle()
        return session_id in self._sessions

    def _expire_idle(self) -> None:
        now = self.clock()
        while self._idle:
            session_id, since = next(iter(self._idle.items()))
            if now - since < self.grace_s and len(self._idle) <= self.max_sessions:
                return
            self._drop_session(session_id)

    def _drop_session(self, session_id: str) -> None:
        self._idle.pop(session_id, None)
        session = self._sessions.pop(session_id, None)
        if session is not None:
            for turn in session.turns.values():
                self._clear_replay(turn)
        self.metrics.sessions.set(len(self._sessions))

    def connect(self, session_id: str, resume: dict | None = None) -> ClientChannel:
        """Attach a new client to `session_id`; queue the rest of the active turn for it.

        `resume` = {"turn_id", "sentence_seq"} (what the player was playing when it lost the
        connection): replay that turn from the start of that sentence; with ``"finished": true``
        the player had heard that turn to its end, and the turn itself is not sent again. Either
        way every turn that came after it (in the order this edge routed their first audio) is
        sent whole, ended or not: a turn published and ended while the player had no connection
        (its edge had died) is its to hear. Without `resume`, or one naming a turn this edge
        keeps nothing of: every turn that has not ended, from the earliest sentence still
        buffered. Raises `ConnectionRefused` when this edge or this session has as many clients
        as it may."""
        self._expire_idle()
        if self.n_clients >= self.max_clients:
            self.metrics.disconnects.labels("edge-full").inc()
            raise ConnectionRefused("edge-full", f"this edge serves {self.max_clients} players already")
        session = self._sessions.get(session_id)
        if session is not None and len(session.clients) >= self.max_clients_per_session:
            self.metrics.disconnects.labels("session-full").inc()
            raise ConnectionRefused("session-full", f"session has {self.max_clients_per_session} players on this edge already")
        if session is None:
            session = self._sessions[session_id] = _Session()
        self._sessions.move_to_end(session_id)
        self._idle.pop(session_id, None)
        channel = ClientChannel(
            f"c{next(self._client_ids)}", session_id, self.client_queue_frames, self.stall_timeout_s, self.metrics,
            cancel_bucket=TokenBucket(self.cancel_rate_per_s, self.cancel_burst, self.clock), clock=self.clock,
            message_bucket=TokenBucket(self.message_rate_per_s, self.message_burst, self.clock),
        )
        session.clients[channel.client_id] = channel
        self.n_clients += 1
        self.metrics.clients.inc()
        self.metrics.sessions.set(len(self._sessions))
        turns = list(session.turns.values())
        anchor = next((i for i, t in enumerate(turns) if resume and t.turn_id == resume.get("turn_id")), None)
        for i, turn in enumerate(turns):
            if turn.stopped or self.cancels.is_cancelled(session_id, turn.turn_id):
                continue
            if i == anchor:
                if resume.get("finished"):
                    continue  # heard to its end already
                from_sentence = int(resume.get("sentence_seq") or 0)
            elif anchor is not None and i > anchor:
                from_sentence = 0  # came after the turn the player was on: all of it, even if it ended
            elif not turn.ended:
                from_sentence = 0
            else:
                continue
            frames = [(s, f) for s, f in turn.replay if s >= from_sentence]
            if not frames and not turn.ended:
                continue
            self._announce(channel, turn)
            for sentence, frame in frames:
                channel.push(OutFrame(frame, turn.turn_id, sentence))
            if turn.ended:
                channel.push(OutFrame(self._turn_end(turn)))
        return channel

    def hold(self, session_id: str) -> bool:
        """Keep state for `session_id` from now on, as if its last player had just left (its grace
        window starts now), so the chunks routed next are framed and kept for replay: what the edge
        does before it re-reads the audio of a session that moved here, for a player that resumes.
        Returns False when the session had state already."""
        self._expire_idle()
        if session_id in self._sessions:
            return False
        self._sessions[session_id] = _Session()
        self._idle[session_id] = self.clock()
        self.metrics.sessions.set(len(self._sessions))
        return True

    def move_out(self, moved: Callable[[str], bool], reason: str = "moved") -> list[ClientChannel]:
        """Sessions this edge no longer owns (`moved(session_id)`): each of their players is closed
        with 1012 (the sender tells it to reconnect first) and their state is forgotten: the new
        owner serves them. Returns the closed channels."""
        closed: list[ClientChannel] = []
        for session_id in [sid for sid in self._sessions if moved(sid)]:
            session = self._sessions[session_id]
            for channel in list(session.clients.values()):
                channel.close(protocol.CLOSE_SERVICE_RESTART, reason)
                closed.append(channel)
            for _ in list(session.clients):
                self.n_clients -= 1
                self.metrics.clients.dec()
            session.clients.clear()
            self._drop_session(session_id)
        return closed

    def disconnect(self, channel: ClientChannel) -> None:
        session = self._sessions.get(channel.session_id)
        if session is not None and session.clients.pop(channel.client_id, None) is not None:
            self._client_left(channel.session_id, session)
        channel.close(protocol.CLOSE_NORMAL, "disconnected")

    def _client_left(self, session_id: str, session: _Session) -> None:
        self.n_clients -= 1
        self.metrics.clients.dec()
        if not session.clients:  # the grace window for a reconnect starts now
            self._idle[session_id] = self.clock()
            self._idle.move_to_end(session_id)

    def outboxes_empty(self) -> bool:
        """No frame waits in any client's outbox (each sender has taken all it was given)."""
        return not self.outbox_sizes()

    def outbox_sizes(self) -> dict[str, int]:
        """Client id -> frames waiting in its outbox, for the clients with any."""
        return {c.client_id: len(c.outbox) for session in self._sessions.values()
                for c in session.clients.values() if c.outbox}

    def clients_of(self, session_id: str) -> list[ClientChannel]:
        session = self._sessions.get(session_id)
        return list(session.clients.values()) if session else []

    def active_turns(self, session_id: str) -> list[str]:
        session = self._sessions.get(session_id)
        return [t.turn_id for t in session.turns.values() if not t.ended] if session else []

    def known_turns(self, session_id: str) -> list[str]:
        """The ids of the turns of `session_id` this edge holds (newest last)."""
        session = self._sessions.get(session_id)
        return list(session.turns) if session else []

    def players_of_turn(self, session_id: str, turn_id: str) -> list[str]:
        """The ids of the session's connected players the turn was sent to."""
        return [c.client_id for c in self.clients_of(session_id) if turn_id in c.announced_turns and not c.closed]

    def turn_started_at(self, session_id: str, turn_id: str) -> int | None:
        session = self._sessions.get(session_id)
        turn = session.turns.get(turn_id) if session else None
        return turn.started_at_us if turn else None

    def update_queue_gauges(self) -> None:
        self._expire_idle()
        depths = [len(c.outbox) for s in self._sessions.values() for c in s.clients.values()]
        self.metrics.queue_depth.set(sum(depths))
        self.metrics.queue_depth_max.set(max(depths, default=0))
        self.metrics.replay_bytes.set(self.replay_bytes)

    # --- data -----------------------------------------------------------------------------
    def _message(self, payload: str) -> OutFrame:
        """A control message for any number of clients, in its wire form too when the edge set one."""
        return OutFrame(payload, wire=self.wire(payload) if self.wire is not None else None)

    def _announce(self, channel: ClientChannel, turn: _Turn) -> None:
        if turn.turn_id not in channel.announced_turns:
            channel.announced_turns.add(turn.turn_id)
            if len(channel.announced_turns) > 64:
                channel.announced_turns.pop()
            if turn.start_frame is None:  # one message for every client of the turn
                turn.start_frame = self._message(protocol.encode_control(
                    protocol.TURN_START, turn_id=turn.turn_id, turn=turn.number, sample_rate=turn.sample_rate))
            channel.push(turn.start_frame)

    @staticmethod
    def _turn_end(turn: _Turn) -> str:
        fields: dict[str, Any] = {"turn_id": turn.turn_id, "turn": turn.number}
        if turn.end_reason:
            fields["reason"] = turn.end_reason
        return protocol.encode_control(protocol.TURN_END, **fields)

    def route(self, chunk: AudioChunk, consumed_ns: int | None = None, edge_received_at_us: int | None = None,
              trace: Any = None) -> int:
        """Queue one `AudioChunk` for the clients of its session; returns how many got it.

        Each (turn, sentence_seq, chunk_seq) reaches a client once: a copy of a chunk already
        forwarded (a producer retry, a worker that re-speaks a sentence after a restart) is
        dropped, so a re-spoken sentence contributes only the chunks the first attempt had not
        delivered (docs/edge.md, "Each chunk once")."""
        consumed_ns = consumed_ns or time.perf_counter_ns()
        edge_received_at_us = edge_received_at_us or now_us()
        session_id, turn_id = chunk.session_id, chunk.turn_id
        sentence, chunk_seq = chunk.sentence_seq, chunk.chunk_seq
        started = chunk.first_token_at_us or None
        encoding = chunk.encoding
        try:  # forwarded as it is (no transcoding): it must be what its encoding says
            protocol.check_payload(protocol.ENCODINGS.get(encoding, 0), chunk.pcm)
        except protocol.MalformedFrame as exc:
            raise UnroutableChunk(f"chunk {session_id}/{turn_id}/{sentence}/{chunk_seq}: {len(chunk.pcm)} bytes "
                                  f"of {encoding}: {exc}") from None
        if not (0 <= sentence <= LIMITS.max_seq and 0 <= chunk_seq <= LIMITS.max_seq):
            raise UnroutableChunk(f"chunk {session_id}/{turn_id}: sentence_seq {sentence} / chunk_seq {chunk_seq} "
                                  f"outside 0..{LIMITS.max_seq}")
        # Only chunks the edge accepts count in the latency histograms: a rejected one says nothing
        # about the pipeline's speed and would skew the per-stage counts.
        self.metrics.observe_chunk(chunk, edge_received_at_us)
        self._expire_idle()
        session = self._sessions.get(session_id)
        if session is None:  # nobody listens to this session here: no frame, no replay, no state
            self.metrics.unserved_chunks.inc()
            return 0
        # The first audio of a preempting turn: the turns it cut stop now, their `stop` ahead of it.
        self._stop_deferred(session_id, turn_id)
        self.cancels.observe(session_id, turn_id)  # a later whole-session cancel covers it
        turn = session.turns.get(turn_id)
        if turn is None:
            if self.cancels.is_cancelled(session_id, turn_id):
                self.metrics.drops.labels("cancelled").inc()
                return 0
            turn = session.turns[turn_id] = _Turn(turn_id, next(session.turn_numbers), started,
                                                  chunk.sample_rate, session_id=session_id)
            while len(session.turns) > self.turns_per_session:
                self._clear_replay(session.turns.popitem(last=False)[1])
            if chunk_seq > 0:
                # This edge started serving the session in the middle of this sentence: its
                # start is gone, so the sentence is skipped rather than played from mid-word.
                turn.mark(sentence, chunk_seq, last=True)
                self.metrics.drops.labels("joined-mid-sentence").inc()
                self._end_if_last(session, turn, chunk)
                return 0
        elif turn.stopped or turn.ended:
            self.metrics.drops.labels("cancelled" if turn.stopped else "after-turn-end").inc()
            return 0
        elif self.cancels.is_cancelled(session_id, turn_id):
            if not self._stop_is_deferred(session_id, turn_id):  # else it plays on until its cutter speaks
                self._stop_turns(session, [turn])
            self.metrics.drops.labels("cancelled").inc()
            return 0
        self._sessions.move_to_end(session_id)
        if chunk_seq <= turn.high_water(sentence):
            self.metrics.drops.labels("duplicate").inc()
            if chunk.is_last_chunk:
                turn.mark(sentence, chunk_seq, last=True)
            self._end_if_last(session, turn, chunk)
            return 0
        turn.mark(sentence, chunk_seq, last=chunk.is_last_chunk)
        flags = (
            (protocol.FLAG_LAST_IN_SENTENCE if chunk.is_last_chunk else 0)
            | (protocol.FLAG_LAST_IN_TURN if chunk.is_last_in_turn else 0)
            | (protocol.FLAG_FIRST_IN_SENTENCE if chunk_seq == 0 else 0)
        )
        frame = protocol.encode_audio(protocol.AudioFrame(
            turn.number, sentence, chunk_seq, chunk.sample_rate, chunk.pcm, flags, protocol.ENCODINGS[encoding],
        ), checked=True)  # checked above, before any state changed
        words = chunk.words
        if words:
            # the words of this chunk go just before its audio (and into the replay with it), so a
            # player knows a word before it renders the word's start; the edge keeps them for the
            # heard report (voicebus.players.heard)
            self.heard.add_words(session_id, turn_id, sentence, words)
            message = protocol.encode_control(protocol.WORDS, turn_id=turn_id, turn=turn.number, sentence_seq=sentence,
                                              words=[{"text": w.text, "start": w.start, "end": w.end} for w in words])
            turn.replay.append((sentence, message))
            turn.replay_bytes += len(message)
            self.replay_bytes += len(message)
        turn.replay.append((sentence, frame))
        turn.replay_bytes += len(frame)
        self.replay_bytes += len(frame)
        self._replaying[(session_id, turn_id)] = turn
        self._replaying.move_to_end((session_id, turn_id))
        self._trim_replay(turn)
        timeline = None
        if chunk_seq == 0:
            timeline = {"turn_id": turn_id, "turn": turn.number, "sentence_seq": sentence,
                        **{k: getattr(chunk, k) for k in TIMELINE_FIELDS}, "edge_received_at_us": edge_received_at_us}
        # built once for all the session's clients (the fan-out costs a write per client, no more)
        out = OutFrame(frame, turn_id, sentence, consumed_ns, timeline, trace if timeline else None)
        words_out = self._message(message) if words else None
        clients = list(session.clients.values())
        if self.wire is not None and clients:
            out.wire = self.wire(frame)
            if timeline is not None:
                out.sent_at_us = now_us()
                out.wire += self.wire(protocol.encode_control(protocol.TIMELINE, **timeline, sent_at_us=out.sent_at_us))
        for channel in clients:
            channel.hold()
        try:
            for channel in clients:
                self._announce(channel, turn)
                if words_out is not None:
                    channel.push(words_out)
                channel.push(out)
            self._end_if_last(session, turn, chunk)
        finally:
            written = sum(channel.release() for channel in clients)
            if written:
                self.metrics.observe_sent_many((time.perf_counter_ns() - consumed_ns) / 1e9, written)
        self._reap_closed(session_id, session)
        self._enforce_replay_bytes()
        return len(session.clients)

    def _end_if_last(self, session: _Session, turn: _Turn, chunk: AudioChunk) -> None:
        """The turn's last chunk ends it, whether its audio was forwarded or not (every turn ends)."""
        if not chunk.is_last_in_turn or turn.ended:
            return
        turn.ended = True
        turn.end_reason = chunk.end_reason[: LIMITS.max_label_chars]
        end = self._message(self._turn_end(turn))
        for channel in session.clients.values():
            self._announce(channel, turn)
            channel.push(end)

    def _drop_oldest_sentence(self, turn: _Turn) -> None:
        oldest = turn.replay[0][0]
        while turn.replay and turn.replay[0][0] == oldest:
            freed = len(turn.replay.popleft()[1])
            turn.replay_bytes -= freed
            self.replay_bytes -= freed
        if not turn.replay:
            self._replaying.pop((turn.session_id, turn.turn_id), None)

    def _clear_replay(self, turn: _Turn) -> None:
        self.replay_bytes -= turn.replay_bytes
        turn.replay.clear()
        turn.replay_bytes = 0
        self._replaying.pop((turn.session_id, turn.turn_id), None)

    def _trim_replay(self, turn: _Turn) -> None:
        # Bounded: past the cap, the oldest *whole* sentence goes, so a replay always starts at
        # a sentence boundary.
        while len(turn.replay) > self.replay_frames:
            self._drop_oldest_sentence(turn)

    def _enforce_replay_bytes(self) -> None:
        """All replay buffers together stay under `replay_max_bytes`: the oldest sentence of the
        turn least recently added to goes first (O(1) per sentence)."""
        while self.replay_bytes > self.replay_max_bytes and self._replaying:
            self._drop_oldest_sentence(next(iter(self._replaying.values())))
            self.metrics.replay_evictions.inc()

    def _reap_closed(self, session_id: str, session: _Session) -> None:
        for cid in [cid for cid, c in session.clients.items() if c.closed]:
            del session.clients[cid]
            self._client_left(session_id, session)

    # --- control --------------------------------------------------------------------------
    def _stop_turns(self, session: _Session, turns: list[_Turn]) -> int:
        """Stop `turns` at every client of the session: queued audio goes, `stop` goes first."""
        dropped = 0
        for turn in turns:
            self._clear_replay(turn)
            turn.ended = turn.stopped = True
        for channel in session.clients.values():
            for turn in turns:
                dropped += channel.drop_turn(turn.turn_id)
                channel.push(OutFrame(protocol.encode_control(
                    protocol.STOP, turn_id=turn.turn_id, turn=turn.number, reason="cancel")), front=True)
        self.metrics.drops.labels("cancelled").inc(dropped)
        return dropped

    def cancel(self, session_id: str, turn_id: str | None, turn_ids: list[str] | tuple[str, ...] = (),
               source: str = "bus", after_turn_id: str | None = None) -> int:
        """Apply a cancel (one turn, the listed turns, or every turn of the session seen so far):
        later chunks of the turn(s) are dropped, queued audio goes now and every client of the
        session is told to stop. Returns the number of frames dropped. No clock is compared: a
        turn this edge sees after the cancel is not covered unless it is listed (a gate resolution).

        With `after_turn_id` (a preemption on the session's floor) the stop waits until that
        turn's first audio reaches this edge (at most `DEFERRED_STOP_S`): the listener hears the
        old turn until the new one can be heard. Its later chunks are dropped meanwhile."""
        self.cancels.cancel(session_id, turn_id, turn_ids)
        self.metrics.cancels.labels(metric_label(source, CANCEL_SOURCES)).inc()
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        # Not yet stopped only: the edge's own cancel comes back from the bus, stop once.
        hit = [t for t in session.turns.values()
               if not t.stopped and self.cancels.is_cancelled(session_id, t.turn_id)]
        # A cancel of the preempting turn itself stops what waited for it, too.
        for cutter in [turn_id, *turn_ids] if turn_id is not None or turn_ids else list(session.turns):
            self._stop_deferred(session_id, cutter)
        if after_turn_id is not None and not self._has_audio(session, after_turn_id):
            waiting = [t.turn_id for t in hit if not self._stop_is_deferred(session_id, t.turn_id)]
            if waiting:
                stops, _ = self._deferred_stops.pop((session_id, after_turn_id), ([], 0.0))
                self._deferred_stops[(session_id, after_turn_id)] = (stops + waiting, self.clock() + DEFERRED_STOP_S)
                while len(self._deferred_stops) > self.max_sessions:
                    self._apply_deferred(*self._deferred_stops.popitem(last=False))
            return 0
        return self._stop_turns(session, [t for t in hit if not self._stop_is_deferred(session_id, t.turn_id)])

    def apply_control(self, event: ControlEvent) -> int:
        if not event.is_cancel:
            return 0
        return self.cancel(event.session_id, event.turn_id, event.turn_ids, source=event.source or "bus",
                           after_turn_id=event.after_turn_id)

    def stop_overdue(self) -> int:
        """Stop the turns whose preempting turn has not been heard within `DEFERRED_STOP_S` (its
        audio is late, or it never came). Called periodically by the edge."""
        now = self.clock()
        due = [key for key, (_stops, deadline) in self._deferred_stops.items() if deadline <= now]
        return sum(self._apply_deferred(key, self._deferred_stops.pop(key)) for key in due)

    @staticmethod
    def _has_audio(session: _Session, turn_id: str) -> bool:
        return turn_id in session.turns

    def _stop_is_deferred(self, session_id: str, turn_id: str) -> bool:
        return any(sid == session_id and turn_id in stops for (sid, _by), (stops, _) in self._deferred_stops.items())

    def _stop_deferred(self, session_id: str, cutter: str) -> None:
        entry = self._deferred_stops.pop((session_id, cutter), None)
        if entry is not None:
            self._apply_deferred((session_id, cutter), entry)

    def _apply_deferred(self, key: tuple[str, str], entry: tuple[list[str], float]) -> int:
        session = self._sessions.get(key[0])
        if session is None:
            return 0
        turns = [session.turns[t] for t in entry[0] if t in session.turns and not session.turns[t].stopped]
        return self._stop_turns(session, turns)
