"""The `voicebus` command line: one entry point, one subcommand per domain.

Each domain module in `SUBCOMMAND_MODULES` exposes `register(subparsers)`, which adds its
subcommand(s) and sets `func` on its parser. Heavy imports (torch, aiohttp) happen inside
those functions, so `voicebus --help` stays fast.

Options that mean the same thing everywhere:

* ``--bootstrap HOST:PORT`` (global: before or after the subcommand, on every one): the Kafka
  bootstrap servers, over ``VOICEBUS_BOOTSTRAP``; `main` applies it to the settings before the
  subcommand runs, and keeps it as ``args.bootstrap`` (None when not given): a benchmark given it
  uses that broker and starts none.
* ``--json PATH`` (`add_json_argument`, `write_json`): a command's results as JSON in PATH; ``-``
  is stdout, and what the command prints besides goes to stderr then.
* ``--language`` wherever a language is chosen, ``--log-level LEVEL`` on the long-running
  commands (`voicebus.logs`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, TextIO

from voicebus import __version__
from voicebus.settings import Settings, SettingsError

SUBCOMMAND_MODULES = [
    "voicebus.ops.kafka_cli",  # kafka fetch|start|status|stop
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


def bootstrap_servers(text: str) -> str:
    """``--bootstrap``'s value: ``HOST:PORT``, or several, comma-separated."""
    servers = [server.strip() for server in text.split(",")]
    for server in servers:
        host, colon, port = server.rpartition(":")
        if not (colon and host and port.isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT[,HOST:PORT...]")
    return ",".join(servers)


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """The options every command takes, before or after its name. Their default is
    `argparse.SUPPRESS`: a command's parser that does not see the option leaves the value given
    before the command's name alone."""
    parser.add_argument("--bootstrap", type=bootstrap_servers, default=argparse.SUPPRESS, metavar="HOST:PORT",
                        help="Kafka bootstrap servers, over VOICEBUS_BOOTSTRAP (a benchmark given it uses that "
                             "broker and starts none)")


def command_parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser under `parser`, depth first, once each, with its full name
    (``voicebus bench scale``)."""
    seen: set[int] = set()

    def walk(p: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    if id(child) not in seen:  # an alias names the same parser
                        seen.add(id(child))
                        yield child.prog, child
                        yield from walk(child)

    yield from walk(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicebus", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"voicebus {__version__}")
    add_global_options(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for _, command in list(command_parsers(parser)):  # after a command's name too: no module repeats them
        add_global_options(command)
    return parser


def add_json_argument(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json PATH``: `write_json` writes `what` there; ``-`` is stdout (the command's other
    output then goes to stderr: `main`)."""
    parser.add_argument("--json", metavar="PATH", default=None,
                        help=f"write {what} as JSON to PATH ('-': to stdout, the rest of the output to stderr)")


_json_stdout: TextIO | None = None  # where `--json -` writes, while `main` sends the rest to stderr


def write_json(dest: str | os.PathLike | None, data: Any, *, indent: int | None = 1) -> None:
    """`data` as JSON to ``--json``'s `dest`: nothing for None, stdout for ``-``, else the file
    (its folder made first)."""
    if dest is None:
        return
    text = json.dumps(data, indent=indent) + "\n"
    if str(dest) == "-":
        out = _json_stdout or sys.stdout
        out.write(text)
        out.flush()
        return
    path = Path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@contextlib.contextmanager
def json_to_stdout(args: argparse.Namespace) -> Iterator[None]:
    """With ``--json -``: stdout is the JSON's alone while the command runs, what it prints
    besides goes to stderr."""
    global _json_stdout
    if getattr(args, "json", None) != "-":
        yield
        return
    _json_stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stdout = None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    args.bootstrap = getattr(args, "bootstrap", None)
    try:
        settings = Settings.from_env(**({} if args.bootstrap is None else {"bootstrap": args.bootstrap}))
    except SettingsError as exc:
        print(f"voicebus: {exc}", file=sys.stderr)
        return 2
    with quiet_third_party_warnings(settings.show_library_warnings):
        try:
            with json_to_stdout(args):
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
