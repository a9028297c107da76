"""`voicebus bench agents`: what an agent joining costs, to itself and to everyone else.

One gate worker (a subprocess, as deployed) and a few "other" sessions speaking all the time from
an agent that has been there since the start. Phases in blocks of the same length, taken in turn
(quiet, churn, churn_unseen, quiet, ...) so the machine's drifting load falls on each alike:

- quiet: only the others speak;
- churn: new agents join at a steady rate (default 20 a minute). Each one starts its SDK
  `Publisher` (which creates its text topic and registers it in the agent registry), speaks its
  first turn at once, then two later turns, and leaves. The joiners run in a child process of
  their own (agents are other processes), so their client start-ups do not share an event loop
  with the others' sends.

Release latency of a sentence = from sending the token that completes it (the event the pure
core releases the sentence on, found by replaying the turn offline) to ``released_at_us`` of its
synthesis request (the gate's clock; same machine). Reported as JSON:
``new_agent_first_turn_ms`` and ``later_turns_ms`` ({p50, p95}, the new agents' sentences), and
``others_ms`` ({quiet: {p50, p99}, churn: {p50, p99}}). ``--quick`` runs a few minutes.

The third phase, ``churn_unseen``, runs the same joiners with a text prefix and registry the gate
does not follow: the broker creates their topics and they speak, but the gate never reads them.
``others_ms.churn_unseen`` is what agent churn costs this machine and broker by itself; the gap
between it and ``churn`` is what it costs the gate.

It uses the broker at ``VOICEBUS_BOOTSTRAP`` (or starts a local one and stops it at the end;
given ``--bootstrap``, that broker and none started) with topic names of its own. The gate's log
is dropped unless ``--log-level`` is given (then it goes to stderr at that level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from voicebus.cli import add_json_argument
from voicebus.clock import now_us
from voicebus.latency import percentile
from voicebus.ops.bench.cli import add_stage_log_level
from voicebus.ops.bench.gate import releasing_events
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import TextEvent
from voicebus.settings import Settings

SENTENCES = ("The weather is fine today. ", "Your order shipped on Monday morning. ",
             "It should arrive before the weekend. ")
TOKEN_CHARS = 4
TOKEN_GAP_S = 0.02  # an LLM streaming ~50 tokens a second


def turn_events(session: str, turn: str, agent: str, text: str) -> list[TextEvent]:
    pieces = [text[i:i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)]
    base = {"session_id": session, "turn_id": turn, "agent_id": agent, "produced_at_us": 0}
    events = [TextEvent(**base, seq=i, kind=TextEventKind.TOKEN, text=p) for i, p in enumerate(pieces)]
    events.append(TextEvent(**base, seq=len(pieces), kind=TextEventKind.END_OF_TURN))
    return events


@dataclass
class Sent:
    """What was sent per (session, turn): the send time of each releasing event, in request order."""

    releasing_sent_us: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    kind: dict[tuple[str, str], str] = field(default_factory=dict)  # first | later | quiet | churn...


async def speak(publisher, sent: Sent, session: str, turn: str, agent: str, kind: str, text: str) -> None:
    events = turn_events(session, turn, agent, text)
    released_by = releasing_events(events)
    times: list[int] = []
    for e in events:
        e = replace(e, produced_at_us=now_us())
        times.append(e.produced_at_us)
        await publisher.publish_text_event(e)
        await asyncio.sleep(TOKEN_GAP_S)
    sent.releasing_sent_us[(session, turn)] = [times[i] for i in released_by]
    sent.kind[(session, turn)] = kind


async def others(settings: Settings, sent: Sent, phase: dict, n: int, stop: asyncio.Event) -> None:
    from voicebus.agents.sdk import Publisher

    async with Publisher(settings, agent_id="steady") as publisher:
        async def one(k: int) -> None:
            turn = 0
            while not stop.is_set():
                await speak(publisher, sent, f"other{k}", f"t{turn}", "steady", phase["name"],
                            "".join(SENTENCES))
                turn += 1

        await asyncio.gather(*(one(k) for k in range(n)))


async def newcomer(settings: Settings, sent: Sent, k: int, uid: str) -> None:
    from voicebus.agents.sdk import Publisher

    agent = f"joiner{uid}-{k}"
    async with Publisher(settings, agent_id=agent) as publisher:  # creates and registers its topic
        for turn, kind in ((0, "first"), (1, "later"), (2, "later")):
            await speak(publisher, sent, f"new-{uid}-{k}", f"t{turn}", agent, kind, "".join(SENTENCES))


async def joiners(settings: Settings, phase_s: float, rate_per_min: float, uid: str) -> dict:
    """The churn: new agents at a steady rate for `phase_s` (run in the child process)."""
    sent = Sent()
    tasks: list[asyncio.Task] = []
    gap = 60.0 / rate_per_min
    started = time.monotonic()
    k = 0
    while time.monotonic() - started < phase_s:
        tasks.append(asyncio.create_task(newcomer(settings, sent, k, uid)))
        k += 1
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    return {"joined": k, "sent": [[s, t, times, sent.kind[(s, t)]] for (s, t), times in sent.releasing_sent_us.items()]}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def run_bench(settings: Settings, *, block_s: float, rounds: int, rate_per_min: float, n_others: int,
                    progress=_stderr, log_level: str | None = None) -> dict:
    """The benchmark (module doc). `progress` gets one line as each block starts (it runs for
    minutes: 3 blocks a round), stderr by default, so stdout keeps only the JSON."""
    from voicebus.bus import ensure_topics, make_consumer
    from voicebus.codecs import Codec
    from voicebus.gate.app import READY_LINE
    from voicebus.gate.cli import start_gate_subprocess
    from voicebus.schemas.messages import SynthesisRequest
    from voicebus.topics import text_topic

    uid = uuid.uuid4().hex[:8]
    settings = settings.replace(
        text_topic_prefix=f"bench{uid}.text.", control_topic=f"bench{uid}.control",
        synthesis_topic=f"bench{uid}.synthesis", deadletter_topic=f"bench{uid}.deadletter",
        audio_topic=f"bench{uid}.audio", playback_topic=f"bench{uid}.playback", agents_topic=f"bench{uid}.agents",
        gate_app_id=f"bench-agents-{uid}", gate_changelog_topic=f"bench-agents-{uid}-changelog",
    )
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "steady")])
    gate = (start_gate_subprocess(settings, stderr=subprocess.DEVNULL) if log_level is None
            else start_gate_subprocess(settings, log_level=log_level))  # its log on this stderr
    ready = threading.Event()

    def pump() -> None:  # drain the child's stdout so it never blocks on a full pipe
        for line in gate.stdout:
            if line.startswith(READY_LINE):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    codec = Codec()
    received: list[SynthesisRequest] = []
    consumer = make_consumer(settings, settings.synthesis_topic, auto_offset_reset="earliest")
    try:
        deadline = time.monotonic() + 90
        while not ready.is_set():
            if gate.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gate worker did not get its partitions")
            await asyncio.sleep(0.05)
        await consumer.start()

        async def consume() -> None:
            while True:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    received.extend(SynthesisRequest.from_record(codec.decode(r.value, expect="SynthesisRequest").value)
                                    for r in records)

        consuming = asyncio.create_task(consume())
        sent = Sent()
        phase = {"name": "quiet"}
        stop = asyncio.Event()
        speaking = asyncio.create_task(others(settings, sent, phase, n_others, stop))
        unseen = settings.replace(text_topic_prefix=f"bench{uid}.unseen.", agents_topic=f"bench{uid}.unseen-agents",
                                  synthesis_topic=f"bench{uid}.unseen-synthesis")
        k = 0
        bench_started = time.monotonic()
        # Blocks of each phase in turn, so the machine's drifting load falls on all three alike.
        for block in range(rounds):
            for b, (name, joiner_settings) in enumerate((("quiet", None), ("churn", settings), ("churn_unseen", unseen))):
                done = 3 * block + b
                progress(f"bench agents: block {done + 1}/{3 * rounds} (round {block + 1}/{rounds}, {name}, "
                         f"{block_s:g} s); {k} agents joined so far, {time.monotonic() - bench_started:.0f} s elapsed")
                phase["name"] = name
                if joiner_settings is None:
                    await asyncio.sleep(block_s)
                    continue
                child = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "voicebus.ops.bench.agents", "--joiners", str(block_s), str(rate_per_min),
                    f"{uid}{name}{block}", env={**os.environ, **joiner_settings.to_env()},
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
                out, _ = await child.communicate()
                if child.returncode != 0:
                    raise RuntimeError(f"the joiners' process failed (exit code {child.returncode})")
                churn = json.loads(out.decode().strip().splitlines()[-1])
                if name == "churn":
                    k += churn["joined"]
                    for session, turn, times, kind in churn["sent"]:
                        sent.releasing_sent_us[(session, turn)] = times
                        sent.kind[(session, turn)] = kind
        stop.set()
        await speaking
        progress(f"bench agents: blocks done in {time.monotonic() - bench_started:.0f} s; collecting the last requests")
        expected = sum(len(v) for v in sent.releasing_sent_us.values())
        wait_until = time.monotonic() + 30
        while len(received) < expected and time.monotonic() < wait_until:
            await asyncio.sleep(0.1)
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)
    finally:
        await consumer.stop()
        gate.terminate()
        try:
            gate.wait(20)
        except subprocess.TimeoutExpired:
            gate.kill()
            gate.wait(10)

    kinds = ("first", "later", "quiet", "churn", "churn_unseen")
    by_kind: dict[str, list[float]] = {k: [] for k in kinds}
    for r in received:
        key = (r.session_id, r.turn_id)
        times = sent.releasing_sent_us.get(key)
        if times is None or r.sentence_seq >= len(times):
            continue
        by_kind[sent.kind[key]].append((r.released_at_us - times[r.sentence_seq]) / 1000)

    def pct(values: list[float], high: int) -> dict:
        values = sorted(values)
        if not values:
            return {"p50": None, f"p{high}": None}
        return {"p50": round(statistics.median(values), 1), f"p{high}": round(percentile(values, high), 1)}

    def stats(kind: str, high: int) -> dict:
        return {**pct(by_kind[kind], high), "n": len(by_kind[kind])}

    return {
        "new_agent_first_turn_ms": stats("first", 95),
        "later_turns_ms": stats("later", 95),
        "others_ms": {"quiet": stats("quiet", 99), "churn": stats("churn", 99),
                      "churn_unseen": stats("churn_unseen", 99)},
        "agents_joined": k,
        "config": {"block_s": block_s, "rounds": rounds, "rate_per_min": rate_per_min, "other_sessions": n_others,
                   "partitions": settings.partitions, "token_chars": TOKEN_CHARS, "token_gap_ms": TOKEN_GAP_S * 1000},
        "requests": {"expected": expected, "received": len(received)},
    }


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "agents", help="agents joining while others speak: a new agent's first-turn release latency vs later turns, "
                       "others' latency quiet vs churn")
    add_json_argument(p)
    p.add_argument("--quick", action="store_true", help="a short run (about 3 minutes: 3 rounds of 15 s blocks)")
    p.add_argument("--rate", type=float, default=20.0, metavar="PER_MIN", help="agents joining per minute (20)")
    p.add_argument("--block", type=float, default=30.0, metavar="S",
                   help="seconds of each block; a round is one block of quiet, churn and churn_unseen (30; --quick: 15)")
    p.add_argument("--rounds", type=int, default=None, metavar="N", help="rounds (6; --quick: 3)")
    p.add_argument("--others", type=int, default=4, metavar="N", help="other sessions speaking throughout (4)")
    add_stage_log_level(p)
    p.set_defaults(func=run_agents_bench)


def run_agents_bench(args: argparse.Namespace, settings: Settings) -> int:
    from voicebus.cli import write_json
    from voicebus.logs import configure_logging
    from voicebus.ops.bench.cli import bench_kafka

    log_level = getattr(args, "log_level", None)
    configure_logging(log_level)
    block_s = 15.0 if args.quick and args.block == 30.0 else args.block
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 6)
    rate = args.rate * (2 if args.quick and args.rate == 20.0 else 1)  # enough joiners in a short run
    with bench_kafka(args, settings) as live:
        result = asyncio.run(run_bench(live, block_s=block_s, rounds=rounds, rate_per_min=rate, n_others=args.others,
                                       log_level=log_level))
    if args.json != "-":  # the results are this benchmark's report (with `--json -`, they are that alone)
        print(json.dumps(result, indent=2))
    write_json(args.json, result, indent=2)
    return 0


if __name__ == "__main__":  # the joiners' child process: python -m voicebus.ops.bench.agents --joiners S RATE UID
    if sys.argv[1:2] != ["--joiners"]:
        sys.exit("usage: python -m voicebus.ops.bench.agents --joiners PHASE_S RATE_PER_MIN UID (run by the bench)")
    result = asyncio.run(joiners(Settings.from_env(), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
    print(json.dumps(result))
