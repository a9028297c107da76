"""Synthetic `AudioChunk`s carrying real PCM16 tones: what tests, the edge benchmark and a browser
demo feed the edge when no synthesis worker runs."""

from __future__ import annotations

import math
import struct

from voicebus.clock import now_us
from voicebus.audio_codec import AudioFormat
from voicebus.schemas.contract import AudioEncoding
from voicebus.schemas.messages import AudioChunk


def tone_pcm(duration_s: float, sample_rate: int = 24000, freq_hz: float = 440.0, amplitude: float = 0.3,
             leading_silence_s: float = 0.0) -> bytes:
    """Mono PCM16LE: `leading_silence_s` of zeros, then a sine tone."""
    silent = int(leading_silence_s * sample_rate)
    n = int(duration_s * sample_rate)
    peak = int(amplitude * 32767)
    samples = [0] * silent + [int(peak * math.sin(2 * math.pi * freq_hz * i / sample_rate)) for i in range(n)]
    return struct.pack(f"<{len(samples)}h", *samples)


def tone_turn(session_id: str, turn_id: str, sentences: int = 2, chunks_per_sentence: int = 3, chunk_ms: int = 150,
              sample_rate: int = 24000, freq_hz: float = 440.0, leading_silence_s: float = 0.0,
              encoding: AudioEncoding = AudioEncoding.PCM16LE) -> list[AudioChunk]:
    """The `AudioChunk`s of one turn, timestamps set as if the pipeline just produced them.
    With ``encoding`` OPUS each sentence is encoded as a worker does (chunks of whole 20 ms
    frames, so ``chunk_ms`` is rounded to them)."""
    t0 = now_us()
    audio = AudioFormat(encoding, sample_rate)
    if encoding == AudioEncoding.OPUS:
        chunk_ms = audio.chunk_bytes(chunk_ms) // 2 * 1000 // sample_rate
    chunks = []
    for s in range(sentences):
        encoder = audio.encoder()
        for c in range(chunks_per_sentence):
            lead = leading_silence_s if (s, c) == (0, 0) else 0.0
            if encoding == AudioEncoding.OPUS:  # whole frames
                lead = round(lead * 1000 / audio.frame_ms) * audio.frame_ms / 1000
            chunks.append(AudioChunk(
                session_id=session_id, turn_id=turn_id, sentence_seq=s, chunk_seq=c,
                is_last_chunk=c == chunks_per_sentence - 1,
                is_last_in_turn=s == sentences - 1 and c == chunks_per_sentence - 1,
                sample_rate=sample_rate, encoding=encoding,
                pcm=encoder.encode(tone_pcm(chunk_ms / 1000, sample_rate, freq_hz, leading_silence_s=lead),
                                   last=c == chunks_per_sentence - 1),
                worker_id="tone", first_token_at_us=t0 - 400_000, text_complete_at_us=t0 - 300_000,
                released_at_us=t0 - 290_000, request_received_at_us=t0 - 280_000,
                synthesis_started_at_us=t0 - 270_000, audio_ready_at_us=t0 - 20_000, published_at_us=t0 - 10_000,
            ))
    return chunks
