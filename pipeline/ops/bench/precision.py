"""`voicebus bench precision`: the quality gate and the speed of each way to compute Kokoro-82M
on a CPU, A/B in one run.

The engine's default computes the folded decoder and PL-BERT in bfloat16 where the CPU
multiplies it in hardware, else in float32 (`voicebus.synthesis.engine.pick_precision`). A
faster approximation for CPUs without hardware bfloat16 earns its place only at equal quality,
judged as the project's precision gate says (docs/benchmarks.md, "Precision"):

- the log-mel distance of its audio to the float32 reference (same frames, same harmonic
  excitation) is no larger than two float32 decodes with different excitation seeds differ;
- Whisper tiny.en hears the same words: the word error rate over the 20 sentences of
  `voicebus.ops.bench.seams.ENGLISH` within 0.02 of the float32 reference's.

Candidates, each built from the loaded model's weights:

- ``float32``: the folded decoder in float32 (the reference; ``float32-seed``: the same with
  another excitation seed, the gate's noise floor);
- ``float32-tiled``: the engine's float32 path on a CPU (`engine.folded_decoder`): the same with
  the generator's wide convolutions through short DFTs, the 3-tap ones of many channels through
  F(4, 3) (`voicebus.synthesis.tiled_conv`) and PL-BERT prepacked (`kokoro_frames.PrepackedBert`);
- ``bfloat16``: the folded decoder and PL-BERT in bfloat16 (the default where the CPU has it);
  ``bfloat16-bert32``: the decoder in bfloat16, PL-BERT in float32 (the same frames as float32:
  the decoder's share of the difference);
- ``int8-convs``: the float32 folded generator with every residual-block convolution run as
  a dynamically quantized int8 convolution (fbgemm: int8 weights per output channel, each
  input quantized per tensor at run time);
- ``int8-bert``: float32 decoding with PL-BERT's linear layers dynamically quantized to int8;
- ``onnxruntime``: the float32 folded generator between its STFT and inverse STFT exported to
  ONNX and run by ONNX Runtime's CPU provider (the STFT, inverse STFT and the rest in torch);
- ``openvino``: the same ONNX graph compiled by OpenVINO for its CPU plugin in float32
  (``pip install openvino``; not a dependency of voicebus).

The default run is the first seven; ``onnxruntime`` and ``openvino`` run when named in
``--candidates`` (whether another CPU runtime decodes faster at equal quality, A/B against float32).

Times: PL-BERT, the rest of the prediction, and the decoder over each sentence's sounding
frames (one window), medians over the sentences and repeats, each candidate's time over the
float32 reference's in the same repeat. The int8 candidates live here, not in the engine:
they fail the gate (docs/benchmarks.md)."""

from __future__ import annotations

import json
import statistics
import time

CANDIDATES = ("float32", "float32-seed", "float32-tiled", "bfloat16", "bfloat16-bert32", "int8-convs", "int8-bert")
RUNTIMES = ("onnxruntime", "openvino")  # not in the default run: named in --candidates
REFERENCE_SEED, OTHER_SEED = 0, 1
WER_GATE = 0.02


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("precision", help="Kokoro on CPU: each precision candidate's speed and quality gate, A/B")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help=f"comma-separated, of {', '.join(CANDIDATES + RUNTIMES)} (default: {', '.join(CANDIDATES)}); "
                        "onnxruntime: the float32 generator's core exported to ONNX, run by ONNX Runtime on the CPU; "
                        "openvino: the same ONNX graph run by OpenVINO's CPU plugin in float32 (pip install openvino)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the sentences (quality: the first pass)")
    p.add_argument("--sentences", type=int, default=20, help="how many of the 20 English gate sentences")
    p.add_argument("--voice", default="af_heart")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-whisper", action="store_true", help="skip the word error rates (log-mel distances only)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight engine (the code path only)")
    p.add_argument("--layers", action="store_true",
                   help="instead: each of the decoder's convolutions, direct against through tiles "
                        "(`tiled_conv`), the generator's over one window of --frames frames")
    p.add_argument("--frames", type=int, default=28, help="--layers: the window's frames (28: a first window)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.set_defaults(func=run)


def _int8_conv_generator(model):
    """A `FoldedGenerator` in float32 whose residual blocks' convolutions are dynamically
    quantized int8 modules (`_int8_conv`)."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedGenerator

    class Int8ConvGenerator(FoldedGenerator):
        def _apply_conv(self, conv, x):  # a quantized module, or a folded float convolution
            if isinstance(conv, torch.nn.Module):
                return conv(x.contiguous())
            return FoldedGenerator._apply_conv(conv, x)

    generator = Int8ConvGenerator(model, torch.float32)
    for blocks in (generator.resblocks, generator.noise_res):
        blocks[:] = [[(a1, _int8_conv(c1), a2, _int8_conv(c2)) for a1, c1, a2, c2 in layers] for layers in blocks]
    return generator


def _int8_conv(conv):
    """A folded float convolution (`kokoro_frames._FoldedConv`) as an int8 dynamic one: its
    weights per output channel, its input quantized per tensor at each call."""
    import torch

    weight = conv.weight.float().contiguous()
    out = weight.shape[0]
    scale = (weight.abs().amax(dim=(1, 2, 3)) / 127).clamp(min=1e-12)
    qweight = torch.quantize_per_channel(weight, scale, torch.zeros(out, dtype=torch.long), 0, torch.qint8)
    module = torch.ao.nn.quantized.dynamic.Conv2d(
        weight.shape[1] * conv.groups, out, tuple(weight.shape[2:]), stride=conv.stride, padding=conv.padding,
        dilation=conv.dilation, groups=conv.groups)
    module.set_weight_bias(qweight, None if conv.bias is None else conv.bias.float())
    return module


def _int8_bert(model):
    import copy

    import torch

    bert = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model.bert), {torch.nn.Linear}, dtype=torch.qint8)
    return lambda input_ids, attention_mask: bert(input_ids, attention_mask=attention_mask)


def _runtime_generator(model, runtime: str):
    """A `FoldedGenerator` in float32 whose `FoldedGenerator.core` (from the harmonic source's
    STFT to ``conv_post``) is exported once to ONNX (opset 17, dynamic lengths) and run by
    ``runtime``: ``onnxruntime`` (CPU provider, torch's intra-op threads, all graph
    optimizations) or ``openvino`` (CPU plugin, float32, latency). The STFT, the inverse STFT
    and everything before the generator stay torch's. Called like a `FoldedGenerator`."""
    import importlib
    import os
    import tempfile

    import torch

    from voicebus.synthesis.kokoro_frames import SAMPLES_PER_FRAME, FoldedGenerator

    package = runtime  # the candidate is named after its pip package
    try:
        lib = importlib.import_module(package)
    except ImportError as e:
        raise SystemExit(f"the {runtime} candidate needs {package}: pip install {package} ({e})") from None

    class Core(torch.nn.Module):  # what torch.onnx.export traces
        def __init__(self, generator):
            super().__init__()
            self.generator = generator

        def forward(self, x, har, style, fw):
            return FoldedGenerator.core(self.generator, x, har, style, fw)

    class RuntimeGenerator(FoldedGenerator):
        def core(self, x, har, style, frame_weights):
            fw = torch.ones(x.shape[-1] // 2) if frame_weights is None else frame_weights
            feed = {"x": x, "har": har, "style": style, "fw": fw}
            return torch.from_numpy(self.infer({name: feed[name].float().contiguous().numpy() for name in self.inputs}))

    generator = RuntimeGenerator(model, torch.float32)
    gen, frames = generator.gen, 24  # the example's length; every length is an ONNX dynamic axis
    example = torch.Generator().manual_seed(0)
    har = torch.cat(gen.stft.transform(torch.randn(1, SAMPLES_PER_FRAME * frames, generator=example)), dim=1)
    args = (torch.randn(1, gen.ups[0].in_channels, 2 * frames, generator=example), har,
            torch.randn(1, gen.resblocks[0].adain1[0].fc.in_features, generator=example), torch.ones(frames))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="voicebus-precision-") as folder:
        path = os.path.join(folder, "generator.onnx")
        with torch.no_grad():
            torch.onnx.export(Core(generator).eval(), args, path, input_names=["x", "har", "style", "fw"],
                              output_names=["out"], opset_version=17, dynamo=False,
                              dynamic_axes={"x": {2: "x_steps"}, "har": {2: "har_steps"}, "fw": {0: "frames"},
                                            "out": {2: "out_steps"}})
        if runtime == "onnxruntime":
            options = lib.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.graph_optimization_level = lib.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = lib.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            generator.inputs = [i.name for i in session.get_inputs()]
            generator.infer = lambda feed: session.run(None, feed)[0]
        else:
            compiled = lib.Core().compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                              "INFERENCE_PRECISION_HINT": "f32",
                                                              "PERFORMANCE_HINT": "LATENCY"})
            request = compiled.create_infer_request()
            generator.inputs = [i.get_any_name() for i in compiled.inputs]
            generator.infer = lambda feed: request.infer(feed)[compiled.outputs[0]]
    return generator


def build_candidates(engine, names: list[str]) -> dict:
    """name -> (generator, frame-rate half, bert, seed) for each candidate in ``names``."""
    import warnings

    import torch

    from voicebus.synthesis.engine import folded_decoder
    from voicebus.synthesis.kokoro_frames import Bfloat16Bert, FoldedFrameRateHalf, FoldedGenerator

    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "x86"
    model = engine.model
    f32 = (FoldedGenerator(model, torch.float32), FoldedFrameRateHalf(model, torch.float32))
    built = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices for its eager quantization
        for name in names:
            if name == "float32":
                built[name] = (*f32, None, REFERENCE_SEED)
            elif name == "float32-seed":
                built[name] = (*f32, None, OTHER_SEED)
            elif name == "float32-tiled":  # the engine's float32 on a CPU: convolutions through tiles, PL-BERT prepacked
                built[name] = (*folded_decoder(model, torch.float32), REFERENCE_SEED)
            elif name == "bfloat16":
                built[name] = (FoldedGenerator(model, torch.bfloat16), FoldedFrameRateHalf(model, torch.bfloat16),
                               Bfloat16Bert(model, torch.bfloat16), REFERENCE_SEED)
            elif name == "bfloat16-bert32":
                built[name] = (FoldedGenerator(model, torch.bfloat16), FoldedFrameRateHalf(model, torch.bfloat16),
                               None, REFERENCE_SEED)
            elif name == "int8-convs":
                built[name] = (_int8_conv_generator(model), f32[1], None, REFERENCE_SEED)
            elif name == "int8-bert":
                built[name] = (*f32, _int8_bert(model), REFERENCE_SEED)
            elif name in RUNTIMES:
                built[name] = (_runtime_generator(model, name), f32[1], None, REFERENCE_SEED)
            else:
                raise SystemExit(f"unknown candidate {name!r}: use {', '.join(CANDIDATES + RUNTIMES)}")
    return built


def decode(engine, phonemes: str, ref_s, candidate) -> tuple:
    """(float audio of the sentence's sounding frames, seconds in PL-BERT, in the rest of the
    prediction, in the decoder) with one candidate."""
    import torch

    from voicebus.synthesis import kokoro_frames as kf

    generator, half, bert, seed = candidate
    bert = bert or engine.model.bert
    spent = {"bert": 0.0}

    def timed_bert(input_ids, attention_mask):
        began = time.perf_counter()
        out = bert(input_ids, attention_mask=attention_mask)
        spent["bert"] += time.perf_counter() - began
        return out

    with torch.inference_mode():
        began = time.perf_counter()
        frames = kf.predict_frames(engine.model, phonemes, ref_s, bert=timed_bert)
        predicted = time.perf_counter()
        start, stop = kf.sound_span(frames.frame_energy(), lead=kf.CONTEXT_FRAMES)
        torch.manual_seed(seed)
        prepared = kf.prepare_decoder(engine.model, frames, start, stop, None, half)
        audio = generator(prepared)
        done = time.perf_counter()
    return audio.numpy(), spent["bert"], predicted - began - spent["bert"], done - predicted


def measure(engine, names: list[str], sentences: list[str], voice: str, repeats: int, whisper=None, progress=None) -> dict:
    """Per candidate: median times and their ratio to float32's, the log-mel distance to the
    float32 reference per sentence, and Whisper's word error rate (``whisper`` given).
    ``progress(repeat, sentence, seconds per candidate)`` is called after each sentence."""
    from voicebus.ops.bench import seams

    candidates = build_candidates(engine, ["float32", *[n for n in names if n != "float32"]])
    pack = engine.voice_pack(voice)
    phonemes = [engine.phonemize(text, "en")[0] for text in sentences]
    times = {name: {"bert": [], "predict": [], "decode": [], "ratio": []} for name in candidates}
    audio: dict[str, list] = {name: [] for name in candidates}
    for candidate in candidates.values():  # first-call costs (oneDNN's kernels, the quantized weights' packing)
        decode(engine, phonemes[0], pack[len(phonemes[0]) - 1], candidate)
    for repeat in range(repeats):  # the first pass also keeps each candidate's audio
        for i, ph in enumerate(phonemes):
            ref_s = pack[len(ph) - 1]
            spent = {}
            for name, candidate in candidates.items():
                wave, bert_s, predict_s, decode_s = decode(engine, ph, ref_s, candidate)
                spent[name] = bert_s + predict_s + decode_s
                if repeat == 0:
                    audio[name].append(wave)
                for key, value in (("bert", bert_s), ("predict", predict_s), ("decode", decode_s)):
                    times[name][key].append(value)
                times[name]["ratio"].append(spent[name] / spent["float32"])
            if progress:
                progress(repeat, i, spent)
    results = {}
    for name in candidates:
        if name not in names:
            continue
        distances = [seams.log_mel_distance(a, ref) for a, ref in zip(audio[name], audio["float32"])]
        row = {key: statistics.median(values) if values else float("nan") for key, values in times[name].items()}
        row["log_mel_distance"] = statistics.median(distances)
        row["log_mel_distances"] = distances
        if whisper is not None:
            errors = reference = 0
            for text, wave in zip(sentences, audio[name]):
                expected = seams.words(text)
                reference += len(expected)
                errors += seams.word_errors(expected, seams.words(seams.heard(whisper, wave)))
            row["wer"] = errors / max(1, reference)
        results[name] = row
    floor = results.get("float32-seed", {}).get("log_mel_distance")
    reference_wer = results.get("float32", {}).get("wer")
    for row in results.values():
        wer_ok = reference_wer is None or row["wer"] - reference_wer <= WER_GATE
        row["passes"] = None if floor is None else bool(row["log_mel_distance"] <= floor and wer_ok)
    return results


def _conv_shapes(model, frames: int) -> dict[tuple, int]:
    """(part, in, out, kernel, dilation, steps) -> how many: each stride-1 convolution of the
    generator's residual blocks over a window of ``frames`` frames, and each 3-tap one of the
    frame-rate half (encode and the decode blocks) over a span of as many frames."""
    gen = model.decoder.generator
    steps = 2 * frames  # the frame-rate half's output: two steps a frame
    shapes: dict[tuple, int] = {}

    def count(key: tuple) -> None:
        shapes[key] = shapes.get(key, 0) + 1

    for i, up in enumerate(gen.ups):
        steps = (steps - 1) * up.stride[0] - 2 * up.padding[0] + up.kernel_size[0] + up.output_padding[0]
        if i == len(gen.ups) - 1:
            steps += 1  # kokoro's reflection pad
        blocks = list(gen.resblocks[i * gen.num_kernels : (i + 1) * gen.num_kernels]) + [gen.noise_res[i]]
        for block in blocks:
            for conv in [*block.convs1, *block.convs2]:
                count(("generator", conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.dilation[0], steps))
    dec = model.decoder
    for block in (dec.encode, *dec.decode):
        upsampled = 2 * frames if block.upsample_type != "none" else frames  # its pool doubles the steps
        for conv in (block.conv1, block.conv2):
            count(("frame-rate half", conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.dilation[0],
                   upsampled))
    return shapes


def layer_times(model, frames: int, repeats: int = 9) -> list[dict]:
    """Each distinct convolution of `_conv_shapes` (part, channels in and out, kernel, dilation,
    steps, how many), timed directly (channels-last, as the folded decoder runs it) and through
    `voicebus.synthesis.tiled_conv` (short DFTs for 7 taps or more, F(4, 3) for 3), interleaved,
    medians of ``repeats``; ``engine`` says which way the engine's float32 path takes (`tiling`:
    some are timed both ways and stay direct)."""
    import torch
    import torch.nn.functional as F

    from voicebus.synthesis.tiled_conv import TiledConv, WinogradConv, tiling

    rows = []
    with torch.inference_mode():
        for (part, cin, out, kernel, dilation, length), count in sorted(_conv_shapes(model, frames).items()):
            weight = torch.randn(out, cin, kernel) / (cin * kernel) ** 0.5
            bias = torch.randn(out)
            padding = dilation * (kernel - 1) // 2
            x = torch.randn(1, cin, 1, length).contiguous(memory_format=torch.channels_last)
            folded = weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            tiled = (WinogradConv if kernel == 3 else TiledConv)(weight, dilation, padding, bias)
            time_major = x.permute(0, 2, 3, 1).reshape(length, cin)
            ways = {"direct": lambda: F.conv2d(x, folded, bias, 1, (0, padding), (1, dilation)),
                    "tiled": lambda: tiled(time_major)}
            spent: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(repeats):
                for name, way in ways.items():
                    t0 = time.perf_counter()
                    way()
                    spent[name].append(time.perf_counter() - t0)
            direct, through = statistics.median(spent["direct"]), statistics.median(spent["tiled"])
            rows.append({"part": part, "channels": cin, "out": out, "kernel": kernel, "dilation": dilation,
                         "steps": length, "count": count, "direct_ms": direct * 1000, "tiled_ms": through * 1000,
                         "ratio": through / direct, "engine": tiling(kernel, cin, out) or "direct"})
    return rows


def _run_layers(args, settings) -> int:
    import torch

    from voicebus.synthesis.engine import SynthesisEngine

    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings.replace(synthesis_precision="float32"))
    torch.set_num_threads(args.threads)
    rows = layer_times(engine.model, max(1, args.frames), repeats=max(3, 3 * args.repeats))
    print(f"the decoder's convolutions, the generator's over a window of {args.frames} frames and the frame-rate "
          f"half's over a span of as many, {args.threads} thread(s), direct vs through tiles "
          "(short DFTs for 7 taps or more, F(4, 3) for 3), medians")
    print(f"{'part':<15} {'in':>5} {'out':>5} {'kernel':>6} {'dilation':>8} {'steps':>6} {'layers':>6} {'direct ms':>9} "
          f"{'tiled ms':>8} {'ratio':>6}  engine")
    for row in rows:
        print(f"{row['part']:<15} {row['channels']:5d} {row['out']:5d} {row['kernel']:6d} {row['dilation']:8d} "
              f"{row['steps']:6d} {row['count']:6d} {row['direct_ms']:9.2f} {row['tiled_ms']:8.2f} {row['ratio']:6.2f}  "
              f"{row['engine']}")
    for part in ("generator", "frame-rate half"):
        of = [r for r in rows if r["part"] == part]
        direct = sum(r["direct_ms"] * r["count"] for r in of)
        engine_way = sum((r["direct_ms"] if r["engine"] == "direct" else r["tiled_ms"]) * r["count"] for r in of)
        print(f"{part}, all {sum(r['count'] for r in of)} convolutions: direct {direct:.1f} ms, the engine's way "
              f"{engine_way:.1f} ms ({engine_way / direct:.2f}x)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"frames": args.frames, "threads": args.threads, "layers": rows}, out, indent=1)
    return 0


def run(args, settings) -> int:
    import torch

    if args.layers:
        return _run_layers(args, settings)

    from voicebus.ops.bench import seams
    from voicebus.synthesis.engine import SynthesisEngine

    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings.replace(synthesis_precision="float32"))
    torch.set_num_threads(args.threads)
    voice = engine.voices[0] if args.tiny else args.voice
    whisper = None
    if not (args.no_whisper or args.tiny):
        from voicebus.ops.bench.words import tiny_en_whisper

        whisper = tiny_en_whisper()
    sentences = seams.ENGLISH[: max(1, args.sentences)]

    def progress(repeat: int, index: int, spent: dict) -> None:
        print(f"  pass {repeat + 1} sentence {index + 1}/{len(sentences)}: "
              + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in spent.items()), flush=True)

    results = measure(engine, names, sentences, voice, max(1, args.repeats), whisper, progress)
    print(f"precision candidates on {engine.source}, {len(sentences)} sentences, voice {voice}, {args.threads} thread(s), "
          f"repeats {args.repeats}: medians per sentence")
    print(f"{'candidate':<14} {'bert ms':>8} {'predict ms':>10} {'decode ms':>9} {'time/fp32':>9} {'log-mel':>8} "
          f"{'WER':>6}  gate")
    for name, row in results.items():
        wer = f"{row['wer']:.3f}" if "wer" in row else "-"
        gate = {True: "passes", False: "fails", None: "-"}[row["passes"]]
        print(f"{name:<14} {row['bert'] * 1000:8.1f} {row['predict'] * 1000:10.1f} {row['decode'] * 1000:9.1f} "
              f"{row['ratio']:9.2f} {row['log_mel_distance']:8.3f} {wer:>6}  {gate}")
    print("log-mel: median distance to the float32 reference (bels); the gate: no larger than float32-seed's, "
          f"and WER within {WER_GATE} of float32's")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"sentences": len(sentences), "voice": voice, "threads": args.threads, "results": results}, out, indent=1)
    return 0
