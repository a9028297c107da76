"""Confluent framing in the codec, and the schema registry client against the real Apicurio
Registry (`schema_registry` fixture): subjects per topic, BACKWARD compatibility, ids resolved
once, the contract checked on both sides, and the typed errors."""

from __future__ import annotations

import json
import struct
import uuid

import pytest
from fastavro import parse_schema, schemaless_writer

from voicebus import schemas
from voicebus.ops.daemon import free_port
from voicebus.codecs import (
    CONFLUENT, MAGIC, SINGLE_OBJECT, Codec, InvalidMessage, MalformedRecord, RegistryUnavailable,
    UnknownSchemaId, WrongMessageType, codec_for,
)
from voicebus.registry import IncompatibleSchema, SchemaNotFound, SchemaRegistry, subject_for
from voicebus.ops.registry_server import java_major
from voicebus.settings import Settings, SettingsError


def text_event(**changes) -> dict:
    value = {
        "session_id": "s1", "turn_id": "t1", "agent_id": "assistant", "seq": 0, "kind": "TOKEN",
        "text": "Hello", "claim_id": None, "language": "en", "voice": None, "floor": None, "priority": 0, "speed": None, "lexicon": None,
        "produced_at_us": 1,
    }
    value.update(changes)
    return value


def confluent_frame(schema_id: int, schema: dict, value: dict) -> bytes:
    import io

    buf = io.BytesIO()
    buf.write(b"\x00" + struct.pack(">I", schema_id))
    schemaless_writer(buf, parse_schema(schema, named_schemas={}), value)
    return buf.getvalue()


# --- without a registry: nothing touches the network ------------------------------------------


def test_single_object_stays_the_default_and_needs_no_registry():
    codec = codec_for(Settings())
    assert codec.framing == SINGLE_OBJECT and codec.registry is None
    assert codec.encode("TextEvent", text_event())[:2] == MAGIC


def test_confluent_framing_without_a_registry_url_is_a_settings_error():
    with pytest.raises(SettingsError, match="VOICEBUS_REGISTRY_URL"):
        codec_for(Settings(wire_format=CONFLUENT))
    with pytest.raises(SettingsError, match="VOICEBUS_WIRE_FORMAT"):
        codec_for(Settings(wire_format="protobuf"))
    with pytest.raises(SettingsError, match="http"):
        codec_for(Settings(registry_url="localhost:8081"))
    assert Settings.from_env({"VOICEBUS_WIRE_FORMAT": "confluent"}).wire_format == CONFLUENT


def test_a_confluent_frame_without_a_registry_is_an_unknown_schema_id():
    data = confluent_frame(7, schemas.load("TextEvent"), text_event())
    with pytest.raises(UnknownSchemaId, match="no schema registry configured") as err:
        Codec().decode(data)
    assert err.value.reason == "unknown-schema-id"


@pytest.mark.parametrize("data", [b"\x00", b"\x00\x00\x00\x01", b"\x01\x00\x00\x00\x01hello"])
def test_short_or_unknown_frames_are_malformed(data):
    with pytest.raises(MalformedRecord):
        Codec().decode(data)


def test_an_unreachable_registry_is_registry_unavailable_not_a_crash():
    url = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"  # nothing listens there
    codec = codec_for(Settings(wire_format=CONFLUENT, registry_url=url, registry_timeout_s=1.0))
    with pytest.raises(RegistryUnavailable) as err:
        codec.encode("TextEvent", text_event(), "voicebus.text.assistant")
    assert err.value.reason == "registry-unavailable"
    with pytest.raises(RegistryUnavailable):
        codec.decode(confluent_frame(3, schemas.load("TextEvent"), text_event()))


def test_the_java_version_is_read_from_the_release_file(tmp_path):
    (tmp_path / "release").write_text('IMPLEMENTOR="x"\nJAVA_VERSION="25.0.3"\n')
    assert java_major(tmp_path) == 25
    (tmp_path / "release").write_text('JAVA_VERSION="1.8.0_412"\n')
    assert java_major(tmp_path) == 8
    assert java_major(tmp_path / "nope") is None


# --- against the real registry ---------------------------------------------------------------


@pytest.fixture
def codec(registry_url) -> Codec:
    return codec_for(Settings(wire_format=CONFLUENT, registry_url=registry_url))


def topic() -> str:
    return f"t{uuid.uuid4().hex[:10]}.text.assistant"


@pytest.mark.registry
def test_confluent_round_trip_registers_the_subject_per_topic_with_backward(codec, registry_url):
    name = topic()
    data = codec.encode("TextEvent", text_event(), name)
    schema_id = struct.unpack(">I", data[1:5])[0]
    assert data[0] == 0
    registry = SchemaRegistry(registry_url)
    assert subject_for(name) == f"{name}-value" and subject_for(name) in registry.subjects()
    assert registry.compatibility(subject_for(name)) == "BACKWARD"
    assert json.loads(registry.schema_by_id(schema_id))["name"] == "TextEvent"
    # a fresh reader (another process) resolves the id through the registry
    decoded = codec_for(Settings(registry_url=registry_url)).decode(data, expect="TextEvent")
    assert decoded.value == text_event() and decoded.schema_id == schema_id and not decoded.older_writer
    assert decoded.fingerprint == codec.fingerprint_of("TextEvent")


@pytest.mark.registry
def test_one_reader_takes_both_framings_on_one_topic(codec, registry_url):
    """A topic migrating from single-object to Confluent framing: old and new records side by side."""
    name = topic()
    old = Codec().encode("TextEvent", text_event(seq=0))
    new = codec.encode("TextEvent", text_event(seq=1), name)
    for reader in (Codec(), codec_for(Settings(registry_url=registry_url)), codec):
        if reader.registry is None:
            assert reader.decode(old).value["seq"] == 0
            continue
        assert [reader.decode(d).value["seq"] for d in (old, new)] == [0, 1]


@pytest.mark.registry
def test_an_older_writer_schema_by_id_is_resolved_to_the_current_reader(registry_url):
    [v0] = [s for s in schemas.load_history() if s["name"] == "TextEvent" and s["version"] == 0]
    name = topic()
    registry = SchemaRegistry(registry_url)
    v0_id = registry.register(subject_for(name), v0)
    old = {k: v for k, v in text_event().items() if k not in {"language", "voice", "floor", "priority"}}
    decoded = codec_for(Settings(registry_url=registry_url)).decode(confluent_frame(v0_id, v0, old))
    assert decoded.older_writer and decoded.value == text_event(language=None)
    # and the current schema is a BACKWARD-compatible next version of that subject
    assert registry.register(subject_for(name), schemas.load("TextEvent")) != v0_id


@pytest.mark.registry
def test_the_registry_refuses_an_incompatible_version(codec, registry_url):
    name = topic()
    codec.register(name, "TextEvent")
    breaking = {"type": "record", "name": "TextEvent", "namespace": "io.voicebus",
                "fields": [{"name": "session_id", "type": "long"}]}
    with pytest.raises(IncompatibleSchema):
        SchemaRegistry(registry_url).register(subject_for(name), breaking)


@pytest.mark.registry
def test_unknown_ids_and_foreign_schemas_are_typed_errors(registry_url):
    reader = codec_for(Settings(registry_url=registry_url))
    data = confluent_frame(987654, schemas.load("TextEvent"), text_event())
    with pytest.raises(UnknownSchemaId, match="987654"):
        reader.decode(data)
    with pytest.raises(UnknownSchemaId, match="987654"):  # remembered: not asked again
        reader.decode(data)
    with pytest.raises(SchemaNotFound):
        SchemaRegistry(registry_url).schema_by_id(987654)
    foreign = {"type": "record", "name": "Invoice", "namespace": "com.example",
               "fields": [{"name": "amount", "type": "long"}]}
    foreign_id = SchemaRegistry(registry_url).register(subject_for(topic()), foreign)
    with pytest.raises(WrongMessageType, match="Invoice"):
        reader.decode(confluent_frame(foreign_id, foreign, {"amount": 3}))


@pytest.mark.registry
def test_the_contract_is_checked_on_both_sides_in_confluent_framing(codec, registry_url):
    name = topic()
    with pytest.raises(InvalidMessage):
        codec.encode("TextEvent", text_event(seq=-1), name)
    schema_id = codec.register(name, "TextEvent")
    bad = confluent_frame(schema_id, schemas.load("TextEvent"), text_event(language="xx"))
    with pytest.raises(InvalidMessage, match="language"):
        codec_for(Settings(registry_url=registry_url)).decode(bad)


@pytest.mark.registry
def test_confluent_encoding_needs_the_topic(codec):
    with pytest.raises(WrongMessageType, match="topic"):
        codec.encode("TextEvent", text_event())
