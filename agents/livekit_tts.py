"""voicebus as a LiveKit Agents TTS (extra ``voicebus[livekit]``): `VoicebusTTS`.

Owns one voicebus session for the agent it speaks for: a `Publisher` that publishes the agent's
text as token events, and a `Listener` on the edge that receives the session's audio, which it
hands to LiveKit through the `AudioEmitter` (PCM16 mono, 24 kHz) with the words' timings.

What maps to what:

- one `SynthesizeStream` (`tts.stream()`, what `AgentSession` opens for each reply) is one voicebus
  turn: every `push_text` is published as a token as it comes (the gate segments sentences
  itself, so no LiveKit tokenizer sits in between); `flush()` / `end_input()` is END_OF_TURN;
- `synthesize(text)` (`ChunkedStream`) is a turn of one token and its end;
- `aclose()` before the turn's audio has all come (the agent interrupted) is a CANCEL of the
  turn on the control topic (`Publisher.cancel`); no more of its audio is emitted;
- the edge's ``words`` messages (in samples from their sentence's start) become the aligned
  transcript: a `TimedString` per word, in seconds from the start of the turn's audio;
- the edge's ``turn_end`` ends the segment; its ``stop`` (the turn cancelled elsewhere: a
  barge-in at a web player, a preempting turn) ends it with the audio heard so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

from aiokafka.errors import KafkaError
from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APITimeoutError,
    tts,
    utils,
)
from livekit.agents.types import TimedString

from voicebus.agents.sdk import AgentError, Publisher, new_session_id, new_turn_id
from voicebus.players import protocol
from voicebus.players.listener import AUDIO, CLOSED, Listener
from voicebus.schemas.contract import CancelReason
from voicebus.settings import Settings

KOKORO_SAMPLE_RATE = 24000
# A turn that hears nothing from the edge for this long (no gate, no worker, a turn that waited for
# the floor that long) is given up: cancelled, and the stream fails with APITimeoutError.
TURN_IDLE_TIMEOUT_S = 60.0


class VoicebusTTS(tts.TTS):
    """Speaks a LiveKit agent's replies through voicebus (a gate, synthesis workers and an edge
    already running for `settings`), in one session: `session_id`, or a new one.

    `edge_url` (default ``settings.edge_url``) is the edge the session's audio is read from,
    with a token signed by `edge_secret` (default ``settings.edge_secret``) or `edge_token`
    (one issued elsewhere, `voicebus token`). `voice` and `language` are the turns' (None: the
    gate's defaults; `update_options` changes them). A turn that hears nothing from the edge
    for `turn_idle_timeout_s` is given up. Connects on first use (or `prewarm()`); `aclose()`
    closes the streams still open, the listener and the producer.
    """

    def __init__(
        self,
        *,
        settings: Settings | None = None,
        session_id: str | None = None,
        agent_id: str = "livekit",
        edge_url: str | None = None,
        edge_secret: str | None = None,
        edge_token: str | None = None,
        voice: str | None = None,
        language: str | None = None,
        turn_idle_timeout_s: float = TURN_IDLE_TIMEOUT_S,
    ) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=KOKORO_SAMPLE_RATE, num_channels=1)
        self.voicebus_settings = settings or Settings.from_env()
        self.session_id = session_id or new_session_id()
        self.agent_id = agent_id
        self.voice, self.language = voice, language
        self.turn_idle_timeout_s = turn_idle_timeout_s
        self._edge_url = edge_url or self.voicebus_settings.edge_url
        self._edge_secret = edge_secret if edge_secret is not None else self.voicebus_settings.edge_secret
        self._edge_token = edge_token
        self._publisher: Publisher | None = None
        self._listener: Listener | None = None
        self._connecting: asyncio.Lock | None = None
        self._streams: weakref.WeakSet[tts.SynthesizeStream | tts.ChunkedStream] = weakref.WeakSet()
        self._prewarm: asyncio.Task | None = None

    @property
    def model(self) -> str:
        return "kokoro-82m"

    @property
    def provider(self) -> str:
        return "voicebus"

    def update_options(self, *, voice: str | None = None, language: str | None = None) -> None:
        """The voice and language of the turns opened from now on."""
        self.voice = voice or self.voice
        self.language = language or self.language

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "VoicebusChunkedStream":
        stream = VoicebusChunkedStream(tts=self, input_text=text, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "VoicebusSynthesizeStream":
        stream = VoicebusSynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        """Connect now (the producer and the listener), so the first reply does not wait for it."""
        with contextlib.suppress(RuntimeError):  # no running loop: connect on first use
            self._prewarm = asyncio.get_running_loop().create_task(self._connect(DEFAULT_API_CONNECT_OPTIONS.timeout))

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        if self._prewarm is not None:
            await utils.aio.cancel_and_wait(self._prewarm)
        listener, publisher = self._listener, self._publisher
        self._listener = self._publisher = None
        if listener is not None:
            await listener.stop()
        if publisher is not None:
            await publisher.stop()

    async def _connect(self, timeout_s: float) -> tuple[Publisher, Listener]:
        """The producer and the listener, started on first use; a listener whose connection to
        the edge ended is replaced."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            try:
                if self._publisher is None:
                    publisher = Publisher(self.voicebus_settings, agent_id=self.agent_id)
                    await _started(publisher, timeout_s)
                    self._publisher = publisher
                if self._listener is None:
                    listener = Listener(self._edge_url, self.session_id, self._edge_secret, token=self._edge_token)
                    await _started(listener, timeout_s)
                    self._listener = listener
            except (OSError, asyncio.TimeoutError, ConnectionError, KafkaError) as exc:
                raise APIConnectionError(f"voicebus: could not reach the bus or the edge: {exc}") from exc
            return self._publisher, self._listener

    async def _listener_lost(self, listener: Listener) -> None:
        if self._listener is listener:
            self._listener = None
            await listener.stop()


async def _started(owned: Publisher | Listener, timeout_s: float) -> None:
    """`owned` started within `timeout_s` (0: no limit), or stopped again and the error raised."""
    try:
        await asyncio.wait_for(owned.start(), timeout_s or None)
    except BaseException:
        await owned.stop()
        raise


class VoicebusSynthesizeStream(tts.SynthesizeStream):
    """One reply as one voicebus turn: text in as it is pushed, audio and timed words out."""

    def __init__(self, *, tts: VoicebusTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._voicebus = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        turn_id = new_turn_id()
        output_emitter.initialize(request_id=turn_id, sample_rate=self._voicebus.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)

        async def texts() -> AsyncIterator[str]:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    return  # the end of the segment: one stream speaks one turn
                yield data

        def started() -> None:
            self._mark_started()
            output_emitter.start_segment(segment_id=turn_id)

        if await _speak(self._voicebus, turn_id, texts(), output_emitter, started, self._conn_options):
            output_emitter.end_segment()


class VoicebusChunkedStream(tts.ChunkedStream):
    """`synthesize(text)`: the whole text as one voicebus turn."""

    def __init__(self, *, tts: VoicebusTTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._voicebus = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        turn_id = new_turn_id()
        output_emitter.initialize(request_id=turn_id, sample_rate=self._voicebus.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=False)

        async def texts() -> AsyncIterator[str]:
            yield self._input_text

        await _speak(self._voicebus, turn_id, texts(), output_emitter, lambda: None, self._conn_options)


async def _speak(voicebus: VoicebusTTS, turn_id: str, texts: AsyncIterator[str], emitter: tts.AudioEmitter,
                 started, conn_options: APIConnectOptions) -> bool:
    """Publish `texts` as the tokens of turn `turn_id` and its end, and emit what the edge sends
    of the turn until its ``turn_end`` or ``stop``. Returns whether a turn was spoken (False: no
    text came). Left early (cancelled, failed), the turn is cancelled."""
    publisher, listener = await voicebus._connect(conn_options.timeout)
    events = listener.follow(turn_id)  # before the first token: none of its audio is missed
    turn = publisher.turn(voicebus.session_id, turn_id, voice=voicebus.voice, language=voicebus.language)

    async def publish() -> int:
        sent = 0
        async for text in texts:
            if not sent and not text.strip():
                continue  # a turn opens with its first words
            if not sent:
                started()
            sent += await turn.token(text) is not None
        if sent:
            await turn.end()
        return sent

    async def receive() -> None:
        samples, starts = 0, {}  # the turn's audio so far; sentence -> its first sample in the turn
        while True:
            try:
                event = await asyncio.wait_for(events.get(), voicebus.turn_idle_timeout_s)
            except asyncio.TimeoutError:
                raise APITimeoutError(f"voicebus: nothing of turn {turn_id} came from the edge for "
                                      f"{voicebus.turn_idle_timeout_s:g} s") from None
            if event.kind == CLOSED:
                await voicebus._listener_lost(listener)
                raise APIConnectionError(f"voicebus: {event.reason} during turn {turn_id}")
            if event.kind not in (AUDIO, protocol.WORDS):
                return  # turn_end, or stop: the turn was cancelled elsewhere
            # a sentence's words come just before its first audio, after all of the previous
            # sentence's: where it starts in the turn is the audio received so far
            start = starts.setdefault(event.sentence, samples)
            if event.sample_rate != voicebus.sample_rate:
                raise APIError(f"voicebus: the edge sent {event.sample_rate} Hz audio, not {voicebus.sample_rate}",
                               retryable=False)
            if event.kind == protocol.WORDS:
                emitter.push_timed_transcript([
                    TimedString(w["text"] + " ", start_time=(start + int(w["start"])) / event.sample_rate,
                                end_time=(start + int(w["end"])) / event.sample_rate)
                    for w in event.words if w.get("text")])
            elif event.pcm:
                samples += len(event.pcm) // 2
                emitter.push(event.pcm)

    publishing = asyncio.create_task(publish(), name=f"voicebus-publish-{turn_id}")
    receiving = asyncio.create_task(receive(), name=f"voicebus-receive-{turn_id}")
    settled = False
    reason = CancelReason.BARGE_IN  # left early without an error of its own: aclose, the agent interrupted
    try:
        await asyncio.wait({publishing, receiving}, return_when=asyncio.FIRST_COMPLETED)
        if publishing.done():
            try:
                sent = publishing.result()
            except AgentError as exc:  # what the contract refuses (a language no stage speaks...)
                raise APIError(f"voicebus: {exc}", retryable=False) from exc
            except KafkaError as exc:
                raise APIConnectionError(f"voicebus: could not publish the text: {exc}") from exc
            if not sent:
                settled = True  # no text came: no turn was opened
                return False
        await receiving  # the turn's end (or its stop) at the edge
        settled = True
        return True
    except APITimeoutError:
        reason = CancelReason.IDLE_TIMEOUT
        raise
    except Exception:
        reason = CancelReason.FAILED
        raise
    finally:
        for task in (publishing, receiving):
            if not task.done():
                task.cancel()
        await asyncio.gather(publishing, receiving, return_exceptions=True)
        listener.unfollow(turn_id)
        if not settled and turn.events.next_seq:
            # left before the turn's end with some of it published (aclose: the agent was
            # interrupted; or a failure): cancel it everywhere, saying which. Shielded: a second
            # cancellation of this task cannot lose it.
            with contextlib.suppress(Exception):
                await asyncio.shield(publisher.cancel(voicebus.session_id, turn_id, reason=reason))
