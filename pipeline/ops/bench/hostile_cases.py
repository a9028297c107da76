"""Named attack cases of `voicebus bench hostile`: one attack at a time beside normal sessions,
and the observable its defence produces.

Each case (`CASES`, in order) runs while the normal sessions replay their turns once more
(`voicebus.ops.bench.hostile.normal_sessions`, fresh session ids), and is scored like a hostile
round: ``processes_died`` (stage processes that exited during the case), ``normal_turns_affected``
(`voicebus.ops.bench.hostile.affected` against the clean run) and ``memory_growth_mb``: what the
attack added to each stage's VmRSS. Before the first case two warm-up replays (not measured), one
at the normal pace and one with every token at once, set the stages' high-water marks of the
normal turns; then each case gets a **control** replay (the same turns, no attack) just before it, measured the same way (VmRSS after minus before), and
``memory_growth_mb`` is the stage's memory after the case less the higher of its levels before and
after the control (`attack_only`; the case's own growth ``memory_growth_raw_mb`` and the
control's ``memory_control_mb`` are kept). On top of that each case says whether the rejection was
**reported**, and how (``reason``): what an operator or a client can see of the defence.

- ``directory-forgery``: edge-directory records claiming every partition for a foreign URL,
  unsigned and signed with the wrong secret (`voicebus.players.shard`). Observed: the edge's
  ``voicebus_records_dead_lettered_total{reason="forged-directory-record"}``, the dead letters'
  ``voicebus.error.reason`` header, the edge's ``/healthz`` owners (no forged edge) and a fresh
  player's first message (``ready``, not ``redirect``).
- ``near-max-record``: a TextEvent just under the topic's ``max.message.bytes`` (so its dead
  letter, with its headers, would not fit). Observed: the gate's dead-letter counter, the dead
  letter's ``voicebus.error.truncated`` / ``voicebus.error.sha256`` headers (`voicebus.shell.capped_copy`)
  and the gate's ``/healthz``.
- ``missing-dlq``: the dead-letter topic deleted (and so unwritable), then an undecodable control
  record that every stage must dead-letter. Observed: ``voicebus_records_skipped_total`` on the
  gate, the worker and the edge after ``deadletter_attempts`` tries of ``deadletter_timeout_s``
  each, and how long that took; the topic is created again afterwards and a second bad record
  is dead-lettered normally (the stages kept serving).
- ``huge-turn-ids``: a cancel listing 100 times ``LIMITS.max_turn_ids`` turns. Observed: the
  ``contract-violation`` dead-letter counter of each stage and the dead letter's message
  (``turn_ids lists N turns, at most 64``).
- ``label-flood``: thousands of valid cancels, each with a distinct ``source``. Observed: each
  stage applied them, and the count of metric series on its ``/metrics`` grew by at most
  `LABEL_SERIES_SLACK` (the edge counts them under ``source="other"``, `metric_label`).
- ``report-ping-flood``: one player sending pings and playback reports at ten times
  ``edge_message_rate_per_s`` for 3 s, reading what it is sent. Observed: ``voicebus_edge_refused_total{reason="ping-rate-limited"|
  "report-rate-limited"}`` and the ``rate-limited`` error frames the player received, the
  connection staying up.
- ``pre-hello-flood``: more sockets than the edge's ``edge_max_clients`` that never say hello.
  Observed: the sockets beyond the limit refused with close 1013 and the error ``edge-full``
  (``voicebus_edge_disconnects_total{reason="edge-full"}``), the others closed 4408 at the hello
  deadline; the normal players (connected before) hear every turn.
- ``unknown-schema-flood``: Confluent-framed records naming made-up schema ids. The stages run
  with a schema registry (`CountingRegistry`, a stub in the bench process that knows no id and
  counts the lookups it gets). Observed: each stage dead-lettered every record as
  ``unknown-schema-id``, and the registry got at most ``stages x (burst + rate x seconds)``
  lookups (`voicebus.codecs.LOOKUP_RATE_PER_S`, ``LOOKUP_BURST``), fewer than the records.
- ``session-flood``, ``zombie-gate``: more sessions than the gate holds, a gate paused until its
  partitions moved
  (`voicebus.ops.bench.hostile_faults`, which says what each does and observes). ``zombie-gate``
  restarts the gate first (`PREPARE`), before its control replay.

Size: about 740 lines, a table of attack cases: each case is a setup, an attack and the observable
of its defence, and they share the bench's sessions, scoring and stage processes
(`voicebus.ops.bench.hostile`). Benchmarks are not on the runtime path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from voicebus.ops.bench.hostile_scoring import DLQ_COUNTER, REASON_HEADER, Observation  # noqa: F401 - re-exported
from voicebus.schemas.messages import TextEvent

SKIP_COUNTER = "voicebus_records_skipped_total"
LABEL_SERIES_SLACK = 12  # series a label flood may add to a stage's /metrics (the "other" label, first uses)
WAIT_S = 120.0  # how long a case waits for the stages to show what it expects
FLOOD_TIMES, FLOOD_S = 10, 3.0  # report-ping-flood: 10 times edge_message_rate_per_s for 3 s
NEAR_MAX_MARGIN = 4096  # bytes under the topic's max.message.bytes of the near-max record (key, headers, batch framing)


class CountingRegistry:
    """A Confluent-compatible schema registry that knows no schema: every ``GET /schemas/ids/N``
    answers 404 (error 40403) and is counted. Runs in the bench's event loop (`start`, `stop`)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.lookups = 0  # GET /schemas/ids/<id>
        self.other = 0  # any other request
        self.url = ""
        self._runner: Any = None

    async def start(self) -> "CountingRegistry":
        from aiohttp import web

        async def schema_by_id(request: web.Request) -> web.Response:
            self.lookups += 1
            return web.json_response({"error_code": 40403, "message": "Schema not found"}, status=404)

        async def anything(request: web.Request) -> web.Response:
            self.other += 1
            return web.json_response({"error_code": 40401, "message": "Subject not found"}, status=404)

        app = web.Application()
        app.router.add_get("/schemas/ids/{id}", schema_by_id)
        app.router.add_route("*", "/{tail:.*}", anything)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port the OS chose
        self.url = f"http://{self.host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass(frozen=True)
class Helpers:
    """What the cases take from `voicebus.ops.bench.hostile` (which imports this module, so it
    hands them over): the wire encoder that bypasses the contract, record builders, the header
    naming what the bench sent, what each stage counts when it applies a control event, and the
    normal sessions with their comparison against the clean run."""

    raw_avro: Callable[[Any, str, dict], bytes]
    text_event: Callable[..., TextEvent]
    cancel_event: Callable[..., dict]
    kind_header: str
    cancel_counters: dict[str, str]
    normal_sessions: Callable[..., Awaitable[list]]
    affected: Callable[[list, list], list]


@dataclass
class CaseContext:
    """What an attack needs: the live stack, a raw producer, the codec, the scale of the inputs."""

    stack: Any  # voicebus.ops.bench.stages.StageProcesses
    producer: Any  # raw bytes, any key, any partition, any headers
    codec: Any
    rng: random.Random
    scale: int
    helpers: Helpers
    registry: CountingRegistry | None = None
    hostile_topic: str = ""
    replay_done: asyncio.Event | None = None  # set once the normal sessions' replay of the case ended

    @property
    def s(self):
        return self.stack.settings

    def sid(self) -> str:
        return f"hostile-{uuid.uuid4().hex[:8]}"

    @property
    def stage_names(self) -> list[str]:
        return [stage.name for stage in self.stack.stages]

    async def send(self, kind: str, topic: str, value: bytes | None, key: bytes | None,
                   headers: list[tuple[str, bytes]] = (), **kw: Any):
        return await self.producer.send_and_wait(topic, value, key=key,
                                                 headers=[*headers, (self.helpers.kind_header, kind.encode())], **kw)

    async def counters(self, name: str, **labels: str) -> dict[str, float]:
        return {stage: await self.stack.metric(stage, name, labels or None) for stage in self.stage_names}

    async def wait_counters(self, name: str, targets: dict[str, float], timeout_s: float = WAIT_S,
                            **labels: str) -> tuple[dict[str, float], dict[str, float]]:
        """Until every stage in `targets` counts at least its target of `name`; returns the counts
        then (or at the timeout) and, per stage, the seconds it took (None: not reached)."""
        started = time.monotonic()
        reached: dict[str, float] = {}
        while True:
            now = {stage: await self.stack.metric(stage, name, labels or None) for stage in targets}
            for stage, value in now.items():
                if value >= targets[stage] and stage not in reached:
                    reached[stage] = round(time.monotonic() - started, 2)
            if len(reached) == len(targets) or time.monotonic() - started > timeout_s:
                return now, reached
            await asyncio.sleep(0.2)

    async def metrics_text(self, stage: str) -> str:
        import aiohttp

        async with aiohttp.ClientSession() as http, \
                http.get(self.stack.metrics_urls[stage], timeout=aiohttp.ClientTimeout(total=5)) as response:
            return await response.text()

    async def series(self, stage: str) -> int:
        """Metric series (samples, ``_created`` ones aside) on `stage`'s /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = await self.metrics_text(stage)
        return sum(1 for family in text_string_to_metric_families(text) for sample in family.samples
                   if not sample.name.endswith("_created"))

    async def healthz(self, stage: str) -> tuple[int, dict]:
        import aiohttp

        url = (self.stack.edge_url + "/healthz" if stage == "edge"
               else self.stack.metrics_urls[stage].rsplit("/metrics", 1)[0] + "/healthz")
        async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status, await response.json(content_type=None)

    async def dlq_mark(self) -> dict:
        """The dead-letter topic's end offsets now (`dead_letters` reads from there)."""
        from voicebus.bus import end_offsets

        return await end_offsets(self.s, [self.s.deadletter_topic])

    async def dead_letters(self, mark: dict, source_topic: str | None = None) -> list[dict[str, str]]:
        """Headers of each dead letter written since `mark` (of records from `source_topic`)."""
        from voicebus.bus import make_consumer

        consumer = make_consumer(self.s, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        out: list[dict[str, str]] = []
        try:
            tps = list(mark)
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, mark[tp])
            ends = await consumer.end_offsets(tps)
            deadline = time.monotonic() + 30
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]] and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        headers = {k: v.decode("utf-8", "replace") for k, v in record.headers or []}
                        if source_topic is None or headers.get("voicebus.source.topic") == source_topic:
                            out.append(headers | {"_value_bytes": str(len(record.value or b""))})
        finally:
            await consumer.stop()
        return out

    async def player(self, session_id: str | None = None):
        """A connected player of a (hostile) session past its hello: (http session, ws, first message)."""
        import aiohttp

        from voicebus.players import protocol
        from voicebus.players.auth import issue_token

        session_id = session_id or self.sid()
        http = aiohttp.ClientSession()
        try:
            ws = await http.ws_connect(self.stack.edge_url.rstrip("/") + "/ws", max_msg_size=0)
            await ws.send_str(protocol.encode_control(protocol.HELLO, session=session_id,
                                                      token=issue_token(self.s.edge_secret, session_id, 600)))
            msg = await ws.receive(timeout=10)
            first = json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {"type": f"ws:{msg.type.name}"}
            return http, ws, first
        except BaseException:
            await http.close()
            raise


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# --- the cases ---------------------------------------------------------------------------------


async def directory_forgery(ctx: CaseContext) -> Observation:
    from voicebus.players import protocol
    from voicebus.players.shard import DIRECTORY_PARTITION, SIGNATURE_HEADER, directory_record, directory_signature
    from voicebus.topics import edge_group_id

    s = ctx.s
    group = edge_group_id(s)
    mark = await ctx.dlq_mark()
    before = await ctx.stack.metric("edge", DLQ_COUNTER, {"reason": "forged-directory-record"})
    sent = 0
    for i in range(ctx.scale):
        # the whole topic claimed for a URL of the attacker's, under a new edge id and under the
        # key of no edge at all: unsigned, then signed with a secret that is not the edges'
        key, value = directory_record(group, f"forged-{i}-{uuid.uuid4().hex[:6]}", "ws://forged.invalid/ws",
                                      set(range(s.partitions)))
        await ctx.send("edges:unsigned", s.edges_topic, value, key, partition=DIRECTORY_PARTITION)
        await ctx.send("edges:wrong-secret", s.edges_topic, value, key, partition=DIRECTORY_PARTITION,
                       headers=[(SIGNATURE_HEADER, directory_signature("not-the-edge-secret", key, value))])
        sent += 2
    now, took = await ctx.wait_counters(DLQ_COUNTER, {"edge": before + sent}, reason="forged-directory-record")
    letters = await ctx.dead_letters(mark, s.edges_topic)
    reasons = Counter(h.get(REASON_HEADER, "") for h in letters)
    status, health = await ctx.healthz("edge")
    owners = (health.get("shard") or {}).get("owners", {})
    forged_owner = sorted({o for o in owners.values() if o and o.startswith("forged-")})
    http, ws, first = await ctx.player()
    with contextlib.suppress(Exception):
        await ws.close()
    await http.close()
    counted = now["edge"] - before
    ok = (counted >= sent and reasons["forged-directory-record"] >= sent and not forged_owner
          and first.get("type") == protocol.READY)
    return Observation(ok, f"dead-lettered forged-directory-record x{reasons['forged-directory-record']} "
                           f"(edge counter +{counted:g}); directory owners unchanged; a new player got "
                           f"{first.get('type')!r}", sent,
                       {"dead_letter_reasons": dict(reasons), "edge_counter_increase": counted,
                        "forged_owners": forged_owner, "new_player_first_message": first.get("type"),
                        "edge_healthz": status, "seconds_to_count": took.get("edge")})


async def _topic_max_bytes(s, topic: str) -> int:
    """The topic's effective ``max.message.bytes`` (its own, else the broker's), at most the producer's request size."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from voicebus.bus import make_admin

    admin = make_admin(s)
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        for response in responses:
            for resource in response.resources:
                for entry in resource[4]:
                    if entry[0] == "max.message.bytes" and entry[1]:
                        return min(int(entry[1]), s.max_message_bytes)
    except Exception:  # noqa: BLE001 - the broker's default then
        pass
    finally:
        await admin.close()
    return s.max_message_bytes


async def near_max_record(ctx: CaseContext) -> Observation:
    raw_avro, _text = ctx.helpers.raw_avro, ctx.helpers.text_event
    s, topic = ctx.s, ctx.hostile_topic
    limit = await _topic_max_bytes(s, topic)
    target = limit - NEAR_MAX_MARGIN
    mark = await ctx.dlq_mark()
    before = await ctx.stack.metric("gate", DLQ_COUNTER)
    offsets = set()
    for _ in range(ctx.scale):
        sid = ctx.sid()
        base = len(raw_avro(ctx.codec, "TextEvent", _text(sid, "near-max", 0, text="").to_record()))
        text = "a" * max(0, target - base - 4)  # the string's length varint: up to 4 bytes more
        value = raw_avro(ctx.codec, "TextEvent", _text(sid, "near-max", 0, text=text).to_record())
        meta = await ctx.send("text:near-max-record", topic, value, sid.encode())
        offsets.add(meta.offset)
        size = len(value)
    now, took = await ctx.wait_counters(DLQ_COUNTER, {"gate": before + ctx.scale})
    letters = [h for h in await ctx.dead_letters(mark, topic) if int(h.get("voicebus.source.offset", -1)) in offsets]
    capped = [h for h in letters if h.get("voicebus.error.truncated") == str(size) and h.get("voicebus.error.sha256")]
    status, _health = await ctx.healthz("gate")
    reasons = sorted({h.get(REASON_HEADER, "") for h in letters})
    ok = len(capped) >= ctx.scale and status == 200
    return Observation(ok, f"dead-lettered {', '.join(reasons) or 'nothing'}; the copy capped to "
                           f"{capped[0]['_value_bytes'] if capped else '?'} of {size} bytes "
                           f"(voicebus.error.truncated, voicebus.error.sha256); gate /healthz {status}", ctx.scale,
                       {"topic_max_message_bytes": limit, "record_bytes": size, "dead_letters": len(letters),
                        "capped_copies": len(capped), "copy_bytes": int(capped[0]["_value_bytes"]) if capped else None,
                        "reasons": reasons, "gate_healthz": status,
                        "seconds_to_count": took.get("gate")})


async def missing_dlq(ctx: CaseContext) -> Observation:
    from voicebus.bus import ensure_topics, make_admin
    from voicebus.codecs import MAGIC

    s = ctx.s
    stages = ctx.stage_names
    admin = make_admin(s)
    await admin.start()
    try:
        await admin.delete_topics([s.deadletter_topic])
        deadline = time.monotonic() + 30
        while s.deadletter_topic in await admin.list_topics() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await admin.close()
    skipped_before = await ctx.counters(SKIP_COUNTER)
    started = time.monotonic()
    try:
        for _ in range(ctx.scale):  # undecodable: every stage that follows control must dead-letter it
            await ctx.send("control:garbage-without-dlq", s.control_topic, MAGIC + ctx.rng.randbytes(24),
                           ctx.sid().encode())
        bound = ctx.scale * s.deadletter_attempts * (s.deadletter_timeout_s + 2.0)  # tries + backoff (at most 2 s)
        skipped, took = await ctx.wait_counters(SKIP_COUNTER, {st: skipped_before[st] + ctx.scale for st in stages},
                                                timeout_s=bound + 60)
    finally:
        await ensure_topics(s, [s.deadletter_topic])
    elapsed = round(time.monotonic() - started, 1)
    # back: the same bad input is dead-lettered again, by every stage
    dlq_before = await ctx.counters(DLQ_COUNTER)
    mark = await ctx.dlq_mark()
    await ctx.send("control:garbage-after-dlq-back", s.control_topic, MAGIC + ctx.rng.randbytes(24), ctx.sid().encode())
    await ctx.wait_counters(DLQ_COUNTER, {st: dlq_before[st] + 1 for st in stages})
    deadline = time.monotonic() + 60
    letters: list = []
    while len(letters) < len(stages) and time.monotonic() < deadline:  # the stages' producers find the new topic
        letters = [h for h in await ctx.dead_letters(mark, s.control_topic)
                   if h.get("voicebus.error.stage") and h.get(REASON_HEADER)]
        if len(letters) < len(stages):
            await asyncio.sleep(1.0)
    increase = _delta(skipped, skipped_before)
    within = all(took.get(st) is not None and took[st] <= bound for st in stages)
    ok = all(increase[st] >= ctx.scale for st in stages) and within
    return Observation(ok, "voicebus_records_skipped_total +" + ", +".join(f"{increase[st]:g} {st}" for st in stages)
                           + f" after {s.deadletter_attempts} tries of {s.deadletter_timeout_s:g} s; dead-lettered "
                           f"again once the topic was back ({len(letters)} of {len(stages)} stages)", ctx.scale,
                       {"skipped_increase": increase, "seconds_to_skip": took, "bound_s": round(bound, 1),
                        "case_seconds": elapsed, "dead_letters_after_restore": len(letters)})


async def huge_turn_ids(ctx: CaseContext) -> Observation:
    from voicebus.schemas.contract import LIMITS

    raw_avro, _cancel = ctx.helpers.raw_avro, ctx.helpers.cancel_event
    s = ctx.s
    stages = ctx.stage_names
    n_ids = 100 * LIMITS.max_turn_ids
    before = await ctx.counters(DLQ_COUNTER, reason="contract-violation")
    mark = await ctx.dlq_mark()
    for _ in range(ctx.scale):
        sid = ctx.sid()
        await ctx.send("control:huge-turn-ids", s.control_topic,
                       raw_avro(ctx.codec, "ControlEvent", _cancel(sid, None, turn_ids=[f"t{i}" for i in range(n_ids)])),
                       sid.encode())
    now, took = await ctx.wait_counters(DLQ_COUNTER, {st: before[st] + ctx.scale for st in stages},
                                        reason="contract-violation")
    letters = [h for h in await ctx.dead_letters(mark, s.control_topic)
               if f"turn_ids lists {n_ids} turns" in h.get("voicebus.error.message", "")]
    increase = _delta(now, before)
    ok = all(increase[st] >= ctx.scale for st in stages) and len(letters) >= len(stages) * ctx.scale
    message = letters[0].get("voicebus.error.message", "") if letters else ""
    return Observation(ok, f"dead-lettered contract-violation by {', '.join(stages)} "
                           f"(\"turn_ids lists {n_ids} turns, at most {LIMITS.max_turn_ids}\")", ctx.scale,
                       {"turn_ids": n_ids, "counter_increase": increase, "dead_letters": len(letters),
                        "message": message[-120:], "seconds_to_count": took})


async def label_flood(ctx: CaseContext) -> Observation:
    CANCEL_COUNTERS, _cancel = ctx.helpers.cancel_counters, ctx.helpers.cancel_event
    s = ctx.s
    n = 2000 * ctx.scale
    series_before = {st: await ctx.series(st) for st in ctx.stage_names}
    applied_before = {st: await ctx.stack.metric(st, name) for st, name in CANCEL_COUNTERS.items()}
    other_before = await ctx.stack.metric("edge", "voicebus_edge_cancels_total", {"source": "other"})
    sid = ctx.sid()
    for i in range(n):
        await ctx.producer.send(s.control_topic, ctx.codec.encode("ControlEvent", _cancel(
            sid, f"made-up-{i}", source=f"flood-{i}-{ctx.rng.getrandbits(24):x}")), key=sid.encode())
    await ctx.producer.flush()
    started = time.monotonic()
    while True:  # each stage counts what it applied under a name of its own (CANCEL_COUNTERS)
        applied = {st: await ctx.stack.metric(st, name) for st, name in CANCEL_COUNTERS.items()}
        if all(applied[st] >= applied_before[st] + n for st in applied) or time.monotonic() - started > WAIT_S:
            break
        await asyncio.sleep(0.3)
    seconds = round(time.monotonic() - started, 1)
    series_after = {st: await ctx.series(st) for st in ctx.stage_names}
    growth = _delta(series_after, series_before)
    other = await ctx.stack.metric("edge", "voicebus_edge_cancels_total", {"source": "other"}) - other_before
    all_applied = all(applied[st] >= applied_before[st] + n for st in applied)
    ok = all_applied and all(g <= LABEL_SERIES_SLACK for g in growth.values()) and other >= n
    return Observation(ok, f"{n} distinct sources applied by every stage; metric series "
                           + ", ".join(f"{st} {series_before[st]}->{series_after[st]}" for st in series_after)
                           + f"; the edge counted them as source=\"other\" (+{other:g})", n,
                       {"series_before": series_before, "series_after": series_after, "series_growth": growth,
                        "applied": {st: applied[st] - applied_before[st] for st in applied},
                        "edge_other_increase": other, "seconds_to_apply": seconds})


async def report_ping_flood(ctx: CaseContext) -> Observation:
    import aiohttp

    from voicebus.players import protocol

    s = ctx.s
    rate = FLOOD_TIMES * s.edge_message_rate_per_s  # messages a second, pings and reports alternating
    n = int(rate * FLOOD_S) * ctx.scale
    refused_before = {k: await ctx.stack.metric("edge", "voicebus_edge_refused_total", {"reason": f"{k}-rate-limited"})
                      for k in ("ping", "report")}
    http, ws, first = await ctx.player()
    got: Counter[str] = Counter()

    async def read() -> None:  # the player reads what it is sent (one that does not is cut off as too slow)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                data = json.loads(msg.data)
                got[data.get("code") or data.get("type")] += 1

    reader = asyncio.create_task(read())
    started = time.monotonic()
    try:
        for i in range(n):
            if i % 2:
                await ws.send_str(protocol.encode_control(protocol.REPORT, kind="UNDERRUN", turn_id=f"t{i % 7}",
                                                          sentence_seq=0))
            else:
                await ws.send_str(protocol.encode_control(protocol.PING, t0=i))
            await asyncio.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
        elapsed = time.monotonic() - started
        await asyncio.sleep(1.0)  # the last answers
        open_after, close_code = not ws.closed, ws.close_code
    finally:
        with contextlib.suppress(Exception):
            await ws.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        await http.close()
    refused = {k: await ctx.stack.metric("edge", "voicebus_edge_refused_total", {"reason": f"{k}-rate-limited"})
               - refused_before[k] for k in refused_before}
    allowed = s.edge_message_burst + s.edge_message_rate_per_s * (elapsed + 1.0)
    ok = (first.get("type") == protocol.READY and open_after and got["rate-limited"] > 0
          and sum(refused.values()) >= n - allowed)
    return Observation(ok, f"voicebus_edge_refused_total ping-rate-limited +{refused['ping']:g}, "
                           f"report-rate-limited +{refused['report']:g} of {n} sent at {rate:g}/s; the player got "
                           f"{got['rate-limited']} 'rate-limited' errors and {got['pong']} pongs, "
                           + ("its connection kept" if open_after else f"closed {close_code}"), n,
                       {"sent": n, "rate_per_s": rate, "seconds": round(elapsed, 2), "refused": refused,
                        "errors_received": got["rate-limited"], "pongs": got["pong"], "open_after": open_after,
                        "close_code": close_code, "allowed_at_most": round(allowed)})


async def pre_hello_flood(ctx: CaseContext) -> Observation:
    import aiohttp

    s = ctx.s
    extra = 8 * ctx.scale
    total = s.edge_max_clients + extra
    full_before = await ctx.stack.metric("edge", "voicebus_edge_disconnects_total", {"reason": "edge-full"})
    outcomes: Counter[str] = Counter()
    url = ctx.stack.edge_url.rstrip("/") + "/ws"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def silent() -> None:
            try:
                async with http.ws_connect(url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                    error = None
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with asyncio.timeout(30):  # the edge's hello deadline is 5 s
                            async for msg in ws:
                                if msg.type == aiohttp.WSMsgType.TEXT:
                                    error = json.loads(msg.data).get("code")
                    outcomes[f"{ws.close_code}:{error}"] += 1
            except (aiohttp.ClientError, ConnectionError) as exc:
                outcomes[type(exc).__name__] += 1

        await asyncio.gather(*(silent() for _ in range(total)))
    refused = sum(v for k, v in outcomes.items() if k.startswith("1013:edge-full"))
    full = await ctx.stack.metric("edge", "voicebus_edge_disconnects_total", {"reason": "edge-full"}) - full_before
    timed_out = sum(v for k, v in outcomes.items() if k.startswith("4408"))
    ok = refused >= extra and full >= extra and refused + timed_out == total
    return Observation(ok, f"{refused} of {total} silent sockets refused with close 1013 'edge-full' "
                           f"(limit {s.edge_max_clients}, voicebus_edge_disconnects_total{{reason=\"edge-full\"}} "
                           f"+{full:g}), {timed_out} closed 4408 at the hello deadline", total,
                       {"sockets": total, "edge_max_clients": s.edge_max_clients, "outcomes": dict(outcomes),
                        "edge_full_increase": full})


async def unknown_schema_flood(ctx: CaseContext) -> Observation:
    from voicebus.codecs import CONFLUENT_MAGIC, LOOKUP_BURST, LOOKUP_RATE_PER_S

    s = ctx.s
    stages = ctx.stage_names
    n = 400 * ctx.scale
    before = await ctx.counters(DLQ_COUNTER, reason="unknown-schema-id")
    lookups_before = ctx.registry.lookups if ctx.registry else 0
    started = time.monotonic()
    ids = ctx.rng.sample(range(10_000_000, 2**31 - 1), n)  # none of them registered anywhere
    sid = ctx.sid()
    for schema_id in ids:
        await ctx.producer.send(s.control_topic, CONFLUENT_MAGIC + struct.pack(">I", schema_id) + ctx.rng.randbytes(16),
                                key=sid.encode())
    await ctx.producer.flush()
    now, took = await ctx.wait_counters(DLQ_COUNTER, {st: before[st] + n for st in stages}, reason="unknown-schema-id")
    seconds = time.monotonic() - started
    lookups = (ctx.registry.lookups if ctx.registry else 0) - lookups_before
    bound = len(stages) * (LOOKUP_BURST + LOOKUP_RATE_PER_S * seconds)
    increase = _delta(now, before)
    ok = all(increase[st] >= n for st in stages) and lookups <= bound and (ctx.registry is None or lookups < n * len(stages))
    return Observation(ok, f"dead-lettered unknown-schema-id x{n} by each of {', '.join(stages)}; "
                           f"{lookups} registry lookups for {n * len(stages)} records (at most "
                           f"{LOOKUP_BURST} + {LOOKUP_RATE_PER_S:g}/s per stage)", n,
                       {"records": n, "counter_increase": increase, "registry_lookups": lookups,
                        "lookup_bound": round(bound), "seconds": round(seconds, 1),
                        "registry": "counting stub" if ctx.registry else "none configured"})


Attack = Callable[[CaseContext], Awaitable[Observation]]

# the cases that bend a stage (that module imports this one: reached at call time)
from voicebus.ops.bench import hostile_faults as _faults  # noqa: E402

CASES: dict[str, tuple[str, Attack]] = {
    "directory-forgery": ("unsigned and wrongly signed edge-directory records claiming every partition", directory_forgery),
    "near-max-record": ("a text event just under the topic's max.message.bytes", near_max_record),
    "missing-dlq": ("the dead-letter topic deleted, then an undecodable control record", missing_dlq),
    "huge-turn-ids": ("a cancel listing 100 x LIMITS.max_turn_ids turns", huge_turn_ids),
    "label-flood": ("2000 cancels with 2000 distinct sources", label_flood),
    "report-ping-flood": ("one player sending pings and reports at 10 x edge_message_rate_per_s for 3 s",
                          report_ping_flood),
    "pre-hello-flood": ("edge_max_clients + 8 sockets that never say hello", pre_hello_flood),
    "unknown-schema-flood": ("400 Confluent-framed records naming made-up schema ids", unknown_schema_flood),
    "session-flood": ("2 x gate_max_sessions sessions whose turns end at once, then the bound + 20 that never end",
                      lambda ctx: _faults.session_flood(ctx)),
    "zombie-gate": ("the gate paused past its session timeout while a second gate takes its partitions, then resumed",
                    lambda ctx: _faults.zombie_gate(ctx)),
}
# what a case needs done before it is measured (before its control replay)
PREPARE: dict[str, Callable[[CaseContext], Awaitable[None]]] = {
    "zombie-gate": lambda ctx: _faults.zombie_prepare(ctx),
}


def parse_cases(text: str | None) -> list[str]:
    """``--cases``: None or "all" -> every case; "none" -> none; else the comma-separated names
    (`ValueError` naming the unknown ones)."""
    if text is None or text.strip() == "all":
        return list(CASES)
    if text.strip() in ("", "none"):
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; choose from {', '.join(CASES)} (or all, none)")
    return names


def attack_only(raw: dict[str, float], control: dict[str, float]) -> dict[str, float]:
    """Per stage, what the attack added: the stage's memory after the case less the higher of its
    memory before and after the control replay (the same turns with no attack, just before the
    case). A high-water step the replay takes is taken in the control; memory the allocator
    handed back during the control does not count against the attack. `raw`: after the case
    less before it; `control`: after the control less before it."""
    return {st: round(raw[st] + min(control.get(st, 0.0), 0.0), 1) for st in raw}


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {st: round(after[st] - before.get(st, 0.0), 1) for st in after}


async def run_cases(stack, publisher, plan, clean, names: list[str], ctx: CaseContext,
                    progress: Callable[[str], None] = lambda m: None) -> tuple[dict[str, dict], dict]:
    """Each case in `names`, one after the other, while the normal sessions replay their turns.

    Memory: two warm-up replays first (not measured: the stages' high-water marks of the normal
    turns, at their pace and all at once), then per case a **control** replay (no attack) and the
    case's replay, each measured as VmRSS after minus before; ``memory_growth_mb`` is the case's growth over the higher of the
    levels before and after the control (`attack_only`), ``memory_growth_raw_mb`` and
    ``memory_control_mb`` the two it comes from. A case's preparation
    (`PREPARE`: a stage restarted with other options) runs before its control replay.

    Returns name -> its figures (``processes_died``, ``normal_turns``, ``normal_turns_affected``,
    ``memory_growth_mb``, ``memory_growth_raw_mb``, ``memory_control_mb``, ``rejection_reported``,
    ``reason``, ``inputs``, ``detail``, ``affected``, ``died``), and the warm-up's figures."""
    normal_sessions, affected = ctx.helpers.normal_sessions, ctx.helpers.affected
    out: dict[str, dict] = {}
    warm: dict = {}
    if names and plan.memory:
        progress("cases: a warm-up replay at the normal pace, then one all at once (not measured)")
        before = stack.rss_mb()
        heard = await normal_sessions(stack, publisher, plan, "warm-up")
        # every token at once: the worker takes the turns' sentences together, as it does when a
        # gate that was away releases its backlog
        heard += await normal_sessions(stack, publisher, dataclasses.replace(plan, token_ms=0.0), "warm-up-burst")
        warm = {"memory_growth_mb": growth(before, stack.rss_mb()), "normal_turns": len(heard),
                "normal_turns_affected": len(affected(clean, heard))}
    for name in names:
        description, attack = CASES[name]
        died_before = set(stack.died())
        if name in PREPARE:
            progress(f"case {name}: preparing")
            await PREPARE[name](ctx)
        rss_control = stack.rss_mb()
        control_heard = []
        if plan.memory:
            progress(f"case {name}: control replay")
            control_heard = await normal_sessions(stack, publisher, plan, f"k-{name}")
        rss_before = stack.rss_mb()
        control = growth(rss_control, rss_before)
        progress(f"case {name}: {description}")
        tasks: list[asyncio.Task] = []
        ctx.replay_done = asyncio.Event()

        async def before_turns(session_ids: list[str]) -> None:
            tasks.append(asyncio.create_task(attack(ctx)))

        try:
            heard = await normal_sessions(stack, publisher, plan, f"c-{name}", before_turns=before_turns)
        finally:
            ctx.replay_done.set()
        try:
            seen = await tasks[0]
        except Exception as exc:  # noqa: BLE001 - one case failing to observe is that case's result
            seen = Observation(False, f"the case itself failed: {type(exc).__name__}: {exc}", 0)
        bad = affected(clean, heard)
        died = sorted(set(stack.died()) - died_before)
        raw = growth(rss_before, stack.rss_mb())
        out[name] = {
            "attack": description,
            "inputs": seen.inputs,
            "processes_died": len(died),
            "normal_turns": len(heard),
            "normal_turns_affected": len(bad),
            "memory_growth_mb": attack_only(raw, control),
            "memory_growth_raw_mb": raw,
            "memory_control_mb": control,
            "control_turns_affected": len(affected(clean, control_heard)),
            "rejection_reported": seen.reported,
            "reason": seen.reason,
            "detail": seen.detail,
            "affected": [f"{key}: {why}" for key, why in bad],
            "died": died,
        }
        progress(f"  {name}: died {len(died)}, affected {len(bad)}/{len(heard)}, MB {out[name]['memory_growth_mb']} "
                 f"(raw {raw}, control {control}), reported {seen.reported}: {seen.reason}")
    return out, warm


MEMORY_TARGET_MB = 5.0  # a case's attack-only memory growth per stage, at most


def case_ok(result: dict) -> bool:
    return (result["processes_died"] == 0 and result["normal_turns_affected"] == 0 and result["rejection_reported"])


def memory_ok(result: dict, target_mb: float = MEMORY_TARGET_MB) -> bool:
    """The case's attack-only growth (`attack_only`) is within `target_mb` on every stage."""
    return all(mb <= target_mb for mb in result["memory_growth_mb"].values())


def format_cases(cases: dict[str, dict]) -> str:
    """The per-case table of the text output: attack-only memory growth, and the case's raw
    growth and its control's when known."""
    if not cases:
        return ""
    stages = list(next(iter(cases.values()))["memory_growth_mb"])

    def mb(figures: dict[str, float] | None) -> str:
        return "/".join(f"{figures[st]:+.1f}" for st in stages) if figures else "-"

    head = (f"{'case':<22} {'died':>4} {'affected':>9} {'MB ' + '/'.join(stages):>24} "
            f"{'raw':>20} {'control':>20}  reported  reason")
    lines = [head]
    for name, r in cases.items():
        lines.append(f"{name:<22} {r['processes_died']:>4} {r['normal_turns_affected']:>4} of {r['normal_turns']:<2} "
                     f"{mb(r['memory_growth_mb']):>24} {mb(r.get('memory_growth_raw_mb')):>20} "
                     f"{mb(r.get('memory_control_mb')):>20}  {'yes' if r['rejection_reported'] else 'NO':<8}  "
                     f"{r['reason']}")
    return "\n".join(lines)
