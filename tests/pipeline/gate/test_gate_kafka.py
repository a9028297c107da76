"""The gate worker (aiokafka shell) through the real broker: agents' token events in, synthesis
requests out, in order per session; evidence, hold timeout, cancel, dead letters; a worker SIGKILLed
mid-turn and two restarted workers sharing the partitions leave no gap and no repeat."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time

import pytest

from voicebus.bus import end_offsets, ensure_topics, make_consumer, make_producer, publish, read_to_end
from voicebus.codecs import Codec
from voicebus.gate.app import POSITIONS_KEY, READY_LINE, stored_positions
from voicebus.gate.cli import start_gate_subprocess
from voicebus.gate.core import FAILURE_NOTICES, GateConfig, gate_sentences
from voicebus.topics import text_topic
from tests.foreign import foreign_encode
from tests.pipeline.gate.test_core import Turn, cancel
from tests.waiting import eventually


def session_of(event) -> str:
    return event.session_id


pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

PARTITIONS = 3


class GateProcess:
    """A gate worker subprocess the test owns; its stdout lines are read by a thread."""

    def __init__(self, settings, tmp_path, name, **options):
        self.stderr = open(tmp_path / f"{name}.stderr", "w")
        self.proc = start_gate_subprocess(settings, stderr=self.stderr, log_level="INFO", **options)
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.assigned: list[str] | None = None

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_assigned(self, timeout=90.0, want=lambda a: bool(a)):
        """Wait for an announced assignment that satisfies `want`; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if self._note_assignment(line) and want(self.assigned):
                return self.assigned
        raise AssertionError(f"gate worker announced no wanted assignment (last {self.assigned}); "
                             f"stderr: {open(self.stderr.name).read()[-3000:]}")

    def latest_assignment(self) -> list[str] | None:
        """The last assignment announced so far, without waiting."""
        while True:
            try:
                self._note_assignment(self.lines.get_nowait())
            except queue.Empty:
                return self.assigned

    def _note_assignment(self, line: str) -> bool:
        """Keep the assignment a READY line announces; False for any other line."""
        if not line.startswith(READY_LINE):
            return False
        self.assigned = json.loads(line[len(READY_LINE):])
        return True

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


@pytest.fixture
def gate_processes(tmp_path):
    started: list[GateProcess] = []

    def start(settings, name, **options):
        process = GateProcess(settings, tmp_path, name, **options)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


async def send_all(settings, events_by_agent):
    codec = Codec()
    producer = make_producer(settings)
    await producer.start()
    try:
        for agent, event in events_by_agent:
            if agent == "control":
                await publish(producer, codec, settings.control_topic, "ControlEvent", event)
            elif agent == "raw":
                await producer.send_and_wait(event[0], event[1], key=event[2] if len(event) > 2 else b"bad")
            else:
                await publish(producer, codec, text_topic(settings, agent), "TextEvent", event)
    finally:
        await producer.stop()


async def collect(settings, done, timeout=60.0, topic=None):
    """Synthesis requests (decoded) until `done(requests)` or `timeout`."""
    codec = Codec()
    consumer = make_consumer(settings, topic or settings.synthesis_topic, auto_offset_reset="earliest")
    await consumer.start()
    got: list = []
    try:
        deadline = time.monotonic() + timeout
        while not done(got) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for r in records:
                    got.append(r if topic else codec.decode(r.value, expect="SynthesisRequest").value)
    finally:
        await consumer.stop()
    return got


async def gate_caught_up(settings, agents, timeout_s: float = 90.0) -> list:
    """Wait until the gate's stored text positions cover every record now on the agents' text
    topics; then every synthesis request. The gate writes positions only after the broker
    acknowledged all the requests their records made, so from then on the synthesis topic holds
    everything the gate will make of that input, late repeats included: nothing is left to a
    quiet interval's guess."""
    ends = await end_offsets(settings, [text_topic(settings, a) for a in agents])
    behind: dict = {}

    async def covered() -> bool:
        stored = await stored_positions(settings)
        behind.clear()
        behind.update({tp: (stored.get((tp.topic, tp.partition), 0), end) for tp, end in ends.items()
                       if stored.get((tp.topic, tp.partition), 0) < end})
        return not behind
    await eventually(covered, timeout_s=timeout_s, interval_s=0.2, what="the gate's stored positions at the text topics' ends",
                     detail=lambda: f"behind (stored, end): {behind}")
    codec = Codec()
    return [codec.decode(r.value, expect="SynthesisRequest").value for r in await read_to_end(settings, [settings.synthesis_topic])]


def by_session(requests):
    out: dict[str, list] = {}
    for r in requests:
        out.setdefault(r["session_id"], []).append((r["turn_id"], r["sentence_seq"], r["text"], r["is_last_in_turn"]))
    return out


def changelog_holds_a_release(sessions):
    """A `collect` condition on the gate's changelog: each session's latest state has released a
    sentence, and its partition's text positions were written after it (what a restart reads)."""
    def done(records) -> bool:
        state_at: dict[str, tuple[int, int]] = {}
        positions_at: dict[int, int] = {}
        for r in records:
            if r.key == POSITIONS_KEY:
                positions_at[r.partition] = r.offset
            elif r.value is not None and any(t.get("next_seq", 0) >= 1
                                             for t in json.loads(r.value).get("turns", {}).values()):
                state_at[r.key.decode()] = (r.partition, r.offset)
        return all(s in state_at and positions_at.get(state_at[s][0], -1) > state_at[s][1] for s in sessions)
    return done


def ended_sessions(n):
    return lambda got: sum(r["is_last_in_turn"] for r in got) >= n


async def test_sessions_from_two_agents_evidence_timeout_cancel_and_dead_letters(make_settings, gate_processes):
    settings = make_settings(partitions=PARTITIONS, hold_timeout_s=6.0, hold_timeout_policy="release")
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm"), text_topic(settings, "retriever")])
    gate = gate_processes(settings, "gate")
    gate.wait_assigned()
    # A new agent's topic appears only now: the gate must pick it up without a restart.
    await ensure_topics(settings, [text_topic(settings, "newcomer")])
    f = Turn(session="sf", agent="newcomer")

    a, b, c = Turn(session="sa"), Turn(session="sb"), Turn(session="sc")
    rb, rc = Turn(session="sb", agent="retriever"), Turn(session="sc", agent="retriever")
    d, e = Turn(session="sd"), Turn(session="se")
    a_ev = a.tokens("Good morning. The weather is fine today. ") + [a.end()]
    b_ev = b.tokens("Let me look. ") + [b.pending("order")] + b.tokens("Your order shipped Monday. ") + [b.end()]
    c_ev = c.tokens("Checking now. ") + [c.pending("price")] + c.tokens("It costs 12.50 euros. ") + [c.end()]
    d_ev = d.tokens("Hold on. ") + [d.pending("lost")] + d.tokens("This waits for a lost marker. ") + [d.end()]
    e_ev = e.tokens("This is spoken. ") + [e.pending("x")] + e.tokens("This is held") + []
    interleaved = []
    for i in range(max(map(len, (a_ev, b_ev, c_ev)))):
        for ev in (a_ev, b_ev, c_ev):
            if i < len(ev):
                interleaved.append(("llm", ev[i]))
    phase1 = (
        [("retriever", rc.failed("price"))]  # before its mark: must not be lost
        + interleaved + [("llm", x) for x in d_ev + e_ev]
        + [("retriever", rb.ready("order"))]
        + [("raw", (text_topic(settings, "llm"), b"not avro at all"))]
        + [("raw", (text_topic(settings, "llm"),
                    foreign_encode("TextEvent", Turn(session="sx", language="klingon").tokens("Qapla'.")[0].to_record()),
                    b"sx"))]
        + [("llm", Turn(session="sy", turn="t9").pending(None))]  # a mark without a claim id
        + [("newcomer", x) for x in f.tokens("A new agent speaks. ") + [f.end()]]
    )
    await send_all(settings, phase1)
    await collect(settings, lambda got: any(r["session_id"] == "se" for r in got), timeout=90)
    # se's first sentence is out, its second is held behind "x": now the barge-in.
    phase2 = (
        [("control", cancel(session="se", turn="t1"))]
        + [("llm", x) for x in e.tokens(" and never said. ") + [e.end()]]
        + [("retriever", Turn(session="se", agent="retriever").ready("x"))]
    )
    await send_all(settings, phase2)
    await collect(settings, ended_sessions(5), timeout=90)
    got = await gate_caught_up(settings, ["llm", "retriever", "newcomer"])  # all of it, late extras included
    sessions = by_session(got)

    assert [x[2] for x in sessions["sa"]] == ["Good morning.", "The weather is fine today."]
    assert [x[2] for x in sessions["sb"]] == ["Let me look.", "Your order shipped Monday."]
    assert [x[2] for x in sessions["sc"]] == ["Checking now.", FAILURE_NOTICES["en"]]
    assert [x[2] for x in sessions["sd"]] == ["Hold on.", "This waits for a lost marker."]  # released on timeout
    held = [r for r in got if r["session_id"] == "sd"][1]
    assert held["released_at_us"] - held["text_complete_at_us"] >= 5_000_000  # ~hold_timeout_s behind
    assert [x[2] for x in sessions["sf"]] == ["A new agent speaks."]
    assert [x[2] for x in sessions["se"]] == ["This is spoken."]  # the cancel purged the held text
    for s in ("sa", "sb", "sc", "sd"):
        assert [x[1] for x in sessions[s]] == list(range(len(sessions[s]))), s
        assert [x[3] for x in sessions[s]] == [False] * (len(sessions[s]) - 1) + [True], s
    # The pure core gives the same for the sessions whose outcome does not depend on timing.
    released = gate_sentences([ev for agent, ev in phase1 + phase2
                               if agent != "raw" and session_of(ev) not in ("sx", "sy")],
                              GateConfig.from_settings(settings.replace(hold_timeout_s=3600)))
    core = by_session(r.to_record() for r in released)
    for s in ("sa", "sb", "sc"):
        assert sessions[s] == core[s], s

    dead = await collect(settings, lambda got: len(got) >= 3, timeout=10, topic=settings.deadletter_topic)
    reasons = {dict(r.headers)["voicebus.error.reason"]: r.value for r in dead}
    assert set(reasons) == {b"malformed", b"contract-violation", b"gate-rejected"}
    assert all(dict(r.headers)["voicebus.error.stage"] == b"gate" for r in dead)
    assert reasons[b"malformed"] == b"not avro at all"
    assert "sx" not in sessions


async def test_worker_killed_mid_turn_restarts_without_gap_or_repeat(make_settings, gate_processes):
    settings = make_settings(partitions=PARTITIONS)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    turns = {s: Turn(session=s) for s in ("k1", "k2", "k3", "k4")}
    text = "First sentence is here. Second one follows now. Third is the last one. "
    cut = text.index("Second one") + 6  # the kill comes inside the second sentence
    first_half = {s: t.tokens(text[:cut], size=4) for s, t in turns.items()}
    second_half = {s: t.tokens(text[cut:], size=4) + [t.end()] for s, t in turns.items()}

    # A long commit interval: the killed worker never commits control offsets; its text
    # positions and states are in the changelog, written after the acks of what they produced,
    # so the new workers go on exactly where the killed one's last write says.
    first = gate_processes(settings, "first", commit_interval_s=300, session_timeout_s=6)
    first.wait_assigned()
    await send_all(settings, [("llm", ev) for s in turns for ev in first_half[s]])
    got = await collect(settings, lambda got: len(got) >= len(turns), timeout=60)
    assert sorted(r["text"] for r in got) == ["First sentence is here."] * len(turns)
    # The requests are acked before the state that released them is written: kill only once that
    # write is in the changelog, or the restart would (rightly) release sentence 0 again.
    written = changelog_holds_a_release(turns)
    assert written(await collect(settings, written, timeout=30, topic=settings.gate_changelog_topic))
    first.proc.kill()
    first.proc.wait(10)

    # Two workers in one group share the partitions after the restart.
    second = gate_processes(settings, "second", session_timeout_s=6)
    third = gate_processes(settings, "third", session_timeout_s=6)
    text_prefix = settings.text_topic_prefix

    text_parts = lambda a: {p for p in a or () if p.startswith(text_prefix)}
    # The group rebalances more than once here (the killed worker stays a member until its
    # session times out), so compare the two workers' *latest* assignments, not one of each
    # from different generations: a split means both hold text partitions and none twice.
    def split():
        a2, a3 = text_parts(second.latest_assignment()), text_parts(third.latest_assignment())
        return a2 and a3 and not a2 & a3 and len(a2 | a3) == PARTITIONS
    await eventually(split, timeout_s=90, interval_s=0.2, what="the text partitions split between two workers",
                     detail=lambda: f"second {second.assigned}, third {third.assigned}; stderr of the second: "
                                    f"{open(second.stderr.name).read()[-2000:]}")

    await send_all(settings, [("llm", ev) for s in turns for ev in second_half[s]])
    await collect(settings, ended_sessions(len(turns)), timeout=90)
    got = await gate_caught_up(settings, ["llm"])  # everything, including late repeats
    for s in turns:
        mine = [(r["sentence_seq"], r["text"], r["is_last_in_turn"]) for r in got if r["session_id"] == s]
        assert mine == [(0, "First sentence is here.", False), (1, "Second one follows now.", False),
                        (2, "Third is the last one.", True)], s


async def test_cancel_overtakes_a_backlog_of_text(make_settings, gate_processes):
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    gate = gate_processes(settings, "backlog")
    gate.wait_assigned()
    t = Turn(session="bl")
    sentences = 1500
    events = t.tokens("Here is one more sentence. " * sentences, size=6) + [t.end()]
    codec = Codec()
    producer = make_producer(settings)
    await producer.start()
    try:
        topic = text_topic(settings, "llm")
        for ev in events:  # queued, not awaited one by one: the gate gets a backlog at once
            await producer.send(topic, codec.encode("TextEvent", ev), key=b"bl")
        await producer.flush()
        await publish(producer, codec, settings.control_topic, "ControlEvent", cancel(session="bl", turn="t1"))
    finally:
        await producer.stop()

    got = await gate_caught_up(settings, ["llm"])  # the whole backlog read, its requests all out
    seqs = [r["sentence_seq"] for r in got]
    assert seqs == list(range(len(got)))  # in order, no gap, no repeat
    assert len(got) < sentences, "the cancel waited for the whole backlog"
    assert not any(r["is_last_in_turn"] for r in got)


async def test_a_worker_started_before_any_agent_topic_picks_up_the_first(make_settings, gate_processes):
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    gate = gate_processes(settings, "empty")
    gate.wait_assigned()
    t = Turn(session="first", agent="pioneer")
    await ensure_topics(settings, [text_topic(settings, "pioneer")])
    await send_all(settings, [("pioneer", ev) for ev in t.tokens("The first agent arrives. ") + [t.end()]])
    got = await collect(settings, ended_sessions(1), timeout=60)
    assert [(r["text"], r["is_last_in_turn"]) for r in got] == [("The first agent arrives.", True)]
