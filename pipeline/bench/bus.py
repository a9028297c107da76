"""`voicebus bench bus`: produce-to-consume latency of single small events through Kafka.

Sends N small TextEvents one at a time (each waits for the previous to arrive, so nothing is
batched) with the pipeline's own producer options (`PRODUCER_OPTIONS`) and consumer options
(`make_consumer`), and measures, per event, the time from the `send` call to the consumer handing
the record over, on one clock (one process). Prints p50/p90/p99/max and whether the target
(p50 <= 2 ms, p99 <= 10 ms) is met by the
medians over `--runs` rounds on one broker. Uses the broker at settings.bootstrap, or starts a local one
(`ensure_local_kafka`) and stops it at the end.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from pipeline.latency import percentile
from pipeline.settings import Settings

TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0


@dataclass(frozen=True)
class BusLatency:
    events: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    kafka_bootstrap: str


async def measure_bus_latency(settings: Settings, events: int = 2000, warmup: int = 1000) -> BusLatency:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from pipeline.bus import ensure_topics, make_consumer, make_producer
    from pipeline.clock import now_us
    from pipeline.codecs import codec_for
    from pipeline.topics import session_key

    topic = f"voicebus.bench.bus.{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, [topic], partitions=1)
    codec = codec_for(settings)
    consumer = make_consumer(settings)  # no group: assigned directly, no rebalance in the way
    producer = make_producer(settings)
    latencies_ms: list[float] = []
    try:
        await consumer.start()
        await producer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        for i in range(warmup + events):
            value = {
                "session_id": "bench", "turn_id": "t1", "agent_id": "bench", "seq": i, "kind": "TOKEN",
                "text": " word", "claim_id": None, "language": None, "voice": None, "produced_at_us": now_us(),
            }
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
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
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
    )


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("bus", help="Kafka produce-to-consume latency p50/p99 of single small events")
    p.add_argument("--events", type=int, default=2000, help="measured events (default 2000)")
    p.add_argument("--warmup", type=int, default=1000, help="events sent first and not counted")
    p.add_argument("--runs", type=int, default=3, help="rounds on the same broker; the medians are the figures")
    p.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    p.set_defaults(func=run_bench)


def run_bench(args, settings: Settings) -> int:
    from rich.console import Console
    from rich.table import Table

    from pipeline.broker import ensure_local_kafka

    console = Console()
    with ensure_local_kafka(settings) as live:
        results = [asyncio.run(measure_bus_latency(live, events=args.events, warmup=args.warmup))
                   for _ in range(max(1, args.runs))]
    table = Table(title=f"bus: produce -> consume, {args.events} single events per run ({results[0].kafka_bootstrap})")
    for column in ("run", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms"):
        table.add_column(column, justify="right")
    for i, r in enumerate(results, 1):
        table.add_row(str(i), *(f"{v:.3f}" for v in (r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms, r.mean_ms)))
    p50 = statistics.median(r.p50_ms for r in results)
    p99 = statistics.median(r.p99_ms for r in results)
    met = p50 <= TARGET_P50_MS and p99 <= TARGET_P99_MS
    table.add_row("median", f"{p50:.3f}", "", f"{p99:.3f}", "", "", style="bold")
    console.print(table)
    print(f"bus_latency_p50_ms={p50:.3f} bus_latency_p99_ms={p99:.3f} "
          f"ratio_p50_to_target={p50 / TARGET_P50_MS:.2f} ratio_p99_to_target={p99 / TARGET_P99_MS:.2f} "
          f"target={'met' if met else 'missed'} (p50 <= {TARGET_P50_MS} ms, p99 <= {TARGET_P99_MS} ms)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"runs": [asdict(r) for r in results], "median_p50_ms": p50, "median_p99_ms": p99,
                       "meets_target": met}, f, indent=2)
    return 0
