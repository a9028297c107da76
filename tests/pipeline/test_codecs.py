"""The codec: Avro single-object encoding that other Avro implementations read, schema evolution
both ways, and a typed error for every kind of bad input."""

from __future__ import annotations

import io
import json
import struct

import avro.errors
import avro.io
import avro.schema
import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from voicebus import schemas
from voicebus.codecs import (
    HEADER_LEN,
    InvalidMessage,
    MAGIC,
    Codec,
    CodecError,
    InvalidText,
    MalformedRecord,
    OversizedText,
    UnknownFingerprint,
    WrongMessageType,
    schema_fingerprint,
)

from voicebus.schemas import contract

CODEC = Codec()
TEXT_EVENT_V0 = json.loads((schemas.SCHEMA_DIR / "history" / "text_event_v0.avsc").read_text())
AUDIO_CHUNK_V1 = json.loads((schemas.SCHEMA_DIR / "history" / "audio_chunk_v1.avsc").read_text())
AUDIO_CHUNK_V2 = json.loads((schemas.SCHEMA_DIR / "history" / "audio_chunk_v2.avsc").read_text())
AUDIO_CHUNK_V3 = json.loads((schemas.SCHEMA_DIR / "history" / "audio_chunk_v3.avsc").read_text())
FLOOR_EVENT_V1 = json.loads((schemas.SCHEMA_DIR / "history" / "floor_event_v1.avsc").read_text())
SYNTHESIS_REQUEST_V1 = json.loads((schemas.SCHEMA_DIR / "history" / "synthesis_request_v1.avsc").read_text())


# --- values from a schema ------------------------------------------------------------------------


def values_of(schema) -> st.SearchStrategy:
    """A hypothesis strategy for Python values of an Avro schema (the subset our schemas use)."""
    if isinstance(schema, list):  # union
        return st.one_of(*(values_of(s) for s in schema))
    if isinstance(schema, str):
        return {
            "null": st.none(),
            "boolean": st.booleans(),
            "int": st.integers(-(2**31), 2**31 - 1),
            "long": st.integers(-(2**63), 2**63 - 1),
            "float": st.floats(width=32, allow_nan=False),
            "double": st.floats(allow_nan=False),
            "string": st.text(max_size=40),
            "bytes": st.binary(max_size=64),
        }[schema]
    kind = schema["type"]
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: values_of(f["type"]) for f in schema["fields"]})
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(values_of(schema["items"]), max_size=4)
    if kind == "map":
        return st.dictionaries(st.text(max_size=8), values_of(schema["values"]), max_size=4)
    return values_of(kind)


_ID_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40)
# A voice spec (contract.parse_voice): empty (none named), a name, or a mix of up to 4 with weights.
_VOICE = st.just("") | st.lists(
    st.tuples(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,15}", fullmatch=True),
              st.sampled_from(["", ":1", ":0.25", "(2)"])),
    min_size=1, max_size=4, unique_by=lambda p: p[0]).map(lambda parts: "+".join(n + w for n, w in parts))
# A lexicon entry the contract accepts: a word, and either its phonemes or what to say.
_LEXICON_ENTRY = st.builds(
    lambda match, phonemes, say: {"match": match, "regex": False, "phonemes": phonemes, "say": say},
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
    st.none() | st.text(sorted(contract.PHONEME_SYMBOLS - {" "}), min_size=1, max_size=20),
    st.text(max_size=20),
).map(lambda e: {**e, "say": None} if e["phonemes"] is not None else e)
# Fields whose Avro type is wider than the contract (voicebus.schemas.contract) allows, drawn within it.
CONTRACT_FIELDS = {
    "session_id": _ID_TEXT, "turn_id": _ID_TEXT, "claim_id": st.none() | _ID_TEXT, "client_id": _ID_TEXT,
    "after_turn_id": st.none() | _ID_TEXT,
    "agent_id": st.from_regex(r"[A-Za-z0-9._-]{1,30}", fullmatch=True),
    "seq": st.integers(0, 2**63 - 1), "sentence_seq": st.integers(0, 2**31 - 1),
    "chunk_seq": st.integers(0, 2**31 - 1), "produced_at_us": st.integers(0, 2**63 - 1),
    "issued_at_us": st.integers(0, 2**63 - 1), "turn_ids": st.lists(_ID_TEXT, max_size=4),
    "sample_rate": st.sampled_from(sorted(contract.LIMITS.sample_rates)),
    "pcm": st.binary(max_size=32).map(lambda b: b[: len(b) // 2 * 2]),
    "speed": st.floats(0.25, 4.0, width=32),
    "rendered_samples": st.integers(0, 2**31 - 1), "waited_us": st.integers(0, 2**63 - 1),
    "floor": st.none() | st.sampled_from(contract.FLOOR_POLICIES),
    "priority": st.integers(-contract.LIMITS.max_priority, contract.LIMITS.max_priority),
    "lexicon": st.none() | st.lists(_LEXICON_ENTRY, max_size=3),
    "words": st.lists(st.tuples(st.text(max_size=20), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)).map(
        lambda w: {"text": w[0], "start": min(w[1], w[2]), "end": max(w[1], w[2])}), max_size=4),
}


def valid_values(name: str) -> st.SearchStrategy:
    """Values of message type `name` that the contract accepts as well as Avro."""
    fields = {f["name"]: CONTRACT_FIELDS.get(f["name"], values_of(f["type"])) for f in schemas.load(name)["fields"]}
    if name == "TextEvent":
        fields["language"] = st.none() | st.sampled_from(sorted(contract.LANGUAGES))
        fields["voice"] = st.none() | _VOICE
    if name == "SynthesisRequest":
        fields["language"] = st.sampled_from(sorted(contract.LANGUAGES))
        fields["voice"] = _VOICE
    if name == "AudioChunk":  # the audio is what its encoding says: samples, or length-prefixed Opus packets
        opus = {**fields, "encoding": st.just("OPUS"), "sample_rate": st.sampled_from(sorted(contract.OPUS_SAMPLE_RATES)),
                "pcm": st.lists(st.binary(min_size=1, max_size=12), max_size=3).map(contract.pack_opus_packets)}
        return st.fixed_dictionaries({**fields, "encoding": st.just("PCM16LE")}) | st.fixed_dictionaries(opus)
    return st.fixed_dictionaries(fields)


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO as the Avro specification writes it (an independent check of fingerprints)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty if fp & 1 else 0)
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


# --- round trips and the Apache avro package -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(schemas.CURRENT))
@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_schema_round_trips(name, data):
    value = data.draw(valid_values(name))
    decoded = CODEC.decode(CODEC.encode(name, value), expect=name)
    assert decoded.type == name and not decoded.older_writer
    assert decoded.value == value  # floats are drawn at their schema's width, so exact


@pytest.mark.parametrize("name", sorted(schemas.CURRENT))
@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_apache_avro_reads_our_bytes(name, data):
    raw = schemas.load(name)
    apache_schema = avro.schema.parse(json.dumps(raw))
    value = data.draw(valid_values(name))
    encoded = CODEC.encode(name, value)

    assert encoded[:2] == b"\xc3\x01"  # the single-object marker
    # the fingerprint is Apache avro's CRC-64-AVRO of the canonical form, and the spec's algorithm's,
    # written little-endian
    assert encoded[2:HEADER_LEN] == apache_schema.fingerprint("CRC-64-AVRO")
    canonical = apache_schema.canonical_form.encode()
    assert encoded[2:HEADER_LEN] == struct.pack("<Q", crc64_avro(canonical))

    reader = avro.io.DatumReader(apache_schema)
    body = io.BytesIO(encoded[HEADER_LEN:])
    read = reader.read(avro.io.BinaryDecoder(body))
    assert body.tell() == len(encoded) - HEADER_LEN
    assert read == value


# --- schema evolution ------------------------------------------------------------------------------


def v0_text_event() -> dict:
    return {"session_id": "s1", "turn_id": "t1", "agent_id": "a1", "seq": 3, "kind": "TOKEN",
            "text": "old", "claim_id": None, "produced_at_us": 42}


def test_history_holds_an_older_text_event_with_a_different_fingerprint():
    assert {f["name"] for f in schemas.load("TextEvent")["fields"]} - {f["name"] for f in TEXT_EVENT_V0["fields"]} == {
        "language", "voice", "floor", "priority", "speed", "lexicon"}
    assert TEXT_EVENT_V0 in schemas.load_history()


def test_new_reader_decodes_an_old_record_by_fingerprint():
    # write the way an old producer did, with Apache avro (no voicebus code involved)
    apache_v0 = avro.schema.parse(json.dumps(TEXT_EVENT_V0))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v0.fingerprint("CRC-64-AVRO"))
    avro.io.DatumWriter(apache_v0).write(v0_text_event(), avro.io.BinaryEncoder(buf))

    decoded = CODEC.decode(buf.getvalue(), expect="TextEvent")
    assert decoded.older_writer
    assert decoded.fingerprint != CODEC.fingerprint_of("TextEvent")
    # defaults filled in
    assert decoded.value == {**v0_text_event(), "language": None, "voice": None, "floor": None, "priority": 0,
                             "speed": None, "lexicon": None}


def test_old_reader_reads_a_new_record():
    new = {**v0_text_event(), "language": "en", "voice": "af_heart"}
    encoded = CODEC.encode("TextEvent", new)
    # an old consumer: fastavro with the v0 schema as its reader schema
    old_view = schemaless_reader(
        io.BytesIO(encoded[HEADER_LEN:]), parse_schema(schemas.load("TextEvent")), parse_schema(TEXT_EVENT_V0)
    )
    assert old_view == v0_text_event()
    # and Apache avro with the v0 reader schema
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(schemas.load("TextEvent"))),
                                 avro.schema.parse(json.dumps(TEXT_EVENT_V0)))
    assert reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:]))) == v0_text_event()


def test_a_codec_without_history_refuses_old_records():
    buf = io.BytesIO()
    old = parse_schema(TEXT_EVENT_V0)
    buf.write(MAGIC + avro.schema.parse(json.dumps(TEXT_EVENT_V0)).fingerprint("CRC-64-AVRO"))
    schemaless_writer(buf, old, v0_text_event())
    with pytest.raises(UnknownFingerprint):
        Codec(history=[]).decode(buf.getvalue())


def v1_audio_chunk() -> dict:
    return {"session_id": "s1", "turn_id": "t1", "sentence_seq": 2, "chunk_seq": 0, "is_last_chunk": True,
            "is_last_in_turn": True, "sample_rate": 24000, "encoding": "PCM16LE", "pcm": b"", "worker_id": "w",
            "first_token_at_us": 1, "text_complete_at_us": 2, "released_at_us": 3, "request_received_at_us": 4,
            "synthesis_started_at_us": 5, "audio_ready_at_us": 6, "published_at_us": 7}


def test_audio_chunk_gained_end_reason_and_keeps_v1_in_history():
    assert {f["name"] for f in AUDIO_CHUNK_V2["fields"]} - {f["name"] for f in AUDIO_CHUNK_V1["fields"]} == {
        "end_reason"}
    assert AUDIO_CHUNK_V1 in schemas.load_history()


def test_an_audio_chunk_written_before_end_reason_decodes_with_an_empty_reason():
    apache_v1 = avro.schema.parse(json.dumps(AUDIO_CHUNK_V1))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v1.fingerprint("CRC-64-AVRO"))
    avro.io.DatumWriter(apache_v1).write(v1_audio_chunk(), avro.io.BinaryEncoder(buf))
    decoded = CODEC.decode(buf.getvalue(), expect="AudioChunk")
    assert decoded.older_writer
    assert decoded.value == {**v1_audio_chunk(), "end_reason": "", "words": []}


def test_a_reader_from_before_end_reason_reads_a_new_audio_chunk():
    encoded = CODEC.encode("AudioChunk", {**v1_audio_chunk(), "end_reason": "no-voices"})
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(schemas.load("AudioChunk"))),
                                 avro.schema.parse(json.dumps(AUDIO_CHUNK_V1)))
    assert reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:]))) == v1_audio_chunk()
    assert CODEC.decode(encoded).value["end_reason"] == "no-voices"


WORDS = [{"text": "Hello,", "start": 72, "end": 9672}, {"text": "don't", "start": 9672, "end": 13272}]


def test_audio_chunk_gained_words_and_keeps_v2_in_history():
    assert {f["name"] for f in schemas.load("AudioChunk")["fields"]} - {f["name"] for f in AUDIO_CHUNK_V2["fields"]} == {
        "words"}
    assert AUDIO_CHUNK_V2 in schemas.load_history()


def test_an_audio_chunk_written_before_words_decodes_with_no_words():
    apache_v2 = avro.schema.parse(json.dumps(AUDIO_CHUNK_V2))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v2.fingerprint("CRC-64-AVRO"))
    v2 = {**v1_audio_chunk(), "end_reason": ""}
    avro.io.DatumWriter(apache_v2).write(v2, avro.io.BinaryEncoder(buf))
    decoded = CODEC.decode(buf.getvalue(), expect="AudioChunk")
    assert decoded.older_writer
    assert decoded.value == {**v2, "words": []}


def test_a_reader_from_before_words_reads_a_new_audio_chunk():
    v2 = {**v1_audio_chunk(), "end_reason": ""}
    encoded = CODEC.encode("AudioChunk", {**v2, "words": WORDS})
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(schemas.load("AudioChunk"))),
                                 avro.schema.parse(json.dumps(AUDIO_CHUNK_V2)))
    assert reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:]))) == v2
    # and a voicebus codec that knows only v2 (a stage not yet upgraded) reads it too
    old_codec = Codec(current={**{n: schemas.load(n) for n in schemas.CURRENT}, "AudioChunk": AUDIO_CHUNK_V2},
                      history=[schemas.load("AudioChunk")])
    assert old_codec.decode(encoded).value == v2
    assert CODEC.decode(encoded).value["words"] == WORDS


def test_a_word_must_start_before_it_ends():
    with pytest.raises(InvalidMessage, match="start must be"):
        CODEC.encode("AudioChunk", {**v1_audio_chunk(), "words": [{"text": "x", "start": 10, "end": 5}]})


def test_audio_chunk_v4_only_adds_opus_to_its_encoding_and_keeps_v3_in_history():
    current = {f["name"]: f for f in schemas.load("AudioChunk")["fields"]}
    v3 = {f["name"]: f for f in AUDIO_CHUNK_V3["fields"]}
    assert current.keys() == v3.keys() and AUDIO_CHUNK_V3 in schemas.load_history()
    assert [n for n in current if current[n]["type"] != v3[n]["type"]] == ["encoding"]
    assert current["encoding"]["type"]["symbols"] == v3["encoding"]["type"]["symbols"] + ["OPUS"]


def test_an_audio_chunk_written_before_opus_decodes_as_pcm16():
    apache_v3 = avro.schema.parse(json.dumps(AUDIO_CHUNK_V3))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v3.fingerprint("CRC-64-AVRO"))
    value = {**v1_audio_chunk(), "pcm": b"\x01\x00", "end_reason": "", "words": WORDS}
    avro.io.DatumWriter(apache_v3).write(value, avro.io.BinaryEncoder(buf))
    decoded = CODEC.decode(buf.getvalue(), expect="AudioChunk")
    assert decoded.older_writer and decoded.value == value and decoded.value["encoding"] == contract.AudioEncoding.PCM16LE


def test_a_reader_from_before_opus_reads_new_pcm16_chunks_and_refuses_opus_ones():
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(schemas.load("AudioChunk"))),
                                 avro.schema.parse(json.dumps(AUDIO_CHUNK_V3)))
    pcm16 = {**v1_audio_chunk(), "pcm": b"\x01\x00", "end_reason": "", "words": WORDS}
    encoded = CODEC.encode("AudioChunk", pcm16)
    assert reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:]))) == pcm16
    # no enum default on purpose: an old edge must not forward Opus packets as if they were samples
    opus = {**pcm16, "encoding": "OPUS", "pcm": contract.pack_opus_packets([b"\xf8\xff\xfe"])}
    encoded = CODEC.encode("AudioChunk", opus)
    assert CODEC.decode(encoded).value == opus
    with pytest.raises(avro.errors.SchemaResolutionException):
        reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:])))


def test_a_floor_event_from_before_its_warnings_decodes_with_none():
    apache_v1 = avro.schema.parse(json.dumps(FLOOR_EVENT_V1))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v1.fingerprint("CRC-64-AVRO"))
    value = {"session_id": "s", "turn_id": "t", "agent_id": "a", "event": "GRANTED", "waited_us": 0, "reason": "",
             "at_us": 1}
    avro.io.DatumWriter(apache_v1).write(value, avro.io.BinaryEncoder(buf))
    decoded = CODEC.decode(buf.getvalue(), expect="FloorEvent")
    assert decoded.older_writer and decoded.value == {**value, "warnings": []}
    current = {f["name"] for f in schemas.load("FloorEvent")["fields"]}
    assert current - {f["name"] for f in FLOOR_EVENT_V1["fields"]} == {"warnings"}


@pytest.mark.parametrize("payload", [b"\x05\x00abc", b"\x00\x00", b"\x01", b"\xff\x04" + b"x" * 1279])
def test_an_opus_chunk_whose_packets_do_not_parse_is_refused(payload):
    with pytest.raises(InvalidMessage, match="Opus"):
        CODEC.encode("AudioChunk", {**v1_audio_chunk(), "encoding": "OPUS", "pcm": payload, "end_reason": ""})


def v1_synthesis_request() -> dict:
    return {"session_id": "s1", "turn_id": "t1", "agent_id": "a1", "sentence_seq": 0, "text": "Hi there.",
            "language": "a", "voice": "af_heart", "speed": 1.0, "is_last_in_turn": False,
            "first_token_at_us": 1, "text_complete_at_us": 2, "released_at_us": 3}


def test_synthesis_request_gained_tentative_and_keeps_v1_in_history():
    assert {f["name"] for f in schemas.load("SynthesisRequest")["fields"]} - {
        f["name"] for f in SYNTHESIS_REQUEST_V1["fields"]} == {"tentative"}
    assert SYNTHESIS_REQUEST_V1 in schemas.load_history()


def test_a_synthesis_request_written_before_tentative_decodes_as_final():
    apache_v1 = avro.schema.parse(json.dumps(SYNTHESIS_REQUEST_V1))
    buf = io.BytesIO()
    buf.write(MAGIC + apache_v1.fingerprint("CRC-64-AVRO"))
    avro.io.DatumWriter(apache_v1).write(v1_synthesis_request(), avro.io.BinaryEncoder(buf))
    decoded = CODEC.decode(buf.getvalue(), expect="SynthesisRequest")
    assert decoded.older_writer
    assert decoded.value == {**v1_synthesis_request(), "tentative": False}


def test_a_reader_from_before_tentative_reads_a_new_synthesis_request():
    encoded = CODEC.encode("SynthesisRequest", {**v1_synthesis_request(), "tentative": True})
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(schemas.load("SynthesisRequest"))),
                                 avro.schema.parse(json.dumps(SYNTHESIS_REQUEST_V1)))
    assert reader.read(avro.io.BinaryDecoder(io.BytesIO(encoded[HEADER_LEN:]))) == v1_synthesis_request()
    assert CODEC.decode(encoded).value["tentative"] is True


# --- bad input: each typed error -------------------------------------------------------------------


def good_text_event(text: str = "hello") -> bytes:
    return CODEC.encode("TextEvent", {**v0_text_event(), "text": text, "language": None, "voice": None})


@pytest.mark.parametrize("data", [b"", b"\xc3", b"not avro at all", b"\xc3\x02" + b"\x00" * 12])
def test_garbage_is_malformed(data):
    with pytest.raises(MalformedRecord, match="neither Avro single-object encoding nor Confluent framing"):
        CODEC.decode(data)


def test_a_truncated_body_is_malformed():
    with pytest.raises(MalformedRecord, match="TextEvent"):
        CODEC.decode(good_text_event()[:-5])


def test_trailing_bytes_are_malformed():
    with pytest.raises(MalformedRecord, match="trailing"):
        CODEC.decode(good_text_event() + b"\x00")


def test_unknown_fingerprint():
    data = good_text_event()
    with pytest.raises(UnknownFingerprint, match="fingerprint"):
        CODEC.decode(MAGIC + b"\x00" * 8 + data[HEADER_LEN:])


def test_invalid_utf8_is_invalid_text():
    data = good_text_event("hello").replace(b"hello", b"hel\xffo")
    with pytest.raises(InvalidText, match="UTF-8"):
        CODEC.decode(data)


def test_oversized_text_on_decode_and_on_encode():
    small = Codec(max_text_bytes=8)
    with pytest.raises(OversizedText, match="limit 8"):
        small.decode(good_text_event("nine bytes"))
    with pytest.raises(OversizedText):
        small.encode("TextEvent", {**v0_text_event(), "text": "é" * 5})  # 10 UTF-8 bytes


def test_wrong_message_type():
    with pytest.raises(WrongMessageType, match="expected ControlEvent, got TextEvent"):
        CODEC.decode(good_text_event(), expect="ControlEvent")
    with pytest.raises(WrongMessageType):
        CODEC.encode("NoSuchEvent", {})


def test_a_value_that_does_not_fit_its_schema_is_malformed_on_encode():
    with pytest.raises(MalformedRecord, match="cannot encode TextEvent"):
        CODEC.encode("TextEvent", {"session_id": "s1"})


@hsettings(max_examples=200, deadline=None)
@given(st.binary(max_size=120))
def test_any_bytes_decode_or_raise_a_codec_error(data):
    try:
        CODEC.decode(data)
    except CodecError as exc:
        assert exc.reason and str(exc)


@hsettings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=60))
def test_any_body_after_a_known_header_decodes_or_raises_a_codec_error(body):
    try:
        CODEC.decode(MAGIC + CODEC.fingerprint_of("TextEvent") + body)
    except CodecError as exc:
        assert exc.reason


@pytest.mark.parametrize("name", sorted(schemas.CURRENT))
@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_avro_value_is_taken_whole_or_refused_by_the_contract_both_ways(name, data):
    """Fuzz: a value Avro accepts is either within the contract (it round-trips) or refused on
    encode and, written by a producer that does not check, refused on decode, with its reason."""
    raw = schemas.load(name)
    value = data.draw(values_of(raw))
    foreign = io.BytesIO()
    foreign.write(MAGIC + CODEC.fingerprint_of(name))
    schemaless_writer(foreign, parse_schema(raw), value)
    problems = contract.violations(name, value)
    if not problems:  # (values_of draws texts far below the size limit)
        assert CODEC.decode(CODEC.encode(name, value), expect=name).value == value
        return
    with pytest.raises(InvalidMessage) as on_encode:
        CODEC.encode(name, value)
    with pytest.raises(InvalidMessage) as on_decode:
        CODEC.decode(foreign.getvalue(), expect=name)
    assert on_encode.value.reason == on_decode.value.reason == "contract-violation"
    assert str(on_decode.value) == str(on_encode.value) == f"{name}: " + "; ".join(problems)


# Every writer schema the codec reads, current and history (a fuzz per decoder).
_WRITERS = sorted((raw["name"].rsplit(".", 1)[-1], i, raw) for i, raw in
                  enumerate([schemas.load(n) for n in sorted(schemas.CURRENT)] + schemas.load_history()))


@pytest.mark.parametrize("name,index,raw", _WRITERS, ids=[f"{n}-{i}" for n, i, _ in _WRITERS])
@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_damage_to_a_record_of_each_writer_schema_decodes_or_raises_a_codec_error(name, index, raw, data):
    """A record of each writer schema (drawn by Avro's rules, not the contract's), then damaged:
    bytes flipped, cut, inserted. Decoding gives a value the contract accepts or a typed error."""
    body = io.BytesIO()
    schemaless_writer(body, parse_schema(raw), data.draw(values_of(raw)))
    record = bytearray(MAGIC + schema_fingerprint(raw) + body.getvalue())
    for _ in range(data.draw(st.integers(0, 4))):
        at = data.draw(st.integers(HEADER_LEN, len(record)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(record):
            record[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del record[at:]
        else:
            record[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decoded = CODEC.decode(bytes(record), expect=name)
    except CodecError as exc:
        assert exc.reason and str(exc)
        return
    assert decoded.type == name and not contract.violations(name, decoded.value)
