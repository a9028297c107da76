"""The audio encodings of voicebus: what an AudioChunk's ``pcm`` holds, made and read in one place.

``Settings.audio_encoding`` chooses what the synthesis workers write to the bus, and so what the
edges forward and the players decode (the edge does not transcode: its frames carry the chunk's
bytes as they are):

* ``pcm16`` (`AudioEncoding.PCM16LE`): 16-bit little-endian mono samples, 48 KB/s at 24 kHz;
* ``opus`` (`AudioEncoding.OPUS`): Opus packets (``opus_bitrate``, constrained VBR, ``opus_frame_ms`` per
  packet, application VOIP: tuned for speech), framed as `voicebus.schemas.contract.pack_opus_packets`
  says. 3.74 KB/s of AudioChunk records per session at 24 kbit/s vs 48.5 for PCM16
  (docs/benchmarks.md, `voicebus bench scale`).

Chunk boundaries stay where cancel and skip act: each chunk holds whole packets, and a sentence's
chunks come from one encoder (`AudioFormat.encoder`), so its packets follow each other without a
seam; the encoder is flushed at the sentence's last chunk (its lookahead, a few ms, is in the
last packets). A chunk of PCM cut for Opus is a whole number of frames (`AudioFormat.chunk_bytes`);
only a sentence's last chunk is padded with silence to its last frame.

Opus comes from FFmpeg's libopus through PyAV (``av``): a maintained binding with wheels that
bundle FFmpeg and libopus on PyPI for Linux, macOS and Windows, so no system library is needed;
decoding (the Python listener, the quality test) uses the same binding. libopus decodes
at 48 kHz here; `OpusDecoder` resamples to the chunk's rate with FFmpeg's resampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from voicebus.schemas.contract import (
    OPUS_SAMPLE_RATES,
    AudioEncoding,
    pack_opus_packets,
    split_opus_packets,
)

if TYPE_CHECKING:
    from voicebus.settings import Settings

BYTES_PER_SAMPLE = 2
PCM16 = "pcm16"
OPUS = "opus"
SETTING_VALUES = {PCM16: AudioEncoding.PCM16LE, OPUS: AudioEncoding.OPUS}
OPUS_FRAME_MS = (10, 20, 40, 60)
OPUS_BITRATES = range(6_000, 510_001)  # what libopus accepts


class AudioCodecError(ValueError):
    """An audio format voicebus cannot make or read (a bad setting, a payload that does not decode)."""


class ChunkEncoder(Protocol):
    def encode(self, pcm: bytes, *, last: bool) -> bytes:
        """One chunk's PCM16 in, the chunk's payload out; ``last`` ends the sentence."""


@dataclass(frozen=True)
class AudioFormat:
    """What a worker writes: the encoding and, for Opus, its bitrate and frame length."""

    encoding: AudioEncoding = AudioEncoding.PCM16LE
    sample_rate: int = 24_000
    bitrate: int = 24_000
    frame_ms: int = 20

    def __post_init__(self) -> None:
        if self.encoding == AudioEncoding.OPUS:
            if self.sample_rate not in OPUS_SAMPLE_RATES:
                raise AudioCodecError(f"Opus cannot encode {self.sample_rate} Hz (one of {sorted(OPUS_SAMPLE_RATES)})")
            if self.frame_ms not in OPUS_FRAME_MS:
                raise AudioCodecError(f"Opus frames are {', '.join(map(str, OPUS_FRAME_MS))} ms, not {self.frame_ms}")
            if self.bitrate not in OPUS_BITRATES:
                raise AudioCodecError(f"Opus bitrate {self.bitrate} is outside 6000..510000 bits/s")

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000 if self.encoding == AudioEncoding.OPUS else 1

    @property
    def unit_bytes(self) -> int:
        """The PCM bytes a chunk that is not a sentence's last is made of: whole Opus frames, or
        whole samples."""
        return self.frame_samples * BYTES_PER_SAMPLE if self.encoding == AudioEncoding.OPUS else BYTES_PER_SAMPLE

    def chunk_bytes(self, chunk_ms: int) -> int:
        """PCM bytes of one chunk of about ``chunk_ms``: whole Opus frames (at least one)."""
        samples = max(1, self.sample_rate * chunk_ms // 1000)
        frames = max(1, round(samples / self.frame_samples))
        return frames * self.frame_samples * BYTES_PER_SAMPLE

    def encoder(self) -> ChunkEncoder:
        """A fresh encoder for one sentence."""
        if self.encoding == AudioEncoding.OPUS:
            return OpusEncoder(self.sample_rate, self.bitrate, self.frame_ms)
        return _Pcm16()


def audio_format(settings: "Settings", sample_rate: int) -> AudioFormat:
    """The format the settings ask for at the engine's ``sample_rate``; `AudioCodecError` when
    the setting names no encoding or Opus cannot be made as configured."""
    try:
        encoding = SETTING_VALUES[settings.audio_encoding.strip().lower()]
    except KeyError:
        raise AudioCodecError(f"VOICEBUS_AUDIO_ENCODING={settings.audio_encoding!r}: "
                              f"one of {', '.join(SETTING_VALUES)}") from None
    return AudioFormat(encoding, sample_rate, settings.opus_bitrate, settings.opus_frame_ms)


class _Pcm16:
    def encode(self, pcm: bytes, *, last: bool) -> bytes:
        return pcm


class OpusEncoder:
    """One sentence's Opus encoder: PCM16 chunks in, length-prefixed packets out.

    Every chunk but the last must be whole frames; the last is padded with silence and the
    encoder flushed, so the sentence's packets all leave with its last chunk."""

    def __init__(self, sample_rate: int = 24_000, bitrate: int = 24_000, frame_ms: int = 20) -> None:
        self.sample_rate = sample_rate
        self.bitrate = bitrate
        self.frame_ms = frame_ms
        self.frame_samples = sample_rate * frame_ms // 1000
        self._context = None  # opened with the first audio: an end-of-turn marker has none
        self._pts = 0
        self._flushed = False

    def _open(self):
        import av

        context = av.CodecContext.create("libopus", "w")
        context.sample_rate = self.sample_rate
        context.layout = "mono"
        context.format = "s16"
        context.bit_rate = self.bitrate
        # constrained VBR: speech still spends fewer bits on easy frames, and no stream runs far over
        # the target (unconstrained VBR put a steady tone at 34 kbit/s for a 24 kbit/s target)
        context.options = {"frame_duration": str(self.frame_ms), "application": "voip", "vbr": "constrained"}
        context.open()
        return context

    def encode(self, pcm: bytes, *, last: bool) -> bytes:
        import av
        import numpy as np

        if self._flushed or (self._context is None and not pcm):
            if pcm:
                raise AudioCodecError("this sentence's Opus encoder was already flushed")
            return b""
        if len(pcm) % BYTES_PER_SAMPLE:
            raise AudioCodecError(f"{len(pcm)} bytes of PCM16 is not whole samples")
        samples = np.frombuffer(pcm, "<i2")
        rest = len(samples) % self.frame_samples
        if rest:
            if not last:
                raise AudioCodecError(f"a chunk of {len(samples)} samples is not whole {self.frame_samples}-sample "
                                      "Opus frames (only a sentence's last chunk may be)")
            samples = np.concatenate([samples, np.zeros(self.frame_samples - rest, "<i2")])
        if self._context is None:
            self._context = self._open()
        packets: list[bytes] = []
        for at in range(0, len(samples), self.frame_samples):
            frame = av.AudioFrame.from_ndarray(samples[at:at + self.frame_samples].reshape(1, -1),
                                               format="s16", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            self._pts += self.frame_samples
            packets.extend(bytes(p) for p in self._context.encode(frame))
        if last:
            packets.extend(bytes(p) for p in self._context.encode(None))
            self._flushed = True
        return pack_opus_packets(packets)


class OpusDecoder:
    """Length-prefixed Opus payloads in, PCM16 at ``sample_rate`` out; one per stream of packets
    (a player's turn): its state runs on from one chunk to the next, as an encoder's did."""

    def __init__(self, sample_rate: int = 24_000) -> None:
        import av

        self.sample_rate = sample_rate
        self._context = av.CodecContext.create("libopus", "r")
        self._context.layout = "mono"
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate)

    def decode(self, payload: bytes) -> bytes:
        import av

        out = bytearray()
        try:
            for packet in split_opus_packets(payload):
                for frame in self._context.decode(av.Packet(packet)):
                    for resampled in self._resampler.resample(frame):
                        out += resampled.to_ndarray().astype("<i2").tobytes()
        except av.error.FFmpegError as exc:
            raise AudioCodecError(f"an Opus packet does not decode: {exc}") from exc
        return bytes(out)

    def flush(self) -> bytes:
        """What the resampler still holds (a few ms): call once the stream has ended."""
        out = bytearray()
        for resampled in self._resampler.resample(None):
            out += resampled.to_ndarray().astype("<i2").tobytes()
        return bytes(out)


def decode_payload(encoding: AudioEncoding | str, payload: bytes, sample_rate: int = 24_000) -> bytes:
    """One stand-alone payload as PCM16 (a fresh decoder, flushed): for tests and tools."""
    if encoding == AudioEncoding.PCM16LE:
        return payload
    if encoding == AudioEncoding.OPUS:
        decoder = OpusDecoder(sample_rate)
        return decoder.decode(payload) + decoder.flush()
    raise AudioCodecError(f"no decoder for audio encoding {encoding!r}")
