"""Named attack cases of `voicebus bench hostile` that bend a stage rather than send one bad
record: more sessions than the gate holds, a gate paused until its partitions moved. Registered
in `voicebus.ops.bench.hostile_cases.CASES` and scored like the others (`hostile_cases.run_cases`).

- ``session-flood``: the bench's gate holds at most `hostile.GATE_MAX_SESSIONS` sessions
  (``gate_max_sessions``). During the normal sessions' replay a hostile agent opens twice that many
  sessions, each a turn that ends at once (idle as soon as it ended). Observed: the gate's
  ``voicebus_gate_sessions_evicted_total`` (the least recently active idle sessions forgotten, their
  tombstones on the changelog) and its ``/healthz`` ``sessions`` (never past the bound). After the
  replay it opens the bound + `FLOOD_REFUSED` sessions whose turns never end: once no session is
  idle, the rest is refused (``voicebus_gate_sessions_refused_total``, dead letters ``gate-full``);
  their turns are then ended, so the gate has idle sessions again. (With no idle session a gate
  refuses every new session, a normal one too: the bound's documented behaviour; that part is
  therefore run after the normal turns.)
- ``zombie-gate``: the gate restarted with a short consumer-group session timeout
  (`ZOMBIE_SESSION_TIMEOUT_S`) and INFO logs before the case; then it is paused (SIGSTOP), a second
  gate joins and takes every partition once the first is expelled, a probe turn is sent and
  released by the second gate, and the first is resumed (SIGCONT). Observed: the first gate's log
  line ``fenced after a stall`` (`voicebus.gate.app.GateWorker._fence`) or the revoke it learned
  first, its rejoin (its ready line again), and no request of the probe on the synthesis topic
  twice (the same sentence_seq, text and ``tentative`` flag: a speculative release and its
  confirmation are two requests by design; the zombie published none of them again). The second
  gate is stopped and the first gets every partition back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections import Counter, deque
from typing import Any, Iterable

from voicebus.ops.bench import hostile_scoring as hc
from voicebus.schemas.messages import SynthesisRequest

FLOOD_TIMES = 2  # session-flood: sessions of turns that end at once, times the gate's bound
FLOOD_REFUSED = 20  # session-flood: sessions past the bound whose turns never end (refused)
ZOMBIE_SESSION_TIMEOUT_S = 6.0  # the gate's consumer-group session timeout for zombie-gate
ZOMBIE_WAIT_S = 60.0
FENCE_LINE = "fenced after a stall"  # what `GateWorker._fence` logs (INFO) when it refuses output
REVOKED_LINE = "revoked"  # `GateWorker._revoke`: "gate: partitions [...] revoked"


# --- pure parts (tests/pipeline/ops/test_bench_hostile.py) -------------------------------------


def flood_expectation(bound: int, held_before: int, opened: int) -> int:
    """Sessions the gate must forget (evict) when `opened` new sessions arrive, each idle once its
    turn ended, at a gate holding `held_before` of at most `bound`."""
    return max(0, held_before + opened - bound)


def ready_partitions(lines: Iterable[str], ready_line: str) -> list[list[str]]:
    """The partitions a gate announced after each rebalance (``READY_LINE ["topic:p", ...]``)."""
    out = []
    for line in lines:
        if line.startswith(ready_line):
            try:
                out.append(list(json.loads(line[len(ready_line):].strip() or "[]")))
            except ValueError:
                out.append([])
    return out


def owned_control(announced: list[str], control_topic: str) -> int:
    """How many control partitions one announcement lists (the gate's own partitions; the text
    partitions it reads follow them)."""
    return sum(1 for tp in announced if tp.rsplit(":", 1)[0] == control_topic)


def fence_report(lines: Iterable[str]) -> dict[str, list[str]]:
    """A gate's log lines of the fence (`FENCE_LINE`) and of partitions revoked."""
    fenced, revoked = [], []
    for line in lines:
        if FENCE_LINE in line:
            fenced.append(line)
        elif "partitions" in line and REVOKED_LINE in line:
            revoked.append(line)
    return {"fenced": fenced, "revoked": revoked}


def released_twice(requests: Iterable[tuple]) -> dict[str, int]:
    """Requests released more than once (by (turn, sentence_seq, tentative, text)), with how many
    times. A speculative release and its confirmation differ in ``tentative``: not a repeat."""
    counts = Counter(requests)
    return {"#".join(str(part) for part in key): n for key, n in counts.items() if n > 1}


# --- helpers -----------------------------------------------------------------------------------


async def _requests_of(ctx, mark: dict, session_id: str, until_last: bool,
                       timeout_s: float) -> list[SynthesisRequest]:
    """Synthesis requests of `session_id` written since `mark` (end offsets of the synthesis
    topic); with `until_last`, reads until one is the turn's last (or `timeout_s`)."""
    from voicebus.bus import make_consumer

    consumer = make_consumer(ctx.s, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    out: list[SynthesisRequest] = []
    try:
        tps = list(mark)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, mark[tp])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ends = await consumer.end_offsets(tps)
            while ([tp for tp in tps if await consumer.position(tp) < ends[tp]]
                   and time.monotonic() < deadline + 10):
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        if record.key != session_id.encode():
                            continue
                        with contextlib.suppress(Exception):
                            out.append(SynthesisRequest.from_record(
                                ctx.codec.decode(record.value, expect="SynthesisRequest").value))
            if not until_last or any(r.is_last_in_turn for r in out):
                break
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()
    return out


# --- the cases ---------------------------------------------------------------------------------


async def session_flood(ctx) -> hc.Observation:
    s = ctx.s
    bound = s.gate_max_sessions
    _text = ctx.helpers.text_event
    topic = ctx.hostile_topic
    _status, health = await ctx.healthz("gate")
    held_before = int(health.get("sessions", 0))
    evicted_before = await ctx.stack.metric("gate", "voicebus_gate_sessions_evicted_total")
    refused_before = await ctx.stack.metric("gate", "voicebus_gate_sessions_refused_total")
    full_before = await ctx.stack.metric("gate", hc.DLQ_COUNTER, {"reason": "gate-full"})
    # 1. beside the normal turns: sessions whose one turn ends at once (idle once it ended)
    opened = FLOOD_TIMES * bound * ctx.scale
    peak = held_before
    for i in range(opened):
        sid = f"flood-{uuid.uuid4().hex[:10]}"
        await ctx.producer.send(topic, ctx.codec.encode("TextEvent", _text(sid, "t", 0, kind="END_OF_TURN")),
                                key=sid.encode(), headers=[(ctx.helpers.kind_header, b"text:session-flood")])
        if i % 100 == 99:
            await ctx.producer.flush()
            with contextlib.suppress(Exception):
                peak = max(peak, int((await ctx.healthz("gate"))[1].get("sessions", 0)))
    await ctx.producer.flush()
    target = flood_expectation(bound, held_before, opened)
    evicted_now, took = await ctx.wait_counters("voicebus_gate_sessions_evicted_total",
                                                {"gate": evicted_before + target})
    evicted = evicted_now["gate"] - evicted_before
    _status, health = await ctx.healthz("gate")
    held_after_flood = int(health.get("sessions", 0))
    peak = max(peak, held_after_flood)
    # 2. after the normal turns: turns that never end, the bound + FLOOD_REFUSED of them
    if ctx.replay_done is not None:
        await ctx.replay_done.wait()
    opened_open = bound + FLOOD_REFUSED * ctx.scale
    mark = await ctx.dlq_mark()
    sent: dict[tuple[int, int], str] = {}
    for _ in range(opened_open):
        sid = f"flood-open-{uuid.uuid4().hex[:10]}"
        meta = await ctx.producer.send_and_wait(
            topic, ctx.codec.encode("TextEvent", _text(sid, "open", 0, text=" ")), key=sid.encode(),
            headers=[(ctx.helpers.kind_header, b"text:session-flood-open")])
        sent[(meta.partition, meta.offset)] = sid
    refused_now, _ = await ctx.wait_counters("voicebus_gate_sessions_refused_total",
                                             {"gate": refused_before + FLOOD_REFUSED * ctx.scale})
    await asyncio.sleep(1.0)
    letters = [h for h in await ctx.dead_letters(mark, topic) if h.get(hc.REASON_HEADER) == "gate-full"]
    refused_sids = {sent.get((int(h.get("voicebus.source.partition", -1)), int(h.get("voicebus.source.offset", -1))))
                    for h in letters} - {None}
    _status, health = await ctx.healthz("gate")
    held_full = int(health.get("sessions", 0))
    peak = max(peak, held_full)
    # their turns ended (those the gate holds), so it has idle sessions again for what follows
    for sid in set(sent.values()) - refused_sids:
        await ctx.producer.send(topic, ctx.codec.encode("TextEvent", _text(sid, "open", 1, kind="END_OF_TURN")),
                                key=sid.encode(), headers=[(ctx.helpers.kind_header, b"text:session-flood-end")])
    await ctx.producer.flush()
    await asyncio.sleep(3.0)  # the gate applies them before the next replay's sessions need room
    refused = refused_now["gate"] - refused_before
    full = await ctx.stack.metric("gate", hc.DLQ_COUNTER, {"reason": "gate-full"}) - full_before
    status, _ = await ctx.healthz("gate")
    ok = (evicted >= target and peak <= bound and refused >= FLOOD_REFUSED * ctx.scale
          and len(letters) >= FLOOD_REFUSED * ctx.scale and status == 200)
    return hc.Observation(ok, f"{opened} sessions (bound {bound}): voicebus_gate_sessions_evicted_total +{evicted:g} "
                              f"(expected >= {target}), /healthz sessions at most {peak}; then {opened_open} turns "
                              f"that never end: voicebus_gate_sessions_refused_total +{refused:g}, "
                              f"{len(letters)} dead letters 'gate-full'", opened + opened_open,
                          {"bound": bound, "held_before": held_before, "opened_idle": opened,
                           "evicted": evicted, "evicted_expected": target, "seconds_to_evict": took.get("gate"),
                           "sessions_after_flood": held_after_flood, "sessions_peak_seen": peak,
                           "opened_never_ending": opened_open, "sessions_when_full": held_full,
                           "refused": refused, "gate_full_dead_letters": len(letters),
                           "gate_full_counter_increase": full, "gate_healthz": status})


def _gate_cmd(cmd: list[str], log_level: str, session_timeout_s: float) -> list[str]:
    """The gate's command line with this log level and consumer-group session timeout."""
    out, skip = [], False
    for arg in cmd:
        if skip:
            skip = False
            continue
        if arg in ("--log-level", "--loglevel", "--session-timeout"):
            skip = True
            continue
        out.append(arg)
    return out + ["--log-level", log_level, "--session-timeout", f"{session_timeout_s:g}"]


async def zombie_prepare(ctx) -> None:
    """Before the case is measured: the bench's gate restarted with a session timeout short
    enough for the case and INFO logs (its fence is logged at INFO)."""
    gate = ctx.stack.by_name()["gate"]
    cmd = _gate_cmd(gate.cmd, "INFO", ZOMBIE_SESSION_TIMEOUT_S)
    if cmd != gate.cmd:
        gate.cmd = cmd
        await gate.restart(timeout=120)


class _Tap(deque):
    """A stage's output ring that also keeps every line appended from now on."""

    def __init__(self, ring: deque) -> None:
        super().__init__(ring, maxlen=ring.maxlen)
        self.tapped: list[str] = []

    def append(self, line: str) -> None:  # the stage's output thread
        super().append(line)
        self.tapped.append(line)


async def _until(what, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        await asyncio.sleep(0.2)
    return bool(what())


# The probe turn's tokens: sentences the normal turns speak too. The worker's first synthesis of a
# sentence it never spoke takes a one-time memory step (~12 MB: the model's allocations for new
# input shapes), which is no part of the fence this case measures.
ZOMBIE_PROBE = ("Here is a short answer. ", "It has three sentences. ")


async def zombie_gate(ctx) -> hc.Observation:
    from voicebus.bus import end_offsets
    from voicebus.gate.app import READY_LINE
    from voicebus.ops.bench.stages import StageProcess
    from voicebus.ops.daemon import free_port

    s = ctx.s
    _text = ctx.helpers.text_event
    gate = ctx.stack.by_name()["gate"]
    tap = gate.output = _Tap(gate.output)
    port = free_port(s.edge_host)
    second = StageProcess("gate-2", [sys.executable, "-m", "voicebus.gate.cli", "--announce", "--log-level", "INFO",
                                     "--session-timeout", f"{ZOMBIE_SESSION_TIMEOUT_S:g}", "--metrics-port", str(port)],
                          gate.env, ready_line=READY_LINE)
    every = s.partitions
    mark = await end_offsets(s, [s.synthesis_topic])
    sid = f"zombie-probe-{uuid.uuid4().hex[:8]}"
    detail: dict[str, Any] = {}
    probe: list[dict] = []
    paused = time.monotonic()
    try:
        try:
            os.kill(gate.pid, signal.SIGSTOP)
            await second.start(timeout=ZOMBIE_WAIT_S + 60)  # ready once the paused gate was expelled
            detail["second_gate_partitions"] = owned_control(
                (ready_partitions(second.output, READY_LINE) or [[]])[-1], s.control_topic)
            detail["seconds_to_take_over"] = round(time.monotonic() - paused, 1)
            # a probe turn the paused gate never saw: the second gate releases it
            for seq, (kind, text) in enumerate([*(("TOKEN", t) for t in ZOMBIE_PROBE), ("END_OF_TURN", "")]):
                await ctx.send("text:zombie-probe", ctx.hostile_topic,
                               ctx.codec.encode("TextEvent", _text(sid, "probe", seq, kind=kind, text=text)),
                               sid.encode())
            probe = await _requests_of(ctx, mark, sid, until_last=True, timeout_s=ZOMBIE_WAIT_S)
            detail["probe_released_by_second_gate"] = len(probe)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(gate.pid, signal.SIGCONT)
            detail["paused_s"] = round(time.monotonic() - paused, 1)
        # the zombie learns of the rebalance and rejoins: its ready line again
        rejoined = await _until(lambda: bool(ready_partitions(tap.tapped, READY_LINE)), ZOMBIE_WAIT_S)
        await asyncio.sleep(2.0)  # what it fetched before it knew has gone through its fence
        probe = await _requests_of(ctx, mark, sid, until_last=False, timeout_s=10)
        detail["second_gate_rss_mb"] = round(second.rss_mb(), 1)
        await second.stop()
        back = await _until(lambda: owned_control((ready_partitions(tap.tapped, READY_LINE) or [[]])[-1],
                                                  s.control_topic) == every, ZOMBIE_WAIT_S)
    finally:
        await second.stop()
        gate.output = deque(tap, maxlen=tap.maxlen)
    lines = fence_report(tap.tapped)
    twice = released_twice((r.turn_id, r.sentence_seq, r.tentative, r.text) for r in probe)
    announced = ready_partitions(tap.tapped, READY_LINE)
    detail |= {"zombie_fence_lines": [line[:240] for line in lines["fenced"][:3]],
               "zombie_revoke_lines": [line[:160] for line in lines["revoked"][:3]],
               "zombie_announcements": [owned_control(p, s.control_topic) for p in announced],
               "probe_requests": len(probe),
               "probe_released_twice": twice, "partitions_back": back}
    ok = (rejoined and back and bool(lines["fenced"] or lines["revoked"]) and not twice
          and any(r.is_last_in_turn for r in probe))
    how = (f"'{FENCE_LINE}' x{len(lines['fenced'])}" if lines["fenced"]
           else f"its partitions revoked first ({len(lines['revoked'])} lines), no fence needed")
    return hc.Observation(ok, f"paused {detail['paused_s']} s (session timeout {ZOMBIE_SESSION_TIMEOUT_S:g} s), "
                              f"a second gate took {detail.get('second_gate_partitions')} partitions; resumed, the "
                              f"zombie logged {how}, rejoined ({'yes' if rejoined else 'NO'}); probe: "
                              f"{len(probe)} requests, {len(twice)} released twice; every partition back to it: "
                              f"{'yes' if back else 'NO'}", 1, detail)
