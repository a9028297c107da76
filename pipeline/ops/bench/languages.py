"""How each language the engine speaks sounds: `voicebus bench synth --languages`.

Per language (en, es, pt, fr, it, hi, ja, zh), over the natural sentences of
``data/languages.json`` (ten each, none of them in the tests), spoken by the engine as a worker
speaks them with the language's default voice (`voicebus.schemas.contract.DEFAULT_VOICES`),
seeded per sentence:

- **WER** (word error rate; **CER**, characters, for Japanese and Chinese, written without
  spaces) of multilingual Whisper base's transcript (`heard`), greedy;
- **mid-phrase pauses** (`inner_pauses`): silences of at least 200 ms inside the speech that
  fall where the text has no punctuation;
- **reading error** for Japanese and Chinese (`reading`): the error rate over what is said,
  not how it is written: the katakana reading (UniDic, through fugashi) or the pinyin syllables
  with their tones (pypinyin) of the text and of the transcript, so a homophone written with
  other characters (薬局 heard as 役曲) is no error and a wrong tone is one;
- **RTF**: synthesis time over the duration of the audio, all sentences together.

Windows are of fixed sizes (`SynthesisEngine.adaptive_windows` off): sized from the decode
speed, they and so the audio would differ run to run.

Whisper base is the judge, and a weak one in places: it writes Hindi in Urdu or Latin script
unless prompted with Devanagari (`PROMPTS`), and mishears much clear Hindi even then, so a
Hindi WER is Whisper base's as much as the engine's (its CER is given too); Chinese it writes
in traditional characters as often as not, compared here in simplified ones (OpenCC's table).
"""

from __future__ import annotations

import json
import time
import unicodedata
from importlib import resources

import numpy as np

from voicebus.ops.bench import seams
from voicebus.ops.bench.seams import HOP, PAUSE_S, pcm_to_float, silence_bins, silent_runs, word_errors

LANGUAGES = ("en", "es", "pt", "fr", "it", "hi", "ja", "zh")
BY_CHARACTER = frozenset({"ja", "zh"})  # written without spaces between words: CER

# Whisper's prompt per language: the script it is to write in (Hindi heard in Urdu or Latin
# script, the same words, would count as all wrong)
PROMPTS = {"hi": "नमस्ते। आपका स्वागत है।"}

# what a phoneme group carries of the text's punctuation (every G2P keeps it in the phonemes)
_PUNCTUATION = set(",.;:!?…—–-\"“”()«»")


def sentences() -> dict[str, list[str]]:
    """The bench's sentences per language (``data/languages.json``)."""
    data = resources.files("voicebus.ops.bench") / "data" / "languages.json"
    return json.loads(data.read_text(encoding="utf-8"))


def heldout_sentences() -> dict[str, list[str]]:
    """Ten more sentences for Hindi, Japanese and Chinese (``data/languages_heldout.json``), none
    of them in `sentences` or the tests: the second set a default voice is chosen on (`sweep`)."""
    data = resources.files("voicebus.ops.bench") / "data" / "languages_heldout.json"
    return json.loads(data.read_text(encoding="utf-8"))


def tone_sentences() -> dict[str, list[str]]:
    """Twenty Mandarin sentences whose syllables change tone in speech (一 and 不 before another
    tone, third tones in a row: 一定, 不是, 往左拐) (``data/mandarin_tones.json``), none of them
    in the other sets or the tests: the third set `sweep` measures Mandarin's voices on."""
    data = resources.files("voicebus.ops.bench") / "data" / "mandarin_tones.json"
    return json.loads(data.read_text(encoding="utf-8"))


def voices_of(language: str) -> list[str]:
    """Every Kokoro voice of ``language``, by name."""
    from voicebus.schemas.contract import KOKORO_VOICES, kokoro_code

    code = kokoro_code(language, default=None)
    return sorted(name for name, info in KOKORO_VOICES.items() if info.language == code)


def default_voice(language: str) -> str:
    """The language's default voice (the contract's), or the first Kokoro voice of it by name."""
    from voicebus.schemas.contract import DEFAULT_VOICES, kokoro_code

    return DEFAULT_VOICES.get(kokoro_code(language, default=None)) or voices_of(language)[0]


def heard(whisper, audio: np.ndarray, language: str) -> str:
    """What multilingual ``whisper`` hears in float ``audio`` (24 kHz) in ``language``, greedily,
    prompted where the script needs it (`PROMPTS`)."""
    return seams.heard(whisper, audio, language, initial_prompt=PROMPTS.get(language), no_repeat_ngram_size=3)


def units(text: str, language: str) -> list[str]:
    """What the error rate counts in ``text``: its characters for Japanese and Chinese (Chinese
    in simplified characters), its words elsewhere; lower case, apostrophes out (Whisper writes
    "l'attesa" as "lattesa" as often as not), punctuation and symbols out (Devanagari's vowel
    signs are marks, not word characters to a regular expression: words are split on
    everything else)."""
    text = unicodedata.normalize("NFC", text.lower().replace("’", "").replace("'", ""))
    if language == "zh":
        text = _simplified(text)
    kept = "".join(c if unicodedata.category(c)[0] in "LMN" else " " for c in text)
    if language in BY_CHARACTER:
        return [c for c in kept if not c.isspace()]
    return kept.split()


READ = frozenset({"ja", "zh"})  # written with characters that homophones share: `reading` too
_TAGGER: list = []


def reading(text: str, language: str) -> list[str]:
    """What is said in ``text``: for Japanese the katakana of UniDic's reading of each word
    (fugashi with unidic-lite, the dictionary misaki's Japanese G2P uses), one unit per kana; for
    Chinese the pinyin syllables with tone numbers (pypinyin; the neutral tone is 5), one unit per
    syllable, read in simplified characters. Punctuation and spaces are no units; a word with no
    reading (a digit, a Latin word) counts by its characters."""
    if language == "ja":
        if not _TAGGER:
            from voicebus.synthesis.g2p import unidic_lite_tagger

            _TAGGER.append(unidic_lite_tagger())
        words = [(getattr(w.feature, "kana", None), w.surface) for w in _TAGGER[0](text)]
        said = "".join(kana if kana and kana != "*" else surface for kana, surface in words)
        return [c for c in said if unicodedata.category(c)[0] in "LMN"]
    if language == "zh":
        from pypinyin import Style, lazy_pinyin

        syllables = lazy_pinyin(_simplified(text), style=Style.TONE3, neutral_tone_with_five=True)
        return [u for s in syllables for u in ([s] if s.isalnum() else [c for c in s if c.isalnum()])]
    raise ValueError(f"no reading for {language!r}: only {sorted(READ)}")


def reading_error_rate(reference: str, hypothesis: str, language: str) -> tuple[int, int]:
    """(edits, reference length) in `reading` units."""
    expected = reading(reference, language)
    return word_errors(expected, reading(hypothesis, language)), len(expected)


_TO_SIMPLIFIED = []


def _simplified(text: str) -> str:
    if not _TO_SIMPLIFIED:
        from opencc import OpenCC

        _TO_SIMPLIFIED.append(OpenCC("t2s"))
    return _TO_SIMPLIFIED[0].convert(text)


def error_rate(reference: str, hypothesis: str, language: str) -> tuple[int, int]:
    """(edits, reference length) in `units`: Levenshtein distance in words or characters."""
    expected = units(reference, language)
    return word_errors(expected, units(hypothesis, language)), len(expected)


def _silences(audio: np.ndarray, pause_s: float = PAUSE_S) -> list[tuple[int, int]]:
    """Silent stretches of at least ``pause_s`` between the first and the last sound of float
    ``audio`` (24 kHz), as (start, end) in samples."""
    if len(audio) < HOP:
        return []
    quiet, faint = silence_bins(audio)
    loud = np.flatnonzero(~quiet)
    runs = silent_runs(quiet, int(loud[0]), int(loud[-1]) + 1, pause_s, faint=faint)
    return [(start * HOP, end * HOP) for start, end in runs]


def _punctuated(group: str, following: str | None) -> bool:
    return group[-1:] in _PUNCTUATION or (following is not None and following[:1] in _PUNCTUATION)


def inner_pauses(groups: list, audio: np.ndarray, pause_s: float = PAUSE_S) -> list[tuple[int, int, str]]:
    """The silences of at least ``pause_s`` in float ``audio`` where the text has no punctuation:
    each silence is placed by its middle among the phoneme groups (the words as spoken, timed by
    the model's own durations: `voicebus.synthesis.words.WordTiming`, in samples of ``audio``):
    in a group or after it, it belongs to that group, and is a mid-phrase pause unless the group
    ends with punctuation or the next begins with it. (start ms, length ms, group) of each."""
    out = []
    for start, end in _silences(audio, pause_s):
        middle = (start + end) // 2
        at = max((i for i, g in enumerate(groups) if g.start <= middle), default=None)
        if at is None:
            continue  # before the first word: the lead
        following = groups[at + 1].text if at + 1 < len(groups) else None
        if at == len(groups) - 1 and middle >= groups[at].end:
            continue  # after the last word: the trail
        if not _punctuated(groups[at].text, following):
            out.append((start * 1000 // 24000, (end - start) * 1000 // 24000, groups[at].text))
    return out


def speak(engine, text: str, language: str, voice: str) -> tuple[np.ndarray, list, float]:
    """(float audio, timed phoneme groups, seconds to synthesize) of one sentence as the engine
    streams it: its pieces' words timed as their phoneme groups (`words.phoneme_words` with the
    phonemes as the text), so that a language written without spaces is timed word by word too."""
    from voicebus.synthesis.words import phoneme_words

    kept = engine.model.vocab.__contains__
    plain = engine.pieces

    def grouped(text: str, language: str) -> list:
        return [p._replace(time_words=lambda d, ps=p.phonemes: phoneme_words(ps, ps, d, None, kept))
                for p in plain(text, language)]

    engine.pieces = grouped
    try:
        t0 = time.perf_counter()
        spoken = list(engine.spoken_pieces(text, language, voice))
        elapsed = time.perf_counter() - t0
    finally:
        del engine.pieces
    pcm = b"".join(p.voiced.pcm for p in spoken)
    return pcm_to_float(pcm), [w for p in spoken for w in p.words], elapsed


def measure(engine, whisper, language: str, voice: str, texts: list[str]) -> dict:
    """One row of the table: `error_rate` (words, or characters for ja/zh; for hi, characters
    too), for ja/zh `reading_error_rate`, mid-phrase pauses and real-time factor over ``texts``,
    seeded per sentence."""
    seed, adaptive = engine.seed, engine.adaptive_windows
    engine.adaptive_windows = False  # window sizes from the decode speed would differ run to run
    errors = reference = char_errors = chars = read_errors = read = 0
    pauses: list = []
    synth_s = audio_s = 0.0
    try:
        engine.seed = 0
        list(engine.stream("Warm up.", language, voice))  # G2P built, first-call costs paid
        for i, text in enumerate(texts):
            engine.seed = i
            audio, groups, elapsed = speak(engine, text, language, voice)
            synth_s, audio_s = synth_s + elapsed, audio_s + len(audio) / 24000
            transcript = heard(whisper, audio, language)
            e, n = error_rate(text, transcript, language)
            errors, reference = errors + e, reference + n
            e, n = error_rate(text, transcript, "zh")  # characters, whatever the language
            char_errors, chars = char_errors + e, chars + n
            if language in READ:
                e, n = reading_error_rate(text, transcript, language)
                read_errors, read = read_errors + e, read + n
            pauses += [(i, *p) for p in inner_pauses(groups, audio)]
    finally:
        engine.seed, engine.adaptive_windows = seed, adaptive
    return {"language": language, "voice": voice, "sentences": len(texts), "units": reference,
            "rate": errors / max(1, reference), "cer": char_errors / max(1, chars),
            "reading": read_errors / read if read else None,
            "measure": "CER" if language in BY_CHARACTER else "WER",
            "pauses": pauses, "rtf": synth_s / max(1e-9, audio_s), "audio_s": audio_s}


# the targets a row is compared with (docs/benchmarks.md)
TARGETS = {"en": 0.05, "es": 0.10, "pt": 0.10, "fr": 0.10, "it": 0.10, "hi": 0.15, "ja": 0.10, "zh": 0.10}


def run(engine, whisper, languages=LANGUAGES, extra_voices: dict[str, list[str]] | None = None) -> list[dict]:
    """`measure` for each of ``languages`` with its default voice, then for each language of
    ``extra_voices`` with each of its voices; prints the table as it goes."""
    texts = sentences()
    rows = []
    plan = [(lang, default_voice(lang)) for lang in languages]
    plan += [(lang, voice) for lang, voices in (extra_voices or {}).items() for voice in voices]
    print(f"{'language':<8} {'voice':<12} {'WER/CER':>11} {'target':>6} {'CER':>6} {'reading':>7} {'mid-phrase pauses':>17} "
          f"{'RTF':>6}  (sentences, units)")
    for language, voice in plan:
        row = measure(engine, whisper, language, voice, texts[language])
        rows.append(row)
        said = "" if row["reading"] is None else f"{row['reading']:.3f}"
        print(f"{language:<8} {voice:<12} {row['measure']:>5} {row['rate']:.3f} {TARGETS[language]:>6.2f} {row['cer']:>6.3f} "
              f"{said:>7} {len(row['pauses']):>17} {row['rtf']:>6.2f}  ({row['sentences']}, {row['units']})", flush=True)
    for row in rows:
        for sentence, start_ms, length_ms, group in row["pauses"]:
            print(f"  {row['language']} {row['voice']}: sentence {sentence}, {length_ms} ms at {start_ms} ms, after {group!r}")
    return rows


def sweep(engine, whisper, languages: list[str]) -> list[dict]:
    """`measure` for every voice of each of ``languages``, on the bench's sentences and on the
    held-out ones and the tone changes where the language has them (`heldout_sentences`,
    `tone_sentences`); prints one line per voice and set, then the voice `pick_default` picks
    per language: how ``hf_beta`` and ``zm_yunxia`` were chosen (docs/benchmarks.md)."""
    sets = {"bench": sentences(), "held-out": heldout_sentences(), "tones": tone_sentences()}
    rows = []
    print(f"{'language':<8} {'voice':<14} {'set':<8} {'WER/CER':>11} {'CER':>6} {'reading':>7} {'pauses':>6} {'RTF':>6}")
    for language in languages:
        default = default_voice(language)
        for voice in voices_of(language):
            for name, texts in sets.items():
                if language not in texts:
                    continue
                row = {**measure(engine, whisper, language, voice, texts[language]), "set": name,
                       "default": voice == default}
                rows.append(row)
                said = "" if row["reading"] is None else f"{row['reading']:.3f}"
                shown = voice + ("*" if row["default"] else "")
                print(f"{language:<8} {shown:<14} {name:<8} {row['measure']:>5} {row['rate']:.3f} {row['cer']:>6.3f} "
                      f"{said:>7} {len(row['pauses']):>6} {row['rtf']:>6.2f}", flush=True)
        picked = pick_default([row for row in rows if row["language"] == language], default)
        print(f"{language}: the default is {default}; the rule picks {picked}", flush=True)
    return rows


def pick_default(rows: list[dict], current: str) -> str:
    """The voice a language's default should be, from `sweep`'s rows of that language: ``current``
    unless a voice with no mid-phrase pause in any set has fewer characters wrong (CER: steadier
    than Hindi's WER under this judge) than ``current`` in every set; of several such, the one
    with the fewest over all sets (the sum of its rates)."""
    by_voice: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_voice.setdefault(row["voice"], {})[row["set"]] = row
    mine = by_voice[current]
    better = [voice for voice, sets in by_voice.items()
              if voice != current and sets.keys() == mine.keys() and not any(r["pauses"] for r in sets.values())
              and all(sets[name]["cer"] < mine[name]["cer"] for name in mine)]
    return min(better, key=lambda voice: (sum(r["cer"] for r in by_voice[voice].values()), voice), default=current)
