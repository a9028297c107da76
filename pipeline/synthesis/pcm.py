"""PCM16LE audio as the engine makes it: float model output to 16-bit samples, the silence
Kokoro pads each forward pass with trimmed (`trimmed`, `PartTrimmer` for audio decoded in
windows), where a piece sounds (`sounding_span`), and chunks of a target length (`chunk_pcm`).
numpy only; torch is imported by `float_to_pcm16` alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Kokoro-82M pads every forward pass with silence: about 250-290 ms before the first sound and
# 430-690 ms after the last (measured on the offline pack, docs/worker.md). The lead delays
# the first *audible* sample of a turn by that much; lead plus trail make a pause of almost a
# second between sentences and inside a sentence cut in pieces. `trim_silence` keeps a margin.
SILENCE_THRESHOLD = 33  # |sample| of PCM16 at -60 dBFS: quieter than any speech onset


def float_to_pcm16(audio: "torch.Tensor") -> bytes:
    """Float audio in [-1, 1] (clipped) to little-endian signed 16-bit PCM bytes."""
    import torch

    samples = torch.nan_to_num(audio.detach().float().cpu().flatten(), nan=0.0)
    scaled = (samples.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy()
    return scaled.astype("<i2", copy=False).tobytes()


def chunk_pcm(pcm: bytes, chunk_samples: int) -> list[bytes]:
    """Cut PCM16 bytes into chunks of ``chunk_samples``; a tail under half a chunk joins the
    chunk before it, so every chunk is between 0.5x and 1.5x the target (unless the whole
    audio is shorter)."""
    step = chunk_samples * 2
    chunks = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    if len(chunks) >= 2 and len(chunks[-1]) < step // 2:
        tail = chunks.pop()
        chunks[-1] += tail
    return chunks


def trim_silence(
    pcm: bytes, max_lead_samples: int, max_trail_samples: int, threshold: int = SILENCE_THRESHOLD, undecoded_trail_samples: int = 0
) -> bytes:
    """`trimmed`: the PCM16LE only (see there)."""
    return trimmed(pcm, max_lead_samples, max_trail_samples, threshold, undecoded_trail_samples)[0]


def trimmed(
    pcm: bytes, max_lead_samples: int, max_trail_samples: int, threshold: int = SILENCE_THRESHOLD, undecoded_trail_samples: int = 0
) -> tuple[bytes, int]:
    """PCM16LE with the silence before the first and after the last sample louder than
    ``threshold`` cut to at most ``max_lead_samples`` and ``max_trail_samples``. Audio that is
    silent throughout comes back unchanged: trimming must never turn a piece into nothing.

    ``undecoded_trail_samples``: silence the model predicted after ``pcm`` that was not decoded
    (`kokoro_frames.sound_span`); up to that many zero samples are appended so the trail kept
    is what trimming the whole decode would have kept. The model's silence is below -70 dBFS:
    digital zeros sound the same and cost nothing to compute.

    Returns the PCM and the number of samples cut before it (word timings move by that much)."""
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2")
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > threshold)
    if loud.size == 0:
        return pcm, 0
    start = max(0, int(loud[0]) - max(0, max_lead_samples))
    end = min(len(samples) + max(0, undecoded_trail_samples), int(loud[-1]) + 1 + max(0, max_trail_samples))
    return pcm[start * 2 : end * 2] + bytes(2 * max(0, end - len(samples))), start


def sounding_span(pcm: bytes, threshold: int = SILENCE_THRESHOLD) -> tuple[int, int]:
    """Samples ``(first, last + 1)`` of PCM16LE louder than ``threshold`` (the whole of it when
    none is): where a piece's words may start and end (`words.place`)."""
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2")
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > threshold)
    if loud.size == 0:
        return 0, len(samples)
    return int(loud[0]), int(loud[-1]) + 1


class PartTrimmer:
    """`trimmed` for audio that comes in parts (the windows of `kokoro_frames.decode_windows`):
    `feed` returns what can be published of each part, and the parts' outputs joined are
    exactly ``trimmed(all parts joined, ...)``. The lead is cut on the first loud sample; the
    quiet samples after a part's last loud one are held until the next part says whether
    speech follows (then they are kept) or the piece ends (then the trail rule applies).
    ``cut``: the samples cut before the output, known once `feed` has returned audio."""

    def __init__(self, max_lead_samples: int, max_trail_samples: int, threshold: int = SILENCE_THRESHOLD,
                 undecoded_trail_samples: int = 0) -> None:
        import numpy as np

        self.max_lead, self.max_trail = max(0, max_lead_samples), max(0, max_trail_samples)
        self.threshold, self.undecoded = threshold, max(0, undecoded_trail_samples)
        self.cut = 0
        self._started = False
        self._held = np.empty(0, dtype="<i2")

    def feed(self, pcm: bytes, last: bool) -> bytes:
        import numpy as np

        samples = np.concatenate([self._held, np.frombuffer(pcm, dtype="<i2")])
        loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > self.threshold)
        if not self._started:
            if loud.size == 0:  # nothing loud yet: silent throughout so far
                if last:
                    self._held = samples[:0]
                    return samples.tobytes()
                self._held = samples
                return b""
            self.cut = max(0, int(loud[0]) - self.max_lead)
            samples, loud = samples[self.cut :], loud - self.cut
            self._started = True
        last_loud = int(loud[-1]) if loud.size else -1  # -1: the last loud sample was before the held ones
        if last:
            self._held = samples[:0]
            end = min(len(samples) + self.undecoded, last_loud + 1 + self.max_trail)
            return samples[:end].tobytes() + bytes(2 * max(0, end - len(samples)))
        self._held = samples[last_loud + 1 :]
        return samples[: last_loud + 1].tobytes()
