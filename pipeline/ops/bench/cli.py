"""`voicebus bench <name>`: benchmarks that print numbers and ratios (never timed tests).

Each module in `BENCH_MODULES` exposes `register(bench_subparsers)`, adding one benchmark with
`set_defaults(func=...)`; `func(args, settings) -> int`.
"""

from __future__ import annotations

import importlib

BENCH_MODULES = [
    "voicebus.ops.bench.bus",
    "voicebus.ops.bench.segment",
    "voicebus.ops.bench.gate",
    "voicebus.ops.bench.synth",
    "voicebus.ops.bench.edge",
    "voicebus.ops.bench.scale",
    "voicebus.ops.bench.ttfa",
    "voicebus.ops.bench.agents",
    "voicebus.ops.bench.words",
    "voicebus.ops.bench.chaos",
    "voicebus.ops.bench.failover",
    "voicebus.ops.bench.hostile",
]


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    bench = p.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench)
    p.set_defaults(func=lambda args, settings: (p.print_help(), 2)[1])
