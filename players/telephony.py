"""The edge's telephony door: a phone call hears a voicebus session over Twilio Media Streams.

`setup(app)` adds ``GET /telephony/twilio`` (and ``/telephony/telnyx``, the same protocol in
Telnyx's framing: `Dialect`) to an edge app (`voicebus.players.edge.make_app`).
Twilio opens it for a call whose TwiML says ``<Connect><Stream url=".../telephony/twilio">``
(a bidirectional stream) with ``<Parameter name="session">`` and ``<Parameter name="token">``;
the session's audio then plays into the call (docs/telephony.md). This module owns, per call:

* the admission: the ``start`` message within 5 s (as a hello), its token checked as a
  player's hello is (`voicebus.players.auth.verify_token`), the session served only by the edge
  that owns its partition (another edge refuses the call: Twilio cannot follow a redirect);
* the audio: one `SessionTap` client of the session in the edge's router (cancels, the
  slow-client rule and each chunk once apply as to a browser); each turn's PCM resampled to
  8 kHz and encoded as G.711 μ-law with PyAV (`MulawEncoder`), cut into 20 ms ``media`` frames
  sent at real-time pace, at most `LEAD_S` ahead of what the call has played;
* what was heard: a ``mark`` after a turn's first frame, after each chunk's frames and after its
  last frame; Twilio echoes a mark when the audio before it has played, and those echoes make
  the call's reports (AUDIBLE_START, PLAYBACK_END, STOPPED on the playback topic, TurnHeard on
  the heard topic), as a browser's reports do;
* barge-in: a cancel that reaches the edge stops the turn's frames at once and sends ``clear``
  (Twilio drops what it buffered); marks Twilio returns for cleared audio count as not heard.

The door reads the edge's app through its typed keys (`voicebus.players.keys`) and admits
requests by the edge's own rules (`voicebus.players.access`); it never imports the edge module
that mounts it. The Kafka link is used through its interface, `EdgeLink`.

Size: about 710 lines: one door (admission, mu-law encoding, the two providers' framing, marks and
the call's playback reports) whose parts share the call's state; it is loaded only when telephony
is enabled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, runtime_checkable

from aiohttp import WSMsgType, web

from voicebus.clock import now_us
from voicebus.players import protocol
from voicebus.players.access import host_allowed
from voicebus.players.auth import TokenError, verify_token
from voicebus.players.keys import LINK_KEY, ROUTER_KEY, SETTINGS_KEY
from voicebus.players.heard import HEARD_KINDS, Rendered
from voicebus.players.channel import ClientClosed
from voicebus.players.router import ConnectionRefused, SessionRouter
from voicebus.players.tap import SessionTap, TapAudio, TapTurnEnd, TapTurnStart
from voicebus.ratelimit import TokenBucket
from voicebus.schemas.contract import PlaybackKind, is_valid_id
from voicebus.schemas.messages import PlaybackReport
from voicebus.settings import ENV_PREFIX, Settings

log = logging.getLogger(__name__)

TWILIO_PATH = "/telephony/twilio"
TELNYX_PATH = "/telephony/telnyx"

MULAW_RATE = 8000  # G.711 on the phone network: 8 kHz, one byte a sample
FRAME_S = 0.020
FRAME_BYTES = int(MULAW_RATE * FRAME_S)  # 160: one 20 ms media frame, what Twilio itself sends
MULAW_SILENCE = 0xFF  # μ-law's zero: pads a turn's last frame to a whole 20 ms
# How far ahead of the call's playout the door may be. Twilio plays whatever it has buffered, so
# a lead rides out a stall of the edge's event loop (a GC pause, a burst of routing) or of the
# network without a gap in the call; 100 ms (5 frames) covers the stalls of tens of ms that
# happen, and is all that keeps playing should a `clear` be lost with the connection. More lead
# buys nothing: the audio is synthesized ahead anyway, and buffering it at Twilio only moves it
# out of the edge's reach (its cancels, its skips) and makes the marks' echoes later.
LEAD_S = 0.100
# Audio taken from the router and not yet sent: beyond this the door stops reading its tap and
# the router's bounded outbox (with its slow-client rule) holds the rest. Reading ahead keeps a
# cancel's `stop` (which the router puts first in the outbox) in sight at once.
MAX_QUEUED_FRAMES = int(30 / FRAME_S)  # 30 s, 240 KB of μ-law
START_TIMEOUT_S = 5.0  # as the player's hello (voicebus.players.edge.HELLO_TIMEOUT_S)
MAX_MESSAGE_BYTES = protocol.MAX_TEXT_FRAME_BYTES  # a start with its parameters is < 2 KB
# Twilio sends 50 media messages a second (the caller's 20 ms frames), a mark echo per chunk
# (about 7 a second) and a dtmf per key: 100 a second with a burst of 200 is twice that.
INBOUND_RATE_PER_S, INBOUND_BURST = 100.0, 200
MAX_OUTSTANDING_MARKS = 1024  # marks sent and not echoed (a peer that never echoes cannot grow this)
MAX_TURNS = 16  # turns of a call with audio in flight (a call plays one at a time)

CLOSE_NOT_OWNER = protocol.CLOSE_REDIRECT  # 4307: another edge owns the session; Twilio cannot follow

CALLS_KEY = web.AppKey("telephony_calls", set)  # the open call sockets (closed with 1001 on shutdown)
START_TIMEOUT_KEY = web.AppKey("telephony_start_timeout_s", float)


@runtime_checkable
class EdgeLink(Protocol):
    """What the door needs of the edge's Kafka link (`voicebus.players.link.KafkaLink`)."""

    async def owner_url(self, session_id: str) -> str | None: ...

    async def publish(self, topic: str, message_type: str, value: dict,
                      headers: list[tuple[str, bytes]] | None = None) -> None: ...

    async def publish_heard(self, heard: dict) -> None: ...


def setup(app: web.Application) -> None:
    """Add ``GET /telephony/twilio`` and ``/telephony/telnyx`` to an edge app from `make_app` (before it starts). Calling
    it again is a no-op."""
    if CALLS_KEY in app:
        return
    if SETTINGS_KEY not in app or ROUTER_KEY not in app:
        raise ValueError("telephony.setup needs an edge app (voicebus.players.edge.make_app)")
    app[CALLS_KEY] = set()
    app[START_TIMEOUT_KEY] = START_TIMEOUT_S
    app.on_shutdown.append(_close_calls)
    for dialect in DIALECTS:
        app.router.add_get(dialect.path, _door(dialect))


def _link(app: web.Application) -> EdgeLink | None:
    """The edge's Kafka link, once the app has started it (None without Kafka)."""
    return app[LINK_KEY]


async def _close_calls(app: web.Application) -> None:
    for ws in list(app[CALLS_KEY]):
        await ws.close(code=protocol.CLOSE_GOING_AWAY, message=b"edge shutting down")


# --- audio -------------------------------------------------------------------------------------
class MulawEncoder:
    """PCM16LE mono at `sample_rate` in, G.711 μ-law at 8 kHz out, with PyAV (FFmpeg's resampler
    and its ``pcm_mulaw`` encoder). One per turn: the resampler's filter runs on across chunks, so
    their boundaries make no click; `flush` drains its delay (a few samples) at the turn's end."""

    def __init__(self, sample_rate: int) -> None:
        import av

        self.sample_rate = sample_rate
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=MULAW_RATE)
        self._codec = av.CodecContext.create("pcm_mulaw", "w")
        self._codec.sample_rate, self._codec.layout, self._codec.format = MULAW_RATE, "mono", "s16"
        self._codec.open()

    def encode(self, pcm: bytes) -> bytes:
        import av

        if len(pcm) < 2:
            return b""
        frame = av.AudioFrame(format="s16", layout="mono", samples=len(pcm) // 2)
        frame.planes[0].update(pcm[: len(pcm) // 2 * 2])
        frame.sample_rate = self.sample_rate
        return self._encode(self._resampler.resample(frame))

    def flush(self) -> bytes:
        out = self._encode(self._resampler.resample(None))
        return out + b"".join(bytes(p) for p in self._codec.encode(None))

    def _encode(self, frames: list) -> bytes:
        return b"".join(bytes(p) for f in frames for p in self._codec.encode(f))


@dataclass
class _Frame:
    turn_id: str
    payload: bytes  # FRAME_BYTES of μ-law


@dataclass
class _Mark:
    name: str
    turn_id: str
    sentence: int
    samples: int  # of that sentence, at the turn's sample rate: the audio before the mark
    kind: str  # "start" (after a turn's first frame), "chunk", "end" (after its last frame)


@dataclass
class _Turn:
    """One turn's way into the call: its encoder, the frames it queued and sent, and how far the
    call has played it (the position of its last echoed mark)."""

    turn_id: str
    sample_rate: int
    encoder: MulawEncoder
    carry: bytearray = field(default_factory=bytearray)  # μ-law short of a whole frame
    sentences: list[tuple[int, int]] = field(default_factory=list)  # (sentence_seq, first input sample)
    fed: int = 0  # input samples
    queued: int = 0  # μ-law bytes queued as whole frames
    marked: int = 0  # `queued` when the last mark was queued
    sent: int = 0  # frames sent to the call
    heard: tuple[int, int] | None = None  # (sentence_seq, samples) of its last echoed mark
    audible: bool = False
    finished: bool = False  # reported: played to its end or stopped

    def position(self, out_bytes: int) -> tuple[int, int]:
        """(sentence_seq, samples into it) of the input the first `out_bytes` of μ-law carry."""
        at = min(self.fed, out_bytes * self.sample_rate // MULAW_RATE)
        for seq, start in reversed(self.sentences):
            if start <= at:
                return seq, at - start
        return (self.sentences[0][0] if self.sentences else 0), 0


class _Refused(Exception):
    def __init__(self, close_code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.close_code, self.reason = close_code, reason


# --- the door ------------------------------------------------------------------------------------
def _admit_request(request: web.Request, settings: Settings, path: str) -> None:
    """Browsers are not telephony providers: a request with an ``Origin`` is refused unless
    `edge_allowed_origins` lists it (or ``*``). With the public default secret (a loopback-only
    edge) the ``Host`` must be a loopback name, as on ``/ws`` (DNS rebinding)."""
    origin = request.headers.get("Origin")
    if origin is not None:
        allowed = {o.strip().rstrip("/").lower() for o in settings.edge_allowed_origins.split(",") if o.strip()}
        if "*" not in allowed and origin.strip().rstrip("/").lower() not in allowed:
            raise _Refused(protocol.CLOSE_FORBIDDEN_ORIGIN, "origin-not-allowed",
                           f"origin {origin!r} may not open {path} "
                           f"(list it in {ENV_PREFIX}EDGE_ALLOWED_ORIGINS)")
    if not host_allowed(request.host, settings.edge_secret):
        raise _Refused(protocol.CLOSE_FORBIDDEN_ORIGIN, "origin-not-allowed",
                       f"Host {request.host!r} is not a loopback name; an edge with the default "
                       f"{ENV_PREFIX}EDGE_SECRET serves loopback names only")


def _parse(data: str) -> dict:
    if len(data.encode("utf-8")) > MAX_MESSAGE_BYTES:
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", f"a message over {MAX_MESSAGE_BYTES} bytes")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "a message that is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("event"), str):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "a message without an event")
    return message


async def _receive_start(ws: web.WebSocketResponse, timeout_s: float) -> dict:
    """``connected`` (optional), then ``start``: the stream's metadata and custom parameters."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise asyncio.TimeoutError
        msg = await ws.receive(timeout=remaining)
        if msg.type == WSMsgType.BINARY:
            raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "a binary frame (Twilio sends JSON text)")
        if msg.type != WSMsgType.TEXT:
            raise ConnectionResetError("closed before start")
        message = _parse(msg.data)
        if message["event"] == "connected":
            continue
        if message["event"] != "start":
            raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame",
                           f"the first message after connected must be start, got {message['event'][:40]!r}")
        return message


def _twilio_stream(start: dict, query: Mapping[str, str]) -> tuple[str, str, str, str]:
    """(streamSid, callSid, session, token) of Twilio's ``start``, checked: the session and its
    token come as the stream's ``<Parameter>``s (Twilio drops a URL's query string)."""
    meta = start.get("start")
    if not isinstance(meta, dict):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "start without its start object")
    stream_sid = meta.get("streamSid") or start.get("streamSid")
    call_sid = meta.get("callSid") or ""
    params = meta.get("customParameters") or {}
    fmt = meta.get("mediaFormat") or {}
    if not is_valid_id(stream_sid) or not isinstance(params, dict) or not isinstance(fmt, dict):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "start without a valid streamSid")
    if fmt and (str(fmt.get("encoding")).lower() != "audio/x-mulaw" or fmt.get("sampleRate") != MULAW_RATE
                or fmt.get("channels", 1) != 1):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame",
                       f"media format {fmt!r}: this door speaks audio/x-mulaw, 8000 Hz, mono")
    session, token = params.get("session"), params.get("token")
    if not is_valid_id(session) or not isinstance(token, str) or not token:
        raise _Refused(protocol.CLOSE_UNAUTHORIZED, "malformed-token",
                       "start.customParameters must carry session and token (<Parameter name=...> in the TwiML)")
    return stream_sid, str(call_sid)[:64], session, token


def _telnyx_stream(start: dict, query: Mapping[str, str]) -> tuple[str, str, str, str]:
    """(stream_id, call_control_id, session, token) of Telnyx's ``start``, checked: the stream id
    is beside the start object, the media format is PCMU (G.711 μ-law) at 8 kHz, and the session
    and its token come in the stream URL's query (``stream_url`` is set per call by the Call
    Control command that starts the stream) or, where given, as custom parameters."""
    meta = start.get("start")
    if not isinstance(meta, dict):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "start without its start object")
    stream_id = start.get("stream_id") or meta.get("stream_id")
    fmt = meta.get("media_format") or {}
    if not is_valid_id(stream_id) or not isinstance(fmt, dict):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame", "start without a valid stream_id")
    rate = fmt.get("sample_rate", MULAW_RATE)
    if fmt and (str(fmt.get("encoding")).upper() != "PCMU" or str(rate) != str(MULAW_RATE)
                or str(fmt.get("channels", 1)) != "1"):
        raise _Refused(protocol.CLOSE_PROTOCOL_ERROR, "malformed-frame",
                       f"media format {fmt!r}: this door speaks PCMU, 8000 Hz, mono "
                       f"(stream_bidirectional_codec PCMU)")
    params = meta.get("custom_parameters") or {}
    if isinstance(params, list):  # [{"name": ..., "value": ...}], as the Call Control command takes them
        params = {p.get("name"): p.get("value") for p in params if isinstance(p, dict)}
    if not isinstance(params, dict):
        params = {}
    session, token = params.get("session") or query.get("session"), params.get("token") or query.get("token")
    if not is_valid_id(session) or not isinstance(token, str) or not token:
        raise _Refused(protocol.CLOSE_UNAUTHORIZED, "malformed-token",
                       "the stream URL's query (or its custom parameters) must carry session and token")
    return stream_id, str(meta.get("call_control_id") or "")[:64], session, token


@dataclass(frozen=True)
class Dialect:
    """How one provider frames the same protocol: its path on the edge, how its ``start`` names
    the stream, the session and the token, and the key (if any) under which the messages the edge
    sends name the stream. Media, marks, clear and stop are the same JSON otherwise."""

    provider: str
    path: str
    stream_of: Callable[[dict, Mapping[str, str]], tuple[str, str, str, str]]
    stream_key: str | None


TWILIO = Dialect("twilio", TWILIO_PATH, _twilio_stream, "streamSid")
TELNYX = Dialect("telnyx", TELNYX_PATH, _telnyx_stream, None)
DIALECTS = (TWILIO, TELNYX)


def _door(dialect: Dialect) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def door(request: web.Request) -> web.StreamResponse:
        return await _serve_call(request, dialect)

    return door


async def _serve_call(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    app = request.app
    settings, router = app[SETTINGS_KEY], app[ROUTER_KEY]
    metrics = router.metrics
    # No permessage-deflate: μ-law barely compresses, as PCM on /ws.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=MAX_MESSAGE_BYTES, compress=False)
    await ws.prepare(request)
    peer = request.remote
    try:
        _admit_request(request, settings, dialect.path)
        if router.n_clients + router.awaiting_hello >= router.max_clients:
            raise _Refused(protocol.CLOSE_TRY_AGAIN_LATER, "edge-full",
                           f"this edge serves {router.max_clients} players (and sockets before their hello) already")
        router.awaiting_hello += 1  # an open socket without its start holds a place, as on /ws
        try:
            start = await _receive_start(ws, app[START_TIMEOUT_KEY])
        except asyncio.TimeoutError:
            raise _Refused(protocol.CLOSE_HELLO_TIMEOUT, "no-start",
                           f"no start within {app[START_TIMEOUT_KEY]:g} s") from None
        finally:
            router.awaiting_hello -= 1
        stream_sid, call_sid, session_id, token = dialect.stream_of(start, request.query)
        try:
            verify_token(settings.edge_secret, token, session_id)
        except TokenError as exc:
            raise _Refused(protocol.CLOSE_UNAUTHORIZED, exc.reason, f"session {session_id!r}: {exc}") from None
        link = _link(app)
        if link is not None:
            await _check_owner(link, session_id)
    except _Refused as refused:
        metrics.telephony_calls.labels(dialect.provider, refused.reason).inc()
        log.warning("telephony: refused a %s stream from %s: %s (close %d)", dialect.provider, peer, refused,
                    refused.close_code)
        await ws.close(code=refused.close_code, message=refused.reason.encode()[:120])
        return ws
    except ConnectionResetError:
        return ws
    try:
        tap = SessionTap(router, session_id)
        await tap.__aenter__()
    except ConnectionRefused as exc:
        metrics.telephony_calls.labels(dialect.provider, exc.code).inc()
        log.warning("telephony: refused call %s of session %s: %s", call_sid, session_id, exc)
        await ws.close(code=exc.close_code, message=exc.code.encode())
        return ws
    metrics.telephony_calls.labels(dialect.provider, "served").inc()
    log.info("telephony: call %s (stream %s) hears session %s as client %s", call_sid, stream_sid, session_id,
             tap.client_id)
    app[CALLS_KEY].add(ws)
    call = PhoneCall(ws, tap, stream_sid, settings, router, lambda: _link(app), dialect)
    try:
        code = await call.run()
    finally:
        app[CALLS_KEY].discard(ws)
        await tap.__aexit__(None, None, None)
    if not ws.closed:
        with contextlib.suppress(ConnectionError, RuntimeError, asyncio.TimeoutError):
            async with asyncio.timeout(2.0):
                await ws.close(code=code[0], message=code[1].encode()[:120])
    log.info("telephony: call %s of session %s ended (%s)", call_sid, session_id, code[1])
    return ws


async def _check_owner(link: EdgeLink, session_id: str) -> None:
    """Sharded edges: only the edge that owns the session's partition has its audio. Twilio cannot
    follow a redirect, so another edge refuses the call, naming the owner in its log."""
    try:
        owner = await link.owner_url(session_id)
    except Exception as exc:  # noqa: BLE001 - the edge's NoOwner (a rebalance), or the link failing
        raise _Refused(protocol.CLOSE_TRY_AGAIN_LATER, getattr(exc, "code", None) or "no-owner", str(exc)) from None
    if owner is not None:
        raise _Refused(CLOSE_NOT_OWNER, "not-owner",
                       f"session {session_id!r} is served by the edge at {owner}; point the call's <Stream url> at "
                       f"that edge's {TWILIO_PATH}")


class PhoneCall:
    """One call's stream: three tasks share it. `_pull` turns the tap's events into μ-law frames
    and marks (and a cancel into a purge and a `clear`); `_pace` is the only writer to the socket
    and sends one 20 ms frame at a time against the monotonic clock; `_inbound` reads Twilio's
    messages (mark echoes, stop). Heard reports go out in order through a queue of their own."""

    def __init__(self, ws: web.WebSocketResponse, tap: SessionTap, stream_sid: str, settings: Settings,
                 router: SessionRouter, link: Any, dialect: Dialect = TWILIO) -> None:
        self.ws, self.tap, self.stream_sid, self.dialect = ws, tap, stream_sid, dialect
        self.settings, self.router, self._link = settings, router, link
        self.metrics = router.metrics
        self.turns: OrderedDict[str, _Turn] = OrderedDict()
        self.queue: deque[_Frame | _Mark] = deque()
        self.queued_frames = 0
        self.outstanding: OrderedDict[str, _Mark] = OrderedDict()  # sent, not echoed
        self.clear_for: set[str] = set()  # stopped turns whose audio the call buffered: `clear` is due
        self.last_sent = ""  # the turn of the latest frame sent
        self.finished: OrderedDict[str, None] = OrderedDict()  # turns reported (their late events are ignored)
        self.play_until = 0.0  # monotonic time when everything sent so far will have played
        self._marks = 0
        self._wake = asyncio.Event()  # the pacer: something was queued, or a clear is due
        self._room = asyncio.Event()  # the puller: frames went out
        self._reports: asyncio.Queue = asyncio.Queue()
        self._bucket = TokenBucket(INBOUND_RATE_PER_S, INBOUND_BURST)

    async def run(self) -> tuple[int, str]:
        """Until Twilio stops the stream, the socket closes or the edge closes the tap; returns
        the close code and reason for the socket."""
        reporter = asyncio.create_task(self._report_loop(), name=f"telephony-reports-{self.tap.client_id}")
        tasks = {asyncio.create_task(self._inbound(), name="inbound"), asyncio.create_task(self._pull(), name="pull"),
                 asyncio.create_task(self._pace(), name="pace")}
        result = (protocol.CLOSE_NORMAL, "stopped")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    continue
                exc = task.exception()
                if isinstance(exc, ClientClosed):
                    result = (exc.code, "too-slow" if exc.code == protocol.CLOSE_TOO_SLOW else exc.reason)
                    log.warning("telephony: the edge closed stream %s (%d %s)", self.stream_sid, exc.code, exc.reason)
                elif isinstance(exc, (ConnectionError, RuntimeError)):
                    result = (protocol.CLOSE_GOING_AWAY, "send-failed")
                elif exc is not None:
                    log.error("telephony: stream %s failed", self.stream_sid, exc_info=exc)
                    result = (1011, "internal-error")
                elif task.get_name() == "pull":
                    result = (protocol.CLOSE_NORMAL, "tap-closed")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # whatever was in flight was heard up to its last echoed mark
            for turn in list(self.turns.values()):
                self._finish(turn, stopped=True)
            self._reports.put_nowait(None)
            await reporter
        return result

    # --- the tap's events -> frames and marks ---------------------------------------------------
    async def _pull(self) -> None:
        async for event in self.tap.events():
            if isinstance(event, TapTurnStart):
                self._turn(event.turn_id, event.sample_rate)
            elif isinstance(event, TapAudio):
                self._audio(event)
            elif isinstance(event, TapTurnEnd):
                if event.stopped:
                    self._stop(event.turn_id)
                else:
                    self._end(event.turn_id)
            self._wake.set()
            while self.queued_frames >= MAX_QUEUED_FRAMES:
                self._room.clear()
                await self._room.wait()

    def _turn(self, turn_id: str, sample_rate: int) -> _Turn | None:
        turn = self.turns.get(turn_id)
        if turn is None and turn_id not in self.finished:
            turn = self.turns[turn_id] = _Turn(turn_id, sample_rate, MulawEncoder(sample_rate))
            while len(self.turns) > MAX_TURNS:
                self._finish(next(iter(self.turns.values())), stopped=True)
        return turn

    def _audio(self, audio: TapAudio) -> None:
        turn = self._turn(audio.turn_id, audio.sample_rate)
        if turn is None:
            return
        if not turn.sentences or turn.sentences[-1][0] != audio.sentence_seq:
            turn.sentences.append((audio.sentence_seq, turn.fed))
        turn.fed += len(audio.pcm) // 2
        self._queue_audio(turn, turn.encoder.encode(audio.pcm))
        if turn.queued > turn.marked:
            self._queue_mark(turn, "chunk")

    def _end(self, turn_id: str) -> None:
        turn = self.turns.get(turn_id)
        if turn is None or turn.finished:
            return
        tail = turn.encoder.flush()
        short = -(len(turn.carry) + len(tail)) % FRAME_BYTES
        self._queue_audio(turn, tail + bytes([MULAW_SILENCE]) * short)
        self._queue_mark(turn, "end")

    def _queue_audio(self, turn: _Turn, mulaw: bytes) -> None:
        turn.carry += mulaw
        while len(turn.carry) >= FRAME_BYTES:
            self.queue.append(_Frame(turn.turn_id, bytes(turn.carry[:FRAME_BYTES])))
            del turn.carry[:FRAME_BYTES]
            self.queued_frames += 1
            turn.queued += FRAME_BYTES
            if turn.queued == FRAME_BYTES:
                # its echo says the turn's first 20 ms have played: when the call started to hear it
                self._queue_mark(turn, "start")

    def _queue_mark(self, turn: _Turn, kind: str) -> None:
        self._marks += 1
        sentence, samples = turn.position(turn.queued)
        turn.marked = turn.queued
        self.queue.append(_Mark(f"{turn.turn_id}:{sentence}:{self._marks}", turn.turn_id, sentence, samples, kind))

    def _stop(self, turn_id: str) -> None:
        """A cancel reached the edge: the turn's queued frames go now, and what the call buffered
        of it is cleared (by the pacer, before it sends anything else)."""
        kept = deque(item for item in self.queue if item.turn_id != turn_id)
        self.queued_frames = sum(isinstance(item, _Frame) for item in kept)
        self.queue = kept
        self._room.set()
        turn = self.turns.get(turn_id)
        if turn is None:
            return
        if turn.sent and self.last_sent == turn_id:
            self.clear_for.add(turn_id)  # the pacer clears, then reports the turns it cut
        else:
            # Nothing of it reached the call; or a later turn's first frames went out after its
            # last ones (it was within LEAD_S of its end): a clear would cut that turn too, so
            # the stopped turn's tail plays out, and counts as not heard.
            self._finish(turn, stopped=True)

    # --- the socket ---------------------------------------------------------------------------------
    async def _pace(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.clear_for:
                await self._clear()
                continue
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self.queue[0]
            if isinstance(item, _Mark):
                self.queue.popleft()
                self.outstanding[item.name] = item
                while len(self.outstanding) > MAX_OUTSTANDING_MARKS:
                    self.outstanding.popitem(last=False)
                await self._send({"event": "mark", "mark": {"name": item.name}})
                continue
            now = loop.time()
            early = self.play_until - LEAD_S - now
            if early > 0:  # the call has LEAD_S buffered: wait for the clock, or for a cancel
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), early)
                continue
            self.queue.popleft()
            self.queued_frames -= 1
            self._room.set()
            self.play_until = max(self.play_until, now) + FRAME_S
            turn = self.turns.get(item.turn_id)
            if turn is not None:
                turn.sent += 1
            self.last_sent = item.turn_id
            self.metrics.telephony_frames.labels(self.dialect.provider, "out").inc()
            await self._send({"event": "media", "media": {"payload": base64.b64encode(item.payload).decode("ascii")}})

    async def _clear(self) -> None:
        """Twilio drops what it buffered and returns the marks still in it: those were not heard.
        The stopped turn, and a turn before it whose tail was still buffered, stop where their
        last echoed marks say."""
        cut = {mark.turn_id for mark in self.outstanding.values()} | self.clear_for
        self.clear_for = set()
        self.outstanding.clear()
        self.play_until = 0.0  # the call's buffer is empty: the next frames start a new lead
        self.metrics.telephony_clears.labels(self.dialect.provider).inc()
        for turn_id in cut:
            turn = self.turns.get(turn_id)
            if turn is not None:
                self._finish(turn, stopped=True)
        await self._send({"event": "clear"})

    async def _send(self, message: dict) -> None:
        if self.dialect.stream_key:  # Twilio: every message names its stream
            message = {"event": message.pop("event"), self.dialect.stream_key: self.stream_sid, **message}
        await self.ws.send_str(json.dumps(message, separators=(",", ":")))

    # --- Twilio's messages --------------------------------------------------------------------------
    async def _inbound(self) -> None:
        async for msg in self.ws:
            if msg.type == WSMsgType.ERROR:  # e.g. over MAX_MESSAGE_BYTES: aiohttp closed it (1009)
                log.warning("telephony: stream %s closed (code %s): %s", self.stream_sid, self.ws.close_code, msg.data)
                return
            if msg.type != WSMsgType.TEXT:
                continue  # Twilio sends text only; a binary frame is not worth the call
            if not self._bucket.take():
                self.metrics.refused.labels("telephony-rate-limited").inc()
                continue
            try:
                message = _parse(msg.data)
            except _Refused as bad:
                log.warning("telephony: stream %s: %s (ignored)", self.stream_sid, bad)
                continue
            event = message["event"]
            if event == "media":
                self.metrics.telephony_frames.labels(self.dialect.provider, "in").inc()  # the caller: no speech recognition here
            elif event == "mark":
                name = (message.get("mark") or {}).get("name") if isinstance(message.get("mark"), dict) else None
                if isinstance(name, str):
                    self._echoed(name)
            elif event == "stop":
                return
            elif event == "dtmf":
                log.debug("telephony: stream %s: dtmf %r (not used)", self.stream_sid, message.get("dtmf"))
            else:
                log.debug("telephony: stream %s: %r ignored", self.stream_sid, event[:40])

    def _echoed(self, name: str) -> None:
        """The audio before mark `name` has played (or was cleared, then it is no longer outstanding)."""
        mark = self.outstanding.pop(name, None)
        if mark is None:
            return
        turn = self.turns.get(mark.turn_id)
        if turn is None or turn.finished:
            return
        position = (mark.sentence, mark.samples)
        if turn.heard is None or position > turn.heard:
            turn.heard = position
        if mark.kind == "start" and not turn.audible:
            turn.audible = True
            self._reports.put_nowait((PlaybackKind.AUDIBLE_START, turn.turn_id, mark.sentence,
                                      now_us() - int(FRAME_S * 1e6), None))
        elif mark.kind == "end":
            self._finish(turn, stopped=False)

    # --- heard reports ----------------------------------------------------------------------------
    def _finish(self, turn: _Turn, stopped: bool) -> None:
        """Report how far the call played the turn (once), and forget it."""
        self.turns.pop(turn.turn_id, None)
        if turn.finished:
            return
        turn.finished = True
        self.finished[turn.turn_id] = None
        while len(self.finished) > 64:
            self.finished.popitem(last=False)
        for name in [n for n, m in self.outstanding.items() if m.turn_id == turn.turn_id]:
            del self.outstanding[name]
        sentence, samples = turn.heard or ((turn.sentences[0][0] if turn.sentences else 0), 0)
        kind = PlaybackKind.STOPPED if stopped else PlaybackKind.PLAYBACK_END
        self._reports.put_nowait((kind, turn.turn_id, sentence, now_us(), (sentence, samples)))

    async def _report_loop(self) -> None:
        while (job := await self._reports.get()) is not None:
            try:
                await self._report(*job)
            except Exception:  # noqa: BLE001 - a report is not worth the call
                log.exception("telephony: a report of stream %s failed", self.stream_sid)

    async def _report(self, kind: PlaybackKind, turn_id: str, sentence_seq: int, at_us: int,
                      rendered: tuple[int, int] | None) -> None:
        """What `_handle_client_message` of the edge does with a player's report: metrics, the
        audible start, the heard report (TurnHeard), the PlaybackReport on the playback topic."""
        router, session_id, client_id = self.router, self.tap.session_id, self.tap.client_id
        report = PlaybackReport(session_id=session_id, turn_id=turn_id, client_id=client_id, kind=kind,
                                sentence_seq=sentence_seq, audible_at_us=at_us, reported_at_us=now_us(),
                                detail=self.dialect.provider)
        router.metrics.reports.labels(kind).inc()
        if kind == PlaybackKind.AUDIBLE_START:
            started = router.turn_started_at(session_id, turn_id)
            if started and at_us > started:
                router.metrics.stage_latency.labels("first_token_to_audible").observe((at_us - started) / 1e6)
            router.heard.audible(session_id, turn_id, at_us)
        heard = None
        if kind in HEARD_KINDS and rendered is not None:
            played = Rendered(client_id, rendered[0], rendered[1], kind == PlaybackKind.STOPPED, at_us)
            heard = router.heard.report(session_id, turn_id, played, router.players_of_turn(session_id, turn_id),
                                        now_us())
        link = self._link()
        if link is None:
            return
        if heard is not None:
            await link.publish_heard(heard)  # first: an agent waits on it, the playback record does not
        from aiokafka.errors import KafkaError

        from voicebus.codecs import CodecError

        try:
            await link.publish(self.settings.playback_topic, "PlaybackReport", report)
        except (KafkaError, CodecError) as exc:
            log.warning("telephony: could not publish the %s report of %s/%s: %s", kind, session_id, turn_id, exc)
