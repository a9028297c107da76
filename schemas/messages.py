"""Messages as typed objects: a record type of the wire contract as a frozen dataclass whose
fields are its `.avsc` fields, with the contract's enums for its enum fields.

The schema stays the single source. Each class is checked against its `.avsc` when this module is
imported (`SchemaDrift`): the same field names, and a default exactly where the schema has one,
equal to it. A schema that gains a field and a class that does not follow fail at import, in
every stage and in the tests, not on the bus.

`typed(message_type, value)` is what the stages' plumbing hands a handler (a decoded record's
`voicebus.bus.DecodedRecord.typed`): the typed object for the types in `MESSAGES`, the decoded
dict for the others. Stages build
messages with the classes and publish them as they are (`voicebus.codecs.Codec.encode` takes a
`Message` or a dict).

One class per record type of the contract (`CLASSES`): `TextEvent` (with its `LexiconEntry`
records), `ControlEvent`, `SynthesisRequest`, `AudioChunk` (with its `WordTiming` records),
`PlaybackReport`, `TurnHeard` and `FloorEvent`. `from_record` turns a decoded record into its
object (enum fields to their enum, arrays to tuples, nested records to their class) and
`to_record` back.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

from voicebus import schemas
from voicebus.schemas.contract import AudioEncoding, ControlAction, FloorEventKind, PlaybackKind, TextEventKind

M = TypeVar("M", bound="Record")


class SchemaDrift(RuntimeError):
    """A message class no longer matches its `.avsc` (a field added, removed or re-defaulted)."""


class Record:
    """A typed Avro record: a frozen, slotted dataclass whose fields are the record's. `ENUMS`
    names the fields whose values are a contract enum; `RECORDS` the fields that hold an array
    (or a null or array) of nested records, with the nested record's class."""

    __slots__ = ()
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {}
    RECORDS: ClassVar[Mapping[str, type["Record"]]] = {}

    @classmethod
    def from_record(cls: type[M], record: Mapping[str, Any]) -> M:
        """The object of a decoded record (a dict as the codec returns it: every field present,
        older writers' records resolved to the current schema). A field missing from `record`
        takes its default; a list becomes a tuple (of nested objects where the field holds
        records), an enum field's symbol its enum member."""
        values: dict[str, Any] = {}
        for name, enum_type, nested in _plan(cls):
            if name not in record:
                continue
            value = record[name]
            if value is not None:
                if enum_type is not None:
                    value = enum_type(value)
                elif nested is not None:
                    value = tuple(v if isinstance(v, nested) else nested.from_record(v) for v in value)
                elif isinstance(value, list):
                    value = tuple(value)
            values[name] = value
        return cls(**values)

    def to_record(self) -> dict[str, Any]:
        """The record the codec encodes: every field, tuples as lists, nested objects as dicts."""
        return {name: _plain(getattr(self, name)) for name, _, _ in _plan(type(self))}


class Message(Record):
    """A typed message of the contract's record type `MESSAGE_TYPE`."""

    __slots__ = ()
    MESSAGE_TYPE: ClassVar[str]


_PLANS: dict[type, tuple[tuple[str, Any, Any], ...]] = {}


def _plan(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """Per class, once: (field, its enum or None, its nested record class or None)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = tuple((f.name, cls.ENUMS.get(f.name), cls.RECORDS.get(f.name))
                                   for f in dataclasses.fields(cls))
    return plan


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [v.to_record() if isinstance(v, Record) else v for v in value]
    return value


@dataclass(frozen=True, slots=True)
class ControlEvent(Message):
    """A system message on the control topic, keyed by session: a cancel of one turn
    (`turn_id`), of the listed turns (`turn_ids`), or of every turn the applying stage has seen
    (neither). `after_turn_id`: a preemption the edge applies when that turn's audio arrives."""

    MESSAGE_TYPE: ClassVar[str] = "ControlEvent"
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {"action": ControlAction}

    session_id: str
    action: ControlAction
    issued_at_us: int
    turn_id: str | None = None
    reason: str = ""
    source: str = ""
    turn_ids: tuple[str, ...] = ()
    after_turn_id: str | None = None

    @classmethod
    def cancel(cls, session_id: str, turn_id: str | None = None, *, issued_at_us: int, reason: str = "",
               source: str = "", turn_ids: tuple[str, ...] | list[str] = (),
               after_turn_id: str | None = None) -> "ControlEvent":
        return cls(session_id, ControlAction.CANCEL, issued_at_us, turn_id, reason, source, tuple(turn_ids),
                   after_turn_id)

    @property
    def is_cancel(self) -> bool:
        return self.action == ControlAction.CANCEL


@dataclass(frozen=True, slots=True)
class FloorEvent(Message):
    """What happened to a turn on its session's floor, published by the gate: `event` GRANTED
    (after `waited_us`), QUEUED, PREEMPTING, CUT or REFUSED (with a `reason`), and the turn's
    `warnings` about how it is spoken."""

    MESSAGE_TYPE: ClassVar[str] = "FloorEvent"
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {"event": FloorEventKind}

    session_id: str
    turn_id: str
    agent_id: str
    event: FloorEventKind
    at_us: int
    waited_us: int = 0
    reason: str = ""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class LexiconEntry(Record):
    """How a turn says a word: replaced by another spoken form (`say`) or spoken as the given
    Kokoro `phonemes`; `match` is a whole word or, with `regex`, a Python regular expression."""

    match: str
    regex: bool = False
    phonemes: str | None = None
    say: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TextEvent(Message):
    """A token or an evidence mark of an agent's turn, on the agent's text topic, keyed by session.
    The turn's first event carries its `language`, `voice`, `floor`, `priority`, `speed` and
    `lexicon`."""

    MESSAGE_TYPE: ClassVar[str] = "TextEvent"
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {"kind": TextEventKind}
    RECORDS: ClassVar[Mapping[str, type[Record]]] = {"lexicon": LexiconEntry}

    session_id: str
    turn_id: str
    agent_id: str
    seq: int
    kind: TextEventKind
    text: str = ""
    claim_id: str | None = None
    language: str | None = None
    voice: str | None = None
    floor: str | None = None
    priority: int = 0
    speed: float | None = None
    lexicon: tuple[LexiconEntry, ...] | None = None
    produced_at_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthesisRequest(Message):
    """A sentence the gate released, for the synthesis workers. `tentative`: released before its
    end was certain (speculative release); the gate cancels it if the sentence grows."""

    MESSAGE_TYPE: ClassVar[str] = "SynthesisRequest"

    session_id: str
    turn_id: str
    agent_id: str
    sentence_seq: int
    text: str
    language: str
    voice: str
    speed: float = 1.0
    is_last_in_turn: bool = False
    first_token_at_us: int
    text_complete_at_us: int
    released_at_us: int
    tentative: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WordTiming(Record):
    """A word of a sentence and where it is spoken: samples from the start of the sentence's audio."""

    text: str
    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AudioChunk(Message):
    """A piece of a sentence's audio, from a worker to the edges, with the timestamps the latency
    figures are made of and the `words` whose start lies in it."""

    MESSAGE_TYPE: ClassVar[str] = "AudioChunk"
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {"encoding": AudioEncoding}
    RECORDS: ClassVar[Mapping[str, type[Record]]] = {"words": WordTiming}

    session_id: str
    turn_id: str
    sentence_seq: int
    chunk_seq: int
    is_last_chunk: bool
    is_last_in_turn: bool = False
    sample_rate: int = 24000
    encoding: AudioEncoding = AudioEncoding.PCM16LE
    pcm: bytes
    worker_id: str = ""
    first_token_at_us: int = 0
    text_complete_at_us: int = 0
    released_at_us: int = 0
    request_received_at_us: int = 0
    synthesis_started_at_us: int = 0
    audio_ready_at_us: int = 0
    published_at_us: int = 0
    end_reason: str = ""
    words: tuple[WordTiming, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaybackReport(Message):
    """What a player reported about a turn's audio (`kind`: audible start, end, stopped,
    underrun), published by the edge."""

    MESSAGE_TYPE: ClassVar[str] = "PlaybackReport"
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {"kind": PlaybackKind}

    session_id: str
    turn_id: str
    client_id: str
    kind: PlaybackKind
    sentence_seq: int = 0
    audible_at_us: int = 0
    reported_at_us: int
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnHeard(Message):
    """What the listeners of a session heard of a turn, published by the edge when the turn's
    playback ended: the text heard, whether it was `interrupted`, and the words not heard."""

    MESSAGE_TYPE: ClassVar[str] = "TurnHeard"

    session_id: str
    turn_id: str
    heard_text: str
    interrupted: bool
    unheard_words: tuple[str, ...] = ()
    sentence_seq: int = 0
    rendered_samples: int = 0
    client_id: str = ""
    reports: int = 1
    started_at_us: int = 0
    stopped_at_us: int = 0
    published_at_us: int = 0


CLASSES: tuple[type[Message], ...] = (ControlEvent, FloorEvent, TextEvent, SynthesisRequest, AudioChunk,
                                      PlaybackReport, TurnHeard)
# The types `typed` hands as objects: every message type of the contract.
MESSAGES: Mapping[str, type[Message]] = {cls.MESSAGE_TYPE: cls for cls in CLASSES}


def typed(message_type: str, value: Mapping[str, Any]) -> Any:
    """The typed message of a decoded record where its type has a class here, else the dict."""
    cls = MESSAGES.get(message_type)
    return cls.from_record(value) if cls is not None else value


def _avro_default(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _check_fields(cls: type[Record], avro_fields: list[Mapping[str, Any]], where: str) -> None:
    avro = {f["name"]: f for f in avro_fields}
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if set(avro) != set(fields):
        raise SchemaDrift(f"{cls.__name__} has fields {sorted(fields)}; {where}'s schema has {sorted(avro)}")
    for name, spec in avro.items():
        has_default = fields[name].default is not dataclasses.MISSING
        if ("default" in spec) != has_default or (
                has_default and _avro_default(spec["default"]) != _avro_default(fields[name].default)):
            raise SchemaDrift(f"{cls.__name__}.{name}: default {fields[name].default!r}; the schema's "
                              f"{spec.get('default', 'none')!r}")


def _record_items(spec: Any) -> Mapping[str, Any] | None:
    """The nested record of a field that holds an array of records (or null or one)."""
    for branch in spec if isinstance(spec, list) else [spec]:
        if isinstance(branch, dict) and branch.get("type") == "array" and isinstance(branch["items"], dict):
            return branch["items"]
    return None


def check_against_schemas(classes: tuple[type[Message], ...] = CLASSES) -> None:
    """Raise `SchemaDrift` where a class's fields or defaults (or its nested records') differ
    from its `.avsc`."""
    for cls in classes:
        avro_fields = schemas.load(cls.MESSAGE_TYPE)["fields"]
        _check_fields(cls, avro_fields, cls.MESSAGE_TYPE)
        for f in avro_fields:
            items = _record_items(f["type"])
            if items is not None:
                nested = cls.RECORDS.get(f["name"])
                if nested is None:
                    raise SchemaDrift(f"{cls.__name__}.{f['name']} holds {items['name']} records; "
                                      f"RECORDS names no class for it")
                _check_fields(nested, items["fields"], f"{cls.MESSAGE_TYPE}.{f['name']}")

check_against_schemas()
