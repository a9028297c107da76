"""`voicebus bench synth`: the engine's time to first audio and real-time factor, A/B.

Engine alone, no Kafka. Each repeat runs every variant on every sentence, variants interleaved
(so a busy machine slows them alike), and the figures are medians:

- **model TTFA**: from `SynthesisEngine.stream` called to its first chunk, for the sentence as a
  turn's opening sentence (first piece cut at the first clause of >= 3 words, as the worker does).
- **RTF**: synthesis time of the whole sentence over the duration of the audio published.
- **decoded**: frames the decoder ran over predicted frames (silence skipped, docs/worker.md).
- **stall**: the silence a player starting at the first chunk would hear inside the sentence,
  where a chunk comes after the audio before it has played (`voicebus.players.listener.HeardTurn.starvation`'s
  rule, at the engine): windows decoded slower than the audio before them plays.

Variants: ``before`` is the engine as it was (whole piece decoded, then trimmed); ``after`` only
the sounding frames decoded, in one window, sentences cut after their 8th word for early audio;
``windowed`` is the engine's default (sounding frames decoded in growing windows, the first
audio published from the first, sentences cut only where they must be); the
others change one runtime option: torch intra-op threads, ``no_grad`` instead of
``inference_mode``, ``fixed`` (windowed: the fixed window sizes of `kokoro_frames.seams`, not
those planned from the decode speed), ``unbaked`` (kokoro's weight-norm hooks kept, recomputing every weight on
every forward pass, as the engine did before `kokoro_frames.bake_weight_norms`; a second copy of
the model is loaded for it), and the generator: ``kokoro`` (kokoro's own, float32, as the engine
was before `kokoro_frames.FoldedGenerator` and `FoldedFrameRateHalf`), ``fp32`` or ``bf16`` (folded, in that precision,
bfloat16 with `kokoro_frames.Bfloat16Bert`; without either, the precision `Settings.synthesis_precision`
gives), ``fp32tiled`` (the engine's float32 on a CPU, `engine.folded_decoder`: folded, its wide
convolutions through short DFTs and its 3-tap ones of many channels through F(4, 3),
`tiled_conv`, PL-BERT prepacked, `kokoro_frames.PrepackedBert`; ``fp32dft``: the short DFTs only,
kokoro's PL-BERT; ``fp32``: all convolutions direct); ``bert32`` keeps kokoro's float32 PL-BERT with any of them,
``kokoronoise`` kokoro's own draws of the harmonic source's noise (the same values as the engine's
`torch_ops.randn_like_strided`, one at a time).

``--quality``: the gates of windowed decoding on the 20 English sentences of
`voicebus.ops.bench.seams.ENGLISH`: Whisper tiny.en's word error rate over the whole-piece and the
windowed decodes of the same prediction and excitation, and the seam measure at every seam.
``--pauses``: the mid-phrase pauses of `voicebus.ops.bench.seams.LONG_PHRASES` (the voice and
each language's own), the longest silence in them over the engine's window plans, and the es/pt
intelligibility to multilingual Whisper base, with Kokoro's pauses inside a phrase kept and
shortened (`Settings.shorten_inner_pauses`).
``--languages``: per language (en, es, pt, fr, it, hi, ja, zh) with its default voice, and English
with ``jf_alpha`` too, over ten natural sentences each: multilingual Whisper base's WER (CER for
ja, zh), the mid-phrase pauses and the real-time factor (`voicebus.ops.bench.languages`).
"""

from __future__ import annotations

import statistics
import time

SENTENCES = {
    "short": "Sure, I can help with that.",
    "refund": "Your refund was issued this morning.",
    "medium": "The train to the airport leaves every twenty minutes from the second platform.",
    "long": (
        "When the morning train finally pulled into the station after a long delay, the passengers, "
        "who had been waiting since dawn in the cold, hurried towards the exits without a word."
    ),
}

GENERATORS = ("kokoro", "fp32", "fp32dft", "fp32tiled", "bf16")  # the variants' generator options

OPENING_CLAUSE_MIN_WORDS = 3  # Settings.opening_clause_min_words' default: what a turn's first sentence gets


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("synth", help="synthesis engine: time to first audio and real-time factor, A/B")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--language", "--lang", dest="language", default="en",
                   help="language of the sentences (default en)")
    p.add_argument("--voice", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight engine (code path only, no weights)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads of the variants that name none (0: VOICEBUS_SYNTHESIS_THREADS, default 1)")
    p.add_argument("--variants", default="before,after,windowed",
                   help="comma-separated: before|after|windowed, each optionally -<N>thread(s), -no_grad, -fixed, -unbaked, -bert32, -kokoronoise and/or one of -kokoro, -fp32, -fp32dft, -fp32tiled, -bf16")
    p.add_argument("--quality", action="store_true", help="also the windowed decoding's quality gates (Whisper tiny.en, seams)")
    p.add_argument("--seam-png", default=None, help="write a spectrogram of a seam (the first quality sentence) to this PNG")
    p.add_argument("--pauses", action="store_true",
                   help="also mid-phrase pauses and es/pt intelligibility (multilingual Whisper base), Kokoro's pauses kept / shortened")
    p.add_argument("--languages", action="store_true",
                   help="also per language: WER (CER for ja/zh) to multilingual Whisper base, mid-phrase pauses, RTF")
    p.add_argument("--voice-sweep", default=None, metavar="LANGS",
                   help="also every voice of these languages (comma-separated, e.g. hi,ja,zh) on the bench's "
                        "sentences and held-out ones: what each default voice was chosen on")
    p.add_argument("--quality-only", action="store_true",
                   help="skip the timing A/B (with --quality, --pauses, --languages, --voice-sweep or --seam-png)")
    p.set_defaults(func=run)


def _variant(name: str, threads: int) -> dict:
    """Engine attributes and thread count of a variant name: ``before``, ``after`` or
    ``windowed``, then optionally ``-<N>thread(s)``, ``-no_grad``, ``-fixed``, ``-unbaked``,
    ``-bert32``, ``-kokoronoise`` and/or one of ``-kokoro``, ``-fp32``, ``-fp32dft``, ``-fp32tiled``,
    ``-bf16`` (e.g. ``after-1thread-no_grad``, ``windowed-kokoro``, ``windowed-bf16-bert32``)."""
    base, *options = name.split("-")
    if base not in {"before", "after", "windowed"}:
        raise SystemExit(f"unknown variant {name!r}")
    variant = {"decode_sound_only": base != "before", "windowed": base == "windowed", "grad_mode": "inference",
               "threads": threads, "baked": True, "adaptive": True, "generator": "default"}
    for option in options:
        if option == "no_grad":
            variant["grad_mode"] = "no_grad"
        elif option == "unbaked":
            variant["baked"] = False
        elif option == "fixed":
            variant["adaptive"] = False
        elif option == "bert32":
            variant["bert32"] = True
        elif option == "kokoronoise":
            variant["kokoronoise"] = True
        elif option in GENERATORS:
            variant["generator"] = option
        elif option.rstrip("s").endswith("thread") and option.rstrip("s")[: -len("thread")].isdigit():
            variant["threads"] = int(option.rstrip("s")[: -len("thread")])
        else:
            raise SystemExit(f"unknown option {option!r} in variant {name!r}")
    return variant


def _measure(engine, text: str, language: str, voice: str) -> tuple[float, float, float]:
    """(time to first audio, real-time factor, stall seconds) of one sentence, as a turn's
    opening sentence."""
    t0 = time.perf_counter()
    first = None
    samples = 0
    stall, play_until = 0.0, None
    for chunk in engine.stream(text, language, voice, first_clause_min_words=OPENING_CLAUSE_MIN_WORDS):
        now = time.perf_counter() - t0
        if first is None:
            first = play_until = now
        elif now > play_until:
            stall += now - play_until
            play_until = now
        play_until += len(chunk) / 2 / engine.sample_rate
        samples += len(chunk) // 2
    elapsed = time.perf_counter() - t0
    return first or float("nan"), elapsed / max(1e-9, samples / engine.sample_rate), stall


def _frames_of(engine, text: str, language: str, voice: str) -> tuple[int, int]:
    """Frames decoded and predicted over all pieces of ``text`` (sound-only decoding)."""
    from voicebus.synthesis.pieces import split_for_early_audio

    decoded = predicted = 0
    for piece in split_for_early_audio(text, first_clause_min_words=OPENING_CLAUSE_MIN_WORDS):
        for phonemes in engine.phonemize(piece, language):
            engine.synthesize(phonemes, voice)
            d, p = engine.last_decoded_frames or (0, 0)
            decoded, predicted = decoded + d, predicted + p
    return decoded, predicted


def _apply(engine, variant: dict) -> None:
    import torch

    torch.set_num_threads(variant["threads"])
    engine.decode_sound_only, engine.windowed = variant["decode_sound_only"], variant["windowed"]
    engine.grad_mode = variant["grad_mode"]
    engine.adaptive_windows = variant["adaptive"]
    engine.decode_s_per_frame = variant.get("decode_s_per_frame")  # each variant's own speed (threads differ)
    engine.generator, engine.frame_rate_half, engine.bert = variant["generators"][variant["generator"]]
    if variant.get("bert32"):
        engine.bert = None
    engine.randn_like = None if variant.get("kokoronoise") else variant["randn_like"]


def _generators(engine, named: set[str]) -> dict:
    """The decoders the variants name, built once, as (generator, frame-rate half, bert): the
    engine's own, kokoro's, folded in one precision (bfloat16's with the bfloat16 PL-BERT), or
    the engine's float32 path on a CPU (``fp32tiled``: `engine.folded_decoder`)."""
    import torch

    from voicebus.synthesis.engine import folded_decoder
    from voicebus.synthesis.kokoro_frames import Bfloat16Bert, FoldedFrameRateHalf, FoldedGenerator

    def folded(dtype, tiled=False, winograd=False):
        bert = Bfloat16Bert(engine.model, dtype) if dtype == torch.bfloat16 else None
        return (FoldedGenerator(engine.model, dtype, tiled, winograd), FoldedFrameRateHalf(engine.model, dtype, winograd),
                bert)

    built = {"default": (engine.generator, engine.frame_rate_half, engine.bert), "kokoro": (None, None, None)}
    for name, dtype, tiled, winograd in (("fp32", torch.float32, False, False), ("fp32dft", torch.float32, True, False),
                                         ("bf16", torch.bfloat16, False, False)):
        if name in named:
            built[name] = folded(dtype, tiled, winograd)
    if "fp32tiled" in named:
        built["fp32tiled"] = folded_decoder(engine.model, torch.float32)
    return built


def _quality(engine, voice: str) -> None:
    from voicebus.ops.bench import seams

    t0 = time.perf_counter()
    q = seams.quality(engine, voice)
    measures = q["seams"]
    ok = sum(m["ok"] for m in measures)
    print(f"quality over {q['sentences']} English sentences, {q['words']} words ({time.perf_counter() - t0:.0f} s):")
    print(f"  Whisper tiny.en WER whole-piece {q['wer_whole']:.3f}, windowed {q['wer_windowed']:.3f} "
          f"(difference {q['wer_windowed'] - q['wer_whole']:+.3f}; gate <= 0.02)")
    print(f"  seams {len(measures)}: {ok} no worse than the audio around them; flux at seam median "
          f"{statistics.median(m['seam_flux'] for m in measures):.2f} dB vs whole decode there "
          f"{statistics.median(m['whole_flux'] for m in measures):.2f}, local p90 "
          f"{statistics.median(m['local_p90'] for m in measures):.2f}; sample jump at seam / p99 around: max "
          f"{max(m['jump_ratio'] for m in measures):.2f}")
    print(f"  log-mel distance windowed vs whole (same excitation) median {statistics.median(q['distances']):.3f}, "
          f"whole vs whole with another noise seed {statistics.median(q['seed_distances']):.3f}")


def _pauses(engine, voice: str, settings, seeds: int = 3) -> None:
    """Kokoro's pauses inside a phrase kept (``inner_pause_frames`` None) and
    shortened (the engine's): the mid-phrase pauses in each language's long phrase over
    ``seeds`` decoder seeds, spoken by ``voice`` and by the language's own default voice, the
    longest silence in them over the engine's window plans (`_longest_silences`), and
    Whisper base's word error rate over the es and pt sentences of `voicebus.ops.bench.seams`
    spoken by ``voice`` (fixed window sizes, seeded per sentence: the same audio each run)."""
    from voicebus.ops.bench import seams
    from voicebus.ops.bench.words import base_whisper

    t0 = time.perf_counter()
    whisper = base_whisper(settings.cache_dir)
    shortened, adaptive, seed = engine.inner_pause_frames, engine.adaptive_windows, engine.seed
    modes = {"kept": None, "shortened": shortened}
    engine.adaptive_windows = False  # window sizes from the decode speed would differ run to run
    try:
        print("mid-phrase pauses (>= 200 ms, 10 ms bins 40 dB under the loudest through 20 ms murmurs, between the words "
              f"Whisper base hears), {seeds} seeds: (start ms, length ms) of each")
        for language, text, speaker in _long_phrases(voice):
            for mode, frames in modes.items():
                engine.inner_pause_frames = frames
                found = []
                for s in range(seeds):
                    engine.seed = s
                    pcm = b"".join(engine.stream(text, language, speaker))
                    found.append(seams.mid_phrase_pauses(whisper, seams.pcm_to_float(pcm), language))
                print(f"  {language} {speaker:<8} {mode:<9} {sum(map(len, found))} in {seeds} runs: {found}")
        _longest_silences(engine, whisper, voice, shortened)
        for language, sentences in (("es", seams.SPANISH), ("pt", seams.PORTUGUESE)):
            rates = {}
            for mode, frames in modes.items():
                engine.inner_pause_frames = frames
                errors = reference = 0
                for i, text in enumerate(sentences):
                    engine.seed = i
                    expected = seams.words(text)
                    reference += len(expected)
                    heard = seams.heard(whisper, seams.pcm_to_float(b"".join(engine.stream(text, language, voice))), language)
                    errors += seams.word_errors(expected, seams.words(heard))
                rates[mode] = errors / reference
            print(f"  {language} Whisper base WER over {len(sentences)} sentences ({reference} words): "
                  + ", ".join(f"{mode} {rate:.3f}" for mode, rate in rates.items()))
    finally:
        engine.inner_pause_frames, engine.adaptive_windows, engine.seed = shortened, adaptive, seed
    print(f"  ({time.perf_counter() - t0:.0f} s)")


def _long_phrases(voice: str):
    """(language, phrase, speaker) for each of `voicebus.ops.bench.seams.LONG_PHRASES`, spoken by
    ``voice`` and by the language's own default voice (once where they are the same)."""
    from voicebus.ops.bench import seams
    from voicebus.ops.bench.languages import default_voice

    for language, text in seams.LONG_PHRASES.items():
        for speaker in dict.fromkeys((voice, default_voice(language))):
            yield language, text, speaker


# Decode speeds (generator seconds per frame) the window plans of `_longest_silences` are made
# for: none measured yet, then from a fast CPU to a loaded one
PLAN_SPEEDS = (None, 0.004, 0.008, 0.013, 0.02, 0.03)


def _longest_silences(engine, whisper, voice: str, shortened: int | None) -> None:
    """The longest silence inside each language's long phrase (``voice`` and the language's own),
    its pauses shortened, over the window plans the engine makes for each of `PLAN_SPEEDS` (seed
    0): how far under `seams.PAUSE_S` the worst plan stays. The plans follow the clock too, so
    this line moves a little run to run; a plan that puts a faint bump of a pause at a seam can
    make it whole (docs/worker.md, "Mid-phrase pauses"). The engine is left as it was."""
    from voicebus.ops.bench import seams

    kept = engine.decode_s_per_frame, engine.inner_pause_frames, engine.adaptive_windows, engine.seed
    engine.inner_pause_frames, engine.adaptive_windows, engine.seed = shortened, True, 0
    print(f"  longest silence inside the phrase, shortened, window plans for {len(PLAN_SPEEDS)} decode speeds "
          "(none, 4-30 ms a frame), seed 0: ms in each plan")
    try:
        for language, text, speaker in _long_phrases(voice):
            longest = []
            for speed in PLAN_SPEEDS:
                engine.decode_s_per_frame = speed
                audio = seams.pcm_to_float(b"".join(engine.stream(text, language, speaker)))
                found = seams.mid_phrase_pauses(whisper, audio, language, pause_s=0.01)
                longest.append(max((length for _, length in found), default=0))
            print(f"  {language} {speaker:<8} max {max(longest)} ms: {longest}")
    finally:
        engine.decode_s_per_frame, engine.inner_pause_frames, engine.adaptive_windows, engine.seed = kept


def _languages(engine, settings) -> None:
    """`voicebus.ops.bench.languages.run`: every language with its default voice, English with
    ``jf_alpha`` too (the voice the pause shortening was calibrated on)."""
    from voicebus.ops.bench import languages
    from voicebus.ops.bench.words import base_whisper

    t0 = time.perf_counter()
    print("per language, multilingual Whisper base (greedy), the engine's defaults, seeded per sentence:")
    languages.run(engine, base_whisper(settings.cache_dir), extra_voices={"en": ["jf_alpha"]})
    print(f"  ({time.perf_counter() - t0:.0f} s)")


def _voice_sweep(engine, settings, languages: list[str]) -> None:
    """`voicebus.ops.bench.languages.sweep`: every voice of ``languages``, two sets of sentences."""
    from voicebus.ops.bench import languages as bench_languages
    from voicebus.ops.bench.words import base_whisper

    t0 = time.perf_counter()
    print("every voice, multilingual Whisper base (greedy), the engine's defaults, seeded per sentence (*: the default):")
    bench_languages.sweep(engine, base_whisper(settings.cache_dir), languages)
    print(f"  ({time.perf_counter() - t0:.0f} s)")


def run(args, settings) -> int:
    import os

    import torch

    from voicebus.synthesis.engine import SynthesisEngine, intra_op_threads

    default_threads = args.threads or intra_op_threads(settings)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    variants = {name: _variant(name, default_threads) for name in names}
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)
    if args.tiny:
        engine.silence_margins_ms = (settings.max_lead_silence_ms, settings.max_trail_silence_ms)
    unbaked = None
    if any(not v["baked"] for v in variants.values()) and not args.quality_only:
        if args.tiny:
            raise SystemExit("-unbaked variants need the real model (the tiny engine is built baked)")
        unbaked = SynthesisEngine.load(settings, bake_weight_norms=False, folded=False)
    engines = {name: engine if variant["baked"] else unbaked for name, variant in variants.items()}
    named = {variant["generator"] for variant in variants.values()}
    generators = {id(e): _generators(e, named) for e in {id(e): e for e in engines.values()}.values()}
    for name, variant in variants.items():
        variant["generators"] = generators[id(engines[name])]
        variant["randn_like"] = engines[name].randn_like
    default_generator, default_half, default_bert = engine.generator, engine.frame_rate_half, engine.bert
    default_randn_like = engine.randn_like
    voice = engine.resolve_voice(args.voice or settings.default_voice)
    for name, variant in ([] if args.quality_only else variants.items()):  # warm up each variant: G2P load, first-call costs
        _apply(engines[name], variant)
        list(engines[name].stream("Warm up, please.", args.language, voice))
        variant["decode_s_per_frame"] = engines[name].decode_s_per_frame

    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    if args.quality_only:
        variants, args.repeats = {}, 0
    for _ in range(args.repeats):
        for sentence, text in SENTENCES.items():
            for name, variant in variants.items():
                _apply(engines[name], variant)
                results.setdefault((name, sentence), []).append(_measure(engines[name], text, args.language, voice))
                variant["decode_s_per_frame"] = engines[name].decode_s_per_frame

    engine.decode_sound_only, engine.windowed, engine.grad_mode = True, True, "inference"
    engine.generator, engine.frame_rate_half, engine.bert = default_generator, default_half, default_bert
    engine.randn_like = default_randn_like
    if variants:
        frames = {s: _frames_of(engine, t, args.language, voice) for s, t in SENTENCES.items()}
        load = os.getloadavg()[0]
        precision = "kokoro's own" if default_generator is None else str(default_generator.dtype).removeprefix("torch.")
        print(f"engine: {engine.source} on {engine.device}, voice {voice}, {os.cpu_count()} CPUs, load average {load:.1f}, "
              f"repeats {args.repeats}, variants interleaved; the default generator: {precision}")
        width = max(16, *(len(n) for n in variants))
        print(f"{'variant':<{width}} {'threads':>7} " + " ".join(f"{s + ' ttfa':>12}" for s in SENTENCES)
              + f" {'ttfa p50':>9} {'rtf p50':>8} {'stall p50':>9} {'stall max':>9}")
        for name, variant in variants.items():
            runs = [r for s in SENTENCES for r in results[(name, s)]]
            cells = [statistics.median(r[0] for r in results[(name, s)]) for s in SENTENCES]
            print(f"{name:<{width}} {variant['threads']:>7} " + " ".join(f"{c:>12.3f}" for c in cells)
                  + f" {statistics.median(r[0] for r in runs):>9.3f} {statistics.median(r[1] for r in runs):>8.3f}"
                  f" {statistics.median(r[2] for r in runs):>9.3f} {max(r[2] for r in runs):>9.3f}")
        print("ttfa: seconds from stream() to its first chunk, as a turn's opening sentence; rtf: synthesis time / audio published;"
              " stall: seconds of silence inside the sentence for a player starting at its first chunk")
        print("frames decoded / predicted with sound-only decoding: "
              + ", ".join(f"{s} {d}/{p} ({1 - d / max(1, p):.0%} skipped)" for s, (d, p) in frames.items()))
    if args.quality:
        _quality(engine, voice)
    if args.pauses:
        _pauses(engine, voice, settings)
    if args.languages:
        _languages(engine, settings)
    if getattr(args, "voice_sweep", None):
        _voice_sweep(engine, settings, [lang.strip() for lang in args.voice_sweep.split(",") if lang.strip()])
    if args.seam_png:
        from voicebus.ops.bench import seams

        seams.save_seam_spectrogram(seams.decode_pair(engine, seams.ENGLISH[0], "en", voice), args.seam_png)
        print(f"seam spectrogram: {args.seam_png}")
    return 0
