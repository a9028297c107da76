"""`voicebus bench <name>`: benchmarks that print numbers and ratios (never timed tests).

Each module in `BENCH_MODULES` exposes `register(bench_subparsers)`, adding one benchmark with
`set_defaults(func=...)`; `func(args, settings) -> int`.

What every benchmark does alike: one that needs Kafka uses the broker at ``VOICEBUS_BOOTSTRAP``
when one answers there, else starts a throwaway one and stops it at the end (`bench_kafka`);
given ``--bootstrap`` it uses that broker and starts none. One that kills brokers starts its own
clusters and refuses ``--bootstrap`` (`refuse_bootstrap`). One that runs pipeline stages takes
``--log-level`` (`add_stage_log_level`) and passes it on to them. Results go to ``--json PATH``
(`voicebus.cli.add_json_argument`). Every data file a benchmark reads ships in the package
(``data/``, `data_path`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCH_MODULES = [
    "voicebus.ops.bench.bus",
    "voicebus.ops.bench.segment",
    "voicebus.ops.bench.gate",
    "voicebus.ops.bench.synth",
    "voicebus.ops.bench.precision",
    "voicebus.ops.bench.edge",
    "voicebus.ops.bench.scale",
    "voicebus.ops.bench.ttfa",
    "voicebus.ops.bench.agents",
    "voicebus.ops.bench.words",
    "voicebus.ops.bench.chaos",
    "voicebus.ops.bench.failover",
    "voicebus.ops.bench.hostile",
    "voicebus.ops.bench.floor",
    "voicebus.ops.bench.gpu",
]

DATA_DIR = Path(__file__).resolve().parent / "data"


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    bench = p.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench)
    p.set_defaults(func=lambda args, settings: (p.print_help(), 2)[1])


def data_path(name: str) -> Path:
    """A data file shipped with the benchmarks (package data, ``voicebus/ops/bench/data/``)."""
    return DATA_DIR / name


def bootstrap_given(args: argparse.Namespace) -> bool:
    """Was ``--bootstrap`` given (`voicebus.cli.main` keeps it as ``args.bootstrap``)?"""
    return getattr(args, "bootstrap", None) is not None


def bench_kafka(args: argparse.Namespace, settings):
    """A context manager yielding settings pointed at the benchmark's broker: the one named by
    ``--bootstrap`` (nothing started), else `voicebus.ops.cluster.ensure_local_kafka` (the broker
    at ``settings.bootstrap``, or a throwaway one started now and stopped on exit)."""
    from voicebus.ops.cluster import ensure_local_kafka

    return ensure_local_kafka(settings, start=not bootstrap_given(args))


def refuse_bootstrap(args: argparse.Namespace, bench: str, why: str) -> bool:
    """For a benchmark that must own its brokers: True (and says so on stderr) when
    ``--bootstrap`` was given."""
    if bootstrap_given(args):
        print(f"voicebus bench {bench}: --bootstrap does not apply: {why}", file=sys.stderr)
        return True
    return False


def add_stage_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` of a benchmark that runs pipeline stages: this process's, and every stage's
    it starts (their own defaults when not given: WARNING for the gate, INFO for workers and
    edges)."""
    from voicebus.logs import LEVELS, add_log_level_argument

    add_log_level_argument(parser, None, help=f"log level, {', '.join(LEVELS)}: of this process and of the "
                                              "stages it starts (default: WARNING here, each stage its own)")
