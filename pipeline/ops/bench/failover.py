"""`voicebus bench failover`: how long Kafka itself takes to accept writes again after its leader dies.

This module owns the bus-level failover measurement, beneath `voicebus bench chaos` (which times
the whole pipeline's recovery): on a throwaway 3-node cluster (`voicebus.ops.cluster.ephemeral_cluster`,
voicebus's node properties), one partition replicated 3 times with ``min.insync.replicas=2``, a
producer with the pipeline's options (`PRODUCER_OPTIONS`: acks=all, idempotent) sends a small
record every 50 ms. Each cycle SIGKILLs the partition's leader, starts it again 3 s later and waits
until every replica is in sync before the next. Per kill, two figures:

* ``election_ms``: from the kill until the producer's metadata names a new leader (the dead node
  fenced by the controller, `broker.session.timeout.ms`; longer when the node was also the active
  KRaft controller: a new controller is elected first, and its fencing timer starts then);
* ``first_ack_after_election_ms``: from then until the first write is acknowledged, the time the
  surviving follower takes to fetch from the new leader (acks=all waits for it).

``--variants`` runs several clusters, each with node properties of its own over voicebus's (e.g.
``replica.fetch.backoff.ms=1000``, Kafka's default, against voicebus's 100), the kills alternating
between them, so a load change hits every variant alike. Figures: median and max per variant.
Results in docs/benchmarks.md ("Failover"). It kills brokers, so it starts its clusters itself:
``--bootstrap`` does not apply.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from typing import Any

from voicebus.cli import add_json_argument
from voicebus.settings import Settings

SEND_INTERVAL_S = 0.05
DOWN_S = 3.0  # a killed node stays down this long before its restart
TOPIC = "failover-probe"


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """``"default;replica.fetch.backoff.ms=1000"`` -> {"default": {}, "replica.fetch.backoff.ms=1000": {...}}:
    variants separated by ``;``, each ``default`` or comma-separated ``key=value`` node properties."""
    variants: dict[str, dict[str, str]] = {}
    for raw in (v.strip() for v in text.split(";")):
        if not raw:
            continue
        props: dict[str, str] = {}
        if raw != "default":
            for item in raw.split(","):
                key, sep, value = item.partition("=")
                if not sep or not key.strip() or not value.strip():
                    raise ValueError(f"variant {raw!r}: expected key=value node properties, got {item!r}")
                props[key.strip()] = value.strip()
        variants[raw] = props
    if not variants:
        raise ValueError("no variant given")
    return variants


class FailoverProbe:
    """One cluster's producer, its records' send and ack times, and its kill cycles."""

    def __init__(self, cluster: Any, settings: Settings, topic: str = TOPIC) -> None:
        self.cluster, self.settings, self.topic = cluster, settings, topic
        self.producer: Any = None
        self.sent: dict[int, float] = {}
        self.acked: dict[int, float] = {}
        self._next = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        from voicebus.bus import ensure_topics, make_producer

        s = self.settings
        await ensure_topics(s, [self.topic], partitions=1)
        self.producer = make_producer(s)
        await self.producer.start()

    async def stop(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.producer is not None:
            await self.producer.stop()

    def _send(self) -> None:
        i, self._next = self._next, self._next + 1

        async def send() -> None:
            self.sent[i] = time.monotonic()
            fut = await self.producer.send(self.topic, str(i).encode())
            await fut
            self.acked[i] = time.monotonic()

        task = asyncio.create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sending(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._send()
            await asyncio.sleep(SEND_INTERVAL_S)

    async def cycle(self) -> dict[str, float]:
        """One kill of the partition's leader, its restart, and the cluster in sync again."""
        from aiokafka import TopicPartition

        await self._sending(1.0)
        tp = TopicPartition(self.topic, 0)
        leader = await asyncio.to_thread(lambda: self.cluster.metadata().leader_of(self.topic, 0))
        killed_at = time.monotonic()
        await asyncio.to_thread(self.cluster.kill, leader)
        elected_at: list[float] = []

        def new_leader() -> bool:
            now_leader = self.producer.client.cluster.leader_for_partition(tp)
            if not elected_at and now_leader not in (leader, None, -1):
                elected_at.append(time.monotonic())
            return bool(elected_at)

        restart = None
        deadline = killed_at + 60.0
        while time.monotonic() < deadline and not elected_at:
            self._send()
            for _ in range(5):  # look at the metadata every 10 ms between sends
                await asyncio.sleep(SEND_INTERVAL_S / 5)
                if new_leader():
                    break
            if restart is None and time.monotonic() - killed_at >= DOWN_S:
                restart = asyncio.create_task(asyncio.to_thread(self.cluster.restart, leader, 180.0))
        if not elected_at:
            raise RuntimeError(f"no new leader of {self.topic}[0] within 60 s of killing node {leader}")
        await self._sending(2.0)
        if restart is None:
            await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - killed_at)))
            restart = asyncio.create_task(asyncio.to_thread(self.cluster.restart, leader, 180.0))
        await restart
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.cluster.wait_in_sync, 180.0)
        acks_after = [self.acked[i] for i, t in self.sent.items() if t >= killed_at and i in self.acked]
        first_ack = min(a for a in acks_after if a >= elected_at[0]) if acks_after else float("nan")
        return {"killed_node": leader, "election_ms": round((elected_at[0] - killed_at) * 1000, 1),
                "first_ack_after_election_ms": round((first_ack - elected_at[0]) * 1000, 1),
                "unacked": sum(1 for i in self.sent if i not in self.acked)}


def summarise(cycles: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"kills": len(cycles), "cycles": cycles}
    for key in ("election_ms", "first_ack_after_election_ms"):
        values = [c[key] for c in cycles]
        out[key] = {"median": round(statistics.median(values), 1), "max": round(max(values), 1)}
    return out


async def _run(settings: Settings, variants: dict[str, dict[str, str]], kills: int,
               clusters: dict[str, Any]) -> dict[str, Any]:
    probes = {name: FailoverProbe(c, settings.replace(bootstrap=c.bootstrap, partitions=1))
              for name, c in clusters.items()}
    cycles: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for probe in probes.values():
            await probe.start()
        for k in range(kills):
            for name, probe in probes.items():  # alternate: a load change hits every variant alike
                row = await probe.cycle()
                cycles[name].append(row)
                print(f"[{name}] kill {k + 1}/{kills}: node {row['killed_node']}, elected after "
                      f"{row['election_ms']:.0f} ms, first ack {row['first_ack_after_election_ms']:.0f} ms later",
                      flush=True)
    finally:
        for probe in probes.values():
            await probe.stop()
    return {name: summarise(rows) | {"node_properties": variants[name]} for name, rows in cycles.items()}


def run_failover(args: argparse.Namespace, settings: Settings) -> int:
    import os
    import sys

    from voicebus.cli import write_json
    from voicebus.ops.bench.cli import refuse_bootstrap
    from voicebus.ops.cluster import ephemeral_cluster

    if refuse_bootstrap(args, "failover", "it kills brokers, so it starts clusters of its own"):
        return 2
    try:
        variants = parse_variants(args.variants)
    except ValueError as exc:
        print(f"voicebus bench failover: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        clusters = {name: stack.enter_context(ephemeral_cluster(settings, 3, partitions=1, prefix="failover",
                                                                  extra_config=props))
                    for name, props in variants.items()}
        results = asyncio.run(_run(settings, variants, args.kills, clusters))
    out = {"meta": {"kills_per_variant": args.kills, "wall_s": round(time.monotonic() - started, 1),
                    "load_average": list(os.getloadavg()), "cpus": os.cpu_count()}, "variants": results}
    print("| variant | kills | election median / max (ms) | first ack after election median / max (ms) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        e, a = r["election_ms"], r["first_ack_after_election_ms"]
        print(f"| {name} | {r['kills']} | {e['median']:.0f} / {e['max']:.0f} | {a['median']:.0f} / {a['max']:.0f} |")
    write_json(args.json, out, indent=1)
    return 0


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("failover", help="kill a partition leader of a 3-node cluster: election and "
                                                    "first acked write, A/B of node properties")
    p.add_argument("--kills", type=int, default=4, help="leader kills per variant (default 4)")
    p.add_argument("--variants", default="default;replica.fetch.backoff.ms=1000",
                   help="';'-separated clusters: 'default' (voicebus's node properties) or comma-separated "
                        "key=value node properties over them (default: 'default;replica.fetch.backoff.ms=1000', "
                        "voicebus's 100 ms against Kafka's default)")
    add_json_argument(p)
    p.set_defaults(func=run_failover)
