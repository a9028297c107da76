"""`voicebus bench bus`: produce-to-consume latency of single small events through Kafka.

Sends N small TextEvents one at a time (each waits for the previous to arrive, so nothing is
batched) with the pipeline's own producer options (`PRODUCER_OPTIONS`: acks=all, idempotent) and
consumer options (`make_consumer`), and measures, per event, the time from the `send` call to the
consumer handing the record over, on one clock (one process). Prints p50/p90/p99/max and whether
the target (p50 <= 2 ms, p99 <= 10 ms) is met by the medians over `--runs` rounds.

A/B in one run: ``--acks 1,all`` compares acks=1 (no idempotence: Kafka requires acks=all for
it) with the pipeline's acks=all + idempotence, and ``--brokers 1,3`` starts a throwaway
cluster of each size (free loopback ports, a temporary data dir) and measures each; every run
visits every (brokers, acks) cell in turn, so a load change on the machine hits all cells alike.
Without ``--brokers`` it uses the broker at settings.bootstrap, or starts a local one
(`ensure_local_kafka`) and stops it at the end; given ``--bootstrap``, that broker and none
started (``--brokers`` then does not apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from voicebus.cli import add_json_argument, write_json
from voicebus.latency import percentile
from voicebus.settings import Settings
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import TextEvent

TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0
# The producer variants `--acks` chooses from. "all" is what the pipeline uses (PRODUCER_OPTIONS).
ACKS_OPTIONS: dict[str, dict[str, Any]] = {
    "1": {"acks": 1, "enable_idempotence": False},
    "all": {"acks": "all", "enable_idempotence": True},
}


@dataclass(frozen=True)
class BusLatency:
    events: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    kafka_bootstrap: str
    acks: str = "all"


async def measure_bus_latency(settings: Settings, events: int = 2000, warmup: int = 1000,
                              acks: str = "all") -> BusLatency:
    from aiokafka import TopicPartition

    from voicebus.bus import ensure_topics, make_admin, make_consumer, make_producer
    from voicebus.clock import now_us
    from voicebus.codecs import codec_for
    from voicebus.topics import session_key

    topic = f"voicebus.bench.bus.{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, [topic], partitions=1)  # replicated as the pipeline's topics are
    codec = codec_for(settings)
    consumer = make_consumer(settings)  # no group: assigned directly, no rebalance in the way
    producer = make_producer(settings, **ACKS_OPTIONS[acks])
    latencies_ms: list[float] = []
    try:
        await consumer.start()
        await producer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        for i in range(warmup + events):
            value = TextEvent(session_id="bench", turn_id="t1", agent_id="bench", seq=i, kind=TextEventKind.TOKEN,
                              text=" word", produced_at_us=now_us())
            payload = codec.encode("TextEvent", value, topic)
            started = time.perf_counter()
            await producer.send(topic, payload, key=session_key("bench"))
            record = await asyncio.wait_for(consumer.getone(tp), 30)
            elapsed_ms = (time.perf_counter() - started) * 1000
            if codec.decode(record.value).value["seq"] != i:
                raise RuntimeError(f"expected event {i}, got another: the topic is not ours alone")
            if i >= warmup:
                latencies_ms.append(elapsed_ms)
    finally:
        await producer.stop()
        await consumer.stop()
        admin = make_admin(settings)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()
    ordered = sorted(latencies_ms)
    return BusLatency(
        events=len(ordered),
        p50_ms=percentile(ordered, 50),
        p90_ms=percentile(ordered, 90),
        p99_ms=percentile(ordered, 99),
        max_ms=ordered[-1],
        mean_ms=statistics.fmean(ordered),
        kafka_bootstrap=settings.bootstrap,
        acks=acks,
    )


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("bus", help="Kafka produce-to-consume latency p50/p99 of single small events")
    p.add_argument("--events", type=int, default=2000, help="measured events (default 2000)")
    p.add_argument("--warmup", type=int, default=1000, help="events sent first and not counted")
    p.add_argument("--runs", type=int, default=3, help="rounds per cell; the medians are the figures")
    p.add_argument("--acks", default="all",
                   help="comma-separated producer variants: 1 (acks=1, not idempotent) and/or all "
                        "(acks=all + idempotence, the pipeline's); default all")
    p.add_argument("--brokers", default=None,
                   help="comma-separated cluster sizes, e.g. 1,3: a throwaway cluster of each is started "
                        "(default: the broker at VOICEBUS_BOOTSTRAP, or a throwaway single one)")
    add_json_argument(p, "the figures")
    p.set_defaults(func=run_bench)


def _parse_list(text: str, what: str, allowed: set[str] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or (allowed is not None and not set(items) <= allowed):
        raise ValueError(f"--{what} {text!r}: expected a comma-separated list of {sorted(allowed or [])}")
    return items


def run_bench(args, settings: Settings) -> int:
    import sys

    from rich.console import Console
    from rich.table import Table

    from voicebus.ops.bench.cli import bench_kafka, refuse_bootstrap
    from voicebus.ops.cluster import cluster_metadata, throwaway_cluster

    try:
        acks_variants = _parse_list(args.acks, "acks", set(ACKS_OPTIONS))
        sizes = [int(n) for n in _parse_list(args.brokers, "brokers")] if args.brokers else None
    except ValueError as exc:
        print(f"voicebus bench bus: {exc}", file=sys.stderr)
        return 2
    if sizes is not None and refuse_bootstrap(args, "bus", "--brokers starts throwaway clusters of its own"):
        return 2
    console = Console()
    results: dict[tuple[int, str], list[BusLatency]] = {}
    with contextlib.ExitStack() as stack:
        if sizes is None:
            live = stack.enter_context(bench_kafka(args, settings))
            clusters = {len(cluster_metadata(live.bootstrap).brokers): live}
        else:  # all clusters up at once, so the runs can alternate between them
            clusters = {n: stack.enter_context(throwaway_cluster(settings, n)) for n in sizes}
        for _ in range(max(1, args.runs)):
            for n, live in clusters.items():
                for acks in acks_variants:
                    results.setdefault((n, acks), []).append(
                        asyncio.run(measure_bus_latency(live, events=args.events, warmup=args.warmup, acks=acks)))

    table = Table(title=f"bus: produce -> consume, {args.events} single events per run, {args.runs} runs per cell "
                        "(medians of the runs; each run's p50 in brackets)")
    for column in ("brokers", "acks", "p50 ms", "p90 ms", "p99 ms", "max ms", "runs' p50"):
        table.add_column(column, justify="right")
    cells = []
    for (n, acks), runs in results.items():
        cell = {
            "brokers": n, "acks": acks, "runs": [asdict(r) for r in runs],
            **{f"median_{k}_ms": statistics.median(getattr(r, f"{k}_ms") for r in runs)
               for k in ("p50", "p90", "p99", "max")},
        }
        cells.append(cell)
        table.add_row(str(n), acks, *(f"{cell[f'median_{k}_ms']:.3f}" for k in ("p50", "p90", "p99", "max")),
                      ", ".join(f"{r.p50_ms:.2f}" for r in runs))
    console.print(table)
    for cell in cells:
        print(f"bus brokers={cell['brokers']} acks={cell['acks']} p50_ms={cell['median_p50_ms']:.3f} "
              f"p99_ms={cell['median_p99_ms']:.3f}")
    by_cell = {(c["brokers"], c["acks"]): c for c in cells}
    if {"1", "all"} <= set(acks_variants):
        for n in clusters:
            one, every = by_cell[(n, "1")], by_cell[(n, "all")]
            print(f"bus brokers={n} acks=all/acks=1: p50 x{every['median_p50_ms'] / one['median_p50_ms']:.2f}, "
                  f"p99 x{every['median_p99_ms'] / one['median_p99_ms']:.2f}")
    # The target applies to the pipeline's own producer (acks=all) on the smallest cluster measured.
    ours = by_cell.get((min(clusters), "all")) or cells[0]
    p50, p99 = ours["median_p50_ms"], ours["median_p99_ms"]
    met = p50 <= TARGET_P50_MS and p99 <= TARGET_P99_MS
    print(f"bus_latency_p50_ms={p50:.3f} bus_latency_p99_ms={p99:.3f} "
          f"ratio_p50_to_target={p50 / TARGET_P50_MS:.2f} ratio_p99_to_target={p99 / TARGET_P99_MS:.2f} "
          f"target={'met' if met else 'missed'} (p50 <= {TARGET_P50_MS} ms, p99 <= {TARGET_P99_MS} ms; "
          f"brokers={ours['brokers']} acks={ours['acks']})")
    write_json(args.json, {"cells": cells, "median_p50_ms": p50, "median_p99_ms": p99, "meets_target": met},
               indent=2)
    return 0
