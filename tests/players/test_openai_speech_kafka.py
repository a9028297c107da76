"""The OpenAI-compatible speech endpoint through the bus, driven by the official `openai` client.

Real Kafka, the real gate (a subprocess), a synthesis worker on the real kokoro code (tiny random
weights), the real edge. That the audio is speech of the input (Whisper) is checked with the real
weights in tests/players/test_openai_speech_model.py.
"""

from __future__ import annotations

import io

import av
import pytest
from openai import APIStatusError, AsyncOpenAI

from voicebus.bus import read_to_end
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.ops.daemon import free_port
from voicebus.ops.runtime import PipelineStack
from voicebus.synthesis.engine import SynthesisEngine
from tests.waiting import eventually

pytestmark = pytest.mark.kafka

KEY = "test-key"
TEXT = " ".join(f"Part {n} is here." for n in range(5))


@pytest.fixture(scope="module")
def engine():
    return SynthesisEngine.tiny(seed=11)


def client_for(settings, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key, base_url=f"http://127.0.0.1:{settings.edge_port}/v1", max_retries=0)


async def session_chunks(settings, session_id: str) -> list[dict]:
    codec = Codec()
    records = await read_to_end(settings, [settings.audio_topic])
    return [c for r in records if (c := codec.decode(r.value).value)["session_id"] == session_id]


def duration_s(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples / frame.sample_rate for frame in container.decode(audio=0))


async def test_the_openai_client_streams_wav_and_opus_as_the_turn_is_synthesized(make_settings, engine):
    settings = make_settings(edge_port=free_port(), api_keys=KEY, worker_max_in_flight=1)
    async with PipelineStack(settings, engine) as stack:
        client = client_for(stack.settings)
        for fmt in ("wav", "opus"):
            arrivals: list[tuple[int, bytes]] = []
            async with client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="af_heart", input=TEXT, response_format=fmt, speed=1.2) as response:
                assert response.headers["content-type"] == {"wav": "audio/wav", "opus": "audio/ogg"}[fmt]
                session_id = response.headers["x-voicebus-session"]
                async for chunk in response.iter_bytes():
                    arrivals.append((now_us(), chunk))
            chunks = await session_chunks(stack.settings, session_id)
            sentences = sorted({c["sentence_seq"] for c in chunks})
            assert len(sentences) >= 4, f"{fmt}: the gate released {sentences}"
            # the first bytes arrived before the worker had synthesized the whole text
            last_ready = max(c["audio_ready_at_us"] for c in chunks)
            assert arrivals[0][0] < last_ready, f"{fmt}: the first bytes came after the last sentence was synthesized"
            # all of it, as a file of the format: as long as the audio the workers published
            spoken = sum(len(c["pcm"]) for c in chunks) / 2 / 24_000
            assert spoken > 0.5
            assert abs(duration_s(b"".join(c for _, c in arrivals)) - spoken) < 0.1, fmt
        # the plain (not streamed) call reads the same answer whole
        plain = await client.audio.speech.create(model="tts-1", voice="af_heart", input="Short one. Then done.",
                                                 response_format="wav")
        assert duration_s(plain.content) > 0.2


async def test_a_client_that_goes_away_cancels_its_turn_and_a_wrong_key_is_refused(make_settings, engine):
    settings = make_settings(edge_port=free_port(), api_keys=KEY, worker_max_in_flight=1)
    long_text = " ".join(f"Here is a long sentence number {n} that keeps the worker busy." for n in range(20))
    async with PipelineStack(settings, engine) as stack:
        with pytest.raises(APIStatusError) as refused:
            await client_for(stack.settings, "wrong").audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
        assert refused.value.status_code == 401
        client = client_for(stack.settings)
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=long_text, response_format="pcm") as response:
            session_id, turn_id = response.headers["x-voicebus-session"], response.headers["x-voicebus-turn"]
            async for _ in response.iter_bytes():
                break  # the first audio, then the client leaves
        codec = Codec()

        async def cancels() -> list[dict]:
            records = await read_to_end(stack.settings, [stack.settings.control_topic])
            return [e for r in records if (e := codec.decode(r.value).value)["session_id"] == session_id]

        found = await eventually(cancels, timeout_s=30, interval_s=0.2, what="the cancel of the abandoned turn")
        assert [(e["turn_id"], e["action"], e["source"]) for e in found] == [(turn_id, "CANCEL", "openai-speech")]
        await eventually(stack.drained, timeout_s=120, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)
        spoken = {c["sentence_seq"] for c in await session_chunks(stack.settings, session_id)}
        assert len(spoken) < 20, "the workers stopped speaking the turn once its client left"
