"""Typed messages: checked against their `.avsc`, and the same record on the wire as a dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from voicebus.codecs import Codec
from voicebus.schemas.contract import ControlAction
from voicebus.schemas.messages import ControlEvent, Message, SchemaDrift, check_against_schemas, typed


def test_a_control_event_goes_through_the_codec_unchanged():
    codec = Codec()
    event = ControlEvent.cancel("s1", None, reason="barge-in", source="edge", issued_at_us=7, turn_ids=["a", "b"])
    decoded = codec.decode(codec.encode("ControlEvent", event), expect="ControlEvent")
    back = typed(decoded.type, decoded.value)
    assert back == event and back.action is ControlAction.CANCEL and back.turn_ids == ("a", "b")
    assert back.is_cancel and back.after_turn_id is None


def test_a_record_without_the_later_fields_takes_their_defaults():
    event = ControlEvent.from_record({"session_id": "s", "action": "CANCEL", "issued_at_us": 1, "turn_id": "t"})
    assert (event.turn_ids, event.after_turn_id, event.reason) == ((), None, "")


def test_types_without_a_class_stay_dicts():
    value = {"session_id": "s", "turn_id": "t"}
    assert typed("NoSuchType", value) is value


def test_a_class_that_does_not_follow_its_schema_is_refused():
    @dataclass(frozen=True, slots=True)
    class Stale(Message):  # ControlEvent before after_turn_id was added
        MESSAGE_TYPE: ClassVar[str] = "ControlEvent"
        session_id: str
        action: str
        issued_at_us: int
        turn_id: str | None = None
        reason: str = ""
        source: str = ""
        turn_ids: tuple[str, ...] = ()

    with pytest.raises(SchemaDrift, match="after_turn_id"):
        check_against_schemas((Stale,))

    @dataclass(frozen=True, slots=True)
    class Redefaulted(Message):
        MESSAGE_TYPE: ClassVar[str] = "ControlEvent"
        session_id: str
        action: str
        issued_at_us: int
        turn_id: str | None = None
        reason: str = "barge-in"
        source: str = ""
        turn_ids: tuple[str, ...] = ()
        after_turn_id: str | None = None

    with pytest.raises(SchemaDrift, match="reason"):
        check_against_schemas((Redefaulted,))
    check_against_schemas()


def test_a_floor_event_goes_through_the_codec_unchanged():
    from voicebus.schemas.contract import FloorEventKind
    from voicebus.schemas.messages import FloorEvent

    codec = Codec()
    event = FloorEvent("s1", "t1", "expert", FloorEventKind.GRANTED, 9, waited_us=5, warnings=("voice-unknown: x",))
    decoded = codec.decode(codec.encode("FloorEvent", event), expect="FloorEvent")
    assert typed(decoded.type, decoded.value) == event


def test_what_players_reported_and_heard_are_handed_as_objects():
    from voicebus.schemas.contract import PlaybackKind
    from voicebus.schemas.messages import PlaybackReport, TurnHeard

    codec = Codec()
    report = PlaybackReport(session_id="s1", turn_id="t1", client_id="c1", kind=PlaybackKind.STOPPED,
                            sentence_seq=1, audible_at_us=8, reported_at_us=9)
    heard = TurnHeard(session_id="s1", turn_id="t1", heard_text="Hello", interrupted=True,
                      unheard_words=("there.",), published_at_us=9)
    for message in (report, heard):
        decoded = codec.decode(codec.encode(message.MESSAGE_TYPE, message), expect=message.MESSAGE_TYPE)
        assert typed(decoded.type, decoded.value) == message
    assert typed("PlaybackReport", report.to_record()).kind is PlaybackKind.STOPPED


def test_a_text_event_is_handed_as_an_object_with_its_lexicon_entries():
    from voicebus.schemas.contract import TextEventKind
    from voicebus.schemas.messages import LexiconEntry, TextEvent

    codec = Codec()
    event = TextEvent(session_id="s1", turn_id="t1", agent_id="assistant", seq=0, kind=TextEventKind.TOKEN,
                      text="SQL", lexicon=(LexiconEntry(match="SQL", say="sequel"),), produced_at_us=9)
    decoded = codec.decode(codec.encode("TextEvent", event), expect="TextEvent")
    assert decoded.value["lexicon"] == [{"match": "SQL", "regex": False, "phonemes": None, "say": "sequel"}]
    back = typed(decoded.type, decoded.value)
    assert back == event and back.kind is TextEventKind.TOKEN and back.lexicon[0].say == "sequel"


def test_every_message_type_of_the_contract_has_its_class():
    from voicebus import schemas
    from voicebus.schemas.messages import CLASSES

    assert {cls.MESSAGE_TYPE for cls in CLASSES} == set(schemas.CURRENT)


def test_nested_records_are_objects_and_go_through_the_codec_unchanged():
    from voicebus.schemas.contract import AudioEncoding, TextEventKind
    from voicebus.schemas.messages import AudioChunk, LexiconEntry, TextEvent, WordTiming

    codec = Codec()
    event = TextEvent(session_id="s", turn_id="t", agent_id="a", seq=0, kind=TextEventKind.TOKEN, text="SQL ",
                      lexicon=(LexiconEntry(match="SQL", say="sequel"),), produced_at_us=5)
    back = TextEvent.from_record(codec.decode(codec.encode("TextEvent", event), expect="TextEvent").value)
    assert back == event and isinstance(back.lexicon[0], LexiconEntry) and back.kind is TextEventKind.TOKEN
    chunk = AudioChunk(session_id="s", turn_id="t", sentence_seq=1, chunk_seq=0, is_last_chunk=True, pcm=b"\0\0",
                       words=(WordTiming(text="hi", start=0, end=1),))
    back = AudioChunk.from_record(codec.decode(codec.encode("AudioChunk", chunk), expect="AudioChunk").value)
    assert back == chunk and back.encoding is AudioEncoding.PCM16LE and back.words[0].text == "hi"


def test_a_nested_record_that_does_not_follow_its_schema_is_refused():
    from voicebus.schemas.messages import AudioChunk, Record

    @dataclass(frozen=True, slots=True, kw_only=True)
    class OldTiming(Record):  # a word timing without its end
        text: str
        start: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Chunk(AudioChunk):
        RECORDS: ClassVar = {"words": OldTiming}

    with pytest.raises(SchemaDrift, match="OldTiming"):
        check_against_schemas((Chunk,))
