"""Messages as typed objects: a record type of the wire contract as a frozen dataclass whose
fields are its `.avsc` fields, with the contract's enums for its enum fields.

The schema stays the single source. Each class is checked against its `.avsc` when this module is
imported (`SchemaDrift`): the same field names, and a default exactly where the schema has one,
equal to it. A schema that gains a field and a class that does not follow fail at import, in
every stage and in the tests, not on the bus.

`typed(message_type, value)` is what the stages' plumbing (`voicebus.shell`) hands a handler:
the typed object for the types defined here, the decoded dict for the others. Stages build
messages with the classes and publish them as they are (`voicebus.codecs.Codec.encode` takes a
`Message` or a dict).

Defined here: `ControlEvent` (cancels, published by the edge, the SDK and the gate, applied by
the gate, the workers, the edge and the recorder) and `FloorEvent` (what happened to a turn on
its session's floor, published by the gate, followed by agents: `FloorFollower`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

from voicebus import schemas
from voicebus.schemas.contract import ControlAction, FloorEventKind

M = TypeVar("M", bound="Message")


class SchemaDrift(RuntimeError):
    """A message class no longer matches its `.avsc` (a field added, removed or re-defaulted)."""


class Message:
    """A typed message of type `MESSAGE_TYPE`. Subclasses are frozen, slotted dataclasses;
    `ENUMS` names the fields whose values are a contract enum."""

    __slots__ = ()
    MESSAGE_TYPE: ClassVar[str]
    ENUMS: ClassVar[Mapping[str, type[enum.Enum]]] = {}

    @classmethod
    def from_record(cls: type[M], record: Mapping[str, Any]) -> M:
        """The message of a decoded record (a dict as the codec returns it: every field present,
        older writers' records resolved to the current schema). A field missing from `record`
        takes its default; a list becomes a tuple, an enum field's symbol its enum member."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in record:
                continue
            value = record[f.name]
            if f.name in cls.ENUMS and value is not None:
                value = cls.ENUMS[f.name](value)
            elif isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
        return cls(**values)

    def to_record(self) -> dict[str, Any]:
        """The record the codec encodes: every field, tuples as lists."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]


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


MESSAGES: Mapping[str, type[Message]] = {cls.MESSAGE_TYPE: cls for cls in (ControlEvent, FloorEvent)}


def typed(message_type: str, value: Mapping[str, Any]) -> Any:
    """The typed message of a decoded record where its type has a class here, else the dict."""
    cls = MESSAGES.get(message_type)
    return cls.from_record(value) if cls is not None else value


def _avro_default(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def check_against_schemas(messages: Mapping[str, type[Message]] = MESSAGES) -> None:
    """Raise `SchemaDrift` where a class's fields or defaults differ from its `.avsc`."""
    for message_type, cls in messages.items():
        avro = {f["name"]: f for f in schemas.load(message_type)["fields"]}
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if set(avro) != set(fields):
            raise SchemaDrift(f"{cls.__name__} has fields {sorted(fields)}; {message_type}'s schema has "
                              f"{sorted(avro)}")
        for name, spec in avro.items():
            has_default = fields[name].default is not dataclasses.MISSING
            if ("default" in spec) != has_default or (
                    has_default and _avro_default(spec["default"]) != fields[name].default):
                raise SchemaDrift(f"{cls.__name__}.{name}: default {fields[name].default!r}; the schema's "
                                  f"{spec.get('default', 'none')!r}")


check_against_schemas()
