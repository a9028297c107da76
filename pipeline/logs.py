"""Logging of the long-running commands, one way everywhere: ``--log-level LEVEL`` on the command
(`add_log_level_argument`) and `configure_logging` when it starts.

The gate, the synthesis worker, the edge, the demo and the benchmarks that run stages take the
option; a benchmark passes it on to the stage processes it starts (``--log-level`` on their
command lines). ``--loglevel``, the gate's old spelling, still works there.
"""

from __future__ import annotations

import argparse
import logging

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_level_argument(parser: argparse.ArgumentParser, default: str | None = "WARNING", *,
                           aliases: tuple[str, ...] = (), help: str | None = None) -> None:
    """``--log-level LEVEL`` (then `aliases`, old spellings) on `parser`, as ``args.log_level``;
    any case is accepted (``info`` is ``INFO``)."""
    parser.add_argument("--log-level", *aliases, dest="log_level", type=str.upper, choices=LEVELS,
                        default=default, metavar="LEVEL",
                        help=help or f"log level: {', '.join(LEVELS)} (default {default})")


def configure_logging(level: str | int | None = "WARNING") -> None:
    """Log records at `level` and above to stderr, one line each (time, level, logger, message).
    As `logging.basicConfig`: nothing changes where the root logger has handlers already (a
    test runner's, a host application's)."""
    logging.basicConfig(level=level or "WARNING", format=FORMAT)
