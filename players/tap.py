"""A session's audio inside the edge process, for the doors that are not the WebSocket player.

The OpenAI-compatible speech endpoint (`voicebus.players.openai_speech`) and the telephony
bridge (`voicebus.players.telephony`) serve a session's audio in another shape than the
player protocol. Each is one more client of the session in the edge's `SessionRouter`: a
`SessionTap` connects a `ClientChannel` (so cancels, the slow-client rule, each chunk once and
the replay apply to it as to a browser) and turns the frames the router queues into typed
events, with the audio decoded to PCM16 whatever the workers' encoding:

- `TapTurnStart`: a turn's audio begins (its id and sample rate);
- `TapWords`: the word timings of the chunk that follows;
- `TapAudio`: PCM16LE mono samples of one chunk;
- `TapSkip`: a sentence dropped because this client fell behind;
- `TapTurnEnd`: the turn ended (``stopped``: it was cancelled, its queued audio already dropped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Union

from voicebus.audio_codec import OpusDecoder
from voicebus.players import protocol
from voicebus.players.channel import ClientChannel, ClientClosed
from voicebus.players.router import SessionRouter


@dataclass(frozen=True)
class TapTurnStart:
    turn_id: str
    sample_rate: int


@dataclass(frozen=True)
class TapWords:
    turn_id: str
    sentence_seq: int
    words: list = field(default_factory=list)  # [{"text", "start", "end"}], seconds from the sentence's start


@dataclass(frozen=True)
class TapAudio:
    turn_id: str
    sentence_seq: int
    chunk_seq: int
    pcm: bytes  # PCM16LE mono
    sample_rate: int
    last_in_sentence: bool
    last_in_turn: bool


@dataclass(frozen=True)
class TapSkip:
    turn_id: str
    sentence_seq: int


@dataclass(frozen=True)
class TapTurnEnd:
    turn_id: str
    stopped: bool = False
    reason: str = ""


TapEvent = Union[TapTurnStart, TapWords, TapAudio, TapSkip, TapTurnEnd]


class SessionTap:
    """One in-process client of `session_id` on `router`; use as an async context manager,
    iterate `events()`. Leaving the context disconnects the client (and nothing else)."""

    def __init__(self, router: SessionRouter, session_id: str) -> None:
        self.router, self.session_id = router, session_id
        self.channel: ClientChannel | None = None
        self._turn_ids: dict[int, str] = {}  # the router's turn number -> turn id
        # per sentence, as workers encode: an Opus stream's state runs on across its chunks
        self._decoders: dict[tuple[str, int], OpusDecoder] = {}

    async def __aenter__(self) -> "SessionTap":
        self.channel = self.router.connect(self.session_id)  # ConnectionRefused when the edge is full
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.router.disconnect(self.channel)
            self.channel = None

    @property
    def client_id(self) -> str:
        assert self.channel is not None, "not connected"
        return self.channel.client_id

    async def events(self) -> AsyncIterator[TapEvent]:
        """The session's events until the edge closes this client (`ClientClosed` ends the
        iteration quietly when the close is a normal one, else it is raised)."""
        while True:
            try:
                batch = await self.next()
            except ClientClosed as closed:
                if closed.code == protocol.CLOSE_NORMAL:
                    return
                raise
            for event in batch:
                yield event

    async def next(self) -> list[TapEvent]:
        """The events of the next queued frame (often one, none for a frame only a browser
        needs); raises `ClientClosed` once the edge closed this client. Safe to cancel (e.g.
        under a timeout): a frame is taken from the queue only when it is returned."""
        assert self.channel is not None, "use `async with SessionTap(...)`"
        frame = await self.channel.next_frame()
        # Taking a frame is this client's progress for the router's stall rule (a browser's
        # sender marks it after each send): without it a consumer that reads at its own pace
        # while frames wait (the telephony door, in real time) was closed as too slow.
        self.channel.last_progress = self.channel.clock()
        return self._parse(frame.payload)

    def _parse(self, payload: bytes | str) -> list[TapEvent]:
        if isinstance(payload, bytes):
            audio = protocol.decode_audio(payload)
            turn_id = self._turn_ids.get(audio.turn, "")
            pcm = audio.pcm
            if audio.encoding == protocol.ENCODING_OPUS:
                key = (turn_id, audio.sentence)
                decoder = self._decoders.get(key)
                if decoder is None:
                    decoder = self._decoders[key] = OpusDecoder(audio.sample_rate)
                pcm = decoder.decode(pcm)
                if audio.last_in_sentence:
                    pcm += decoder.flush()
                    del self._decoders[key]
            return [TapAudio(turn_id, audio.sentence, audio.chunk, pcm, audio.sample_rate,
                             audio.last_in_sentence, audio.last_in_turn)]
        message = json.loads(payload)
        kind = message.get("type")
        if kind == protocol.TURN_START:
            self._turn_ids[int(message["turn"])] = message["turn_id"]
            while len(self._turn_ids) > 64:  # as many as the router announces per client
                self._turn_ids.pop(next(iter(self._turn_ids)))
            return [TapTurnStart(message["turn_id"], int(message.get("sample_rate") or 24000))]
        if kind == protocol.WORDS:
            return [TapWords(message["turn_id"], int(message["sentence_seq"]), list(message.get("words") or []))]
        if kind == protocol.SKIP:
            return [TapSkip(message["turn_id"], int(message["sentence_seq"]))]
        if kind in (protocol.TURN_END, protocol.STOP):
            for key in [k for k in self._decoders if k[0] == message["turn_id"]]:
                del self._decoders[key]
            return [TapTurnEnd(message["turn_id"], stopped=kind == protocol.STOP, reason=str(message.get("reason") or ""))]
        return []  # timeline, pong, error: player matters
