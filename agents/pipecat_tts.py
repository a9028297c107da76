"""voicebus as a pipecat TTS service (extra ``voicebus[pipecat]``): `VoicebusTTSService`.

Owns one voicebus session for the pipeline it sits in: a `Publisher` that publishes the LLM's
text as token events of a turn, and a `Listener` on the edge that receives the session's audio,
which it hands to pipecat as `TTSAudioRawFrame`s (PCM16 mono, at the pipeline's output rate).

What maps to what:

- a pipecat TTS context (one LLM response, or one `TTSSpeakFrame`) is one voicebus turn, the turn
  id being the context id; the text of `run_tts` goes out as token events as it streams
  (`TextAggregationMode.TOKEN` by default: the gate does sentence segmentation itself, so
  pipecat's own sentence aggregation would only add its wait; `SENTENCE` works too);
- the end of the LLM response (`flush_audio`) is the turn's END_OF_TURN;
- an interruption (`InterruptionFrame`) is a CANCEL of the turn on the control topic
  (`Publisher.cancel`); pipecat drops the context's audio at once and the edge stops the rest;
- the edge's ``words`` messages (in samples from their sentence's start) become pipecat word
  timestamps (seconds from the start of the turn's audio), hence `TTSTextFrame`s timed to the
  audio; the edge's ``turn_end`` or ``stop`` ends the context with a `TTSStoppedFrame`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService
from pipecat.transcriptions.language import Language

from voicebus.agents.sdk import Publisher, Turn, new_session_id
from voicebus.players import protocol
from voicebus.players.listener import AUDIO, CLOSED, Listener, TurnEvent
from voicebus.schemas.contract import LANGUAGES, CancelReason
from voicebus.settings import Settings

KOKORO_SAMPLE_RATE = 24000
# A turn whose text has ended and that hears nothing from the edge for this long (no gate, no
# worker, a turn that waited for the floor that long) is given up: cancelled, its context ended.
TURN_IDLE_TIMEOUT_S = 60.0
# An interrupted turn's events are drained until the edge's stop (so none is left behind in the
# listener); a stop that never comes (the edge lost) ends the drain after this long.
INTERRUPTED_DRAIN_S = 5.0


@dataclass
class _TurnState:
    """One voicebus turn of this service: its publishing side and what the edge sent of it."""

    turn: Turn
    events: asyncio.Queue
    pump: asyncio.Task | None = None
    interrupted_at: float | None = None  # time.monotonic() of the interruption
    heard_at: float = field(default_factory=time.monotonic)  # when the edge last sent something of it
    samples: int = 0  # samples of the turn's audio received so far (the edge's rate)
    sentence_starts: dict[int, int] = field(default_factory=dict)  # sentence -> its first sample in the turn


class VoicebusTTSService(TTSService):
    """Speaks a pipecat pipeline's text through voicebus (a gate, synthesis workers and an edge
    already running for `settings`), in one session: `session_id`, or a new one.

    `edge_url` (default ``settings.edge_url``) is the edge the session's audio is read from,
    with a token signed by `edge_secret` (default ``settings.edge_secret``) or `edge_token`
    (one issued elsewhere, `voicebus token`). `voice` and `language` are the turns' (runtime
    changes: ``TTSUpdateSettingsFrame(delta=TTSSettings(voice=...))``); None: the gate's default.
    A turn whose text has ended and that hears nothing from the edge for `turn_idle_timeout_s`
    is given up (cancelled, an error pushed, its context stopped).
    """

    def __init__(
        self,
        *,
        settings: Settings | None = None,
        session_id: str | None = None,
        agent_id: str = "pipecat",
        edge_url: str | None = None,
        edge_secret: str | None = None,
        edge_token: str | None = None,
        voice: str | None = None,
        language: Language | str | None = None,
        text_aggregation_mode: TextAggregationMode | None = TextAggregationMode.TOKEN,
        sample_rate: int | None = KOKORO_SAMPLE_RATE,
        turn_idle_timeout_s: float = TURN_IDLE_TIMEOUT_S,
        **kwargs,
    ) -> None:
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            # the words the edge times make the text frames (TTSTextFrame), in step with the audio
            push_text_frames=False,
            # voicebus ends every turn with turn_end or stop: the service pushes TTSStoppedFrame then
            push_stop_frames=False,
            push_start_frame=True,
            sample_rate=sample_rate,
            settings=TTSSettings(model="kokoro-82m", voice=voice, language=language),
            **kwargs,
        )
        self.voicebus_settings = settings or Settings.from_env()
        self.session_id = session_id or new_session_id()
        self.agent_id = agent_id
        self._edge_url = edge_url or self.voicebus_settings.edge_url
        self._edge_secret = edge_secret if edge_secret is not None else self.voicebus_settings.edge_secret
        self._edge_token = edge_token
        self._turn_idle_timeout_s = turn_idle_timeout_s
        self._publisher: Publisher | None = None
        self._listener: Listener | None = None
        self._turns: dict[str, _TurnState] = {}
        self._cancels: set[asyncio.Task] = set()
        self._listener_lost = False  # its connection to the edge ended: the next turn opens a new one

    def can_generate_metrics(self) -> bool:
        return True

    @property
    def supports_processing_metrics(self) -> bool:
        # run_tts only publishes; the audio comes back through the listener (TTFB covers it)
        return False

    def language_to_service_language(self, language: Language) -> str | None:
        """voicebus's language code (``en``, ``en-gb``, ``es``, ``pt``...) for a pipecat language:
        the full tag when voicebus knows it, else its primary subtag; None when it cannot speak it."""
        code = str(language.value if isinstance(language, Language) else language).lower()
        if code in LANGUAGES:
            return code
        primary = code.split("-")[0]
        return primary if primary in LANGUAGES else None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, frame) -> None:
        await super().start(frame)
        try:
            await self._connect()
        except Exception as exc:  # the first text tries again
            await self.push_error(error_msg=f"voicebus: could not reach the bus or the edge: {exc}", exception=exc)
            await self._call_event_handler("on_connection_error", f"{exc}")

    async def stop(self, frame) -> None:
        await super().stop(frame)  # the contexts still open play out first
        await self._disconnect()

    async def cancel(self, frame) -> None:
        await super().cancel(frame)
        await self._disconnect()

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._disconnect()

    async def _connect(self) -> None:
        if self._publisher is not None:
            return
        publisher = Publisher(self.voicebus_settings, agent_id=self.agent_id)
        listener = Listener(self._edge_url, self.session_id, self._edge_secret, token=self._edge_token)
        try:
            await publisher.start()
            await listener.start()
        except BaseException:
            await listener.stop()
            await publisher.stop()
            raise
        self._publisher, self._listener = publisher, listener
        await self._call_event_handler("on_connected")

    async def _reconnect_listener(self) -> None:
        listener = Listener(self._edge_url, self.session_id, self._edge_secret, token=self._edge_token)
        try:
            await listener.start()
        except BaseException:
            await listener.stop()
            raise
        old, self._listener, self._listener_lost = self._listener, listener, False
        await old.stop()

    async def _disconnect(self) -> None:
        publisher, listener = self._publisher, self._listener
        if publisher is None:
            return
        for state in list(self._turns.values()):
            if state.pump is not None:
                await self.cancel_task(state.pump)
        self._turns.clear()
        if self._cancels:  # a barge-in's cancel still on its way to the broker goes out first
            await asyncio.gather(*self._cancels, return_exceptions=True)
        self._publisher = self._listener = None
        await listener.stop()
        await publisher.stop()
        await self._call_event_handler("on_disconnected")

    # --- text in --------------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Publish `text` as the next token of the context's turn (opened by its first text)."""
        try:
            if self._publisher is None:
                await self._connect()
            state = self._turns.get(context_id)
            if state is None:
                if self._listener_lost:
                    await self._reconnect_listener()
                state = self._open_turn(context_id)
            if state.turn.ended or state.interrupted_at is not None:  # a context pipecat dropped
                return
            await state.turn.token(text)
            await self.start_tts_usage_metrics(text)
            yield None  # the audio comes through the listener, into the context
        except Exception as exc:
            yield ErrorFrame(error=f"voicebus: could not publish text: {exc}")

    def _open_turn(self, context_id: str) -> _TurnState:
        voice = self._settings.voice or None
        language = self._settings.language or None
        turn = self._publisher.turn(self.session_id, context_id, voice=voice, language=language)
        # following before the first token is published, so none of the turn's audio is missed
        state = _TurnState(turn, self._listener.follow(context_id))
        self._turns[context_id] = state
        state.pump = self.create_task(self._pump(context_id, state), name=f"voicebus-turn-{context_id}")
        return state

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The end of the LLM response: END_OF_TURN (the gate releases the last sentence)."""
        state = self._turns.get(context_id or self.get_active_audio_context_id() or "")
        if state is not None and not state.turn.ended:
            await state.turn.end()

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """A barge-in: cancel the turn everywhere. Published in the background, so the
        interruption goes on down the pipeline without waiting for the broker's ack."""
        state = self._turns.get(context_id)
        if state is not None and state.interrupted_at is None:
            state.interrupted_at = time.monotonic()
            task = self.create_task(self._cancel_turn(state, CancelReason.BARGE_IN), name=f"voicebus-cancel-{context_id}")
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
        await super().on_audio_context_interrupted(context_id)

    async def _cancel_turn(self, state: _TurnState, reason: CancelReason) -> None:
        try:
            if not state.turn.ended:
                await state.turn.cancel(reason=reason)
            elif self._publisher is not None:  # its text had ended; its audio had not
                await self._publisher.cancel(self.session_id, state.turn.turn_id, reason=reason)
        except Exception as exc:
            await self.push_error(error_msg=f"voicebus: could not cancel turn {state.turn.turn_id}: {exc}",
                                  exception=exc)

    # --- audio out ------------------------------------------------------------------------------

    async def _pump(self, context_id: str, state: _TurnState) -> None:
        """Hand what the edge sends of the turn to the context, until its turn_end or stop."""
        keepalive_s = max(0.2, self._stop_frame_timeout_s / 3)
        try:
            while True:
                try:
                    event = await asyncio.wait_for(state.events.get(), keepalive_s)
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    if state.interrupted_at is not None:
                        if now - state.interrupted_at > INTERRUPTED_DRAIN_S:
                            return
                    elif state.turn.ended and now - state.heard_at > self._turn_idle_timeout_s:
                        await self._give_up(context_id, state)
                        return
                    else:
                        # pipecat ends a context that stays quiet for stop_frame_timeout_s; voicebus
                        # ends every turn (turn_end or stop), so the context stays open until then
                        # (the first audio waits for the sentence's end, a queued turn for the floor)
                        self._refresh_audio_context(context_id)
                    continue
                state.heard_at = time.monotonic()
                if event.kind in (AUDIO, protocol.WORDS):
                    if state.interrupted_at is None:
                        await self._on_audio_or_words(context_id, state, event)
                    continue
                if event.kind == CLOSED:
                    self._listener_lost = True
                if state.interrupted_at is None and self.audio_context_available(context_id):
                    if event.kind == CLOSED:
                        await self.push_error(error_msg=f"voicebus: {event.reason} during turn {context_id}")
                    await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                    await self.remove_audio_context(context_id)
                return
        finally:
            self._turns.pop(context_id, None)
            if self._listener is not None:
                self._listener.unfollow(context_id)

    async def _give_up(self, context_id: str, state: _TurnState) -> None:
        state.interrupted_at = time.monotonic()
        await self._cancel_turn(state, CancelReason.IDLE_TIMEOUT)
        await self.push_error(error_msg=f"voicebus: nothing of turn {context_id} came from the edge "
                                        f"for {self._turn_idle_timeout_s:g} s; given up")
        if self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)

    def _sentence_start(self, state: _TurnState, sentence: int) -> int:
        # a sentence's words come just before its first audio, after all of the previous
        # sentence's: where it starts in the turn is the audio received so far
        return state.sentence_starts.setdefault(sentence, state.samples)

    async def _on_audio_or_words(self, context_id: str, state: _TurnState, event: TurnEvent) -> None:
        start = self._sentence_start(state, event.sentence)
        if event.kind == protocol.WORDS:
            rate = event.sample_rate or KOKORO_SAMPLE_RATE
            await self.add_word_timestamps(
                [(w["text"], (start + int(w["start"])) / rate) for w in event.words if w.get("text")], context_id)
            return
        state.samples += len(event.pcm) // 2
        pcm = event.pcm
        if event.sample_rate != self.sample_rate:
            pcm = await self._resampler.resample(pcm, event.sample_rate, self.sample_rate)
        if pcm:
            await self.append_to_audio_context(
                context_id, TTSAudioRawFrame(pcm, self.sample_rate, 1, context_id=context_id))
