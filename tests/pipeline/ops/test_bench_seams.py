"""`voicebus.ops.bench.seams`'s measure of silences: pure, on synthetic audio."""

from __future__ import annotations

import numpy as np

from voicebus.ops.bench.seams import FAINT_DB, HOP, MURMUR_BINS, QUIET_DB, quiet_bins, silence_bins, silent_runs

# The level of each 10 ms (dB under the loudest) of the engine's Spanish long phrase at
# "nueve | para", ef_dora, seeded, before its silences were shortened through faint bumps: one
# stretch of ~270 ms a listener hears as one pause, with bins at -39 dB in three places (to the
# dB; those that rounded to -40 were over it).
NUEVE_PARA = [-12, -16, -17, -20, -27, -38, -41, -48, -48, -50, -48, -42, -46, -41, -41, -39, -41, -39, -41,
              -41, -44, -44, -45, -45, -49, -49, -39, -43, -44, -53, -54, -60, -52, -21, -12, -4, -4, -5]


def audio_at(levels_db: list[float]) -> np.ndarray:
    """Float audio (24 kHz) whose 10 ms bins have these levels under the loudest (0 dB: 0.5 RMS)."""
    rms = 0.5 * 10 ** (np.asarray(levels_db, dtype=np.float64) / 20)
    return np.concatenate([np.full(HOP, r) * np.where(np.arange(HOP) % 2, 1, -1) for r in rms]).astype(np.float32)


def test_levels_are_read_per_10_ms():
    audio = audio_at([0, -30, -39, -41, -60])
    assert quiet_bins(audio).tolist() == [False, False, False, True, True]
    assert quiet_bins(audio, FAINT_DB).tolist() == [False, False, True, True, True]
    quiet, faint = silence_bins(audio)
    assert (quiet.tolist(), faint.tolist()) == (quiet_bins(audio).tolist(), quiet_bins(audio, FAINT_DB).tolist())
    assert QUIET_DB > FAINT_DB


def test_a_pause_with_faint_bins_in_it_is_measured_whole():
    audio = audio_at([0] + NUEVE_PARA)
    quiet, faint = silence_bins(audio)
    whole = silent_runs(quiet, 0, len(quiet), 0.2, faint=faint)
    assert [(end - start) * 10 for start, end in whole] == [270]  # from the first bin under -40 to the last
    # at -40 dB alone, the bins at -39 cut it into pieces, none of them 200 ms long
    assert silent_runs(quiet, 0, len(quiet), 0.2) == []


def test_a_louder_bin_ends_the_silence_and_the_run_ends_at_its_last_quiet_bin():
    levels = [0] + [-50] * 12 + [-38, -37] + [-50] * 12 + [-20] + [-50] * 25 + [-36, -30, 0]
    quiet, faint = silence_bins(audio_at(levels))
    # the -37 and -38 murmur is inside the first pause; -20 ends it; the last run ends at its
    # last quiet bin, not at the -36 faint one after it
    assert silent_runs(quiet, 0, len(levels), 0.2, faint=faint) == [(1, 27), (28, 53)]


# zm_yunxia's "面包店 | 每天" (the languages bench's first Mandarin sentence, seeded): the "n" of
# 店 hums at -36 to -40 dB for 90 ms between two short silences; a quiet sound, not a pause.
DIAN_MEI = [-6, -12, -24, -35, -47, -50, -41, -39, -38, -36, -37, -37, -38, -38, -38, -39, -43, -45,
            -51, -55, -52, -53, -56, -51, -21, -13, -8]


def test_a_quiet_sound_longer_than_a_murmur_ends_the_silence():
    audio = audio_at([0] + DIAN_MEI)
    quiet, faint = silence_bins(audio)
    assert silent_runs(quiet, 0, len(quiet), 0.2, faint=faint) == []
    assert [(end - start) * 10 for start, end in silent_runs(quiet, 0, len(quiet), 0.03, faint=faint)] == [30, 80]
    assert MURMUR_BINS < 9
