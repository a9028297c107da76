"""Streaming audio formats for the HTTP doors: PCM16 chunks in, a file format's bytes out as they come.

The OpenAI-compatible speech endpoint (`voicebus.players.openai_speech`) answers in the format a
client asks for, while the audio is still being synthesized. Each `StreamEncoder` takes PCM16LE
mono chunks (`feed`) and returns the bytes of the file that can go to the client now; `finish`
returns the rest. Compression is PyAV's (FFmpeg's libmp3lame, libopus, its FLAC and AAC
encoders); nothing here is hand-written codec code.

- ``pcm``: the samples as they are (24 kHz, 16-bit little-endian, mono: what OpenAI's ``pcm`` is);
- ``wav``: a WAV header whose sizes say "unknown" (0xFFFFFFFF, as streamed WAV files do), then the samples;
- ``mp3``, ``flac``, ``aac`` (ADTS): their usual stream containers;
- ``opus``: Ogg Opus, one Ogg page per 20 ms packet, so the first bytes leave with the first
  audio (Ogg's default page of one second would hold them back).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class AudioFormat:
    name: str
    content_type: str
    container: str | None = None  # PyAV's muxer; None: written here (pcm, wav)
    codec: str | None = None
    options: Mapping[str, str] | None = None  # the muxer's options


FORMATS: Mapping[str, AudioFormat] = {
    "pcm": AudioFormat("pcm", "audio/pcm"),
    "wav": AudioFormat("wav", "audio/wav"),
    "mp3": AudioFormat("mp3", "audio/mpeg", "mp3", "libmp3lame"),
    "opus": AudioFormat("opus", "audio/ogg", "ogg", "libopus", {"page_duration": "20000"}),
    "flac": AudioFormat("flac", "audio/flac", "flac", "flac"),
    "aac": AudioFormat("aac", "audio/aac", "adts", "aac"),
}


class AudioFormatError(ValueError):
    """PCM that is not whole samples, or a stream fed after it finished."""


def wav_header(sample_rate: int, channels: int = 1, bits: int = 16, data_bytes: int = 0xFFFFFFFF) -> bytes:
    """A 44-byte PCM WAV header; the default sizes say the length is not known yet (a stream)."""
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", data_bytes))


class _Sink:
    """The file PyAV writes to: collects what the muxer writes until it is drained. It has no
    ``seek``: the muxers write a stream (FLAC's header then keeps its "unknown length")."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class StreamEncoder:
    """One response's audio in `fmt` (a `FORMATS` key) at `sample_rate`."""

    def __init__(self, fmt: str, sample_rate: int = 24_000) -> None:
        self.format = FORMATS[fmt]
        self.sample_rate = sample_rate
        self._started = False
        self._finished = False
        self._pts = 0
        self._sink: _Sink | None = None
        self._container = self._stream = None

    def _open(self) -> None:
        import av

        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=self.format.container,
                                  options=dict(self.format.options or {}))
        self._stream = self._container.add_stream(self.format.codec, rate=self.sample_rate)
        self._stream.layout = "mono"

    def header(self) -> bytes:
        """What may be sent before any audio (the WAV header; nothing for the others)."""
        if self._started:
            return b""
        self._started = True
        if self.format.name == "wav":
            return wav_header(self.sample_rate)
        return b""

    def feed(self, pcm: bytes) -> bytes:
        """PCM16LE mono samples in; the bytes of the file that are ready now out."""
        if self._finished:
            raise AudioFormatError("this stream has finished")
        if len(pcm) % 2:
            raise AudioFormatError(f"{len(pcm)} bytes of PCM16 is not whole samples")
        out = self.header()
        if self.format.container is None:
            return out + pcm
        if not pcm:
            return out
        import av
        import numpy as np

        if self._container is None:
            self._open()
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, "<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(pcm) // 2
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return out + self._sink.drain()

    def finish(self) -> bytes:
        """The rest of the file (the encoder's delay, the container's trailer)."""
        if self._finished:
            return b""
        self._finished = True
        out = self.header()
        if self._container is None:
            return out
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return out + self._sink.drain()

    def close(self) -> None:
        """Release the encoder without finishing the file (the client went away)."""
        self._finished = True
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - a half-written stream nobody will read
                pass
