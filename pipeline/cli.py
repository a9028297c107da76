"""The `voicebus` command line: one entry point, one subcommand per domain.

Each domain module in `SUBCOMMAND_MODULES` exposes `register(subparsers)`, which adds its
subcommand(s) and sets `func` on its parser. Heavy imports (torch, faust, aiohttp) happen inside
those functions, so `voicebus --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.settings import Settings, SettingsError

SUBCOMMAND_MODULES = [
    "pipeline.broker",  # kafka fetch|start|status|stop
    "pipeline.registry_server",  # registry fetch|start|status|stop|register
    "pipeline.topics_cli",  # topics
    "pipeline.gate.cli",  # segment, gate
    "pipeline.synthesis.cli",  # synth, weights, worker
    "players.cli",  # edge, token
    "agents.cli",  # record, replay, say
    "pipeline.demo",  # demo
    "pipeline.bench.cli",  # bench bus|segment|synth|edge|ttfa
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicebus", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"voicebus: {exc}", file=sys.stderr)
        return 2
    result = args.func(args, settings)
    return int(result or 0)
