"""PCM16 audio as the engine makes it: chunks, and the silence trimmed whole or in parts."""

from __future__ import annotations

import numpy as np

from voicebus.synthesis.pcm import chunk_pcm, trim_silence

def test_chunk_pcm_sizes_and_tail_merge():
    pcm = bytes(2 * 1000)
    assert [len(c) // 2 for c in chunk_pcm(pcm, 300)] == [300, 300, 400]
    assert [len(c) // 2 for c in chunk_pcm(pcm, 400)] == [400, 400, 200]


def pcm16(*parts: tuple[int, int]) -> bytes:
    """PCM16 made of (samples, amplitude) runs; amplitude 0 is digital silence."""
    return np.concatenate([np.full(n, a, dtype="<i2") for n, a in parts]).tobytes()


def test_trim_silence_keeps_the_sound_and_at_most_the_margins():
    audio = pcm16((6000, 0), (10, 5), (100, 2000), (50, 20), (100, -3000), (9000, 1))
    trimmed = np.frombuffer(trim_silence(audio, max_lead_samples=480, max_trail_samples=2400), "<i2")
    # 480 quiet samples (-60 dBFS and below counts as quiet), all 250 of sound, 2400 of trail
    assert len(trimmed) == 480 + 250 + 2400
    assert trimmed[480] == 2000 and trimmed[480 + 249] == -3000
    # margins longer than the silence there keep all of it
    assert trim_silence(audio, 10**6, 10**6) == audio


def test_trim_silence_never_empties_silent_audio_nor_cuts_into_sound():
    silent = pcm16((4800, 0), (100, 12))
    assert trim_silence(silent, 0, 0) == silent
    loud = pcm16((300, 500))
    assert trim_silence(loud, 0, 0) == loud
    assert trim_silence(pcm16((100, 0), (300, 500)), -5, -5) == loud  # negative margins are zero
    assert trim_silence(b"", 10, 10) == b""


def test_trimming_in_parts_is_trimming_the_whole():
    """`PartTrimmer` fed a piece's audio in parts, at any cut points, publishes exactly what
    `trimmed` makes of the whole: lead cut, quiet stretches inside kept, trail rule at the end."""
    import random

    import numpy as np

    from voicebus.synthesis.pcm import PartTrimmer, trimmed

    rng = random.Random(4)
    quiet, loud = np.zeros(1, "<i2"), np.full(1, 900, "<i2")
    for case in range(60):
        runs = [np.repeat(rng.choice([quiet, loud]), rng.randint(1, 400)) for _ in range(rng.randint(1, 8))]
        pcm = np.concatenate(runs).tobytes()
        undecoded = rng.choice([0, 50, 5000])
        expected, cut = trimmed(pcm, 30, 120, undecoded_trail_samples=undecoded)
        points = sorted(rng.sample(range(0, len(pcm) // 2), min(3, len(pcm) // 2)))
        parts = [pcm[2 * a : 2 * b] for a, b in zip([0, *points], [*points, len(pcm) // 2])]
        trimmer = PartTrimmer(30, 120, undecoded_trail_samples=undecoded)
        got = b"".join(trimmer.feed(p, last=i == len(parts) - 1) for i, p in enumerate(parts))
        assert got == expected, case
        assert trimmer.cut == cut, case
