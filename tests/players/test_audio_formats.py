"""The streaming audio formats of the HTTP doors: each decodes back to the audio fed, bytes leave as audio comes."""

import io

import av
import numpy as np
import pytest

from voicebus.players.audio_formats import FORMATS, AudioFormatError, StreamEncoder, wav_header

RATE = 24_000


def tone(seconds: float, hz: float = 220.0) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    return (np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes()


def decoded(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        out = [r.to_ndarray().reshape(-1) for f in container.decode(audio=0) for r in resampler.resample(f)]
        out += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return np.concatenate(out)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_streams_while_fed_and_decodes_to_the_audio(fmt):
    encoder = StreamEncoder(fmt, RATE)
    chunks = [tone(0.15) for _ in range(20)]  # 3 s in 150 ms chunks, as workers send them
    parts = [encoder.feed(c) for c in chunks]
    parts.append(encoder.finish())
    # bytes leave long before the end: no format holds the whole answer back
    assert sum(len(p) for p in parts[:5]) > 0
    assert sum(1 for p in parts[:-1] if p) >= 10
    data = b"".join(parts)
    if fmt == "pcm":
        samples = np.frombuffer(data, "<i2")
    else:
        samples = decoded(data)
    assert abs(len(samples) - 3 * RATE) < 0.1 * RATE  # codec delay and padding only
    source = np.frombuffer(b"".join(chunks), "<i2").astype(float)
    level = np.sqrt(np.mean(samples.astype(float) ** 2)) / np.sqrt(np.mean(source ** 2))
    assert 0.7 < level < 1.3, f"{fmt}: level {level:.2f} of the source"


def test_wav_says_its_length_is_unknown_and_pcm_follows():
    encoder = StreamEncoder("wav", RATE)
    data = encoder.feed(tone(0.1)) + encoder.finish()
    assert data[:44] == wav_header(RATE) and data[40:44] == b"\xff\xff\xff\xff"
    assert data[44:] == tone(0.1)


def test_an_empty_stream_is_still_a_file_header_and_odd_bytes_are_refused():
    assert StreamEncoder("wav").finish() == wav_header(RATE)
    with pytest.raises(AudioFormatError):
        StreamEncoder("pcm").feed(b"\x00")
    encoder = StreamEncoder("mp3")
    encoder.finish()
    with pytest.raises(AudioFormatError):
        encoder.feed(tone(0.1))
