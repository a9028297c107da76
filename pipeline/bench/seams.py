"""Measures of windowed decoding's quality (issue 11 item 2), shared by `voicebus bench synth`
and the real-weight tests: log-mel spectra, the log-mel distance between two decodes of the
same frames, and the seam measure.

**Seam measure.** Spectral flux: the L1 change of the log-mel spectrum (10 ms hop, 25 ms
window, 40 bands, floored 60 dB below the piece's loudest bin) from one hop to the next. A
seam that clicks, changes timbre or level, shows as flux well above the audio around it;
speech itself has flux peaks at every phone boundary. The measure compares like with like:
``seam_flux`` is the largest flux within ±20 ms of the seam in the windowed decode, and
``whole_flux`` the same at the same place in the whole-piece decode of the same frames (same
excitation): ``excess = seam_flux - whole_flux`` (log-mel dB units per band). ``local_p90`` is
the 90th percentile of the windowed decode's flux over the 500 ms around the seam, the scale
of ordinary change there. A seam is "no worse than the audio around it" when
``seam_flux <= local_p90`` or ``excess <= 0.1 * local_p90`` (the spectral change at the seam is
within the decode's own change at that place). Also reported: the largest sample-to-sample
jump within ±1 ms of the seam over the 99th percentile of jumps in the 500 ms around it.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 24000
HOP = 240  # 10 ms
WINDOW = 600  # 25 ms
BANDS = 40
FLOOR_DB = 60.0


def _mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = WINDOW, bands: int = BANDS) -> np.ndarray:
    def mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m):
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(60.0), mel(sample_rate / 2 * 0.95), bands + 2))
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    filters = np.zeros((bands, len(bins)))
    for b in range(bands):
        lo, mid, hi = edges[b : b + 3]
        filters[b] = np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0.0, None)
    return filters


_FILTERS = _mel_filters()


def log_mel(audio: np.ndarray) -> np.ndarray:
    """[hops, BANDS] log-mel spectrum in dB of float audio at 24 kHz (frame t centred on
    sample t * HOP), floored FLOOR_DB below its loudest bin."""
    audio = np.asarray(audio, dtype=np.float64)
    padded = np.pad(audio, (WINDOW // 2, WINDOW // 2))
    count = 1 + (len(padded) - WINDOW) // HOP
    index = np.arange(WINDOW)[None, :] + HOP * np.arange(count)[:, None]
    spectrum = np.abs(np.fft.rfft(padded[index] * np.hanning(WINDOW), axis=1)) ** 2
    db = 10.0 * np.log10(spectrum @ _FILTERS.T + 1e-12)
    return np.maximum(db, db.max() - FLOOR_DB)


def log_mel_distance(a: np.ndarray, b: np.ndarray, speech_db: float = 43.0) -> float:
    """Mean absolute log-mel difference (dB per band, divided by 10: "log-mel L1" in bels)
    over the hops of ``b`` whose loudest band is within ``speech_db`` of its loudest."""
    ma, mb = log_mel(a), log_mel(b)
    n = min(len(ma), len(mb))
    ma, mb = ma[:n], mb[:n]
    speech = mb.max(axis=1) >= mb.max() - speech_db
    return float(np.abs(ma[speech] - mb[speech]).mean() / 10.0)


def flux(audio: np.ndarray) -> np.ndarray:
    """Spectral flux per hop: mean |Δ log-mel| (dB) from the hop before; 0 for the first."""
    m = log_mel(audio)
    return np.concatenate([[0.0], np.abs(np.diff(m, axis=0)).mean(axis=1)])


def seam_measure(windowed: np.ndarray, whole: np.ndarray, seam_sample: int) -> dict:
    """The seam measure (module docstring) at ``seam_sample`` of two decodes of the same frames."""
    fw, fh = flux(windowed), flux(whole)
    hop = seam_sample / HOP
    near = slice(max(0, int(np.floor(hop - 2))), int(np.ceil(hop + 2)) + 1)
    around = slice(max(0, int(hop - 25)), int(hop + 25) + 1)
    seam_flux, whole_flux = float(fw[near].max()), float(fh[near].max())
    local = float(np.percentile(fw[around], 90))
    jumps = np.abs(np.diff(np.asarray(windowed, dtype=np.float64)))
    j_near = jumps[max(0, seam_sample - 24) : seam_sample + 24].max()
    j_around = np.percentile(jumps[max(0, seam_sample - 6000) : seam_sample + 6000], 99)
    return {
        "seam_flux": seam_flux, "whole_flux": whole_flux, "excess": seam_flux - whole_flux, "local_p90": local,
        "jump_ratio": float(j_near / max(j_around, 1e-9)),
        "ok": seam_flux <= local or seam_flux - whole_flux <= 0.1 * local,
    }
