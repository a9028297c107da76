"""Gate benchmarks: what the gate costs, in the core and through a real broker.

`voicebus bench gate` (uses the broker at ``VOICEBUS_BOOTSTRAP`` or starts a local one; given
``--bootstrap``, that broker and none started) prints:

- core: µs per event of `GateSession`, in memory and with its state through JSON around every
  event (what the gate worker does);
- broker: the latency from sending the token that completes a sentence to a consumer holding its
  synthesis request, through one gate worker subprocess, p50/p95/max.

The broker run uses topic names and an app id of its own (a random suffix), so it does not touch
the pipeline's topics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import replace

from voicebus.clock import now_us
from voicebus.gate.core import GateConfig, GateSession
from voicebus.latency import percentile
from voicebus.logs import configure_logging
from voicebus.ops.bench.cli import add_stage_log_level, bench_kafka
from voicebus.settings import Settings
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import TextEvent

TEXT = "The quick brown fox jumps. It was far away, said Dr. Smith. Then it rained all day. "


def turn_events(session: str, turn: str, text: str, size: int) -> list[TextEvent]:
    """One agent's TextEvents for one turn: `text` in `size`-character tokens, then END_OF_TURN."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    base = {"session_id": session, "turn_id": turn, "agent_id": "bench", "produced_at_us": 0}
    events = [TextEvent(**base, seq=i, kind=TextEventKind.TOKEN, text=p) for i, p in enumerate(pieces)]
    events.append(TextEvent(**base, seq=len(pieces), kind=TextEventKind.END_OF_TURN))
    return events


def bench_core(repeat: int = 40, size: int = 4) -> dict:
    config = GateConfig()
    events = turn_events("s", "t", TEXT * repeat, size)
    session = GateSession("s", config)
    t0 = time.perf_counter()
    for e in events:
        session.apply(e, 0)
    in_memory = (time.perf_counter() - t0) / len(events) * 1e6
    state = None
    t0 = time.perf_counter()
    for e in events:
        s = GateSession.from_state("s", config, json.loads(state) if state else None)
        s.apply(e, 0)
        state = json.dumps(s.to_state())
    with_state = (time.perf_counter() - t0) / len(events) * 1e6
    return {"events": len(events), "us_per_event": in_memory, "us_per_event_with_state": with_state}


def releasing_events(events: list[TextEvent]) -> list[int]:
    """For each request the core gives, the index of the event that released it."""
    session = GateSession(events[0].session_id, GateConfig())
    out: list[int] = []
    for i, e in enumerate(events):
        out += [i] * len(session.apply(e, 0))
    return out


async def bench_broker(settings: Settings, turns: int = 3, repeat: int = 4, gap_s: float = 0.02,
                       log_level: str | None = None) -> dict:
    from voicebus.bus import ensure_topics, make_consumer, make_producer
    from voicebus.codecs import Codec
    from voicebus.gate.app import READY_LINE
    from voicebus.gate.cli import start_gate_subprocess
    from voicebus.topics import session_key, text_topic

    uid = uuid.uuid4().hex[:8]
    settings = settings.replace(
        partitions=1, text_topic_prefix=f"bench{uid}.text.", control_topic=f"bench{uid}.control",
        synthesis_topic=f"bench{uid}.synthesis", deadletter_topic=f"bench{uid}.deadletter",
        gate_app_id=f"bench-gate-{uid}", gate_changelog_topic=f"bench-gate-{uid}-changelog",
        agents_topic=f"bench{uid}.agents",
    )
    await ensure_topics(settings, [settings.control_topic, settings.synthesis_topic, settings.deadletter_topic,
                                   text_topic(settings, "bench")])
    gate = start_gate_subprocess(settings, log_level=log_level or "WARNING")
    codec = Codec()
    latencies_ms: list[float] = []
    try:
        loop = asyncio.get_running_loop()
        while True:  # wait for the worker's first assignment
            line = await loop.run_in_executor(None, gate.stdout.readline)
            if not line:
                raise RuntimeError("the gate worker exited before it was assigned partitions")
            if line.startswith(READY_LINE):
                break
        consumer = make_consumer(settings, settings.synthesis_topic, auto_offset_reset="earliest")
        producer = make_producer(settings)
        await consumer.start()
        await producer.start()
        try:
            for n in range(turns):
                events = turn_events("bench", f"turn{n}", TEXT * repeat, 4)
                released_by = releasing_events(events)
                received: list[int] = []

                async def consume() -> None:
                    while len(received) < len(released_by):
                        batches = await consumer.getmany(timeout_ms=100)
                        received.extend(now_us() for records in batches.values() for _ in records)

                task = asyncio.create_task(consume())
                sent: list[int] = []
                for e in events:
                    e = replace(e, produced_at_us=now_us())
                    sent.append(e.produced_at_us)
                    await producer.send_and_wait(text_topic(settings, "bench"), codec.encode("TextEvent", e, text_topic(settings, "bench")),
                                                 key=session_key("bench"))
                    await asyncio.sleep(gap_s)
                await asyncio.wait_for(task, 60)
                latencies_ms += [(received[k] - sent[i]) / 1000 for k, i in enumerate(released_by)]
        finally:
            await producer.stop()
            await consumer.stop()
    finally:
        gate.terminate()
        gate.wait(20)
    latencies_ms.sort()
    return {"requests": len(latencies_ms), "p50_ms": statistics.median(latencies_ms),
            "p95_ms": percentile(latencies_ms, 95), "max_ms": latencies_ms[-1]}


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("gate", help="gate cost: core us/event, completing token -> request via the broker")
    p.add_argument("--core-only", action="store_true", help="skip the broker run")
    add_stage_log_level(p)
    p.set_defaults(func=run_gate_bench)


def run_gate_bench(args: argparse.Namespace, settings: Settings) -> int:
    log_level = getattr(args, "log_level", None)
    configure_logging(log_level)
    core = bench_core()
    print(f"gate core: {core['us_per_event']:.1f} us/event in memory, "
          f"{core['us_per_event_with_state']:.1f} us/event with JSON state ({core['events']} events)")
    if not args.core_only:
        with bench_kafka(args, settings) as live:
            broker = asyncio.run(bench_broker(live, log_level=log_level))
        print(f"gate via broker: completing token -> request consumed: p50 {broker['p50_ms']:.1f} ms, "
              f"p95 {broker['p95_ms']:.1f} ms, max {broker['max_ms']:.1f} ms ({broker['requests']} requests)")
    return 0
