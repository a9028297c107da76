"""A headless listener: a Python WebSocket client of the edge that speaks protocol v1.

The demo uses it to write each turn's audio to WAV; the benchmarks use it as "the edge client"
whose first received audio frame ends time to first audio. It records, per turn, when every
audio frame arrived (local wall clock, epoch µs) and the stage timeline the edge sends with it.
`Listener.follow` streams one turn as it arrives instead (its audio, word timings and end): the
framework plugins (`voicebus.agents.pipecat_tts`, `voicebus.agents.livekit_tts`) speak through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import wave
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from voicebus.audio_codec import OpusDecoder
from voicebus.clock import now_us
from voicebus.lifecycle import Owned
from voicebus.players import protocol
from voicebus.players.auth import issue_token
from voicebus.schemas.contract import CancelReason


MAX_REDIRECTS = 4


def resolve_edge_url(current: str, target: str) -> str:
    """A redirect's URL: absolute (``ws://edge-2:8765/ws``) or a path (``/edge-2/ws``) on the
    current edge's origin (edges behind one proxy)."""
    from urllib.parse import urljoin

    return urljoin(current, target)


# The kinds of `TurnEvent` (`words`, `turn_end` and `stop` are the protocol's message types).
AUDIO = "audio"
CLOSED = "closed"  # the connection to the edge ended: nothing more of the turn will come


@dataclass(frozen=True)
class TurnEvent:
    """One thing the edge sent about a followed turn (`Listener.follow`), in the order it came.

    `kind` is `AUDIO` (`pcm`: PCM16LE mono at `sample_rate`, Opus already decoded; `sentence`),
    ``words`` (`words`: ``{text, start, end}`` in samples from the start of sentence `sentence`'s
    audio, sent just before the audio that holds them), ``turn_end`` (`reason` when audio is
    missing), ``stop`` (the turn was cancelled) or `CLOSED`."""

    kind: str
    pcm: bytes = b""
    sample_rate: int = 24000
    sentence: int = 0
    words: tuple = ()
    reason: str = ""


@dataclass
class HeardTurn:
    turn_id: str
    sample_rate: int = 24000
    frames: list[tuple[int, int, int, int]] = field(default_factory=list)  # (received_at_us, sentence, chunk, n_samples)
    pcm: bytearray = field(default_factory=bytearray)
    timelines: dict[int, dict] = field(default_factory=dict)  # sentence -> stage timestamps (+ sent_at_us)
    ended: bool = False
    stopped: bool = False
    stopped_at_us: int | None = None  # when the edge's "stop" arrived (this machine's clock)
    end_reason: str = ""  # turn_end's reason: why audio is missing (a sentence the pipeline could not speak)
    # A barge-in races frames already on the wire: those that arrive after this listener's
    # cancel are discarded, as the browser worklet does. The edge promises to send nothing of
    # the turn after its "stop", so frames after it are counted apart: any is a bug.
    cancelled_at_us: int | None = None
    discarded: list[tuple[int, int, int, int]] = field(default_factory=list)
    frames_after_stop: int = 0
    wire_bytes: int = 0  # audio payload bytes received (Opus packets or PCM), kept frames only
    decoder: "OpusDecoder | None" = field(default=None, repr=False)  # the turn's Opus stream, as a player decodes it
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    heard_event: asyncio.Event = field(default_factory=asyncio.Event)  # first audio and its timeline are in

    @property
    def first_audio_at_us(self) -> int | None:
        return self.frames[0][0] if self.frames else None

    def add_frame(self, received_us: int, frame: protocol.AudioFrame) -> bool:
        """Keep one audio frame, or discard it when it belongs to audio this player stopped.
        Returns whether it was kept."""
        pcm = frame.pcm
        if frame.encoding == protocol.ENCODING_OPUS:
            if self.decoder is None:
                self.decoder = OpusDecoder(frame.sample_rate)
            pcm = self.decoder.decode(frame.pcm)
        heard = (received_us, frame.sentence, frame.chunk, len(pcm) // 2)
        if self.stopped:
            self.frames_after_stop += 1
        if self.stopped or self.cancelled_at_us is not None:
            self.discarded.append(heard)
            return False
        self.sample_rate = frame.sample_rate
        self.frames.append(heard)
        self.pcm += pcm
        self.wire_bytes += len(frame.pcm)
        return True

    @property
    def last_audio_at_us(self) -> int | None:
        """When the last frame of this turn arrived, kept or discarded."""
        return max((f[0] for f in self.frames + self.discarded), default=None)

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate

    def write_wav(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(self.sample_rate)
            out.writeframes(bytes(self.pcm))
        return path

    def starvation(self) -> tuple[float, int]:
        """Total silence (ms) and number of gaps a player starting at the first frame would hit
        when a frame arrives after the audio before it has finished playing."""
        gap_ms, gaps, play_until_us = 0.0, 0, None
        for received_us, _sentence, _chunk, samples in self.frames:
            if play_until_us is None:
                play_until_us = received_us
            elif received_us > play_until_us:
                gap_ms += (received_us - play_until_us) / 1000
                gaps += 1
                play_until_us = received_us
            play_until_us += int(samples * 1_000_000 / self.sample_rate)
        return gap_ms, gaps


class Listener(Owned):
    """Connects to the edge for one session and collects what it hears. Owns its socket and
    reader task: use `async with` or `start()` / `stop()`."""

    def __init__(self, edge_url: str, session_id: str, secret: str | None = None, ttl_s: int = 3600, *,
                 token: str | None = None) -> None:
        self.edge_url = edge_url.rstrip("/")
        self.session_id = session_id
        # a token issued elsewhere (`voicebus token`) lets a client listen without the edge secret
        self._token = token if token is not None else issue_token(secret or "", session_id, ttl_s)
        self.turns: dict[str, HeardTurn] = {}
        self._followers: dict[str, asyncio.Queue[TurnEvent]] = {}
        self._numbers: dict[int, str] = {}
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._turn_seen = asyncio.Event()
        self.redirects: list[str] = []  # the URLs it was redirected to, in order
        self.ws_url: str | None = None  # the /ws it is connected to
        self.ready: dict = {}
        self._pongs: dict[float, asyncio.Future] = {}  # t0 of a ping -> its pong's server time

    async def start(self) -> None:
        """Connect and say hello. An edge that does not own the session answers ``redirect`` with
        the owner's URL (docs/protocol.md, *Sharded edges*): followed, up to `MAX_REDIRECTS` hops."""
        self._http = aiohttp.ClientSession()
        url = self.edge_url + "/ws"
        for _ in range(MAX_REDIRECTS + 1):
            self._ws = await self._http.ws_connect(url, max_msg_size=protocol.MAX_AUDIO_FRAME_BYTES)
            await self._ws.send_str(protocol.encode_control(protocol.HELLO, session=self.session_id, token=self._token))
            ready = await self._ws.receive_json(timeout=10)
            if ready.get("type") != protocol.REDIRECT:
                break
            await self._ws.close()
            url = resolve_edge_url(url, ready["url"])
            self.redirects.append(url)
        if ready.get("type") != protocol.READY:
            raise ConnectionError(f"edge refused the listener: {ready}")
        self.ws_url, self.ready = url, ready
        self._reader = asyncio.create_task(self._read(), name=f"listener-{self.session_id}")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()

    async def cancel(self, turn_id: str | None = None, reason: str = CancelReason.BARGE_IN) -> None:
        """Barge in: from now on this listener discards the turn's audio (all unfinished turns
        when `turn_id` is None), then asks the edge to cancel it."""
        cancelled_at = now_us()
        for turn in [self._turn(turn_id)] if turn_id is not None else [t for t in self.turns.values() if not t.ended]:
            turn.cancelled_at_us = turn.cancelled_at_us or cancelled_at
        fields = {"reason": reason} if turn_id is None else {"turn_id": turn_id, "reason": reason}
        await self._ws.send_str(protocol.encode_control(protocol.CANCEL, **fields))

    async def ping(self, timeout: float = 10.0) -> int:
        """A ``ping`` round trip; the edge's ``server_time_us``. The edge answers ahead of the
        audio still in the client's outbox, but after what it has already written: with that
        outbox empty (`SessionRouter.outboxes_empty`), every frame sent before has arrived by the answer."""
        t0 = float(now_us())
        answered = self._pongs.setdefault(t0, asyncio.get_running_loop().create_future())
        await self._ws.send_str(protocol.encode_control(protocol.PING, t0=t0))
        try:
            async with asyncio.timeout(timeout):
                return await answered
        finally:
            self._pongs.pop(t0, None)

    def follow(self, turn_id: str) -> "asyncio.Queue[TurnEvent]":
        """The turn's `TurnEvent`s as they arrive, from now on (call it before the turn's first
        token is published, so nothing is missed); until `unfollow`."""
        return self._followers.setdefault(turn_id, asyncio.Queue())

    def unfollow(self, turn_id: str) -> None:
        """Stop following a turn and forget it (its audio is not kept either)."""
        self._followers.pop(turn_id, None)
        self.turns.pop(turn_id, None)

    def _tell(self, turn_id: str | None, event: TurnEvent) -> None:
        follower = self._followers.get(turn_id) if turn_id is not None else None
        if follower is not None:
            follower.put_nowait(event)

    async def wait_turn_end(self, turn_id: str, timeout: float) -> HeardTurn:
        async with asyncio.timeout(timeout):
            await self._wait_turn(turn_id)
            await self.turns[turn_id].ended_event.wait()
        return self.turns[turn_id]

    async def wait_first_audio(self, turn_id: str, timeout: float) -> HeardTurn:
        """Wait until the turn's first audio frame and its stage timeline have arrived."""
        async with asyncio.timeout(timeout):
            await self._wait_turn(turn_id)
            await self.turns[turn_id].heard_event.wait()
        return self.turns[turn_id]

    async def _wait_turn(self, turn_id: str) -> None:
        while turn_id not in self.turns:
            self._turn_seen.clear()
            await self._turn_seen.wait()

    def _turn(self, turn_id: str) -> HeardTurn:
        if turn_id not in self.turns:
            self.turns[turn_id] = HeardTurn(turn_id)
            self._turn_seen.set()
        return self.turns[turn_id]

    async def _read(self) -> None:
        try:
            async for msg in self._ws:
                received = now_us()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    frame = protocol.decode_audio(msg.data)
                    turn = self._turn(self._numbers.get(frame.turn, str(frame.turn)))
                    if turn.add_frame(received, frame):
                        if turn.timelines:
                            turn.heard_event.set()
                        samples = turn.frames[-1][3]
                        self._tell(turn.turn_id, TurnEvent(AUDIO, bytes(turn.pcm[len(turn.pcm) - 2 * samples:]),
                                                           turn.sample_rate, frame.sentence))
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    self._on_control(msg.json(), received)
                else:
                    break
        finally:
            for follower in self._followers.values():
                follower.put_nowait(TurnEvent(CLOSED, reason="the connection to the edge ended"))

    def _on_control(self, message: dict, received_us: int) -> None:
        mtype = message.get("type")
        if mtype == protocol.TURN_START:
            self._numbers[message["turn"]] = message["turn_id"]
            self._turn(message["turn_id"]).sample_rate = message.get("sample_rate", 24000)
        elif mtype == protocol.TIMELINE:
            turn = self._turn(message.get("turn_id") or self._numbers.get(message.get("turn"), "?"))
            turn.timelines.setdefault(int(message.get("sentence_seq", message.get("sentence", 0))), message)
            if turn.frames:
                turn.heard_event.set()
        elif mtype == protocol.WORDS:
            turn_id = message.get("turn_id") or self._numbers.get(message.get("turn"))
            if turn_id in self._followers:
                self._tell(turn_id, TurnEvent(protocol.WORDS, sample_rate=self._turn(turn_id).sample_rate,
                                              sentence=int(message.get("sentence_seq", 0)),
                                              words=tuple(message.get("words") or ())))
        elif mtype == protocol.PONG:
            answered = self._pongs.get(message.get("t0"))
            if answered is not None and not answered.done():
                answered.set_result(int(message.get("server_time_us", 0)))
        elif mtype in (protocol.TURN_END, protocol.STOP):
            turn_id = message.get("turn_id") or self._numbers.get(message.get("turn"))
            for turn in ([self.turns[turn_id]] if turn_id in self.turns else list(self.turns.values())):
                turn.ended = True
                turn.stopped = mtype == protocol.STOP
                if turn.stopped and turn.stopped_at_us is None:
                    turn.stopped_at_us = received_us
                if mtype == protocol.TURN_END:
                    turn.end_reason = str(message.get("reason") or "")
                turn.ended_event.set()
                self._tell(turn.turn_id, TurnEvent(mtype, reason=str(message.get("reason") or "")))
