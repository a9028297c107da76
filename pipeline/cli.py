"""The `voicebus` command line: one entry point, one subcommand per domain.

Each domain module in `SUBCOMMAND_MODULES` exposes `register(subparsers)`, which adds its
subcommand(s) and sets `func` on its parser. Heavy imports (torch, aiohttp) happen inside
those functions, so `voicebus --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings
from typing import Iterator

from voicebus import __version__
from voicebus.settings import Settings, SettingsError

SUBCOMMAND_MODULES = [
    "voicebus.ops.broker",  # kafka fetch|start|status|stop
    "voicebus.ops.registry_server",  # registry fetch|start|status|stop|register
    "voicebus.topics_cli",  # topics
    "voicebus.settings_cli",  # settings
    "voicebus.ops.tracing_cli",  # traces
    "voicebus.gate.cli",  # segment, gate
    "voicebus.synthesis.cli",  # synth, weights, worker
    "voicebus.players.cli",  # edge, token
    "voicebus.agents.cli",  # record, replay, say
    "voicebus.ops.demo",  # demo
    "voicebus.ops.local_llm",  # llm
    "voicebus.ops.bench.cli",  # bench bus|segment|synth|edge|ttfa
]


# Warnings that torch and kokoro print on every run of `synth` and the worker, about their own
# code, that a user of voicebus can do nothing about. Matched by category, message and the
# module that warns, so a new warning (or one about our code) still shows. Only `main` (the
# console entry) applies them, inside `warnings.catch_warnings`, so nothing leaks into a test
# or a library caller.
KNOWN_THIRD_PARTY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"dropout option adds dropout after all but last recurrent layer", r"torch\."),
    (FutureWarning, r"`torch\.nn\.utils\.weight_norm` is deprecated", r"torch\."),
    (FutureWarning, r"`torch\.jit\.script` is deprecated", r"torch\."),
)


@contextlib.contextmanager
def quiet_third_party_warnings(show: bool = False) -> Iterator[None]:
    """Hide `KNOWN_THIRD_PARTY_WARNINGS` while a user-facing command runs (restored after);
    ``VOICEBUS_SHOW_LIBRARY_WARNINGS=1`` shows them again."""
    with warnings.catch_warnings():
        if not show:
            for category, message, module in KNOWN_THIRD_PARTY_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicebus", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"voicebus {__version__}")
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
    with quiet_third_party_warnings(settings.show_library_warnings):
        try:
            result = args.func(args, settings)
        except Exception as exc:
            if not is_bus_connection_failure(exc):
                raise
            print(f"voicebus {args.command}: cannot connect: {explain_bus_failure(settings)}", file=sys.stderr)
            return 1
    return int(result or 0)


def is_bus_connection_failure(exc: BaseException) -> bool:
    """A Kafka client could not bootstrap or authenticate (aiokafka's errors, only imported when
    aiokafka already is: the check costs a command that never touched Kafka nothing)."""
    if "aiokafka" not in sys.modules:
        return False
    from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed

    return isinstance(exc, (KafkaConnectionError, SaslAuthenticationFailed))


def explain_bus_failure(settings: Settings) -> str:
    """`voicebus.bus.diagnose_connection`, from synchronous code."""
    import asyncio

    from voicebus.bus import diagnose_connection

    return asyncio.run(diagnose_connection(settings))
