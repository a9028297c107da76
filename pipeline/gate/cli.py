"""Command line of the sentence gate: `voicebus gate` (one gate worker until SIGINT/SIGTERM; also
``python -m voicebus.gate.cli``) and `voicebus segment` (the streaming segmenter on stdin).

This module owns the gate's arguments, its signals and its process entry (`run_gate_worker`,
`start_gate_subprocess`); the Kafka shell is `voicebus.gate.app.GateWorker`, the decisions
`voicebus.gate.core`. `register(subparsers)` adds this domain's subcommands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Iterator, TextIO

from voicebus.logs import add_log_level_argument, configure_logging

if TYPE_CHECKING:
    from voicebus.settings import Settings

log = logging.getLogger(__name__)

LANGUAGES = ("en", "es", "pt", "fr", "it", "hi", "ja", "zh")
_WORD_TOKEN = re.compile(r"\s*\S+|\s+")


def word_tokens(text: str) -> list[str]:
    """Split text the way LLM tokens arrive: word-sized pieces, each with its leading spaces.
    Joined, the pieces give back `text` exactly."""
    return _WORD_TOKEN.findall(text)


def _pieces(stream: TextIO, chunk: int | None) -> Iterator[str]:
    """Read `stream` as it arrives: `chunk` characters at a time, or word-sized tokens per line."""
    if chunk:
        while piece := stream.read(chunk):
            yield piece
        return
    for line in stream:
        yield from word_tokens(line)


def _sentence_json(sentence) -> str:
    return json.dumps(
        {
            "text": sentence.text,
            "kind": sentence.kind,
            "start": sentence.start,
            "end": sentence.end,
            "lag": sentence.lag,
        },
        ensure_ascii=False,
    )


def run_segment(args: argparse.Namespace, settings) -> int:
    from voicebus.gate.segmenter import StreamingSegmenter

    if args.chunk is not None and args.chunk < 1:
        print("voicebus segment: --chunk must be at least 1", file=sys.stderr)
        return 2
    min_words = settings.first_clause_min_words if args.first_clause_min_words is None else args.first_clause_min_words
    segmenter = StreamingSegmenter(args.language, first_clause_min_words=min_words)
    stdin = sys.stdin
    if hasattr(stdin, "reconfigure"):
        stdin.reconfigure(encoding="utf-8")
    out = sys.stdout
    for piece in _pieces(stdin, args.chunk):
        for sentence in segmenter.feed(piece):
            print(_sentence_json(sentence), file=out, flush=True)
    for sentence in segmenter.flush():
        print(_sentence_json(sentence), file=out, flush=True)
    return 0


def register(subparsers) -> None:
    seg = subparsers.add_parser(
        "segment",
        help="split UTF-8 text on stdin into speakable sentences, streamed (one JSON per line)",
        description="Feed stdin to the streaming segmenter and print each released sentence as "
        'one JSON object per line: {"text", "kind", "start", "end", "lag"}.',
    )
    seg.add_argument("--language", "--lang", dest="language", choices=LANGUAGES, default="en",
                     help="language of the text (default en)")
    seg.add_argument(
        "--chunk",
        type=int,
        default=None,
        metavar="N",
        help="feed N characters at a time (default: word-sized tokens with their spaces)",
    )
    seg.add_argument(
        "--first-clause-min-words",
        type=int,
        default=None,
        metavar="N",
        help="release a long first sentence early at a clause mark once it has N words "
        "(default: the setting first_clause_min_words; 0 disables)",
    )
    seg.set_defaults(func=run_segment)

    # `voicebus gate`: one gate worker (aiokafka) until stopped; see pipeline/gate/app.py.

    gate = subparsers.add_parser(
        "gate", help="run a gate worker: agents' text topics in, synthesis requests out",
    )
    add_worker_arguments(gate)
    gate.set_defaults(func=gate_command)


def run_gate_worker(settings: "Settings", **options: Any) -> int:
    """Run one gate worker in this process until SIGINT/SIGTERM; 2 when it cannot start."""
    from voicebus.gate.app import GateStartError, GateWorker

    worker = GateWorker(settings, **options)

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await worker.start()
        try:
            await stopping.wait()
        finally:
            await worker.stop()

    try:
        asyncio.run(main())
    except GateStartError as exc:
        log.error("gate: %s", exc)
        return 2
    return 0


def start_gate_subprocess(
    settings: "Settings", *, commit_interval_s: float = 1.0, session_timeout_s: float = 10.0,
    stdout: Any = subprocess.PIPE, stderr: Any = None, log_level: str = "WARNING",
) -> subprocess.Popen:
    """Start a gate worker as a child process (`python -m voicebus.gate.cli --announce`).

    The caller owns the process: it must terminate (or kill) and wait for it. With the default
    stdout, the child prints `voicebus.gate.app.READY_LINE` and its partitions after each
    rebalance, once it has recovered them.
    """
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "voicebus.gate.cli", "--announce", "--log-level", log_level,
           "--commit-interval", str(commit_interval_s), "--session-timeout", str(session_timeout_s)]
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    from voicebus.gate.app import READY_LINE

    parser.add_argument("--commit-interval", type=float, default=1.0, metavar="S",
                        help="how often applied control offsets are committed (default 1.0; text positions "
                             "are stored with the state, on every event)")
    parser.add_argument("--session-timeout", type=float, default=10.0, metavar="S",
                        help="consumer group session timeout: how soon a dead worker's partitions move")
    add_log_level_argument(parser, "WARNING", aliases=("--loglevel",))
    parser.add_argument("--announce", action="store_true",
                        help=f"print '{READY_LINE} [partitions]' after each rebalance, once recovered")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve Prometheus metrics on http://<edge_host>:P/metrics and health on /healthz "
                             "(200 while every task runs; restarts and last errors per task)")


def gate_command(args: argparse.Namespace, settings: "Settings") -> int:
    """`voicebus gate`: run one gate worker until stopped."""
    configure_logging(args.log_level)
    return run_gate_worker(
        settings, commit_interval_s=args.commit_interval, session_timeout_s=args.session_timeout,
        announce=args.announce, metrics_port=args.metrics_port,
    )


def main(argv: list[str] | None = None) -> int:
    from voicebus.settings import Settings

    parser = argparse.ArgumentParser(prog="python -m voicebus.gate.cli", description="Run one gate worker.")
    add_worker_arguments(parser)
    return gate_command(parser.parse_args(argv), Settings.from_env())


if __name__ == "__main__":
    sys.exit(main())
