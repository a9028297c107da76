import pytest

from voicebus.agents.sdk import (
    END_OF_TURN, EVIDENCE_PENDING, TOKEN, InvalidEventError, TurnEndedError, TurnEvents, cancel_event, text_event,
)
from voicebus.codecs import Codec
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import ControlEvent, LexiconEntry, TextEvent


def test_turn_events_number_from_zero_and_refuse_events_after_the_end():
    turn = TurnEvents("s1", "t1", "assistant", language="en", voice="af_heart")
    first = turn.make(TOKEN, text="Hi")
    mark = turn.make(EVIDENCE_PENDING, claim_id="c1")
    end = turn.make(END_OF_TURN)
    assert [first.seq, mark.seq, end.seq] == [0, 1, 2]
    assert first.language == "en" and first.voice == "af_heart" and first.produced_at_us > 0
    assert isinstance(first, TextEvent) and mark.kind is TextEventKind.EVIDENCE_PENDING
    assert turn.ended
    with pytest.raises(TurnEndedError, match="already ended"):
        turn.make(TOKEN, text="late")


def test_events_encode_with_the_wire_codec():
    codec = Codec()
    turn = TurnEvents("s1", "t1", "retrieval")
    for event in (turn.make(EVIDENCE_PENDING, claim_id="c9"), turn.make(END_OF_TURN)):
        decoded = codec.decode(codec.encode("TextEvent", event), expect="TextEvent").value
        assert decoded == event.to_record() and TextEvent.from_record(decoded) == event
    cancel = cancel_event("s1", None, reason="barge-in", source="edge")
    decoded = codec.decode(codec.encode("ControlEvent", cancel), expect="ControlEvent").value
    assert decoded == cancel.to_record() and ControlEvent.from_record(decoded) == cancel


def test_invalid_events_are_refused_with_a_clear_error():
    base = dict(session_id="s", turn_id="t", agent_id="a", seq=0)
    with pytest.raises(InvalidEventError, match="needs a claim_id"):
        text_event(**base, kind="EVIDENCE_READY")
    with pytest.raises(InvalidEventError, match="carries no text"):
        text_event(**base, kind=END_OF_TURN, text="x")
    with pytest.raises(InvalidEventError, match="unknown TextEvent kind"):
        text_event(**base, kind="WORD")
    with pytest.raises(ValueError, match="agent id"):
        TurnEvents("s", "t", "no spaces allowed")


def test_a_turns_lexicon_goes_with_its_first_event_only():
    lexicon = [{"match": "SQL", "say": "sequel"}, {"match": r"K8s?", "regex": True, "phonemes": "kˈAts"}]
    turn = TurnEvents("s1", "t1", "assistant", lexicon=lexicon)
    first, second = turn.make(TOKEN, text="SQL"), turn.make(TOKEN, text=" rocks.")
    assert first.lexicon == (LexiconEntry(match="SQL", say="sequel"),
                             LexiconEntry(match="K8s?", regex=True, phonemes="kˈAts"))
    assert second.lexicon is None
    codec = Codec()
    assert TextEvent.from_record(codec.decode(codec.encode("TextEvent", first), expect="TextEvent").value) == first
    assert TurnEvents("s1", "t2", "assistant", lexicon=[]).make(TOKEN, text="x").lexicon is None


def test_a_lexicon_the_contract_refuses_is_refused_at_the_source():
    from voicebus.agents.sdk import Publisher
    from voicebus.settings import Settings

    base = dict(session_id="s", turn_id="t", agent_id="a", seq=0, kind=TOKEN)
    with pytest.raises(InvalidEventError, match="not symbols of Kokoro-82M"):
        text_event(**base, lexicon=[{"match": "x", "phonemes": "k#"}])
    with pytest.raises(InvalidEventError, match="unknown keys"):
        text_event(**base, lexicon=[{"match": "x", "spoken": "y"}])
    with pytest.raises(InvalidEventError, match="list of entries"):
        text_event(**base, lexicon={"SQL": "sequel"})
    with pytest.raises(InvalidEventError, match="exactly one of phonemes and say"):
        Publisher(Settings(), lexicon=[{"match": "x"}])
    publisher = Publisher(Settings(), lexicon=[{"match": "SQL", "say": "sequel"}])
    assert publisher.turn("s1").events.lexicon == [{"match": "SQL", "regex": False, "phonemes": None, "say": "sequel"}]
    assert publisher.turn("s1", lexicon=[]).events.lexicon is None
    with pytest.raises(InvalidEventError, match="not a regular expression"):
        publisher.turn("s1", lexicon=[{"match": "(", "regex": True, "say": "x"}])


@pytest.mark.parametrize("record, problem", [
    ({"session_id": "s", "turn_id": "t", "agent_id": "a", "seq": 0, "kind": "TOKEN", "text": "hi"}, "produced_at_us"),
    ({"session_id": "s", "turn_id": "t", "agent_id": "a", "seq": 0, "kind": "SHOUT", "text": "hi",
      "produced_at_us": 1}, "SHOUT"),
    ({"session_id": "s", "turn_id": "t", "agent_id": "a", "seq": 0, "kind": "TOKEN", "text": "hi",
      "produced_at_us": 1, "language": "klingon"}, "language"),
])
async def test_a_text_event_given_as_a_record_is_checked_before_it_is_sent(record, problem):
    """A record that is no TextEvent is the SDK's `InvalidEventError`, raised before any broker is
    involved (the publisher is not even started), as for an event built by the SDK."""
    from voicebus.agents.sdk import Publisher
    from voicebus.settings import Settings

    publisher = Publisher(Settings(), agent_id="a")
    with pytest.raises(InvalidEventError, match=problem):
        await publisher.publish_text_event(record)
