"""The contract beside the schemas: enums from the .avsc files, languages, limits, the checks."""

from __future__ import annotations

import pytest

from voicebus import schemas
from voicebus.codecs import Codec, InvalidMessage
from voicebus.gate.core import kokoro_language, GateInputError
from voicebus.synthesis.engine import UnknownLanguage, resolve_language
from voicebus.schemas import contract


def test_enums_are_the_schema_symbols():
    for enum_type, message_type, field_name in [
        (contract.TextEventKind, "TextEvent", "kind"), (contract.ControlAction, "ControlEvent", "action"),
        (contract.AudioEncoding, "AudioChunk", "encoding"), (contract.PlaybackKind, "PlaybackReport", "kind"),
    ]:
        symbols = next(f["type"]["symbols"] for f in schemas.load(message_type)["fields"] if f["name"] == field_name)
        assert [m.value for m in enum_type] == symbols
    assert contract.ControlAction.CANCEL == "CANCEL" and f"{contract.ControlAction.CANCEL}" == "CANCEL"


def test_gate_and_engine_accept_exactly_the_contract_languages():
    for code, kokoro in contract.LANGUAGES.items():
        assert kokoro_language(code, "en") == kokoro == resolve_language(code)
    for unspeakable in ("j", "z", "fr", "f"):  # the gate used to accept j and z, the engine could not speak them
        with pytest.raises(GateInputError):
            kokoro_language(unspeakable, "en")
        with pytest.raises(UnknownLanguage):
            resolve_language(unspeakable)


def _chunk(**changes):
    value = dict(session_id="s1", turn_id="t1", sentence_seq=0, chunk_seq=0, is_last_chunk=True,
                 is_last_in_turn=False, sample_rate=24000, encoding="PCM16LE", pcm=b"\x00\x00" * 10,
                 worker_id="w", first_token_at_us=0, text_complete_at_us=0, released_at_us=0,
                 request_received_at_us=0, synthesis_started_at_us=0, audio_ready_at_us=0, published_at_us=0)
    value.update(changes)
    return value


@pytest.mark.parametrize("changes, problem", [
    ({"sentence_seq": -1}, "sentence_seq -1"),
    ({"chunk_seq": -5}, "chunk_seq -5"),
    ({"sample_rate": 0}, "sample_rate 0"),
    ({"pcm": b"\x00" * 3}, "not whole samples"),
    ({"session_id": ""}, "session_id"),
    ({"turn_id": "x" * 129}, "turn_id"),
    ({"turn_id": "a\nb"}, "turn_id"),
])
def test_codec_refuses_both_ways_what_the_contract_forbids(changes, problem):
    codec = Codec()
    with pytest.raises(InvalidMessage, match=problem) as caught:
        codec.encode("AudioChunk", _chunk(**changes))
    assert caught.value.reason == "contract-violation"


def test_decode_refuses_a_negative_sequence_written_by_another_producer():
    import io

    from fastavro import parse_schema, schemaless_writer

    from voicebus.codecs import MAGIC

    codec = Codec()
    buf = io.BytesIO()
    buf.write(MAGIC + codec.fingerprint_of("AudioChunk"))
    schemaless_writer(buf, parse_schema(schemas.load("AudioChunk")), _chunk(sentence_seq=-3))
    with pytest.raises(InvalidMessage, match="sentence_seq -3"):
        codec.decode(buf.getvalue(), expect="AudioChunk")
    assert codec.decode(codec.encode("AudioChunk", _chunk()), expect="AudioChunk").value["sentence_seq"] == 0


def test_text_event_rules():
    codec = Codec()
    good = dict(session_id="s", turn_id="t", agent_id="agent-1", seq=0, kind="TOKEN", text="Hi.",
                claim_id=None, language="pt-br", voice=None, produced_at_us=1)
    codec.encode("TextEvent", good)
    for changes, problem in [({"language": "j"}, "cannot be spoken"), ({"agent_id": "a/b"}, "agent_id"),
                             ({"seq": -1}, "seq -1")]:
        with pytest.raises(InvalidMessage, match=problem):
            codec.encode("TextEvent", {**good, **changes})


@pytest.mark.parametrize("turn_ids, problem", [
    ([f"t{i}" for i in range(65)], "turn_ids lists 65 turns, at most 64"),
    (["x" * 600_000], "each of turn_ids"),
    (["ok", ""], "each of turn_ids"),
])
def test_a_cancel_cannot_list_unbounded_turns(turn_ids, problem):
    """Two cancels with 600 KB of turn ids once made the gate's state record too big to write."""
    event = {"session_id": "s", "turn_id": None, "action": "CANCEL", "reason": "", "source": "agent",
             "issued_at_us": 1, "turn_ids": turn_ids}
    with pytest.raises(InvalidMessage, match=problem) as caught:
        Codec().encode("ControlEvent", event)
    assert caught.value.reason == "contract-violation"
    Codec().encode("ControlEvent", {**event, "turn_ids": [f"t{i}" for i in range(64)]})
