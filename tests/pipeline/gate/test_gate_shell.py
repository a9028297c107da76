"""The gate's aiokafka shell through the real broker, workers run in this process:

- a rebalance in the middle of turns with held evidence: two workers, every sentence
  released exactly once, nothing sent by the old owner for a partition after its revoke, the
  changelog holds the new owner's state;
- a restart with a backlog: events sent before the restarted worker is ready are
  processed (50 runs: ``pytest -m soak -k restarted``; the default run takes 3);
- new agents at no cost: a registered topic is read without a rebalance, an
  unregistered one is found by the listing, a topic that cannot be co-partitioned is refused;
- start in any order (16.3): a worker on a bare broker creates what it uses, no error loop;
- a record on the wrong partition for its session is dead-lettered;
- a backlog of two agents' turns read in one fetch: the floor goes in the order they opened.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from voicebus.agents.sdk import Publisher
from voicebus.bus import committed_offsets, ensure_topics, make_consumer, make_producer, publish, read_to_end
from voicebus.codecs import Codec
from voicebus.gate.app import POSITIONS_KEY, GateStartError, GateWorker
from voicebus.schemas.messages import ControlEvent
from voicebus.topics import session_key, text_topic
from tests.foreign import foreign_encode
from tests.pipeline.gate.test_core import Turn, cancel
from tests.waiting import eventually

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


@pytest.fixture
async def workers():
    """Start gate workers in this process; every one still running is stopped at the end."""
    started: list[GateWorker] = []

    async def start(settings, *, wait=True, **options) -> GateWorker:
        """A started worker; with ``wait=False`` one whose start runs as ``worker.starting``."""
        worker = GateWorker(settings, **options)
        started.append(worker)
        if wait:
            await worker.start()
        else:
            worker.starting = asyncio.create_task(worker.start())
        return worker

    yield start
    for worker in started:
        starting = getattr(worker, "starting", None)
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        await worker.stop()


class Requests:
    """Every synthesis request on the topic, read from the beginning by a consumer of its own."""

    def __init__(self, settings):
        self.settings = settings
        self.codec = Codec()
        self.got: list[dict] = []
        self.consumer = make_consumer(settings, settings.synthesis_topic, auto_offset_reset="earliest")

    async def __aenter__(self):
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc):
        await self.consumer.stop()

    async def poll(self) -> list[dict]:
        for records in (await self.consumer.getmany(timeout_ms=100)).values():
            self.got.extend(self.codec.decode(r.value, expect="SynthesisRequest").value for r in records)
        return self.got

    async def to_end(self) -> list[dict]:
        """Every request on the topic up to its end offsets as of now."""
        tps = list(self.consumer.assignment())
        ends = await self.consumer.end_offsets(tps)

        async def caught_up():
            await self.poll()
            return all([await self.consumer.position(tp) >= ends[tp] for tp in tps])
        await eventually(caught_up, what="the synthesis topic read to its end")
        return self.got

    async def until(self, done, what, timeout_s=60.0) -> list[dict]:
        async def probe():
            return done(await self.poll())
        await eventually(probe, timeout_s=timeout_s, what=what)
        return self.got

    def of(self, session):
        return [(r["turn_id"], r["sentence_seq"], r["text"], r["is_last_in_turn"]) for r in self.got
                if r["session_id"] == session]


async def send(settings, agent, events):
    codec = Codec()
    async with make_producer(settings) as producer:
        for event in events:
            if isinstance(event, ControlEvent):
                await publish(producer, codec, settings.control_topic, "ControlEvent", event)
            else:
                await publish(producer, codec, text_topic(settings, agent), "TextEvent", event)


def ended(n):
    return lambda got: sum(r["is_last_in_turn"] for r in got) >= n


def partition_of(settings, session):
    from aiokafka.partitioner import DefaultPartitioner

    n = settings.partitions
    return DefaultPartitioner()(session_key(session), list(range(n)), list(range(n)))


class OutputLog:
    """Spy on one worker: its sends, revocations and assignments, in order."""

    def __init__(self, worker: GateWorker):
        self.events: list[tuple[str, object]] = []
        send_retrying, revoke, assign = worker._send_retrying, worker._revoke, worker._assign

        async def logged_send(partition, records):
            self.events.append(("send", partition))
            return await send_retrying(partition, records)

        async def logged_revoke(partitions):
            await revoke(partitions)
            self.events.append(("revoked", set(partitions)))

        async def logged_assign(partitions):
            self.events.append(("assigning", set(partitions)))  # owned again from here on
            await assign(partitions)

        worker._send_retrying = logged_send
        worker._revoke = logged_revoke
        worker._assign = logged_assign

    def sends_after_revoke(self) -> list[int]:
        revoked: set[int] = set()
        bad = []
        for kind, what in self.events:
            if kind == "revoked":
                revoked |= what
            elif kind == "assigning":
                revoked -= what
            elif what in revoked:
                bad.append(what)
        return bad


async def changelog_states(settings) -> dict[str, dict | None]:
    """The last changelog record of every session key (None: a tombstone)."""
    consumer = make_consumer(settings, settings.gate_changelog_topic, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(settings.gate_changelog_topic, p) for p in range(settings.partitions)]
        ends = await consumer.end_offsets(tps)
        states: dict[str, dict | None] = {}

        async def read_all():
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    if r.key != POSITIONS_KEY:
                        states[r.key.decode()] = json.loads(r.value) if r.value else None
            return all([await consumer.position(tp) >= ends[tp] for tp in tps])

        await eventually(read_all, timeout_s=30, what="changelog read to its end")
        return states
    finally:
        await consumer.stop()


async def test_a_rebalance_mid_turn_releases_every_sentence_exactly_once(make_settings, workers):
    settings = make_settings(partitions=4, hold_timeout_s=5.0, hold_timeout_policy="release")
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm"), text_topic(settings, "retriever")])
    first = await workers(settings, session_timeout_s=6)
    log_first = OutputLog(first)
    await eventually(lambda: first._owned == {0, 1, 2, 3}, what="the first worker owns every partition")

    sessions = [f"rb{i}" for i in range(8)]
    assert len({partition_of(settings, s) for s in sessions}) >= 3
    turns = {s: Turn(session=s) for s in sessions}
    async with Requests(settings) as requests:
        await send(settings, "llm", [e for s in sessions for e in
                                     turns[s].tokens("Before the claim. ") + [turns[s].pending("c")]
                                     + turns[s].tokens("Held one. Held two. ")])
        await requests.until(lambda got: len(got) >= len(sessions), "every first sentence")

        # A second worker joins while every turn holds two sentences behind its pending claim.
        second = await workers(settings, session_timeout_s=6)
        await eventually(lambda: first._owned and second._owned and len(first._owned | second._owned) == 4
                         and not first._owned & second._owned, timeout_s=60, what="the partitions split")
        moved = {0, 1, 2, 3} - first._owned
        assert moved, "no partition moved to the second worker"
        assert all(s not in first._sessions for s in sessions if partition_of(settings, s) in moved)

        # Half the claims resolve; the other half time out (the new owner's timer releases them).
        ready = sessions[::2]
        await send(settings, "retriever", [Turn(session=s, agent="retriever").ready("c") for s in ready])
        await send(settings, "llm", [e for s in sessions for e in turns[s].tokens("After it. ") + [turns[s].end()]])
        await requests.until(ended(len(sessions)), "every turn ended", timeout_s=60)
        # Late duplicates would come from a timer tick of the old owner: two more of them done
        # (their sends acknowledged), then everything on the topic.
        ticked = first.ticks_done
        await eventually(lambda: first.ticks_done >= ticked + 2, what="two more ticks of the old owner")
        await requests.to_end()

    for s in sessions:
        assert requests.of(s) == [("t1", 0, "Before the claim.", False), ("t1", 1, "Held one.", False),
                                  ("t1", 2, "Held two.", False), ("t1", 3, "After it.", True)], s
    assert log_first.sends_after_revoke() == []
    stored = await changelog_states(settings)
    for s in sessions:
        owner = first if partition_of(settings, s) in first._owned else second
        assert stored[s] == json.loads(owner._sessions[s].state), s


@pytest.mark.parametrize("run", [pytest.param(i, marks=[pytest.mark.soak] if i >= 1 else [])
                                 for i in range(50)])
async def test_a_restarted_worker_processes_what_was_sent_before_it_was_ready(run, make_settings, workers):
    settings = make_settings(partitions=2)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    t = Turn(session=f"restart{run}")
    async with Requests(settings) as requests:
        first = await workers(settings)
        await send(settings, "llm", t.tokens("First sentence is here. Sec"))
        await requests.until(lambda got: len(got) >= 1, "the first sentence")
        await first.stop()

        # A backlog while no worker runs, then the probe while the new worker is starting.
        await send(settings, "llm", t.tokens("ond one follows. Third"))
        second = await workers(settings, wait=False)
        await send(settings, "llm", t.tokens(" is the last one.") + [t.end()])
        probe_sent_before_ready = not second.ready.is_set()
        await second.starting
        await requests.until(ended(1), "the turn's end after the restart", timeout_s=60)
    assert probe_sent_before_ready
    assert requests.of(t.session) == [("t1", 0, "First sentence is here.", False),
                                      ("t1", 1, "Second one follows.", False),
                                      ("t1", 2, "Third is the last one.", True)]


async def test_a_registered_agent_is_read_without_a_rebalance(make_settings, workers):
    settings = make_settings(partitions=2, topic_discovery_interval_s=3600.0)  # registry only
    gate = await workers(settings)
    await eventually(lambda: gate._owned == {0, 1}, what="the worker owns both partitions")
    revoked_before = gate.revoked_partitions
    async with Requests(settings) as requests:
        async with Publisher(settings, agent_id="newcomer") as agent:
            async with agent.turn("joiner") as turn:
                await turn.token("Hello from a new agent. ")
                await turn.token("Second sentence.")
        got = await requests.until(ended(1), "the new agent's turn")
    assert [r["text"] for r in got] == ["Hello from a new agent.", "Second sentence."]
    assert text_topic(settings, "newcomer") in gate._text_topics
    assert gate.revoked_partitions == revoked_before  # nobody waited on a rebalance


async def test_unregistered_topics_are_found_by_listing_and_a_wrong_partition_count_is_refused(
        make_settings, workers):
    settings = make_settings(partitions=2, topic_discovery_interval_s=0.3)
    gate = await workers(settings)
    await eventually(lambda: gate._owned == {0, 1}, what="the worker owns both partitions")
    odd = text_topic(settings, "odd")
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(odd, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()
    await ensure_topics(settings, [text_topic(settings, "plain")])  # no registry record
    t = Turn(session="lister", agent="plain")
    async with Requests(settings) as requests:
        await send(settings, "plain", t.tokens("Found by listing. ") + [t.end()])
        got = await requests.until(ended(1), "the unregistered agent's turn")
    assert [r["text"] for r in got] == ["Found by listing."]
    await eventually(lambda: odd in gate.refused_topics, what="the 3-partition topic refused")
    assert odd not in gate._text_topics
    assert gate.registry.get_sample_value("voicebus_gate_topics_refused_total", {"reason": "partition-count"}) == 1


async def test_a_worker_on_a_bare_broker_creates_its_topics_and_logs_no_error_loop(make_settings, workers, caplog):
    settings = make_settings(partitions=2)
    caplog.set_level(logging.WARNING)
    gate = await workers(settings)  # nothing exists yet: no control, synthesis, changelog topic
    await eventually(lambda: gate._owned == {0, 1}, what="the worker owns both partitions")
    async with Publisher(settings, agent_id="early") as agent:
        async with agent.turn("first-session") as turn:
            await turn.token("The first words. ")
    async with Requests(settings) as requests:
        await requests.until(ended(1), "the first turn")
    # No "Topic ... not found in cluster metadata" loop, no error of the gate's own. (aiokafka may
    # log a NotLeaderForPartition retry or two while the brand-new topics elect their leaders.)
    noise = [r.getMessage() for r in caplog.records
             if "not found" in r.getMessage() or (r.levelno >= logging.ERROR and r.name.startswith("pipeline"))]
    assert noise == []
    retries = [r for r in caplog.records if r.name.startswith("aiokafka") and r.levelno >= logging.WARNING]
    assert len(retries) < 20, [r.getMessage() for r in retries]


async def test_a_text_record_on_the_wrong_partition_for_its_session_is_dead_lettered(make_settings, workers):
    settings = make_settings(partitions=2)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    await workers(settings)
    t = Turn(session="misrouted")
    wrong = 1 - partition_of(settings, "misrouted")
    codec = Codec()
    async with make_producer(settings) as producer:
        for e in t.tokens("Nobody hears this. ") + [t.end()]:
            await producer.send_and_wait(text_topic(settings, "llm"), codec.encode("TextEvent", e),
                                         key=b"misrouted", partition=wrong)
    dead = make_consumer(settings, settings.deadletter_topic, auto_offset_reset="earliest")
    await dead.start()
    try:
        got: list = []

        async def probe():
            for records in (await dead.getmany(timeout_ms=200)).values():
                got.extend(records)
            return len(got) >= 2
        await eventually(probe, what="the misrouted records dead-lettered")
    finally:
        await dead.stop()
    assert {dict(r.headers)["voicebus.error.reason"] for r in got} == {b"wrong-partition"}


async def test_a_text_event_whose_voice_is_no_voice_spec_is_dead_lettered_and_never_reaches_a_worker(
        make_settings, workers):
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    gate = await workers(settings)
    bad = Turn(turn="bad", session="blends", voice="af_heart:0.7+")  # as a producer without our codec writes it
    good = Turn(turn="good", session="blends", voice="af_heart:0.7+af_bella:0.3")
    bad_events = bad.tokens("No. ", size=4) + [bad.end()]
    async with make_producer(settings) as producer:
        for e in bad_events:
            await producer.send_and_wait(text_topic(settings, "llm"), foreign_encode("TextEvent", e.to_record()), key=b"blends")
    async with Requests(settings) as requests:
        await send(settings, "llm", good.tokens("Heard in a blend. ") + [good.end()])
        await requests.until(ended(1), "the good turn")
    assert [(r["turn_id"], r["voice"]) for r in requests.got] == [("good", "af_heart:0.7+af_bella:0.3")]
    dead = []

    async def dead_lettered():
        dead[:] = await read_to_end(settings, [settings.deadletter_topic])
        return len(dead) >= len(bad_events)
    await eventually(dead_lettered, what="the bad turn's events dead-lettered")
    assert [dict(r.headers)["voicebus.error.reason"] for r in dead] == [b"invalid-voice"] * len(bad_events)
    assert b"af_heart:0.7+" in dict(dead[0].headers)["voicebus.error.message"]
    assert gate.registry.get_sample_value("voicebus_records_dead_lettered_total",
                                          {"stage": "gate", "reason": "invalid-voice"}) == len(bad_events)


async def test_a_turns_lexicon_rewrites_its_requests_and_a_bad_one_is_dead_lettered(make_settings, workers):
    """docs/protocol.md, "Pronunciation": the worker gets the rewritten text; a lexicon written
    past the codec that breaks the contract never reaches it."""
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    await workers(settings)
    entry = {"regex": False, "phonemes": None, "say": None}
    lexicon = [{**entry, "match": "SQL", "say": "sequel"}, {**entry, "match": "Kokoro", "phonemes": "kˈOkəɹO"}]
    bad = Turn(turn="bad", session="words", lexicon=[{**entry, "match": "x", "phonemes": "k#"}])
    good = Turn(turn="good", session="words", lexicon=lexicon)
    async with make_producer(settings) as producer:
        await producer.send_and_wait(text_topic(settings, "llm"), foreign_encode("TextEvent", bad.tokens("No. ")[0].to_record()),
                                     key=b"words")
    async with Requests(settings) as requests:
        await send(settings, "llm", good.tokens("Kokoro reads SQL. ") + [good.end()])
        await requests.until(ended(1), "the good turn")
    assert [(r["turn_id"], r["text"]) for r in requests.got] == [("good", "[Kokoro](/kˈOkəɹO/) reads sequel.")]
    dead = []

    async def dead_lettered():
        dead[:] = await read_to_end(settings, [settings.deadletter_topic])
        return dead
    await eventually(dead_lettered, what="the bad turn's event dead-lettered")
    assert [dict(r.headers)["voicebus.error.reason"] for r in dead] == [b"invalid-lexicon"]


async def test_a_whole_session_cancel_is_resolved_and_published_once(make_settings, workers):
    settings = make_settings(partitions=2)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    await workers(settings)
    t1, t2 = Turn(turn="t1", session="barge"), Turn(turn="t2", session="barge")
    async with Requests(settings) as requests:
        await send(settings, "llm", t1.tokens("Spoken first. ") + [t1.end()] + t2.tokens("Then this. And"))
        await requests.until(lambda got: len(got) >= 2, "t1 ended and t2's first sentence")
        await send(settings, "llm", [cancel(session="barge")])
        await send(settings, "llm", t2.tokens(" never this. ") + [t2.end()])
        t3 = Turn(turn="t3", session="barge")  # first seen after the cancel: a new turn
        await send(settings, "llm", t3.tokens("A new turn. ") + [t3.end()])
        await requests.until(lambda got: any(r["turn_id"] == "t3" and r["is_last_in_turn"] for r in got), "t3")
    assert [(t, x) for t, _, x, _ in requests.of("barge")] == [
        ("t1", "Spoken first."), ("t2", "Then this."), ("t3", "A new turn.")]
    codec = Codec()
    resolution = None

    async def resolved():
        nonlocal resolution
        resolution = next((r for r in await read_to_end(settings, [settings.control_topic])
                           if codec.decode(r.value, expect="ControlEvent").value["source"] == "gate"), None)
        return resolution is not None
    await eventually(resolved, what="the gate's resolution on the control topic")
    # The gate reads its own resolution back. Once its group has committed past it, the gate has
    # applied it and sent whatever that made: a second resolution (the gate answering its own)
    # would be on the topic by then.
    tp = TopicPartition(settings.control_topic, resolution.partition)

    async def applied():
        return (await committed_offsets(settings, settings.gate_app_id)).get(tp, -1) > resolution.offset
    await eventually(applied, what="the gate's control commit past its own resolution")
    events = [codec.decode(r.value, expect="ControlEvent").value for r in await read_to_end(settings, [settings.control_topic])]
    resolutions = [e for e in events if e["source"] == "gate"]
    assert len(resolutions) == 1 and resolutions[0]["turn_ids"] == ["t1", "t2"]
    assert resolutions[0]["turn_id"] is None and resolutions[0]["session_id"] == "barge"


async def test_a_bad_event_inside_a_batch_costs_only_itself(make_settings, workers):
    """The worker applies a fetched batch before it writes anything; an event the core rejects in
    the middle of a session's batch must not undo the session's events before it."""
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    t = Turn(session="mixed")
    events = t.tokens("One is here. Two") + [t.pending(None)] + t.tokens(" goes on. ") + [t.end()]
    codec = Codec()
    async with make_producer(settings) as producer:  # all queued before the worker starts: one batch
        for e in events:
            await producer.send(text_topic(settings, "llm"), codec.encode("TextEvent", e), key=b"mixed")
        await producer.flush()
    gate = await workers(settings)
    async with Requests(settings) as requests:
        await requests.until(ended(1), "the turn's end")
    assert requests.of("mixed") == [("t1", 0, "One is here.", False), ("t1", 1, "Two goes on.", True)]
    assert gate.registry.get_sample_value("voicebus_records_dead_lettered_total",
                                          {"stage": "gate", "reason": "gate-rejected"}) == 1


async def test_an_idle_session_expires_its_open_turn_ends_and_its_state_is_tombstoned(make_settings, workers):
    settings = make_settings(partitions=1, gate_session_idle_s=1.0)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    gate = await workers(settings)
    t = Turn(session="left")
    async with Requests(settings) as requests:
        await send(settings, "llm", t.tokens("The agent says this. And then it vanishes mid"))
        await requests.until(ended(1), "the abandoned turn ended by expiry", timeout_s=30)
    assert requests.of("left") == [("t1", 0, "The agent says this.", False),
                                   ("t1", 1, "And then it vanishes mid", True)]
    await eventually(lambda: "left" not in gate._sessions, what="the session dropped from memory")
    assert (await changelog_states(settings))["left"] is None  # a tombstone: compaction removes it


async def test_a_control_topic_that_cannot_be_co_partitioned_stops_the_start(make_settings):
    settings = make_settings(partitions=2)
    await ensure_topics(settings.replace(partitions=3), [settings.control_topic])
    worker = GateWorker(settings)
    with pytest.raises(GateStartError, match="3 partitions"):
        await worker.start()
    assert worker.producer is None and worker.control is None  # everything it started is stopped


async def test_healthz_reports_a_task_that_died_and_its_restart(make_settings, workers):
    import aiohttp

    from voicebus.ops.daemon import free_port

    settings = make_settings(partitions=1)
    port = free_port()
    gate = await workers(settings, metrics_port=port)
    await eventually(lambda: gate.ready.is_set(), what="the gate got its partition")
    url = f"http://{settings.edge_host}:{port}"
    backoff = asyncio.Event()

    async def held_backoff(seconds: float) -> None:  # the test decides when the restart happens
        await backoff.wait()
        await asyncio.sleep(seconds)

    async with aiohttp.ClientSession() as http:
        async def status(code: int):
            async with http.get(url + "/healthz") as response:
                return await response.json() if response.status == code else None

        body = await eventually(lambda: status(200), what="healthy at start")
        assert body["stage"] == "gate" and body["partitions"] == [0]
        assert {"control", "text", "timer", "registry", "listing"} <= set(body["tasks"])
        gate.supervisor.sleep = held_backoff
        await gate.discovery.consumer.stop()  # the registry follower's consumer is gone: its task dies
        body = await eventually(lambda: status(503), timeout_s=15, what="/healthz reports the dead task")
        assert body["tasks"]["registry"]["restarts"] == 1 and not body["tasks"]["registry"]["running"]
        assert "ConsumerStoppedError" in body["tasks"]["registry"]["last_error"]
        async with http.get(url + "/metrics") as response:
            assert 'voicebus_task_restarts_total{stage="gate",task="registry"} 1.0' in await response.text()
        backoff.set()


async def test_a_recovery_that_fails_is_reported_on_healthz_and_tried_again(make_settings, workers):
    """Before: only a Kafka error was retried; any other failure of the recovery (here a state
    record the gate cannot load) escaped into aiokafka's rebalance callback, which swallows it:
    the partition sat unserved while /healthz said 200."""
    import aiohttp

    from voicebus.ops.daemon import free_port

    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    async with make_producer(settings) as producer:  # a session state no gate can load
        await producer.send_and_wait(settings.gate_changelog_topic, b"{not json", key=b"s-corrupt", partition=0)
    port = free_port()
    gate = await workers(settings, metrics_port=port, wait=False)
    url = f"http://{settings.edge_host}:{port}/healthz"
    async with aiohttp.ClientSession() as http:
        async def status(code: int, failed: bool = False):
            try:
                async with http.get(url) as response:
                    body = await response.json() if response.status == code else None
            except aiohttp.ClientConnectionError:
                return None  # not serving yet
            return body if body is not None and (not failed or body["recovery_error"]) else None

        # (503 before the first recovery ends too: not ready yet; the reason comes with its failure)
        body = await eventually(lambda: status(503, failed=True), timeout_s=60,
                                what="/healthz reports the failed recovery")
        assert "recovering partitions [0]: JSONDecodeError" in body["recovery_error"]
        await eventually(lambda: gate.recovery_failures >= 2, what="the recovery tried again")
        async with make_producer(settings) as producer:  # the operator deletes the bad state
            await producer.send_and_wait(settings.gate_changelog_topic, None, key=b"s-corrupt", partition=0)
        body = await eventually(lambda: status(200), timeout_s=60, what="healthy once the recovery succeeds")
        assert body["recovery_error"] is None and body["partitions"] == [0]


async def test_a_gate_whose_recovery_keeps_failing_still_stops(make_settings):
    """The consumer's stop waits for its rebalance callback: a recovery retried in it kept the
    stop waiting for ever."""
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    async with make_producer(settings) as producer:
        await producer.send_and_wait(settings.gate_changelog_topic, b"{not json", key=b"s-corrupt", partition=0)
    gate = GateWorker(settings)
    starting = asyncio.create_task(gate.start())
    try:
        await eventually(lambda: gate.recovery_failures >= 1, timeout_s=60, what="the recovery failed")
    finally:
        await asyncio.wait_for(gate.stop(), 30)
        await asyncio.gather(starting, return_exceptions=True)
    assert not gate.ready.is_set()


async def test_past_its_session_bound_the_gate_forgets_an_idle_session_or_refuses_a_new_one(make_settings, workers):
    """VOICEBUS_GATE_MAX_SESSIONS: a new session takes the place of the least recently active idle
    one (tombstoned); with none idle it is refused with a reason, and the sessions held go on."""
    settings = make_settings(partitions=1, gate_max_sessions=2)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    gate = await workers(settings)
    done, talking, late = Turn(session="done"), Turn(session="talking"), Turn(session="late")
    async with Requests(settings) as requests:
        await send(settings, "llm", done.tokens("All said. ") + [done.end()])
        await requests.until(ended(1), "the first session's turn ended")
        await send(settings, "llm", talking.tokens("Still talking. And more"))
        await requests.until(lambda got: any(r["session_id"] == "talking" for r in got), "the second session spoke")
        # a third session: "done" is idle and goes, "talking" (a turn open) stays
        await send(settings, "llm", late.tokens("Me too. ") + [late.end()])
        await requests.until(ended(2), "the third session's turn ended")
        assert set(gate._sessions) == {"talking", "late"}
        assert (await changelog_states(settings))["done"] is None
        # a fourth while both held sessions are busy: refused, dead-lettered with its reason
        late_two = Turn("t2", session="late")
        await send(settings, "llm", late_two.tokens("Busy here"))
        refused = Turn(session="refused")
        await send(settings, "llm", refused.tokens("Nobody hears me. ") + [refused.end()])
        await eventually(lambda: gate.registry.get_sample_value("voicebus_gate_sessions_refused_total") or 0,
                         what="the refused session counted")
        await send(settings, "llm", talking.tokens(" to say. ", size=9) + [talking.end()])
        await requests.until(ended(3), "the held session went on")
    assert "refused" not in {r["session_id"] for r in requests.got}
    records = await read_to_end(settings, [settings.deadletter_topic])
    assert {dict(r.headers).get("voicebus.error.reason") for r in records} == {b"gate-full"}


async def test_cancels_of_sessions_the_gate_does_not_hold_stay_under_its_session_bound(make_settings, workers):
    """A cancel of an unknown session is remembered (its turns may come later): a new session, so
    VOICEBUS_GATE_MAX_SESSIONS bounds it as it bounds text. A flood of cancels naming new sessions
    once grew the gate past its bound."""
    settings = make_settings(partitions=1, gate_max_sessions=3)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    gate = await workers(settings)
    flood = [ControlEvent.cancel(f"ghost-{i}", None, reason="flood", source="agent", issued_at_us=0, turn_ids=[f"t{i}"])
             for i in range(12)]
    await send(settings, "llm", flood)
    await eventually(lambda: (gate.registry.get_sample_value("voicebus_gate_control_events_total") or 0) >= 12,
                     what="the gate applied every cancel", detail=lambda: f"sessions {sorted(gate._sessions)}")
    assert len(gate._sessions) <= 3
    assert (gate.registry.get_sample_value("voicebus_gate_sessions_evicted_total") or 0) >= 9
    # what it holds is the latest: a listed turn that comes now is still cancelled
    late = Turn("t11", session="ghost-11")
    async with Requests(settings) as requests:
        await send(settings, "llm", late.tokens("Never spoken. ") + [late.end()])
        other = Turn(session="alive")
        await send(settings, "llm", other.tokens("Spoken. ") + [other.end()])
        await requests.until(lambda got: any(r["session_id"] == "alive" for r in got), "the live session spoke")
    assert not [r for r in requests.got if r["session_id"] == "ghost-11" and r["text"]]


async def _released_in_state(settings, sid: str) -> bool:
    state = (await changelog_states(settings)).get(sid)
    return bool(state) and any(turn.get("next_seq", 0) >= 1 for turn in state.get("turns", {}).values())


async def test_a_zombie_gate_resumed_after_its_partitions_moved_publishes_nothing(make_settings, workers):
    """A gate process paused (SIGSTOP) past its session timeout loses its partition to another
    gate; resumed, it fetches the text sent meanwhile, but is fenced before any output: every
    sentence is released once, by the new owner."""
    import signal
    import subprocess
    import threading

    from voicebus.gate.app import READY_LINE
    from voicebus.gate.cli import start_gate_subprocess

    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "llm")])
    zombie = start_gate_subprocess(settings, session_timeout_s=6.0, stderr=subprocess.STDOUT, log_level="INFO")
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in zombie.stdout], daemon=True).start()

    def announced(n: int):
        return lambda: sum(line.startswith(READY_LINE) for line in lines) >= n

    try:
        await eventually(announced(1), timeout_s=90, what="the first gate got its partition",
                         detail=lambda: "".join(lines[-20:]))
        t = Turn(session="z")
        async with Requests(settings) as requests:
            await send(settings, "llm", t.tokens("First one. Second", size=4))
            await requests.until(lambda got: len(got) >= 1, "the first sentence released by the first gate")
            # Paused only once the release is in its stored state: a gate stopped between a send and
            # its state write re-sends that request when it recovers (same seq, by design, docs/gate.md);
            # here the pause must test the fence, not that window.
            await eventually(lambda: _released_in_state(settings, "z"), timeout_s=30, interval_s=0.1,
                             what="the first gate stored the session's state with its first sentence released")
            zombie.send_signal(signal.SIGSTOP)
            owner = await workers(settings, session_timeout_s=6.0)
            await eventually(lambda: owner._owned == {0}, timeout_s=60, what="the partition moved to the new gate")
            await send(settings, "llm", t.tokens(" one. Third one. ", size=4) + [t.end()])
            await requests.until(ended(1), "the turn ended by the new owner")
            zombie.send_signal(signal.SIGCONT)
            # the zombie learns of the rebalance (and announces its new, empty, assignment)
            await eventually(announced(2), timeout_s=60, what="the resumed gate rejoined the group")
            got = await requests.to_end()
    finally:
        zombie.send_signal(signal.SIGCONT)
        zombie.terminate()
        zombie.wait(30)
    assert requests.of("z") == [("t1", 0, "First one.", False), ("t1", 1, "Second one.", False),
                                ("t1", 2, "Third one.", True)], "".join(lines[-30:])


def test_a_fetch_is_applied_in_the_order_its_records_were_produced():
    from types import SimpleNamespace as R

    from voicebus.gate.app import in_produced_order

    fetched = {"host": [R(offset=0, timestamp=10), R(offset=1, timestamp=30), R(offset=2, timestamp=50)],
               "expert": [R(offset=0, timestamp=20), R(offset=1, timestamp=30), R(offset=2, timestamp=None)],
               "skewed": [R(offset=0, timestamp=99), R(offset=1, timestamp=5)]}  # a wrong clock
    order = [(tp, r.offset) for tp, r in in_produced_order(fetched)]
    assert order == [("host", 0), ("expert", 0), ("host", 1), ("expert", 1), ("expert", 2), ("host", 2),
                     ("skewed", 0), ("skewed", 1)]  # ties in fetch order; each partition in offset order


async def test_a_backlog_of_two_agents_turns_gives_the_floor_in_the_order_they_opened(make_settings, workers):
    """Before: a fetched batch was applied topic by topic, so a gate reading a backlog (here: started
    after both agents spoke) opened the expert's turn after the host's had ended (granted, never
    queued) or before the host's had opened (the expert heard first), as the fetch came."""
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "host"), text_topic(settings, "expert")])
    host, expert = Turn("host-1", "s-backlog", agent="host"), Turn("expert-1", "s-backlog", agent="expert")
    # The host opens, the expert opens 20 ms later, then the host ends and the expert ends.
    timeline = [("host", e) for e in host.tokens("Welcome to the show. We talk", size=6)] + \
               [("expert", e) for e in expert.tokens("Thanks for having me. The sea", size=6)] + \
               [("host", e) for e in host.tokens(" about the sea.", size=6) + [host.end()]] + \
               [("expert", e) for e in expert.tokens(" is deep.", size=6) + [expert.end()]]
    codec, t0 = Codec(), 1_700_000_000_000
    async with make_producer(settings) as producer:
        for i, (agent, event) in enumerate(timeline):
            await producer.send_and_wait(text_topic(settings, agent), codec.encode("TextEvent", event.to_record()),
                                         key=session_key(event.session_id), timestamp_ms=t0 + 10 * i)
    async with Requests(settings) as requests:
        await workers(settings)
        await requests.until(ended(2), "both turns ended")
    assert [(turn, seq) for turn, seq, _, _ in requests.of("s-backlog")] == [
        ("host-1", 0), ("host-1", 1), ("expert-1", 0), ("expert-1", 1)]
    floor = [Codec().decode(r.value, expect="FloorEvent").value for r in
             await read_to_end(settings, [settings.floor_topic])]
    assert [(f["turn_id"], f["event"]) for f in floor] == [
        ("host-1", "GRANTED"), ("expert-1", "QUEUED"), ("expert-1", "GRANTED")]
