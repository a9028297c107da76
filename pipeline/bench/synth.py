"""`voicebus bench synth`: the engine's real-time factor and time to first audio.

Prints medians over repeats for a few sentence lengths, and the ratio of time to first audio
with long sentences split into pieces (what the engine does) against synthesizing the whole
sentence in one forward pass. Engine alone, no Kafka.
"""

from __future__ import annotations

import statistics
import time

SENTENCES = {
    "short": "Sure, I can help with that.",
    "medium": "The train to the airport leaves every twenty minutes from the second platform.",
    "long": (
        "When the morning train finally pulled into the station after a long delay, the passengers, "
        "who had been waiting since dawn in the cold, hurried towards the exits without a word."
    ),
}


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("synth", help="synthesis engine: real-time factor and time to first audio")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lang", default="en")
    p.add_argument("--voice", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight engine (code path only, no weights)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.set_defaults(func=run)


def _measure(engine, text: str, language: str, voice: str, whole: bool) -> tuple[float, float]:
    """(time to first audio, real-time factor) of one sentence."""
    t0 = time.perf_counter()
    first = None
    samples = 0
    if whole:
        for phonemes in engine.phonemize(text, language):
            pcm = engine.synthesize(phonemes, voice)
            first = first if first is not None else time.perf_counter() - t0
            samples += len(pcm) // 2
    else:
        for chunk in engine.stream(text, language, voice):
            first = first if first is not None else time.perf_counter() - t0
            samples += len(chunk) // 2
    elapsed = time.perf_counter() - t0
    return first or float("nan"), elapsed / (samples / engine.sample_rate)


def run(args, settings) -> int:
    import torch

    from pipeline.synthesis.engine import SynthesisEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)
    voice = engine.resolve_voice(args.voice or settings.default_voice)
    _measure(engine, "Warm up.", args.lang, voice, whole=False)  # G2P load, first-call costs
    print(f"engine: {engine.source} on {engine.device}, voice {voice}, torch threads {torch.get_num_threads()}, repeats {args.repeats}")
    print(f"{'sentence':<8} {'words':>5} {'ttfa split s':>12} {'ttfa whole s':>12} {'ratio':>6} {'rtf':>6}")
    for name, text in SENTENCES.items():
        split = [_measure(engine, text, args.lang, voice, whole=False) for _ in range(args.repeats)]
        whole = [_measure(engine, text, args.lang, voice, whole=True) for _ in range(args.repeats)]
        ttfa_split = statistics.median(t for t, _ in split)
        ttfa_whole = statistics.median(t for t, _ in whole)
        rtf = statistics.median(r for _, r in split)
        print(f"{name:<8} {len(text.split()):>5} {ttfa_split:>12.3f} {ttfa_whole:>12.3f} {ttfa_split / ttfa_whole:>6.2f} {rtf:>6.2f}")
    print("ratio = time to first audio split / whole (lower is better); rtf = synthesis time / audio time")
    return 0
