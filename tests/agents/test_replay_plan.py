from dataclasses import replace

import pytest

from voicebus.agents import corpus
from voicebus.agents.conversation_file import load
from voicebus.agents.recorder import RecordedRecord, TurnTracker, to_conversation
from voicebus.agents.replay import ReplayError, plan_replay
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import ControlEvent, TextEvent, typed


def test_copies_get_distinct_sessions_and_seq_per_agent_and_turn():
    events = load(corpus.corpus_path("rag_slow_retrieval")).events
    run_id, copies = plan_replay(events, sessions=3, run_id="r1")
    assert [c.session_ids for c in copies] == [{"rag-1": f"rag-1.r1.{i}"} for i in range(3)]
    for copy in copies:
        assert {e.value.session_id for e in copy.schedule} == {copy.session_ids["rag-1"]}
        for agent in ("assistant", "retrieval"):
            seqs = [e.value.seq for e in copy.schedule if e.value.agent_id == agent]
            assert seqs == list(range(len(seqs)))
        assert [e.t_ms for e in copy.schedule] == [e.t_ms for e in events]


def test_bad_parameters_are_refused():
    with pytest.raises(ReplayError):
        plan_replay([], sessions=0)
    with pytest.raises(ReplayError):
        plan_replay([], sessions=2, keep_session_ids=True)


def test_recorded_records_become_the_conversation_they_came_from():
    original = load(corpus.corpus_path("interrupted")).events
    _, [copy] = plan_replay(original, keep_session_ids=True)
    base = 1_700_000_000_000_000
    records = []
    for order, item in enumerate(reversed(copy.schedule)):  # consumption order need not be time order
        stamp = "produced_at_us" if item.message_type == "TextEvent" else "issued_at_us"
        value = replace(item.value, **{stamp: base + round(item.t_ms * 1000)})
        # as the recorder takes it off the bus: the record, decoded, handed as its typed message
        records.append(RecordedRecord(item.message_type, typed(item.message_type, value.to_record()), order))
    rebuilt = to_conversation(records).events
    shift = original[0].t_ms
    assert [(type(e), e.session_id, e.turn_id) for e in rebuilt] == [(type(e), e.session_id, e.turn_id) for e in original]
    assert all(abs(r.t_ms - (o.t_ms - shift)) < 0.002 for r, o in zip(rebuilt, original))


def test_turn_tracker_waits_for_pending_claims_and_counts_cancels():
    tracker = TurnTracker()
    events = load(corpus.corpus_path("rag_slow_retrieval")).events
    _, [copy] = plan_replay(events, keep_session_ids=True)
    end_index = next(i for i, e in enumerate(copy.schedule) if e.value.kind == "END_OF_TURN")
    for item in copy.schedule[: end_index + 1]:
        tracker.observe(item.message_type, replace(item.value, produced_at_us=1))
    assert not tracker.finished  # c1 still pending after the speaker's end
    for item in copy.schedule[end_index + 1:]:
        tracker.observe(item.message_type, replace(item.value, produced_at_us=2))
    assert tracker.finished == {("rag-1", "t1")}

    tracker = TurnTracker()
    tracker.observe("TextEvent", _token("s", "a", 5))
    tracker.observe("ControlEvent", ControlEvent.cancel("s", issued_at_us=9))
    assert tracker.finished == {("s", "a")}


def test_a_whole_session_cancel_ends_the_turns_seen_or_listed_whatever_the_clocks():
    tracker = TurnTracker()
    tracker.observe("TextEvent", _token("s", "a", 5_000))
    # the canceller's clock is behind the agent's: its cancel still ends the turn it follows
    tracker.observe("ControlEvent", ControlEvent.cancel("s", issued_at_us=1_000))
    assert tracker.finished == {("s", "a")}
    # the gate's resolution lists a turn the recorder has not seen yet: it is over too
    tracker.observe("ControlEvent", ControlEvent.cancel("s", turn_ids=["b"], issued_at_us=2_000, source="gate"))
    assert tracker.finished == {("s", "a"), ("s", "b")}


def _token(session_id, turn_id, produced_at_us):
    return TextEvent(session_id=session_id, turn_id=turn_id, agent_id="assistant", seq=0, kind=TextEventKind.TOKEN,
                     text="Hi", produced_at_us=produced_at_us)
