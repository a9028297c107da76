"""`VoicebusTTSService` in a real pipecat pipeline (`PipelineWorker`, `WorkerRunner`), speaking
through a whole voicebus pipeline: the real broker, the real gate, a synthesis worker on the tiny
kokoro engine, the real edge."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

pytest.importorskip("pipecat", reason="the pipecat extra: pip install 'voicebus[pipecat]'")

from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.transcriptions.language import Language  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from voicebus.agents.pipecat_tts import VoicebusTTSService  # noqa: E402
from voicebus.bus import read_to_end  # noqa: E402
from voicebus.codecs import Codec  # noqa: E402
from voicebus.settings import Settings  # noqa: E402
from tests.agents.plugin_helpers import cancels_of, module_stack  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(kafka_broker, tmp_path_factory):
    async with module_stack(kafka_broker, tmp_path_factory, seed=5) as running:
        yield running


class Sink(FrameProcessor):
    """The end of the test pipeline: every frame that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list = []

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list:
        return [f for f in self.frames if isinstance(f, kind)]


class Emitted(BaseObserver):
    """The audio frames the TTS service pushed, each with when (the pipeline clock, ns)."""

    def __init__(self, tts: VoicebusTTSService) -> None:
        super().__init__()
        self.tts = tts
        self.audio: list[tuple[int, TTSAudioRawFrame]] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        if data.source is self.tts and isinstance(data.frame, TTSAudioRawFrame):
            self.audio.append((data.timestamp, data.frame))


class Running:
    """A pipeline [tts, sink] run by a WorkerRunner, started and stopped around a test."""

    def __init__(self, tts: VoicebusTTSService) -> None:
        self.tts, self.sink, self.emitted = tts, Sink(), Emitted(tts)
        self.worker = PipelineWorker(Pipeline([tts, self.sink]), params=PipelineParams(audio_out_sample_rate=24000),
                                     cancel_on_idle_timeout=False, enable_rtvi=False, observers=[self.emitted])
        self.runner = WorkerRunner(handle_sigint=False)
        self.started = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.errors: list[ErrorFrame] = []  # what reached the pipeline's source as errors

        @self.worker.event_handler("on_pipeline_started")
        async def _started(_worker, _frame):
            self.started.set()

        @self.worker.event_handler("on_pipeline_error")
        async def _error(_worker, frame):
            self.errors.append(frame)

    async def __aenter__(self) -> "Running":
        await self.runner.add_workers(self.worker)
        self.task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(self.started.wait(), 60)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.cancel()
        await asyncio.wait_for(self.task, 30)


def tts_for(stack, **kwargs) -> VoicebusTTSService:
    return VoicebusTTSService(settings=stack.settings, **kwargs)


async def test_a_pipecat_language_is_the_voicebus_language_of_its_tag_or_its_primary_subtag():
    tts = VoicebusTTSService(settings=Settings())
    speaks = {lang: tts.language_to_service_language(lang) for lang in
              (Language.EN_GB, Language.PT_BR, Language.FR_CA, Language.IT, Language.HI, Language.JA, Language.ZH,
               Language.ES, Language.DE)}
    assert speaks == {Language.EN_GB: "en-gb", Language.PT_BR: "pt-br", Language.FR_CA: "fr", Language.IT: "it",
                      Language.HI: "hi", Language.JA: "ja", Language.ZH: "zh", Language.ES: "es", Language.DE: None}


async def test_llm_text_comes_out_as_audio_frames_and_timed_words(stack):
    tts = tts_for(stack, session_id="pc-speak")
    text = "Hello from the pipecat plugin. Words arrive with their times."
    async with Running(tts) as run:
        await run.worker.queue_frame(LLMFullResponseStartFrame())
        for word in text.split(" "):
            await run.worker.queue_frame(LLMTextFrame(word + " "))
        await run.worker.queue_frame(LLMFullResponseEndFrame())
        await eventually(lambda: run.sink.of(TTSStoppedFrame), timeout_s=60, what="the turn's TTSStoppedFrame",
                         detail=lambda: f"frames: {[type(f).__name__ for f in run.sink.frames][-20:]}")
        # a TTSSpeakFrame is a turn of its own
        await run.worker.queue_frame(TTSSpeakFrame("Goodbye for now."))
        await eventually(lambda: len(run.sink.of(TTSStoppedFrame)) >= 2, timeout_s=60,
                         what="the spoken frame's TTSStoppedFrame")

    started = run.sink.of(TTSStartedFrame)
    audio = run.sink.of(TTSAudioRawFrame)
    first = started[0].context_id
    assert len(started) == 2 and started[1].context_id != first
    turn_audio = [f for f in audio if f.context_id == first]
    assert turn_audio and all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert any(f.context_id == started[1].context_id for f in audio), "the TTSSpeakFrame was spoken"
    # every sample the workers published for the turn (its turn id is pipecat's context id)
    codec = Codec()
    chunks = [c for r in await read_to_end(stack.settings, [stack.settings.audio_topic])
              if (c := codec.decode(r.value).value)["session_id"] == "pc-speak" and c["turn_id"] == first]
    assert len({c["sentence_seq"] for c in chunks}) == 2, "the gate spoke the text as two sentences"
    assert sum(len(f.audio) for f in turn_audio) == sum(len(c["pcm"]) for c in chunks)
    # word timestamps: TTSTextFrames timed from the audio's start, in order
    words = [f for f in run.sink.of(TTSTextFrame) if f.context_id == first]
    assert [w.text.strip() for w in words] == text.split(" ")
    times = [w.pts for w in words]
    assert all(t is not None for t in times) and times == sorted(times)
    # the second sentence's words start after the first sentence's audio
    first_sentence = sum(len(c["pcm"]) // 2 for c in chunks if c["sentence_seq"] == 0) / 24000
    assert (times[5] - times[0]) / 1e9 > first_sentence * 0.8


async def test_a_turn_the_edge_never_answers_is_given_up_cancelled_and_its_context_ended(stack):
    """A turn whose text has ended and of which nothing comes from the edge for
    `turn_idle_timeout_s` (here no gate reads the topic it is published to) is given up: cancelled
    on the control topic, an ErrorFrame saying so, its context ended with a TTSStoppedFrame."""
    unread = stack.settings.replace(text_topic_prefix=f"unread{stack.settings.text_topic_prefix}")
    tts = VoicebusTTSService(settings=unread, session_id="pc-idle", turn_idle_timeout_s=1.0)
    async with Running(tts) as run:
        await run.worker.queue_frame(TTSSpeakFrame("Is anyone there?"))
        await eventually(lambda: run.sink.of(TTSStoppedFrame), timeout_s=30, what="the given-up turn's TTSStoppedFrame",
                         detail=lambda: f"frames: {[type(f).__name__ for f in run.sink.frames][-20:]}")
        [started] = run.sink.of(TTSStartedFrame)
        cancels = await eventually(lambda: cancels_of(stack, "pc-idle"), timeout_s=30,
                                   what="the given-up turn's cancel on the control topic")
        assert [(c["turn_id"], c["reason"]) for c in cancels] == [(started.context_id, "idle-timeout")]
        await eventually(lambda: not tts._turns, timeout_s=10, what="the service let go of the turn")

    # the service's error first; pipecat adds its own for a context that ended with no audio
    errors = [e.error for e in run.errors]
    assert errors[0] == f"voicebus: nothing of turn {started.context_id} came from the edge for 1 s; given up", errors
    assert len(errors) <= 2 and all(started.context_id in e for e in errors), errors
    assert not run.sink.of(TTSAudioRawFrame)


@pytest.mark.usefixtures("settled_heap")
async def test_an_interruption_stops_the_audio_within_100_ms_and_cancels_the_turn(stack):
    tts = tts_for(stack, session_id="pc-barge")
    words = " ".join(f"Sentence number {n} is right here." for n in range(12)).split(" ")
    async with Running(tts) as run:
        async def llm() -> None:  # an LLM's pace, until the user barges in
            await run.worker.queue_frame(LLMFullResponseStartFrame())
            for word in words:
                await run.worker.queue_frame(LLMTextFrame(word + " "))
                await asyncio.sleep(0.05)

        speaking = asyncio.create_task(llm())
        await eventually(lambda: len(run.sink.of(TTSAudioRawFrame)) >= 3, timeout_s=60, interval_s=0.01,
                         what="the turn's first audio frames")
        speaking.cancel()  # the LLM stops generating when the user barges in, as pipecat's do
        interrupted_at = tts.get_clock().get_time()  # the pipeline's clock (ns), as the observer's
        await run.worker.queue_frame(InterruptionFrame())
        turn_id = run.sink.of(TTSAudioRawFrame)[0].context_id

        cancels = await eventually(lambda: cancels_of(stack, "pc-barge"), timeout_s=30,
                                   what="the turn's cancel on the control topic")
        assert [(c["turn_id"], c["reason"]) for c in cancels] == [(turn_id, "barge-in")]
        # the edge's stop reached the service (it stops following the turn then), and
        # everything the pipeline had in flight went through
        await eventually(lambda: not tts._turns, timeout_s=30, what="the edge's stop for the turn")
        await eventually(stack.drained, timeout_s=60, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)

    # measured where the frames leave the service (its pushes), not after a queue behind it
    assert run.emitted.audio, "the observer saw the service's audio"
    late = [(t - interrupted_at) / 1e6 for t, _ in run.emitted.audio if t > interrupted_at + 100_000_000]
    assert not late, f"audio frames emitted after the interruption (ms): {late}"
    # the rest of the answer was never spoken (the workers stopped at the cancel), and of what
    # was, the pipeline got only what came before the interruption
    codec = Codec()
    chunks = [c for r in await read_to_end(stack.settings, [stack.settings.audio_topic])
              if (c := codec.decode(r.value).value)["session_id"] == "pc-barge"]
    assert max(c["sentence_seq"] for c in chunks) < 11
    assert sum(len(f.audio) for f in run.sink.of(TTSAudioRawFrame)) < sum(len(c["pcm"]) for c in chunks)
