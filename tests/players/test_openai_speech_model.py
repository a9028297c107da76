"""The OpenAI-compatible speech endpoint with real speech: the official `openai` client's audio,
through the bus and the offline pack's Kokoro-82M weights, transcribes back to its input."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from openai import AsyncOpenAI

from voicebus.ops.daemon import free_port
from voicebus.ops.runtime import PipelineStack
from tests.listening import transcribe, word_error_rate, words

pytestmark = [pytest.mark.kafka, pytest.mark.model]

TEXT = "The weather is lovely today. Let us take a walk in the park."


def pcm_of(data: bytes) -> bytes:
    """Any answer format decoded to 24 kHz PCM16 mono."""
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=24_000)
        frames = [r.to_ndarray().reshape(-1) for f in container.decode(audio=0) for r in resampler.resample(f)]
        frames += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return np.concatenate(frames).astype("<i2").tobytes()


async def test_what_the_openai_client_receives_is_the_input_spoken(make_settings, real_engine, whisper):
    settings = make_settings(edge_port=free_port(), api_keys="k")
    async with PipelineStack(settings, real_engine) as stack:
        client = AsyncOpenAI(api_key="k", base_url=f"http://127.0.0.1:{settings.edge_port}/v1", max_retries=0)
        for fmt in ("wav", "opus"):
            body = bytearray()
            async with client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="af_heart", input=TEXT, response_format=fmt) as response:
                async for chunk in response.iter_bytes():
                    body += chunk
            heard = transcribe(whisper, pcm_of(bytes(body)))
            assert word_error_rate(words(TEXT), words(heard)) <= 0.15, f"{fmt}: {heard!r}"
