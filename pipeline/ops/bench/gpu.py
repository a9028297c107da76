"""`voicebus bench gpu`: Kokoro-82M's throughput with many sessions at once, batched vs unbatched.

This module owns the benchmark of `voicebus.synthesis.batch.forward_batch` against kokoro's own
`KModel.forward_with_tokens`. At each concurrency N (``--concurrency``), N sessions each speak
``--sentences`` sentences: **batched**, each round's N sentences go through one forward pass;
**unbatched**, the N forward passes run one after another. Reported per concurrency and mode:
throughput (seconds of speech per second of wall time) and each session's time to first audio
(when its first sentence's audio is out), p50 and max, the median of ``--repeats`` runs after
one warm-up round.

It needs no network, no Kafka and no weights: the model is the real Kokoro-82M v1.0
architecture (`voicebus.synthesis.weights.KOKORO_CONFIG`; ``--tiny``: the tiny test config) with
random weights, since speed does not depend on the weights' values. One thing does: how many
frames a token lasts, which sets the decoder's work. Random weights give about half of
``max_dur`` a token (25 with the real config); the duration head's bias is set so a token
lasts about `FRAMES_PER_TOKEN` frames, near the released model's speech rate. The sentences are
fixed phoneme strings (no G2P); the voices random style rows.

``--dtype bfloat16`` or ``float16`` runs both modes under `torch.autocast` (the weights stay
float32; matrix products and convolutions run in the lower precision, as on a GPU one would);
the generator's STFT and inverse STFT stay float32 (`_float32_stft`: a complex tensor of half
precision has no multiply on the CPU, and the phase is the last place to round).
"""

from __future__ import annotations

import argparse
import io
import time

from voicebus.cli import add_json_argument, write_json
from voicebus.latency import percentile

# Frames (25 ms each) a token lasts, near Kokoro-82M's rate of about 12-14 phonemes a second.
FRAMES_PER_TOKEN = 3.5
SAMPLE_RATE = 24000
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
DTYPES = ("float32", "bfloat16", "float16")

# With ``--tiny`` each sentence is cut to its first symbols: the tiny config shrinks the text
# side only (its decoder is Kokoro's), and the bench is there to show the code path runs.
TINY_SYMBOLS = 3

# Conversational English sentences in Kokoro's phoneme alphabet, of varied lengths, so a batch
# pads its shorter sentences as a live one would.
SENTENCES = (
    "hˈɛloʊ, ɡˈʊd tə sˈiː juː əɡˈɛn.",
    "ðə mˈiːtɪŋ hɐz bˌɪn mˈuːvd tə θˈɜːzdeɪ æt tˈuː ə klˈɑːk ɪn ðɪ ˈæftɚnˌuːn.",
    "aɪ θˈɪŋk wiː ʃˌʊd tˈeɪk ðə lˈɑːŋɡɚ ɹˈuːt, ɪts mˈɔːɹ sˈiːnɪk ænd ðə ɹˈoʊdz ɑːɹ kwˈaɪətɚ.",
    "ʃˈʊɹ, aɪl sˈɛnd ɪt ˈoʊvɚ.",
    "jɔːɹ ˈɔːɹdɚ ʃˈɪpt ðɪs mˈɔːɹnɪŋ ænd ʃˌʊd əɹˈaɪv wɪðˌɪn θɹˈiː bˈɪznəs dˈeɪz.",
    "ðæts ə ɡɹˈeɪt kwˈɛstʃən; lˈɛt mˌiː tʃˈɛk ðə dˈiːteɪlz ænd ɡˈɛt bˈæk tə juː ʃˈɔːɹtli.",
    "nˈoʊ pɹˈɑːbləm æt ˈɔːl.",
    "ðə wˈɛðɚ fˈɔːɹkæst sˈeɪz ɹˈeɪn ɪn ðə mˈɔːɹnɪŋ, klˈɪɹɪŋ baɪ ˈiːvnɪŋ wɪð ə hˈaɪ ʌv ˈeɪtiːn dɪɡɹˈiːz.",
)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("gpu", help="Kokoro-82M throughput at many sessions: one batched forward pass vs one per session")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help=f"comma-separated session counts (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="float32 (default), or bfloat16 / float16 under torch.autocast (STFTs in float32)")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead of Kokoro-82M's (code path only)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per concurrency and mode; the median is reported")
    p.add_argument("--sentences", type=int, default=2, help="sentences each session speaks (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default); on a busy "
                                                          "CPU 1 avoids threads waiting for cores others hold")
    add_json_argument(p)
    p.set_defaults(func=run)


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: comma-separated integers, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency: session counts of at least 1, not {text!r}")
    return levels


def build_model(tiny: bool, device: str, seed: int = 0):
    """A `kokoro.KModel` of the real (or tiny) architecture with random weights, weight norms
    baked as the engine's are, durations near the released model's (`FRAMES_PER_TOKEN`)."""
    import math

    import torch
    from kokoro import KModel

    from voicebus.synthesis.engine import REPO_ID, tiny_config
    from voicebus.synthesis.kokoro_frames import bake_weight_norms
    from voicebus.synthesis.weights import kokoro_config

    config = tiny_config() if tiny else kokoro_config(tiny_config()["vocab"])
    empty_state = io.BytesIO()
    torch.save({}, empty_state)  # KModel always loads a state dict; an empty one keeps the init
    empty_state.seek(0)
    torch.manual_seed(seed)
    model = KModel(repo_id=REPO_ID, config=config, model=empty_state).eval()
    bake_weight_norms(model)
    proj = model.predictor.duration_proj.linear_layer
    with torch.no_grad():
        proj.weight.mul_(0.1)  # some spread between tokens, around the bias
        share = FRAMES_PER_TOKEN / config["max_dur"]
        proj.bias.fill_(math.log(share / (1 - share)))
    return model.to(device)


def session_requests(model, sessions: int, sentences: int, cut: int | None = None, seed: int = 0) -> list[list]:
    """``[round][session]`` `voicebus.synthesis.batch.Request`s: session i's sentence k is
    `SENTENCES` ``[(i + k) % len]`` (its first ``cut`` symbols when given), its voice a random
    style row."""
    import torch

    from voicebus.synthesis.batch import Request
    from voicebus.synthesis.kokoro_frames import token_ids

    noise = torch.Generator().manual_seed(seed)
    voices = [torch.randn(1, 256, generator=noise) * 0.5 for _ in range(sessions)]
    texts = [SENTENCES[(i + k) % len(SENTENCES)][:cut] for k in range(sentences) for i in range(sessions)]
    return [[Request(token_ids(model, texts[k * sessions + i]).to(model.device), voices[i].to(model.device))
             for i in range(sessions)] for k in range(sentences)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _single(model, request, device: str) -> int:
    """kokoro's own forward pass for one request: its samples."""
    audio, _ = model.forward_with_tokens(request.input_ids.reshape(1, -1), request.ref_s, request.speed)
    _sync(device)
    return audio.numel()


def _batch(model, requests: list, device: str) -> int:
    """One batched forward pass for all ``requests``: their samples."""
    from voicebus.synthesis.batch import forward_batch

    results = forward_batch(model, requests)
    _sync(device)
    return sum(r.audio.numel() for r in results)


def time_run(model, rounds: list[list], device: str, mode: str) -> dict:
    """One timed run of every round: wall seconds, seconds of speech, and each session's time to
    first audio (batched: the first round's end for all; unbatched: its own forward's end)."""
    start = time.perf_counter()
    ttfa: list[float] = []
    samples = 0
    for k, requests in enumerate(rounds):
        if mode == "batched":
            samples += _batch(model, requests, device)
            ttfa = ttfa or [time.perf_counter() - start] * len(requests)
            continue
        for r in requests:
            samples += _single(model, r, device)
            if k == 0:
                ttfa.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "speech_s": samples / SAMPLE_RATE, "ttfa_s": ttfa}


def measure(model, rounds: list[list], repeats: int, device: str, mode: str) -> dict:
    """The median of ``repeats`` timed runs (by wall time), after one warm-up round."""
    time_run(model, rounds[:1], device, mode)
    runs = sorted((time_run(model, rounds, device, mode) for _ in range(max(1, repeats))), key=lambda r: r["wall_s"])
    run = runs[len(runs) // 2]
    return {
        "wall_s": round(run["wall_s"], 4),
        "speech_s": round(run["speech_s"], 3),
        "throughput": round(run["speech_s"] / run["wall_s"], 3),
        "ttfa_p50_s": round(percentile(run["ttfa_s"], 50), 4),
        "ttfa_max_s": round(max(run["ttfa_s"]), 4),
        "wall_s_runs": [round(r["wall_s"], 4) for r in runs],
    }


def _environment(device: str, tiny: bool, args) -> dict:
    import torch

    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"device": device, "device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "config": "tiny" if tiny else "kokoro-82m-v1.0", "weights": "random",
            "dtype": getattr(args, "dtype", "float32"),
            "frames_per_token": FRAMES_PER_TOKEN, "sentences": args.sentences, "repeats": args.repeats}


def _level(model, sessions: int, args, device: str) -> dict:
    """Both modes at one concurrency; a mode that runs out of device memory is reported so."""
    import torch

    row: dict = {"sessions": sessions}
    rounds = session_requests(model, sessions, args.sentences, TINY_SYMBOLS if args.tiny else None)
    for mode in ("unbatched", "batched"):
        try:
            row[mode] = measure(model, rounds, args.repeats, device, mode)
        except torch.cuda.OutOfMemoryError:
            row[mode] = {"error": "out of device memory"}
            torch.cuda.empty_cache()
    if "throughput" in row["unbatched"] and "throughput" in row["batched"]:
        row["speedup"] = round(row["batched"]["throughput"] / row["unbatched"]["throughput"], 3)
    return row


def _print_row(row: dict) -> None:
    for mode in ("unbatched", "batched"):
        r = row[mode]
        if "error" in r:
            print(f"{row['sessions']:>8} {mode:>9}  {r['error']}")
            continue
        print(f"{row['sessions']:>8} {mode:>9} {r['throughput']:>10.2f} {r['ttfa_p50_s']:>9.3f} {r['ttfa_max_s']:>9.3f} "
              f"{r['speech_s']:>9.1f} {r['wall_s']:>8.2f}")
    if "speedup" in row:
        print(f"{'':>8} {'speedup':>9} {row['speedup']:>9.2f}x")


def run(args: argparse.Namespace, settings) -> int:
    import torch

    from voicebus.synthesis.engine import EngineError, pick_device

    parse_concurrency(args.concurrency)  # a bad list fails before the model is built
    try:
        device = pick_device(args.device)
    except EngineError as e:
        print(f"voicebus bench gpu: {e}")
        return 2
    previous_threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        rows, env = _bench(args, device)
    finally:
        torch.set_num_threads(previous_threads)  # in-process callers (tests) keep their own
    write_json(args.json, {"environment": env, "levels": rows})
    if args.json and args.json != "-":
        print(f"wrote {args.json}")
    return 0


def _bench(args: argparse.Namespace, device: str) -> tuple[list[dict], dict]:
    """Every concurrency level, printed as it is measured: (rows, environment)."""
    import torch

    model = build_model(args.tiny, device)
    dtype = getattr(args, "dtype", "float32")
    if dtype != "float32":
        generator = model.decoder.generator
        generator.stft = _float32_stft(generator.stft, device)
    env = _environment(device, args.tiny, args)
    rows = []
    autocast = torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype), enabled=dtype != "float32")
    with torch.inference_mode(), autocast:
        print(f"bench gpu: {env['config']} (random weights) on {env['device_name']}, {dtype}, "
              f"{args.sentences} sentence(s) a session, median of {args.repeats}")
        print(f"{'sessions':>8} {'mode':>9} {'speech/s':>10} {'ttfa p50':>9} {'ttfa max':>9} {'speech s':>9} {'wall s':>8}")
        for sessions in parse_concurrency(args.concurrency):
            rows.append(_level(model, sessions, args, device))
            _print_row(rows[-1])
    return rows, env


def _float32_stft(stft, device: str):
    """The generator's STFT (kokoro's ``TorchSTFT``: ``transform``, ``inverse``) wrapped to run
    outside autocast, in float32, whatever the precision around it (a module, as the generator's
    child must be)."""
    import torch

    device_type = device.split(":")[0]

    class Float32STFT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = stft

        def transform(self, x):
            with torch.autocast(device_type, enabled=False):
                return self.inner.transform(x.float())

        def inverse(self, magnitude, phase):
            with torch.autocast(device_type, enabled=False):
                return self.inner.inverse(magnitude.float(), phase.float())

    return Float32STFT()
