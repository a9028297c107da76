"""`voicebus bench chaos`: nothing lost, nothing heard twice, while machines under the pipeline die.

This module owns the chaos run (the benchmark and the fault tests in
``tests/pipeline/test_bench_chaos.py`` are this one mechanism). A whole pipeline runs as owned
operating-system processes on a local KRaft cluster of the run's own (it kills its nodes:
``--bootstrap`` does not apply): one gate worker, one synthesis worker (the
tiny random-weight Kokoro by default: real Kokoro code, the test's speed) and one edge, each a
child in its own process group that is SIGKILLed (a crash, no clean shutdown) and started again
(`voicebus.ops.bench.stages.StageProcess`, the one stage-process mechanism the benchmarks share).
An agent (the SDK's `Publisher`, in this process) speaks turns for several sessions at once, in
rounds (every session one turn, all turns ended, the next round); one listener per session (a
protocol v1 WebSocket client of the edge, `ChaosListener`) hears them, and reconnects with
``resume`` when its edge goes away, as the web player does.

Fault kinds, one at a time, in the middle of a turn (once the round's first audio was heard):

* ``broker_leader`` (a cluster of 3): SIGKILL the node leading most of the sessions'
  partitions (text, synthesis, audio, control), start it again after a few seconds;
* ``broker_single`` (a cluster of 1): SIGKILL the only broker and start it again; nothing of the
  pipeline is restarted, every stage must resume on its own;
* ``gate``, ``worker``, ``edge``: SIGKILL that process and start a new one at once.

The listener's record is compared with what the agent said (sentence seqs 0..n-1 of each turn,
sentences short enough that the gate releases each one whole). Per kind: ``turns``,
``sentences`` expected, ``lost`` (not heard whole: a chunk missing, or never heard),
``heard_twice`` (a chunk of the sentence reached the listener again), ``out_of_order`` (a chunk
arrived after a later one of its turn), ``max_gap_ms`` (the longest silence inside a turn, a
player starting at the turn's first frame: a frame that arrives after the audio before it has
finished playing) and ``recovery_ms`` p50/p95 (from the kill to the next *new* audio any
listener received: the first chunk of a sentence published after the kill, or any audio on a
connection opened after it; audio already in flight does not count). A reconnect with
``resume`` restarts the sentence the listener was playing, by design of the protocol
(docs/edge.md, "Reconnect"): the listener drops its partial copy of that sentence first (as a
player starts it again), so that restart is counted apart (``restarted_sentences`` in
``details``), never as heard twice.

Size: about 700 lines: one benchmark (its fault schedule, listener, scoring and report), also run
by the fault tests. Benchmarks are not on the runtime path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from voicebus.cli import add_json_argument, write_json
from voicebus.ops.bench.cli import add_stage_log_level, refuse_bootstrap
from voicebus.ops.bench.stages import StageProcess, healthz_probe, log_level_args, stage_env
from voicebus.clock import now_us
from voicebus.latency import STAGES
from voicebus.lifecycle import Owned
from voicebus.settings import Settings

KINDS = ("broker_leader", "broker_single", "gate", "worker", "edge")
PROCESS_KINDS = ("gate", "worker", "edge")
# Short sentences without a comma: the gate releases each one whole (no early clause release, no
# opening-clause split), so sentence seq k of a turn is the agent's k-th sentence.
SENTENCES = ("The sky is blue.", "Birds fly south.", "Rain falls today.", "We are ready.",
             "Come back soon.", "Time moves on.", "Lights are green.", "Doors stay open.")
BROKER_DOWN_S = 3.0  # a killed broker stays down this long before its restart


# --- the stages, as owned processes (`voicebus.ops.bench.stages`) ---------------------------------------


def make_stages(settings: Settings, tiny: bool = True, session_timeout_s: float = 6.0,
                log_level: str | None = None) -> dict[str, StageProcess]:
    """The gate, worker and edge of a chaos run (not started); `log_level`: every stage's (None:
    WARNING for the gate, the worker's and edge's own INFO)."""
    from voicebus.gate.app import READY_LINE
    from voicebus.synthesis.cli import WORKER_READY_LINE

    env = stage_env(settings)
    gate = StageProcess("gate", [sys.executable, "-m", "voicebus.gate.cli", "--announce", "--log-level",
                                 log_level or "WARNING", "--commit-interval", "1",
                                 "--session-timeout", f"{session_timeout_s:g}"],
                        env, ready_line=READY_LINE)
    worker = StageProcess("worker", [sys.executable, "-m", "voicebus.synthesis.cli", "--announce", "--worker-id",
                                     "chaos-worker"] + (["--tiny"] if tiny else []) + log_level_args(log_level),
                          env, ready_line=WORKER_READY_LINE)
    edge = StageProcess("edge", [sys.executable, "-m", "voicebus", "edge", "--port", str(settings.edge_port),
                                 *log_level_args(log_level)], env,
                        probe=healthz_probe(f"http://{settings.edge_host}:{settings.edge_port}/healthz"))
    return {"gate": gate, "worker": worker, "edge": edge}


# --- the listener -----------------------------------------------------------------------------------


@dataclass
class Frame:
    received_us: int
    sentence: int
    chunk: int
    last_in_sentence: bool
    samples: int
    connection: int = 0  # the listener's connection it came on (0, 1, ... after each reconnect)


@dataclass
class HeardRecord:
    """What one listener heard of one turn, kept frames in arrival order."""

    frames: list[Frame] = field(default_factory=list)
    restarted: int = 0  # partial sentences dropped for a resume (the edge sends them again from their start)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    published_us: dict[int, int] = field(default_factory=dict)  # sentence -> its first chunk's publish time
    timelines: dict[int, dict] = field(default_factory=dict)  # sentence -> its timeline message (stage stamps)
    first_frame_us: dict[int, int] = field(default_factory=dict)  # sentence -> when its chunk 0 arrived

    def complete(self, sentence: int) -> bool:
        chunks = [f for f in self.frames if f.sentence == sentence]
        last = [f.chunk for f in chunks if f.last_in_sentence]
        return bool(last) and sorted({f.chunk for f in chunks}) == list(range(last[0] + 1))

    def resume_point(self) -> int:
        """The sentence being played: the first one not heard whole (past the last whole one)."""
        heard = {f.sentence for f in self.frames}
        k = 0
        while k in heard and self.complete(k):
            k += 1
        return k


class ChaosListener:
    """One session's player: a WebSocket client of the edge that reconnects (every 0.2 s while the
    edge is away) with ``resume {turn_id, sentence_seq}`` of the turn it was playing, as the web
    player does. Owns its connection task: `start()` / `stop()`."""

    def __init__(self, edge_url: str, session_id: str, secret: str) -> None:
        from voicebus.players.auth import issue_token

        self.ws_url = edge_url.rstrip("/") + "/ws"
        self.session_id = session_id
        self._token = issue_token(secret, session_id, 24 * 3600)
        self.turns: dict[str, HeardRecord] = {}
        self.current: str | None = None  # the turn being played
        self.connections = 0
        self.connected_at_us: list[int] = []  # when each connection was ready
        self.connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    def record(self, turn_id: str) -> HeardRecord:
        return self.turns.setdefault(turn_id, HeardRecord())

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"chaos-listener-{self.session_id}")
        async with asyncio.timeout(60):
            await self.connected.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        import aiohttp

        from voicebus.players import protocol

        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.ws_connect(self.ws_url, max_msg_size=protocol.MAX_AUDIO_FRAME_BYTES,
                                               heartbeat=5.0) as ws:
                        await self._session(ws)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ConnectionError):
                    pass
                self.connected.clear()
                await asyncio.sleep(0.2)

    async def _session(self, ws) -> None:
        import aiohttp

        from voicebus.players import protocol

        hello: dict[str, Any] = {"session": self.session_id, "token": self._token}
        current = self.turns.get(self.current) if self.current else None
        if current is not None and not current.ended.is_set():
            k = current.resume_point()
            partial = [f for f in current.frames if f.sentence >= k]
            if partial:  # the player starts that sentence again: the edge sends it from its start
                current.frames = [f for f in current.frames if f.sentence < k]
                current.restarted += 1
            hello["resume"] = {"turn_id": self.current, "sentence_seq": k}
        elif current is not None:
            # between turns: the last one was heard to its end; whatever came after it (a turn
            # spoken, even ended, while no edge ran) is still to be heard
            hello["resume"] = {"turn_id": self.current, "sentence_seq": current.resume_point(), "finished": True}
        await ws.send_str(protocol.encode_control(protocol.HELLO, **hello))
        ready = await ws.receive_json(timeout=10)
        if ready.get("type") != protocol.READY:
            raise ConnectionError(f"edge refused the listener: {ready}")
        self.connections += 1
        self.connected_at_us.append(now_us())
        connection = len(self.connected_at_us) - 1
        self.connected.set()
        numbers: dict[int, str] = {}  # this connection's turn numbers (per edge)
        async for msg in ws:
            received = now_us()
            if msg.type == aiohttp.WSMsgType.BINARY:
                frame = protocol.decode_audio(msg.data)
                turn_id = numbers.get(frame.turn)
                if turn_id is None:
                    continue
                rec = self.record(turn_id)
                rec.frames.append(Frame(received, frame.sentence, frame.chunk, frame.last_in_sentence,
                                        len(frame.pcm) // 2, connection))
                if frame.chunk == 0:
                    rec.first_frame_us.setdefault(frame.sentence, received)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                message = msg.json()
                mtype = message.get("type")
                if mtype == protocol.TURN_START:
                    numbers[message["turn"]] = message["turn_id"]
                    self.record(message["turn_id"])
                    self.current = message["turn_id"]
                elif mtype == protocol.TIMELINE:
                    turn_id = message.get("turn_id") or numbers.get(message.get("turn"))
                    if turn_id:
                        rec, seq = self.record(turn_id), int(message["sentence_seq"])
                        rec.published_us.setdefault(seq, int(message.get("published_at_us") or 0))
                        rec.timelines.setdefault(seq, message)
                elif mtype in (protocol.TURN_END, protocol.STOP):
                    turn_id = message.get("turn_id") or numbers.get(message.get("turn"))
                    if turn_id:
                        self.record(turn_id).ended.set()
            else:
                break

    def first_new_sentence_after(self, t_us: int) -> tuple[int, dict] | None:
        """(when it arrived, its timeline) of the first sentence published at or after `t_us`."""
        hits = [(rec.first_frame_us[s], rec.timelines[s]) for rec in self.turns.values()
                for s, p in rec.published_us.items() if p >= t_us and s in rec.first_frame_us and s in rec.timelines]
        return min(hits, key=lambda hit: hit[0], default=None)

    def first_new_audio_after(self, t_us: int) -> int | None:
        """When this listener received new audio after a fault at `t_us`: the first chunk of a
        sentence published at or after `t_us` (its timeline says when), or any frame on a
        connection opened after `t_us` (the edge died: what the new one sends, its replay too)."""
        hits = [rec.first_frame_us[s] for rec in self.turns.values() for s, p in rec.published_us.items()
                if p >= t_us and s in rec.first_frame_us]
        hits += [f.received_us for rec in self.turns.values() for f in rec.frames
                 if self.connected_at_us[f.connection] >= t_us]
        return min(hits, default=None)


# --- scoring (pure) ---------------------------------------------------------------------------------


def score_turn(frames: list[Frame], expected: int) -> dict[str, Any]:
    """What one listener heard of one turn against the `expected` sentences 0..expected-1.

    ``lost``: expected sentences not heard whole; ``heard_twice``: sentences with a chunk
    received more than once; ``out_of_order``: sentences with a chunk that arrived after a later
    chunk of the turn; ``unexpected``: sentences beyond the expected ones; ``max_gap_ms``: the
    longest silence a player starting at the first frame hits (24 kHz)."""
    by_sentence: dict[int, list[int]] = {}
    last_of: dict[int, int] = {}
    disorder: set[int] = set()
    high = (-1, -1)
    for f in frames:
        by_sentence.setdefault(f.sentence, []).append(f.chunk)
        if f.last_in_sentence:
            last_of[f.sentence] = f.chunk
        if (f.sentence, f.chunk) < high:
            disorder.add(f.sentence)
        high = max(high, (f.sentence, f.chunk))
    lost = sum(1 for s in range(expected)
               if s not in last_of or sorted(set(by_sentence.get(s, []))) != list(range(last_of[s] + 1)))
    twice = sum(1 for chunks in by_sentence.values() if len(chunks) != len(set(chunks)))
    gap_us, play_until = 0, None
    for f in frames:
        if play_until is None:
            play_until = f.received_us
        elif f.received_us > play_until:
            gap_us = max(gap_us, f.received_us - play_until)
            play_until = f.received_us
        play_until += f.samples * 1_000_000 // 24000
    return {"lost": lost, "heard_twice": twice, "out_of_order": len(disorder),
            "unexpected": sum(1 for s in by_sentence if s >= expected), "max_gap_ms": gap_us / 1000}


def summarise_kind(scored: list[dict], recoveries: list[float]) -> dict[str, Any]:
    """The JSON row of one fault kind, exactly the keys the issue names."""
    return {
        "turns": len(scored),
        "sentences": sum(s["expected"] for s in scored),
        "lost": sum(s["lost"] for s in scored),
        "heard_twice": sum(s["heard_twice"] for s in scored),
        "out_of_order": sum(s["out_of_order"] for s in scored),
        "max_gap_ms": round(max((s["max_gap_ms"] for s in scored), default=0.0), 1),
        "recovery_ms": {"p50": _percentile(recoveries, 50), "p95": _percentile(recoveries, 95)},
    }


# The stamps of the sentence that brought a recovery, in the order its audio passed them (every
# benchmark's stage list, `voicebus.latency.STAGES`): where the time from a fault to the next new
# audio went (which hop waited on the failover).
RECOVERY_STAGES = STAGES


def recovery_stages(fault_us: int, timeline: dict, received_us: int) -> dict[str, float]:
    """ms from the fault to each stamp of the recovering sentence (negative: before the fault)."""
    out = {name: round((int(timeline[key]) - fault_us) / 1000, 1) for name, key in RECOVERY_STAGES if timeline.get(key)}
    out["received"] = round((received_us - fault_us) / 1000, 1)
    return out


def summarise_stages(samples: list[dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per stage, p50/p95 over the faults' recovering sentences."""
    names = [name for name, _ in RECOVERY_STAGES] + ["received"]
    return {name: {"p50": _percentile(vals, 50), "p95": _percentile(vals, 95)}
            for name in names if (vals := [s[name] for s in samples if name in s])}


def _percentile(values: list[float], q: float) -> float | None:
    """`voicebus.latency.percentile` (every benchmark's), None without a sample."""
    from voicebus.latency import percentile

    return round(percentile(values, q), 1) if values else None


# --- the run ----------------------------------------------------------------------------------------


@dataclass
class ChaosPlan:
    kinds: tuple[str, ...]
    turns: int = 20  # per kind
    sessions: int = 3
    every: int = 4  # a fault in every `every`-th turn of a kind (the first in its second turn)
    sentences: int = 3  # per turn
    token_ms: float = 40.0
    tiny: bool = True
    turn_timeout_s: float = 150.0
    log_level: str | None = None  # the stage processes' (`make_stages`)

    def faulty(self, round_no: int) -> bool:
        return round_no % self.every == min(1, self.every - 1)


class ChaosRun(Owned):
    """One pipeline (gate, worker, edge processes; agent and listeners here) on one cluster, and
    the faults of the kinds that run on it. Owns everything it starts: use ``async with``."""

    def __init__(self, settings: Settings, cluster: Any, plan: ChaosPlan, log: Callable[[str], None] = print) -> None:
        self.settings, self.cluster, self.plan, self.log = settings, cluster, plan, log
        self.stages = make_stages(settings, plan.tiny, log_level=plan.log_level)
        self.publisher: Any = None
        self.listeners: list[ChaosListener] = []
        self.sessions = [f"chaos-{uuid.uuid4().hex[:6]}-{i}" for i in range(plan.sessions)]
        self.faults: dict[str, list[int]] = {}
        self.baselines: dict[str, list[int]] = {}
        self.scored: dict[str, list[dict]] = {}
        self.details: dict[str, dict] = {}
        self.agent_errors = 0
        self._turn_no = 0

    @property
    def edge_url(self) -> str:
        return self.settings.edge_url

    async def start(self) -> None:
        from voicebus.agents.sdk import Publisher
        from voicebus.bus import ensure_topics
        from voicebus.topics import fixed_topics, text_topic

        s = self.settings
        await ensure_topics(s, [*fixed_topics(s), text_topic(s, "chaos")])
        for name in ("gate", "worker", "edge"):
            self.log(f"starting the {name}")
            await self.stages[name].start()
        self.publisher = Publisher(s, agent_id="chaos")
        await self.publisher.start()
        for session in self.sessions:
            listener = ChaosListener(self.edge_url, session, s.edge_secret)
            self.listeners.append(listener)
            await listener.start()
        self.log("warm-up turn")
        await self._round("warmup", None)  # not scored: every stage has spoken once

    async def stop(self) -> None:
        for listener in self.listeners:
            await listener.stop()
        if self.publisher is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.publisher.stop(), 30)
        for name in ("edge", "worker", "gate"):
            await self.stages[name].stop()

    # --- one round: every session speaks one turn -------------------------------------------------
    def _text(self) -> list[str]:
        n = self.plan.sentences
        start = self._turn_no % len(SENTENCES)
        self._turn_no += 1
        return [SENTENCES[(start + i) % len(SENTENCES)] for i in range(n)]

    async def _speak(self, session: str, turn_id: str, sentences: list[str], first_sent: asyncio.Event) -> None:
        words = " ".join(sentences).split(" ")
        first = len(sentences[0].split(" "))
        try:
            async with self.publisher.turn(session, turn_id) as turn:
                for i, word in enumerate(words):
                    await turn.token(word + (" " if i < len(words) - 1 else ""))
                    if i + 1 == first:
                        first_sent.set()
                    await asyncio.sleep(self.plan.token_ms / 1000)
        except Exception as exc:  # noqa: BLE001 - the agent's own failure is reported, the run goes on
            self.agent_errors += 1
            self.log(f"agent: turn {turn_id} of {session} failed: {exc!r}")

    async def _round(self, kind: str, fault: Callable[[], Any] | None) -> list[dict]:
        tag = f"{kind}-{self._turn_no}"
        texts = self._text()
        turn_ids = {s: f"{tag}-{i}" for i, s in enumerate(self.sessions)}
        for listener in self.listeners:
            listener.record(turn_ids[listener.session_id])
        first_sent = asyncio.Event()
        speakers = [asyncio.create_task(self._speak(s, turn_ids[s], texts, first_sent)) for s in self.sessions]
        fault_task = None
        if fault is not None or kind in self.baselines:
            # a faultless round marks the same moment: the time from it to the next new audio
            # without a fault is the baseline the recovery is read against
            async def mark() -> None:
                self.baselines[kind].append(now_us())

            fault_task = asyncio.create_task(self._fault_mid_turn(kind, turn_ids, first_sent, fault or mark))
        await asyncio.gather(*speakers)
        ends = [asyncio.create_task(listener.turns[turn_ids[listener.session_id]].ended.wait())
                for listener in self.listeners]
        _, pending = await asyncio.wait(ends, timeout=self.plan.turn_timeout_s)
        for task in pending:
            task.cancel()
        if fault_task is not None:
            await fault_task
        scored = []
        for listener in self.listeners:
            rec = listener.turns[turn_ids[listener.session_id]]
            row = score_turn(rec.frames, len(texts)) | {"expected": len(texts), "ended": rec.ended.is_set(),
                                                        "restarted": rec.restarted}
            scored.append(row)
        return scored

    async def _fault_mid_turn(self, kind: str, turn_ids: dict[str, str], first_sent: asyncio.Event,
                              fault: Callable[[], Any]) -> None:
        """Inject the fault in the middle of the round's turns. The gate and the brokers: once the
        agent has sent its first sentence (the rest of the text, the requests and all the audio
        still to come); the worker and the edge: once a listener heard the round's first audio
        (the worker is then synthesizing, the edge forwarding)."""
        def heard() -> bool:
            return any(listener.turns[turn_ids[listener.session_id]].frames for listener in self.listeners)

        await asyncio.wait_for(first_sent.wait(), self.plan.turn_timeout_s)
        if kind in ("worker", "edge"):
            deadline = time.monotonic() + self.plan.turn_timeout_s
            while not heard() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
        await fault()

    # --- the faults ---------------------------------------------------------------------------------
    def _fault(self, kind: str) -> Callable[[], Any]:
        async def kill_restart_stage() -> None:
            stage = self.stages[kind]
            self.faults[kind].append(now_us())
            # the edge stays down until audio was published while no edge ran (what a new edge must not lose)
            await stage.restart(while_down=(lambda: self._audio_published(10.0)) if kind == "edge" else None)

        async def kill_broker(node_id: int) -> None:
            self.faults[kind].append(now_us())
            await asyncio.to_thread(self.cluster.kill, node_id)
            await asyncio.sleep(BROKER_DOWN_S)
            await asyncio.to_thread(self.cluster.restart, node_id, 180.0)

        async def broker_leader() -> None:
            await kill_broker(await asyncio.to_thread(self.leader_of_sessions))

        async def broker_single() -> None:
            await kill_broker(1)

        return {"broker_leader": broker_leader, "broker_single": broker_single}.get(kind, kill_restart_stage)

    async def _audio_published(self, timeout_s: float) -> bool:
        """Wait until a record is published on the audio topic from now on (or `timeout_s`)."""
        from aiokafka import TopicPartition

        from voicebus.bus import make_consumer

        s = self.settings
        consumer = make_consumer(s, group_id=None)
        await consumer.start()
        try:
            tps = [TopicPartition(s.audio_topic, p) for p in range(s.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if any((await consumer.getmany(timeout_ms=100)).values()):
                    return True
            return False
        finally:
            await consumer.stop()

    def leader_of_sessions(self) -> int:
        """The node that leads most of the sessions' partitions (text, synthesis, audio, control)."""
        from aiokafka.partitioner import DefaultPartitioner

        from voicebus.topics import session_key, text_topic

        s = self.settings
        metadata = self.cluster.metadata()
        count: dict[int, int] = {}
        parts = list(range(s.partitions))
        for session in self.sessions:
            p = DefaultPartitioner()(session_key(session), parts, parts)
            for topic in (text_topic(s, "chaos"), s.synthesis_topic, s.audio_topic, s.control_topic):
                leader = metadata.leader_of(topic, p)
                count[leader] = count.get(leader, 0) + 1
        return max(count, key=count.get)

    async def _settle(self, kind: str) -> None:
        """Before the next fault: the cluster whole and in sync again."""
        if kind.startswith("broker"):
            await asyncio.to_thread(self.cluster.wait_in_sync, 180.0)

    def _recovery_stages(self, moments: list[int]) -> list[dict[str, float]]:
        """Per fault: the stage stamps of the first sentence published after it (`recovery_stages`)."""
        out = []
        for t_us in moments:
            hits = [h for h in (listener.first_new_sentence_after(t_us) for listener in self.listeners) if h]
            if hits:
                received_us, timeline = min(hits, key=lambda h: h[0])
                out.append(recovery_stages(t_us, timeline, received_us))
        return out

    def _next_audio_ms(self, moments: list[int]) -> list[float]:
        """Per moment: ms until the first new audio any listener received after it."""
        out = []
        for t_us in moments:
            hits = [t for t in (listener.first_new_audio_after(t_us) for listener in self.listeners) if t]
            if hits:
                out.append((min(hits) - t_us) / 1000)
        return out

    async def run_kind(self, kind: str) -> dict[str, Any]:
        self.faults[kind], self.scored[kind], self.baselines[kind] = [], [], []
        restarts_before = {n: st.starts for n, st in self.stages.items()}
        started = time.monotonic()
        for round_no in range(self.plan.turns):
            faulty = self.plan.faulty(round_no)
            rows = await self._round(kind, self._fault(kind) if faulty else None)
            self.scored[kind] += rows
            bad = [r for r in rows if r["lost"] or r["heard_twice"] or r["out_of_order"] or not r["ended"]]
            self.log(f"{kind}: turn {round_no + 1}/{self.plan.turns}{' (fault)' if faulty else ''}: "
                     f"{sum(r['expected'] for r in rows)} sentences, {sum(r['lost'] for r in rows)} lost, "
                     f"{sum(r['heard_twice'] for r in rows)} twice, {len(bad)} turn(s) not clean")
            if faulty:
                await self._settle(kind)
        recoveries, baseline = self._next_audio_ms(self.faults[kind]), self._next_audio_ms(self.baselines[kind])
        rows = self.scored[kind]
        self.details[kind] = {
            "faults": len(self.faults[kind]), "recovery_samples_ms": [round(r, 1) for r in recoveries],
            # where the recovery went: each stage of the first sentence published after a fault
            "recovery_stages_ms": summarise_stages(self._recovery_stages(self.faults[kind])),
            "no_fault_next_audio_ms": {"p50": _percentile(baseline, 50), "p95": _percentile(baseline, 95),
                                       "n": len(baseline)},
            "restarted_sentences": sum(r["restarted"] for r in rows), "unended_turns": sum(not r["ended"] for r in rows),
            "unexpected_sentences": sum(r["unexpected"] for r in rows), "sessions": self.plan.sessions,
            "stage_restarts": {n: st.starts - restarts_before[n] for n, st in self.stages.items()},
            "wall_s": round(time.monotonic() - started, 1),
        }
        return summarise_kind(rows, recoveries)


def cluster_kinds(brokers: int, kinds: tuple[str, ...], largest: int) -> tuple[str, ...]:
    """The kinds that run on a cluster of `brokers` nodes: its broker kind, and the process kinds
    on the largest cluster of the run."""
    mine = ("broker_leader",) if brokers >= 2 else ("broker_single",)
    return tuple(k for k in kinds if k in mine or (k in PROCESS_KINDS and brokers == largest))


def chaos_settings(settings: Settings, bootstrap: str, tag: str) -> Settings:
    from voicebus.ops.daemon import free_port

    return settings.replace(
        bootstrap=bootstrap, partitions=3, edge_port=free_port(), edge_resume_lookback_s=30.0,
        worker_session_timeout_ms=6000,
        text_topic_prefix=f"chaos-{tag}.text.", control_topic=f"chaos-{tag}.control",
        synthesis_topic=f"chaos-{tag}.synthesis", audio_topic=f"chaos-{tag}.audio",
        playback_topic=f"chaos-{tag}.playback", heard_topic=f"chaos-{tag}.heard",
        deadletter_topic=f"chaos-{tag}.deadletter", agents_topic=f"chaos-{tag}.agents",
        gate_app_id=f"chaos-{tag}-gate", gate_changelog_topic=f"chaos-{tag}-gate-gate_sessions-changelog",
    )


async def run_on_cluster(settings: Settings, cluster: Any, plan: ChaosPlan,
                         log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Run `plan.kinds` (those that fit this cluster) on `cluster`: (faults, details) by kind."""
    tag = uuid.uuid4().hex[:6]
    s = chaos_settings(settings, cluster.bootstrap, tag)
    faults, details = {}, {}
    async with ChaosRun(s, cluster, plan, log) as run:
        for kind in plan.kinds:
            log(f"fault kind {kind} on {len(cluster.nodes)} broker(s)")
            faults[kind] = await run.run_kind(kind)
            details[kind] = run.details[kind]
        details["agent_errors"] = run.agent_errors
    return faults, details


def owned_cluster(settings: Settings, brokers: int):
    """A `brokers`-node cluster of this run on free loopback ports, 3 partitions by default,
    stopped and removed on exit (`voicebus.ops.cluster.ephemeral_cluster`)."""
    from voicebus.ops.cluster import ephemeral_cluster

    return ephemeral_cluster(settings, brokers, partitions=3, prefix="chaos")


# --- CLI --------------------------------------------------------------------------------------------


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("chaos", help="SIGKILL brokers, gate, worker and edge mid-turn: lost / heard twice")
    p.add_argument("--brokers", default="1,3",
                   help="cluster sizes (default 1,3): 3 runs broker_leader (and the gate, worker and edge kinds "
                        "on the largest size), 1 runs broker_single")
    p.add_argument("--sessions", type=int, default=None, help="sessions speaking at once (default 3; quick 2)")
    p.add_argument("--turns", type=int, default=None, help="turns per fault kind (default 20; quick 3)")
    p.add_argument("--every", type=int, default=None, help="a fault every N turns (default 4; quick: one fault)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds (default all: {','.join(KINDS)})")
    p.add_argument("--quick", action="store_true", help="each fault kind once over a few turns (minutes)")
    p.add_argument("--real", action="store_true", help="Kokoro-82M instead of the tiny random-weight model")
    add_json_argument(p)
    add_stage_log_level(p)
    p.set_defaults(func=run_chaos)


def plan_from_args(args: argparse.Namespace) -> ChaosPlan:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"voicebus bench chaos: unknown fault kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
    turns = args.turns or (3 if args.quick else 20)
    return ChaosPlan(kinds=kinds, turns=turns, sessions=args.sessions or (2 if args.quick else 3),
                     every=args.every or (turns if args.quick else 4), tiny=not args.real,
                     log_level=getattr(args, "log_level", None))


def run_chaos(args: argparse.Namespace, settings: Settings) -> int:
    from voicebus.logs import configure_logging

    if refuse_bootstrap(args, "chaos", "it kills brokers, so it starts clusters of its own"):
        return 2
    configure_logging(getattr(args, "log_level", None))
    plan = plan_from_args(args)
    sizes = sorted({int(b) for b in str(args.brokers).split(",")})
    results = asyncio.run(_bench(settings, plan, sizes))
    print(markdown_table(results))
    write_json(args.json, results, indent=1)
    return 0 if all(f["lost"] == f["heard_twice"] == f["out_of_order"] == 0 for f in results["faults"].values()) else 1


async def _bench(settings: Settings, plan: ChaosPlan, sizes: list[int]) -> dict:
    started = time.monotonic()
    faults: dict[str, dict] = {}
    details: dict[str, Any] = {}

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f} s] {line}", file=sys.stderr, flush=True)

    for brokers in sizes:
        kinds = cluster_kinds(brokers, plan.kinds, max(sizes))
        if not kinds:
            continue
        log(f"starting a cluster of {brokers} broker(s) for {', '.join(kinds)}")
        with owned_cluster(settings, brokers) as cluster:
            got, more = await run_on_cluster(settings, cluster, ChaosPlan(**{**plan.__dict__, "kinds": kinds}), log)
        faults |= got
        details[f"{brokers}_brokers"] = more
    meta = {"turns_per_kind": plan.turns, "sessions": plan.sessions, "fault_every_turns": plan.every,
            "sentences_per_turn": plan.sentences, "token_ms": plan.token_ms, "brokers": sizes,
            "engine": "tiny random weights" if plan.tiny else "Kokoro-82M", "wall_s": round(time.monotonic() - started, 1),
            "load_average": list(os.getloadavg()), "cpus": os.cpu_count()}
    return {"meta": meta, "faults": {k: faults[k] for k in KINDS if k in faults}, "details": details}


def markdown_table(results: dict) -> str:
    lines = ["| fault | turns | sentences | lost | heard twice | out of order | max gap (ms) | recovery p50 / p95 (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, f in results["faults"].items():
        r = f["recovery_ms"]
        rec = "-" if r["p50"] is None else f"{r['p50']:.0f} / {r['p95']:.0f}"
        lines.append(f"| {kind} | {f['turns']} | {f['sentences']} | {f['lost']} | {f['heard_twice']} | "
                     f"{f['out_of_order']} | {f['max_gap_ms']:.0f} | {rec} |")
    return "\n".join(lines)
