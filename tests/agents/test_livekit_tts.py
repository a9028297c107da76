"""`VoicebusTTS`, a LiveKit Agents TTS, speaking through a whole voicebus pipeline: the real
broker, the real gate, a synthesis worker on the tiny kokoro engine, the real edge. Used as
`AgentSession` uses a TTS: `stream()`, text pushed, events iterated; `synthesize()`; `aclose()`."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

pytest.importorskip("livekit.agents", reason="the livekit extra: pip install 'voicebus[livekit]'")

from livekit.agents import APIConnectionError, APIConnectOptions, APITimeoutError  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

from voicebus.agents.livekit_tts import VoicebusTTS  # noqa: E402
from voicebus.bus import read_to_end  # noqa: E402
from voicebus.codecs import Codec  # noqa: E402
from voicebus.players.listener import Listener  # noqa: E402
from tests.agents.plugin_helpers import cancels_of, module_stack  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(kafka_broker, tmp_path_factory):
    async with module_stack(kafka_broker, tmp_path_factory, seed=7) as running:
        yield running


async def published_chunks(stack, session_id: str, turn_id: str) -> list[dict]:
    codec = Codec()
    return [c for r in await read_to_end(stack.settings, [stack.settings.audio_topic])
            if (c := codec.decode(r.value).value)["session_id"] == session_id and c["turn_id"] == turn_id]


async def test_a_stream_speaks_pushed_text_with_an_aligned_transcript_and_synthesize_one_shot(stack):
    text = "Hello from the LiveKit plugin. Words arrive with their times."
    async with VoicebusTTS(settings=stack.settings, session_id="lk-speak") as tts:
        assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
        stream = tts.stream()
        for word in text.split(" "):
            stream.push_text(word + " ")
        stream.end_input()
        events = [ev async for ev in stream]
        # a one-shot synthesis: its own turn
        spoken = await asyncio.wait_for(tts.synthesize("Goodbye for now.").collect(), 60)

    assert events and all(ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1 for ev in events)
    turn_id = events[0].segment_id
    assert {ev.segment_id for ev in events} == {turn_id} and events[-1].is_final
    chunks = await published_chunks(stack, "lk-speak", turn_id)
    assert len({c["sentence_seq"] for c in chunks}) == 2, "the gate spoke the text as two sentences"
    assert sum(ev.frame.samples_per_channel for ev in events) == sum(len(c["pcm"]) // 2 for c in chunks)
    # the aligned transcript: every word, timed from the start of the turn's audio, in order
    words = [w for ev in events for w in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert [str(w) for w in words] == [w + " " for w in text.split(" ")]
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.end_time > w.start_time for w in words)
    first_sentence = sum(len(c["pcm"]) // 2 for c in chunks if c["sentence_seq"] == 0) / 24000
    assert starts[5] >= first_sentence * 0.8, "the second sentence's words start after the first's audio"
    assert words[-1].end_time <= sum(ev.frame.duration for ev in events) + 0.05
    assert spoken.duration > 0.2


async def test_a_turn_the_edge_never_answers_times_out_and_is_cancelled(stack):
    """Nothing of a turn comes from the edge for `turn_idle_timeout_s` after its text (here no gate
    reads the topic it is published to): the synthesis fails with APITimeoutError, saying so, and
    the turn is cancelled on the control topic (no stage is left holding it)."""
    unread = stack.settings.replace(text_topic_prefix=f"unread{stack.settings.text_topic_prefix}")
    async with VoicebusTTS(settings=unread, session_id="lk-idle", turn_idle_timeout_s=1.0) as tts:
        speaking = tts.synthesize("Is anyone there?", conn_options=APIConnectOptions(max_retry=0))
        with pytest.raises(APITimeoutError, match=r"nothing of turn \S+ came from the edge for 1 s"):
            await asyncio.wait_for(speaking.collect(), 60)
    cancels = await eventually(lambda: cancels_of(stack, "lk-idle"), timeout_s=30,
                               what="the timed-out turn's cancel on the control topic")
    assert [c["reason"] for c in cancels] == ["idle-timeout"], "an operator reads why: not a barge-in"


async def test_a_turn_whose_edge_connection_is_lost_fails_and_is_cancelled_as_failed(stack):
    """The edge connection closes mid-turn: the stream fails with APIConnectionError and the turn
    is cancelled everywhere with the reason ``failed`` (no interruption happened)."""
    words = " ".join(f"Sentence number {n} is right here." for n in range(12)).split(" ")
    async with VoicebusTTS(settings=stack.settings, session_id="lk-lost") as tts:
        stream = tts.stream(conn_options=APIConnectOptions(max_retry=0))

        async def llm() -> None:  # an LLM's pace
            for word in words:
                stream.push_text(word + " ")
                await asyncio.sleep(0.05)
            stream.end_input()

        speaking = asyncio.create_task(llm())
        received = []
        with pytest.raises(APIConnectionError, match="during turn"):
            async for ev in stream:
                received.append(ev)
                if len(received) == 1:
                    await tts._listener._ws.close()  # what a lost edge looks like from here
        speaking.cancel()
    cancels = await eventually(lambda: cancels_of(stack, "lk-lost"), timeout_s=30,
                               what="the failed turn's cancel on the control topic")
    assert [(c["turn_id"], c["reason"]) for c in cancels] == [(received[0].segment_id, "failed")]


async def test_aclose_mid_stream_cancels_the_turn_and_no_more_audio_arrives(stack):
    words = " ".join(f"Sentence number {n} is right here." for n in range(12)).split(" ")
    async with VoicebusTTS(settings=stack.settings, session_id="lk-barge") as tts, \
            Listener(stack.edge_url, "lk-barge", stack.settings.edge_secret) as player:
        stream = tts.stream()

        async def llm() -> None:  # an LLM's pace
            for word in words:
                stream.push_text(word + " ")
                await asyncio.sleep(0.05)

        speaking = asyncio.create_task(llm())
        received = []
        async for ev in stream:
            received.append(ev)
            if len(received) == 3:
                break
        speaking.cancel()
        await stream.aclose()  # what AgentSession does when the user interrupts
        turn_id = received[0].segment_id
        assert [ev async for ev in stream] == [], "nothing more comes out of a closed stream"

        cancels = await eventually(lambda: cancels_of(stack, "lk-barge"), timeout_s=30,
                                   what="the turn's cancel on the control topic")
        assert [(c["turn_id"], c["reason"]) for c in cancels] == [(turn_id, "barge-in")]
        heard = await player.wait_turn_end(turn_id, timeout=30)
        assert heard.stopped, "the edge stopped the turn"
        await eventually(stack.drained, timeout_s=60, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)
        await player.ping()  # whatever the edge had written has arrived
        assert heard.frames_after_stop == 0

    chunks = await published_chunks(stack, "lk-barge", turn_id)
    assert max(c["sentence_seq"] for c in chunks) < 11, "the rest of the answer was never synthesized"
