"""Measures of windowed decoding's quality, shared by `voicebus bench synth`
and the real-weight tests: log-mel spectra, the log-mel distance between two decodes of the
same frames, the seam measure, and the mid-phrase pause measure (`mid_phrase_pauses`).

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
jump within ±1 ms of the seam over the 99th percentile of jumps in the 500 ms around it (a
click is many times that percentile; the test allows 1.5).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from voicebus.ops.bench.words import GREEDY

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


# --- the quality gates of windowed decoding (the real-weight test and `bench synth --quality`) ---

# 20 English sentences of 7-12 words: each is long enough for two seams.
ENGLISH = [
    "Your refund was issued this morning and should arrive soon.",
    "The technician will call you before nine to confirm the visit.",
    "Please keep your receipt until the replacement part arrives.",
    "We moved your appointment to Thursday afternoon at three.",
    "The package left our warehouse yesterday and is on its way.",
    "Your new card will be mailed to the address on file.",
    "I have updated the phone number on your account for you.",
    "The store on Main Street closes at eight during the week.",
    "You can return the jacket within thirty days for a full refund.",
    "Our team is looking into the problem with your last invoice.",
    "The flight to Denver has been delayed by about forty minutes.",
    "A confirmation email is on its way to your inbox right now.",
    "The doctor can see you next Monday at half past ten.",
    "Your order contains two shirts, one pair of shoes and a belt.",
    "The printer on the second floor needs a new ink cartridge.",
    "We will send a driver to pick up the old washing machine.",
    "The discount applies to every item in the summer collection.",
    "Your password was changed successfully a few minutes ago.",
    "The museum is free for children under twelve on Sundays.",
    "Thank you for waiting, the manager will be with you shortly.",
]


# 8 sentences each of Spanish and Portuguese (12-15 words): windowed decoding must keep them as
# intelligible to multilingual Whisper as the engine before it (`intelligibility`).
SPANISH = [
    "Tu reembolso fue emitido esta mañana y llegará pronto a tu cuenta bancaria.",
    "El paquete salió de nuestro almacén ayer por la tarde y está en camino.",
    "Puedes devolver la chaqueta dentro de treinta días para obtener un reembolso completo.",
    "El vuelo a Madrid se ha retrasado unos cuarenta minutos por el mal tiempo.",
    "Nuestro equipo está revisando el problema con tu última factura de la luz.",
    "La tienda de la calle mayor cierra a las ocho durante la semana.",
    "El médico puede verte el próximo lunes a las diez y media de la mañana.",
    "Tu nueva tarjeta se enviará a la dirección que tenemos registrada.",
]
PORTUGUESE = [
    "O seu reembolso foi emitido hoje de manhã e deve chegar em breve à sua conta.",
    "O pacote saiu do nosso armazém ontem à tarde e já está a caminho.",
    "Você pode devolver a jaqueta em até trinta dias para receber o reembolso completo.",
    "O voo para Lisboa está atrasado cerca de quarenta minutos por causa do tempo.",
    "A nossa equipe está analisando o problema com a sua última fatura de energia.",
    "A loja da rua principal fecha às oito horas durante a semana.",
    "O médico pode atender você na próxima segunda-feira às dez e meia da manhã.",
    "O seu novo cartão será enviado para o endereço que temos no cadastro.",
]


def kokoro_s_own(engine, text: str, language: str, voice: str) -> np.ndarray:
    """Kokoro's own forward pass over a whole sentence of one piece (`KModel.__call__`: nothing
    cut, windowed or trimmed), float audio: the model's phrasing and sound, to compare with."""
    import torch

    (phonemes,) = engine.phonemize(text, language)
    pack = engine.voice_pack(voice)
    with torch.inference_mode():
        return engine.model(phonemes, pack[len(phonemes) - 1].to(engine.device), 1.0).cpu().numpy()


def intelligibility(engine, voice: str, whisper, language: str, sentences: list[str]) -> dict:
    """Word error rates of multilingual ``whisper`` over ``sentences`` as the engine speaks them
    with windowed decoding, without it (the engine before: sentences cut after their 8th word),
    and as Kokoro's own forward pass over each whole sentence. Seeded per sentence."""
    import torch

    errors = {"windowed": 0, "unwindowed": 0, "kokoro": 0}
    reference = 0
    windowed, seed = engine.windowed, engine.seed
    try:
        for i, text in enumerate(sentences):
            expected = words(text)
            reference += len(expected)
            engine.seed = i
            for mode in ("windowed", "unwindowed"):
                engine.windowed = mode == "windowed"
                pcm = b"".join(engine.stream(text, language, voice))
                audio = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
                errors[mode] += word_errors(expected, words(heard(whisper, audio, language)))
            torch.manual_seed(i)
            errors["kokoro"] += word_errors(expected, words(heard(whisper, kokoro_s_own(engine, text, language, voice), language)))
    finally:
        engine.windowed, engine.seed = windowed, seed
    return {mode: count / reference for mode, count in errors.items()} | {"words": reference}


# Sentences of about twenty words with no punctuation inside: any pause in them is mid-phrase.
LONG_PHRASES = {
    "en": "The technician will call you tomorrow morning before nine to confirm the visit and the time of the repair.",
    "es": "El técnico te llamará mañana por la mañana antes de las nueve para confirmar la visita y la hora de la reparación.",
    "pt": "O técnico vai ligar para você amanhã de manhã antes das nove para confirmar a visita e o horário do reparo.",
}

PAUSE_S = 0.2  # a mid-phrase pause: a silence of at least 200 ms
QUIET_DB = 40.0  # a 10 ms bin this far under the loudest is silent
FAINT_DB = 35.0  # and one this far under it does not end a silence it falls back into (`silent_runs`)
MURMUR_BINS = 2  # if no more than this many such bins in a row


def _levels(audio: np.ndarray) -> np.ndarray:
    """dB of each 10 ms of float ``audio`` (24 kHz, at least 10 ms of it)."""
    return 20 * np.log10(np.sqrt(np.mean(audio[: len(audio) // HOP * HOP].reshape(-1, HOP) ** 2, axis=1)) + 1e-9)


def quiet_bins(audio: np.ndarray, below_db: float = QUIET_DB) -> np.ndarray:
    """Per 10 ms of float ``audio`` (24 kHz, at least 10 ms of it): whether its level is at least
    ``below_db`` under the loudest 10 ms."""
    level = _levels(audio)
    return level < level.max() - below_db


def silence_bins(audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`quiet_bins` at `QUIET_DB` and at `FAINT_DB`, from one reading of the levels: what
    `silent_runs` reads a silence from."""
    level = _levels(audio)
    return level < level.max() - QUIET_DB, level < level.max() - FAINT_DB


def silent_runs(
    quiet: np.ndarray, first: int, last: int, pause_s: float = PAUSE_S, faint: np.ndarray | None = None
) -> list[tuple[int, int]]:
    """(start, end) bins of each run of `quiet_bins` of at least ``pause_s`` that starts at or
    after bin ``first`` and ends before bin ``last`` (a run still open there is not counted).
    With ``faint`` (`silence_bins`), a run goes on through up to `MURMUR_BINS` faint
    bins that fall back to quiet ones, and ends at its last quiet bin: a 10 ms murmur at -39 dB
    inside a silence at -50 is no end of the pause to the ear, and a run cut there at -40 would be
    measured in halves. A longer faint stretch is a quiet sound (a nasal's tail: Mandarin
    zm_yunxia hums the "n" of 店 90 ms at -36 to -40 dB) and ends the run."""
    runs, run, end = [], None, None
    for i in range(first, last):
        if quiet[i]:
            run = i if run is None else run
            end = i + 1
        elif run is not None and (faint is None or not faint[i] or i - end >= MURMUR_BINS):
            if end - run >= pause_s * 100:
                runs.append((run, end))
            run = None
    return runs


def mid_phrase_pauses(whisper, audio: np.ndarray, language: str, pause_s: float = PAUSE_S) -> list[tuple[int, int]]:
    """Silent stretches of at least ``pause_s`` (10 ms bins at least 40 dB below the loudest
    10 ms, through murmurs between them: `silent_runs`) between the start of the first word and
    the end of the last word ``whisper`` hears in float ``audio`` (24 kHz), as (start ms from
    the first sound, length ms). In a phrase with no inner punctuation, each is a mid-phrase
    pause. (Whisper's own word gaps are no measure alone: it stretches words over short
    silences and opens gaps on long vowels; the audio says where the silence is, Whisper where
    the words are.)"""
    segments, _ = whisper.transcribe(to_16k(audio), language=language, beam_size=1, word_timestamps=True, temperature=GREEDY)
    heard = [w for s in segments for w in s.words]
    if not heard:
        return []
    quiet, faint = silence_bins(audio)
    onset = int(np.argmax(~quiet))
    first, last = int(heard[0].start * 100), min(len(quiet), int(heard[-1].end * 100))
    runs = silent_runs(quiet, first, last, pause_s, faint=faint)
    return [((start - onset) * 10, (end - start) * 10) for start, end in runs]


def pcm_to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


def words(text: str) -> list[str]:
    import re

    return re.findall(r"[^\W\d_]+(?:'[^\W\d_]+)?", text.lower())


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Levenshtein distance in words."""
    d = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hypothesis, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[-1]


def to_16k(audio: np.ndarray) -> np.ndarray:
    """24 kHz float audio resampled (linearly) to the 16 kHz Whisper expects."""
    t = np.arange(int(len(audio) * 16000 / SAMPLE_RATE)) * (SAMPLE_RATE / 16000)
    return np.interp(t, np.arange(len(audio)), audio).astype(np.float32)



def heard(whisper, audio: np.ndarray, language: str = "en", **options) -> str:
    """What ``whisper`` hears in float ``audio`` (24 kHz), decoded greedily (`GREEDY`);
    ``options``: more of faster-whisper's ``transcribe`` arguments (a prompt, ...)."""
    segments, _ = whisper.transcribe(to_16k(audio), language=language, beam_size=1, temperature=GREEDY, **options)
    return " ".join(s.text for s in segments)


def decode_pair(engine, text: str, language: str, voice: str, other_seed: bool = False, seed: int = 0) -> dict:
    """One sentence's sounding frames decoded whole by kokoro's decoder and in windows by the
    engine's (`SynthesisEngine.frame_rate_half`, `generator`), from the same prediction and the same harmonic
    source (they differ by the windowing and the engine's precision): float audio of the span,
    the cuts, and with ``other_seed`` a second whole decode with another excitation."""
    import torch

    from voicebus.synthesis import kokoro_frames as kf

    model = engine.model
    pack = engine.voice_pack(voice)
    phonemes = engine.phonemize(text, language)[0]
    with torch.inference_mode():
        torch.manual_seed(seed)  # the excitation's noise: the same figures run after run
        frames = kf.predict_frames(model, phonemes, pack[len(phonemes) - 1].to(engine.device))
        start, stop = kf.sound_span(frames.frame_energy())
        weights = kf.stand_in_weights(start, stop, frames.count, kf.CONTEXT_FRAMES, kf.CONTEXT_FRAMES)
        prepared = kf.prepare_decoder(model, frames, start, stop, weights)
        cuts = kf.seams(prepared.count, lead=kf.CONTEXT_FRAMES)
        # the reference: kokoro's own decoder (float32) over the whole span; the windows are
        # decoded as the engine decodes them (its folded decoder, in its precision)
        whole = torch.cat(list(kf.decode_windows(model, prepared, []))).cpu().numpy()
        ours = prepared if engine.frame_rate_half is None else dataclasses.replace(
            prepared, x=engine.frame_rate_half(frames, start, stop, weights))
        windowed = torch.cat(list(kf.decode_windows(model, ours, cuts, engine.generator))).cpu().numpy()
        pair = {"whole": whole, "windowed": windowed, "cuts": cuts}
        if other_seed:
            again = kf.prepare_decoder(model, frames, start, stop, weights)
            pair["other_seed"] = torch.cat(list(kf.decode_windows(model, again, []))).cpu().numpy()
    return pair


def quality(engine, voice: str, whisper=None, other_seed: bool = True) -> dict:
    """The gates over `ENGLISH`: word error rates of the whole and the windowed decodes, the
    seam measure at every seam, log-mel distances (windowed-whole, and whole-whole with another
    excitation when ``other_seed``)."""
    from voicebus.ops.bench.words import tiny_en_whisper

    whisper = whisper or tiny_en_whisper()
    reference = whole_errors = windowed_errors = 0
    measures, distances, seed_distances = [], [], []
    for text in ENGLISH:
        pair = decode_pair(engine, text, "en", voice, other_seed)
        expected = words(text)
        reference += len(expected)
        whole_errors += word_errors(expected, words(heard(whisper, pair["whole"])))
        windowed_errors += word_errors(expected, words(heard(whisper, pair["windowed"])))
        measures += [seam_measure(pair["windowed"], pair["whole"], cut * 600) for cut in pair["cuts"]]
        distances.append(log_mel_distance(pair["windowed"], pair["whole"]))
        if other_seed:
            seed_distances.append(log_mel_distance(pair["other_seed"], pair["whole"]))
    return {"sentences": len(ENGLISH), "words": reference, "wer_whole": whole_errors / reference,
            "wer_windowed": windowed_errors / reference, "seams": measures, "distances": distances,
            "seed_distances": seed_distances or [float("nan")]}


def save_seam_spectrogram(pair: dict, path: str, around_s: float = 0.6) -> None:
    """A PNG of the log-mel spectrogram around the first seam of ``pair`` (`decode_pair`):
    the whole-piece decode, the windowed one, and their difference (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cut = pair["cuts"][0] * 600
    lo, hi = max(0, cut - int(around_s * SAMPLE_RATE)), cut + int(around_s * SAMPLE_RATE)
    whole, windowed = log_mel(pair["whole"][lo:hi]), log_mel(pair["windowed"][lo:hi])
    extent = [(lo - cut) / SAMPLE_RATE * 1000, (lo - cut + len(whole) * HOP) / SAMPLE_RATE * 1000, 0, BANDS]
    fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True)
    vmax = max(whole.max(), windowed.max())
    for ax, data, title in ((axes[0], whole, "whole-piece decode"), (axes[1], windowed, "windowed decode (seam at 0 ms)")):
        ax.imshow(data.T, origin="lower", aspect="auto", extent=extent, vmin=vmax - FLOOR_DB, vmax=vmax, cmap="magma")
        ax.set_title(title)
        ax.set_ylabel("mel band")
    im = axes[2].imshow((windowed - whole).T, origin="lower", aspect="auto", extent=extent, vmin=-15, vmax=15, cmap="coolwarm")
    axes[2].set_title("windowed - whole (dB)")
    axes[2].set_ylabel("mel band")
    axes[2].set_xlabel("ms from the seam")
    for ax in axes:
        ax.axvline(0, color="white" if ax is not axes[2] else "black", linestyle="--", linewidth=0.8)
    fig.colorbar(im, ax=axes[2], fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
