"""`voicebus bench floor`: two agents in one session, what the listener hears between their turns.

Each round opens a fresh session; a host speaks a three-sentence turn, one word a token every
``--token-ms``, and an expert starts its own three-sentence turn ``--offset-ms`` later, through
the whole pipeline (gate subprocess, synthesis worker, edge, the headless `Listener`).

- ``queue`` rounds (the default policy): the listener must get the host's whole turn, then the
  expert's. Reported: ``gap_ms``, the silence between the host's last sample and the expert's
  first one in a player that plays each frame when it arrives or when the audio before it ends,
  whichever is later (negative never: 0 means the expert's audio was there before the host's
  ended); ``floor_wait_ms``, how long the gate held the expert's turn (its GRANTED floor event);
  ``spliced``, rounds where audio of the two turns interleaved (must be 0).
- ``preempt`` rounds: the expert's turn has ``floor=preempt`` and starts once the host's first
  audio reached the listener. Reported: ``silence_ms``, from the moment the host's audio stopped
  at the listener (its ``stop``, or the end of the host's audio it had received, whichever is
  first) to the expert's first audio; ``stop_to_audio_ms``, from the host's ``stop`` to the
  expert's first audio frame (the edge holds the stop until the preempter's first audio: ~0);
  ``host_sentences_heard``.

It uses the broker at ``VOICEBUS_BOOTSTRAP`` (or starts a local one and stops it at the end;
given ``--bootstrap``, that broker and none started), with topic names of its own. Kokoro-82M
from the offline pack unless ``--tiny``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from voicebus.cli import add_json_argument, write_json
from voicebus.latency import percentile
from voicebus.logs import configure_logging
from voicebus.ops.bench.cli import add_stage_log_level, bootstrap_given
from voicebus.settings import Settings

HOST = "Welcome back to the show, everyone. Tonight we talk about the deep sea. Our guest has been down there."
EXPERT = "Thanks for having me here tonight. The deep sea is darker than people think. Most of it is still unseen."


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("floor", help="two agents in one session: the gap between queued turns, "
                                                  "the floor wait and the silence of a preemption")
    p.add_argument("--quick", action="store_true", help="3 rounds of each (default 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each policy")
    p.add_argument("--token-ms", type=float, default=60.0, help="interval between tokens (default 60 ms)")
    p.add_argument("--offset-ms", type=float, default=500.0, help="the expert starts this long after the host")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="uncounted queue rounds first: the stages' first use of each path (default 1)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight model instead of Kokoro-82M")
    add_json_argument(p)
    add_stage_log_level(p)
    p.set_defaults(func=run_floor)


def run_floor(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    configure_logging(getattr(args, "log_level", None))
    console = Console(stderr=True)
    results = asyncio.run(_bench(args, settings, console))
    print_results(results)
    write_json(args.json, results, indent=1)
    return 0


def playback(frames: list[tuple[int, int, int, int]], rate: int, busy_until_us: int = 0) -> tuple[int, int]:
    """When a player that plays each frame on arrival, or when the audio before it ends (whichever
    is later), starts the first of `frames` and ends the last (µs; frames as `HeardTurn.frames`)."""
    first = None
    end = busy_until_us
    for received_us, _sentence, _chunk, samples in sorted(frames):
        start = max(received_us, end)
        first = start if first is None else first
        end = start + samples * 1_000_000 // rate
    return (first or 0), end


def _stats(values: list[float]) -> dict:
    return {"n": len(values), "p50": round(percentile(values, 50), 1), "p95": round(percentile(values, 95), 1),
            "max": round(max(values), 1) if values else float("nan")}


async def _say(publisher, session_id: str, turn_id: str, text: str, token_s: float, **options) -> None:
    async with publisher.turn(session_id, turn_id, language="en", **options) as turn:
        for word in text.split():
            await turn.token(word + " ")
            await asyncio.sleep(token_s)


async def _round(stack, host, expert, floor, policy: str, token_s: float, offset_s: float) -> dict:
    from voicebus.players.listener import Listener

    sid = f"floor-{policy}-{uuid.uuid4().hex[:8]}"
    options = {"floor": "preempt"} if policy == "preempt" else {}
    async with Listener(stack.edge_url, sid, stack.settings.edge_secret.get_secret_value()) as listener:
        hosting = asyncio.create_task(_say(host, sid, "host", HOST, token_s))
        if policy == "preempt":  # cut the host while it is heard
            await listener.wait_first_audio("host", timeout=300)
        else:
            await asyncio.sleep(offset_s)
        await _say(expert, sid, "expert", EXPERT, token_s, **options)
        await hosting
        second = await listener.wait_turn_end("expert", timeout=300)
        first = await listener.wait_turn_end("host", timeout=300)
        granted = await floor.wait(sid, "expert", "GRANTED", timeout_s=60)
    rate = first.sample_rate
    host_start, host_end = playback(first.frames, rate)
    if policy == "queue":
        expert_start, _ = playback(second.frames, rate, busy_until_us=host_end)
        spliced = bool(first.frames and second.frames and max(f[0] for f in first.frames) > min(f[0] for f in second.frames))
        return {"gap_ms": (expert_start - host_end) / 1000, "floor_wait_ms": granted.waited_us / 1000,
                "spliced": spliced}
    stopped = min(host_end, first.stopped_at_us or host_end)
    expert_start, _ = playback(second.frames, rate, busy_until_us=stopped)
    stop_to_audio = (min(f[0] for f in second.frames) - first.stopped_at_us) / 1000 if first.stopped_at_us else None
    return {"silence_ms": (expert_start - stopped) / 1000, "cut": first.stopped, "stop_to_audio_ms": stop_to_audio,
            "host_sentences_heard": len({f[1] for f in first.frames if f[0] <= stopped})}


async def _bench(args: argparse.Namespace, settings: Settings, console) -> dict:
    from voicebus.agents.sdk import FloorFollower, Publisher
    from voicebus.ops.daemon import free_port
    from voicebus.ops.demo_shared import load_engine
    from voicebus.ops.runtime import PipelineStack

    rounds = args.rounds or (3 if args.quick else 8)
    warmup_rounds = args.warmup_rounds
    tag = uuid.uuid4().hex[:6]
    base = settings.replace(
        edge_port=free_port(), first_clause_min_words=0, control_topic=f"bench-{tag}.control",
        audio_topic=f"bench-{tag}.audio", playback_topic=f"bench-{tag}.playback", floor_topic=f"bench-{tag}.floor",
        heard_topic=f"bench-{tag}.heard", text_topic_prefix=f"bench-{tag}.text.", synthesis_topic=f"bench-{tag}.synthesis",
        agents_topic=f"bench-{tag}.agents", gate_app_id=f"bench-{tag}", gate_changelog_topic=f"bench-{tag}-changelog")
    engine = await asyncio.to_thread(load_engine, settings, args.tiny, console)
    token_s, offset_s = args.token_ms / 1000, args.offset_ms / 1000
    results: dict = {"rounds": rounds, "warmup_rounds": warmup_rounds,
                     "token_ms": args.token_ms, "offset_ms": args.offset_ms,
                     "model": "tiny" if args.tiny else "kokoro-82m"}
    started = time.monotonic()
    async with PipelineStack(base, engine, agent_ids=("host", "expert"), start_broker=not bootstrap_given(args),
                             gate_log_level=getattr(args, "log_level", None) or "WARNING") as stack, \
            Publisher(stack.settings, agent_id="host") as host, Publisher(stack.settings, agent_id="expert") as expert, \
            FloorFollower(expert) as floor:
        for _ in range(warmup_rounds):  # not counted
            await _round(stack, host, expert, floor, "queue", token_s, offset_s)
        samples: dict[str, list[dict]] = {"queue": [], "preempt": []}
        for n in range(rounds):
            for policy in ("queue", "preempt") if n % 2 == 0 else ("preempt", "queue"):
                sample = await _round(stack, host, expert, floor, policy, token_s, offset_s)
                console.print(f"{policy:8s} {sample}")
                samples[policy].append(sample)
    queue, preempt = samples["queue"], samples["preempt"]
    results["queue"] = {"gap_ms": _stats([max(0.0, s["gap_ms"]) for s in queue]),
                        "floor_wait_ms": _stats([s["floor_wait_ms"] for s in queue]),
                        "spliced": sum(s["spliced"] for s in queue)}
    results["preempt"] = {"silence_ms": _stats([s["silence_ms"] for s in preempt]),
                          "stop_to_audio_ms": _stats([s["stop_to_audio_ms"] for s in preempt
                                                      if s["stop_to_audio_ms"] is not None]),
                          "cut": sum(s["cut"] for s in preempt),
                          "host_sentences_heard": _stats([s["host_sentences_heard"] for s in preempt])}
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    return results


def print_results(results: dict) -> None:
    q, p = results["queue"], results["preempt"]
    print(f"queue   ({q['gap_ms']['n']} rounds): gap between turns p50 {q['gap_ms']['p50']} ms, "
          f"p95 {q['gap_ms']['p95']} ms, max {q['gap_ms']['max']} ms; floor wait p50 {q['floor_wait_ms']['p50']} ms, "
          f"p95 {q['floor_wait_ms']['p95']} ms; spliced {q['spliced']}")
    print(f"preempt ({p['silence_ms']['n']} rounds): silence at the cut p50 {p['silence_ms']['p50']} ms, "
          f"p95 {p['silence_ms']['p95']} ms; stop to the new turn's audio p50 {p['stop_to_audio_ms']['p50']} ms, "
          f"p95 {p['stop_to_audio_ms']['p95']} ms; cut {p['cut']}; host sentences heard p50 "
          f"{p['host_sentences_heard']['p50']}")
