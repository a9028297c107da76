"""Record then replay through the real broker; concurrent replays keep sessions apart."""

import asyncio
import statistics

import pytest

from voicebus.agents import corpus
from voicebus.agents.conversation_file import TextLine, load, save
from voicebus.agents.recorder import record
from voicebus.agents.replay import replay
from voicebus.topics import text_topic
from tests.agents.bus_helpers import TopicReader

pytestmark = pytest.mark.kafka

# Timing tolerance: this machine is 2 shared cores, so single events may be late by a scheduler
# hiccup; the median must stay tight. The timed test runs on a settled heap: a full collection of
# what earlier tests left (0.3-0.5 s) would otherwise stop the replay's loop (tests/conftest.py).
MAX_ERROR_MS = 250.0
MEDIAN_ERROR_MS = 15.0


def _shape(events, sessions=None):
    """What must survive a round trip: everything but the timestamps (sessions mapped)."""
    sessions = sessions or {}
    out = []
    for e in events:
        session = sessions.get(e.session_id, e.session_id)
        if isinstance(e, TextLine):
            out.append(("text", e.agent_id, session, e.turn_id, e.kind, e.text, e.claim_id, e.language, e.voice))
        else:
            out.append(("control", session, e.turn_id, e.action, e.reason))
    return out


def _timing_errors(got_ms, want_ms):
    got = [t - got_ms[0] for t in got_ms]
    want = [t - want_ms[0] for t in want_ms]
    return [abs(a - b) for a, b in zip(got, want)]


@pytest.mark.usefixtures("settled_heap")
async def test_record_then_replay_gives_the_same_events_in_order_and_timing(make_settings, tmp_path):
    settings = make_settings()
    original = load(corpus.corpus_path("rag_slow_retrieval"))  # two agents, a claim resolved after the end

    ready = asyncio.Event()
    recording = asyncio.create_task(record(settings, turns=1, duration_s=30, ready=ready))
    await asyncio.wait_for(ready.wait(), 20)
    report = await replay(settings, original.events, speed=1.0)
    recorded = await asyncio.wait_for(recording, 30)
    save(recorded, tmp_path / "recorded.jsonl")
    recorded = load(tmp_path / "recorded.jsonl")

    [mapping] = [c.session_ids for c in report.copies]
    assert _shape(recorded.events) == _shape(original.events, mapping)
    errors = _timing_errors([e.t_ms for e in recorded.events], [e.t_ms for e in original.events])
    print(f"record: timing error median {statistics.median(errors):.1f} ms, max {max(errors):.1f} ms; "
          f"replay max lateness {report.max_lateness_ms:.1f} ms")
    assert max(errors) < MAX_ERROR_MS and statistics.median(errors) < MEDIAN_ERROR_MS

    # ... and replaying the recording (twice as fast) puts the same events back on the bus.
    topics = [text_topic(settings, "assistant"), text_topic(settings, "retrieval")]
    async with TopicReader(settings, topics) as reader:
        again = await replay(settings, recorded.events, speed=2.0)
        [session] = again.session_ids  # the reader also sees the first replay: keep this one's
        got = await reader.wait_for(
            lambda got: sum(r.value["session_id"] == session for r in got) >= len(original.events))
    got = sorted((r for r in got if r.value["session_id"] == session), key=lambda r: r.value["produced_at_us"])
    assert len(got) == len(original.events)
    replayed = [TextLine(r.value["produced_at_us"] / 1000.0, r.value["agent_id"], "rag-1", r.value["turn_id"],
                         r.value["kind"], r.value["text"], r.value["claim_id"], r.value["language"],
                         r.value["voice"]) for r in got]
    assert _shape(replayed) == _shape(original.events)
    for agent in ("assistant", "retrieval"):
        seqs = [r.value["seq"] for r in got if r.value["agent_id"] == agent]
        assert seqs == list(range(len(seqs)))
    errors = _timing_errors([e.t_ms for e in replayed], [e.t_ms / 2.0 for e in original.events])
    print(f"replay x2: timing error median {statistics.median(errors):.1f} ms, max {max(errors):.1f} ms")
    assert max(errors) < MAX_ERROR_MS and statistics.median(errors) < MEDIAN_ERROR_MS


async def test_concurrent_replays_keep_sessions_apart(make_settings):
    settings = make_settings()
    original = load(corpus.corpus_path("interrupted"))  # tokens, a cancel on the control topic, a second turn
    copies = 4
    async with TopicReader(settings, [text_topic(settings, "assistant"), settings.control_topic]) as reader:
        report = await replay(settings, original.events, speed=2.0, sessions=copies)
        got = await reader.wait_for(lambda got: len(got) >= copies * len(original.events))

    assert len(set(report.session_ids)) == copies
    assert len(got) == copies * len(original.events)
    for copy in report.copies:
        [session] = copy.session_ids.values()
        mine = [r for r in got if r.value["session_id"] == session]
        assert all(r.key == session.encode() for r in mine)
        texts = [r for r in mine if r.type == "TextEvent"]  # one partition: arrival order = send order
        want = [e for e in original.events if isinstance(e, TextLine)]
        assert [(r.value["turn_id"], r.value["kind"], r.value["text"]) for r in texts] == [
            (e.turn_id, e.kind, e.text) for e in want]
        for turn in ("t1", "t2"):
            seqs = [r.value["seq"] for r in texts if r.value["turn_id"] == turn]
            assert seqs == list(range(len(seqs)))
        [cancel] = [r.value for r in mine if r.type == "ControlEvent"]
        assert cancel["turn_id"] == "t1" and cancel["action"] == "CANCEL"
        # the cancel went out between t1's last token and t2's first, as recorded
        t1_last = max(r.value["produced_at_us"] for r in texts if r.value["turn_id"] == "t1")
        t2_first = min(r.value["produced_at_us"] for r in texts if r.value["turn_id"] == "t2")
        assert t1_last <= cancel["issued_at_us"] <= t2_first


async def test_a_bad_record_is_left_out_and_reported_and_the_recording_goes_on(make_settings):
    """The recorder takes records through the shell's record policy (stage ``recorder``): garbage
    and a record that breaks the contract reach its error callback with their reasons; the good
    turn after them is recorded."""
    import io

    from fastavro import parse_schema, schemaless_writer

    from voicebus import schemas
    from voicebus.bus import ensure_topics, make_producer, publish
    from voicebus.clock import now_us
    from voicebus.codecs import MAGIC, Codec

    settings = make_settings()
    topic = text_topic(settings, "assistant")
    await ensure_topics(settings, [topic, settings.control_topic])
    codec = Codec()
    failures = []

    async def collect(failure) -> None:
        failures.append((failure.stage, failure.reason, failure.record.value))

    def event(seq, kind, text=""):
        return {"session_id": "s1", "turn_id": "t1", "agent_id": "assistant", "seq": seq, "kind": kind,
                "text": text, "claim_id": None, "language": None, "voice": None, "produced_at_us": now_us()}

    bad = io.BytesIO()
    bad.write(MAGIC + codec.fingerprint_of("TextEvent"))
    schemaless_writer(bad, parse_schema(schemas.load("TextEvent")), {**event(0, "TOKEN", "x"), "language": "zz"})
    ready = asyncio.Event()
    recording = asyncio.create_task(record(settings, turns=1, duration_s=60, ready=ready, on_error=collect))
    await asyncio.wait_for(ready.wait(), 20)
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"not avro", key=b"s1")
        await producer.send_and_wait(topic, bad.getvalue(), key=b"s1")
        await publish(producer, codec, topic, "TextEvent", event(0, "TOKEN", "Hello."))
        await publish(producer, codec, topic, "TextEvent", event(1, "END_OF_TURN"))
    finally:
        await producer.stop()
    recorded = await asyncio.wait_for(recording, 60)
    assert [(stage, reason) for stage, reason, _ in failures] == [("recorder", "malformed"),
                                                                  ("recorder", "contract-violation")]
    assert [(e.kind, e.text) for e in recorded.events] == [("TOKEN", "Hello."), ("END_OF_TURN", "")]
