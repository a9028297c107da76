"""The recorded-conversation format (JSONL): parse, validate and write it. Pure, no Kafka.

One JSON object a line (docs/agents.md is the reference):

    {"voicebus_conversation": 1, "title": "...", "description": "..."}          (optional header)
    {"t_ms": 412.0, "type": "text", "agent_id": "assistant", "session_id": "s1", "turn_id": "t1",
     "kind": "TOKEN", "text": " Hello", "language": "en", "voice": "af_heart"}
    {"t_ms": 2210.5, "type": "control", "session_id": "s1", "turn_id": "t1", "action": "CANCEL",
     "reason": "barge-in", "source": "user"}

`t_ms` is the event's offset from the start of the file in milliseconds; lines are in time order.
`seq` and `produced_at_us` are not stored: replay numbers each agent's events per turn from 0
(exactly as the SDK does) and stamps them when it publishes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Union

from voicebus.agents.sdk import END_OF_TURN, EVIDENCE_KINDS, TEXT_EVENT_KINDS, TOKEN, InvalidEventError, cancel_event, text_event
from voicebus.settings import Settings
from voicebus.topics import text_topic
from voicebus.schemas.contract import ControlAction

FORMAT_VERSION = 1
HEADER_KEY = "voicebus_conversation"
CONTROL_ACTIONS = tuple(ControlAction)


class ConversationFormatError(ValueError):
    """A conversation file line is not valid; the message names the file and line."""

    def __init__(self, message: str, source: str = "<events>", line: int | None = None) -> None:
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line


@dataclass(frozen=True)
class TextLine:
    """A TextEvent at `t_ms` from the start of the conversation."""

    t_ms: float
    agent_id: str
    session_id: str
    turn_id: str
    kind: str
    text: str = ""
    claim_id: str | None = None
    language: str | None = None
    voice: str | None = None
    floor: str | None = None  # how the turn takes the session's floor (queue, preempt; None: the gate's)
    priority: int = 0

    type = "text"


@dataclass(frozen=True)
class ControlLine:
    """A ControlEvent (a cancel) at `t_ms` from the start of the conversation."""

    t_ms: float
    session_id: str
    turn_id: str | None
    action: str = ControlAction.CANCEL
    reason: str = ""
    source: str = ""

    type = "control"


ConversationEvent = Union[TextLine, ControlLine]


@dataclass
class Conversation:
    events: list[ConversationEvent]
    title: str = ""
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return self.events[-1].t_ms if self.events else 0.0

    def sessions(self) -> list[str]:
        return list(dict.fromkeys(e.session_id for e in self.events))

    def turns(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys((e.session_id, e.turn_id) for e in self.events if e.turn_id is not None))


def _require(obj: dict, key: str, kind: type | tuple, where: tuple[str, int], optional: bool = False):
    value = obj.get(key)
    if value is None:
        if optional:
            return None
        raise ConversationFormatError(f"missing {key!r}", *where)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConversationFormatError(f"{key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}", *where)
    return value


_TEXT_KEYS = {"t_ms", "type", "agent_id", "session_id", "turn_id", "kind", "text", "claim_id", "language", "voice",
              "floor", "priority", "seq", "produced_at_us"}
_CONTROL_KEYS = {"t_ms", "type", "session_id", "turn_id", "action", "reason", "source", "issued_at_us"}


def _speakable(build: Any, where: tuple[str, int | None]) -> None:
    try:
        build()
    except InvalidEventError as exc:
        raise ConversationFormatError(str(exc), *where) from None


def event_from_json(obj: Any, source: str = "<events>", line: int | None = None) -> ConversationEvent:
    where = (source, line)
    if not isinstance(obj, dict):
        raise ConversationFormatError(f"expected a JSON object, got {type(obj).__name__}", *where)
    t_ms = _require(obj, "t_ms", (int, float), where)
    if not math.isfinite(t_ms) or t_ms < 0:
        raise ConversationFormatError(f"'t_ms' must be a finite number >= 0, got {t_ms!r}", *where)
    kind_of_line = obj.get("type")
    if kind_of_line == "text":
        unknown = set(obj) - _TEXT_KEYS
        if unknown:
            raise ConversationFormatError(f"unknown keys for a text event: {sorted(unknown)}", *where)
        agent_id = _require(obj, "agent_id", str, where)
        try:
            text_topic(Settings(), agent_id)
        except ValueError as exc:
            raise ConversationFormatError(str(exc), *where) from None
        kind = _require(obj, "kind", str, where)
        if kind not in TEXT_EVENT_KINDS:
            raise ConversationFormatError(f"'kind' must be one of {TEXT_EVENT_KINDS}, got {kind!r}", *where)
        text = _require(obj, "text", str, where, optional=True) or ""
        if kind == TOKEN and not text:
            raise ConversationFormatError("a TOKEN needs a non-empty 'text'", *where)
        if kind != TOKEN and text:
            raise ConversationFormatError(f"{kind} carries no 'text'", *where)
        claim_id = _require(obj, "claim_id", str, where, optional=True)
        if kind in EVIDENCE_KINDS and not claim_id:
            raise ConversationFormatError(f"{kind} needs a 'claim_id'", *where)
        line = TextLine(
            t_ms=float(t_ms), agent_id=agent_id, session_id=_require(obj, "session_id", str, where),
            turn_id=_require(obj, "turn_id", str, where), kind=kind, text=text, claim_id=claim_id,
            language=_require(obj, "language", str, where, optional=True),
            voice=_require(obj, "voice", str, where, optional=True),
            floor=_require(obj, "floor", str, where, optional=True),
            priority=int(_require(obj, "priority", int, where, optional=True) or 0),
        )
        # What replay will publish must be something the pipeline can act on (voicebus.schemas.contract):
        # a file naming a language no stage can speak is refused here, not half-way through a replay.
        _speakable(lambda: text_event(
            session_id=line.session_id, turn_id=line.turn_id, agent_id=line.agent_id, seq=0, kind=line.kind,
            text=line.text, claim_id=line.claim_id, language=line.language, voice=line.voice, floor=line.floor,
            priority=line.priority, produced_at_us=0), where)
        return line
    if kind_of_line == "control":
        unknown = set(obj) - _CONTROL_KEYS
        if unknown:
            raise ConversationFormatError(f"unknown keys for a control event: {sorted(unknown)}", *where)
        action = _require(obj, "action", str, where)
        if action not in CONTROL_ACTIONS:
            raise ConversationFormatError(f"'action' must be one of {CONTROL_ACTIONS}, got {action!r}", *where)
        control = ControlLine(
            t_ms=float(t_ms), session_id=_require(obj, "session_id", str, where),
            turn_id=_require(obj, "turn_id", str, where, optional=True), action=action,
            reason=_require(obj, "reason", str, where, optional=True) or "",
            source=_require(obj, "source", str, where, optional=True) or "",
        )
        _speakable(lambda: cancel_event(control.session_id, control.turn_id, reason=control.reason,
                                        source=control.source or "replay", issued_at_us=0), where)
        return control
    raise ConversationFormatError(f"'type' must be 'text' or 'control', got {kind_of_line!r}", *where)


def event_to_json(event: ConversationEvent) -> dict[str, Any]:
    """The line object of `event`; optional fields are left out when empty."""
    out: dict[str, Any] = {"t_ms": round(event.t_ms, 3), "type": event.type}
    if isinstance(event, TextLine):
        out.update(agent_id=event.agent_id, session_id=event.session_id, turn_id=event.turn_id, kind=event.kind)
        for key in ("text", "claim_id", "language", "voice", "floor", "priority"):
            value = getattr(event, key)
            if value:
                out[key] = value
    else:
        out.update(session_id=event.session_id, turn_id=event.turn_id, action=event.action)
        if event.reason:
            out["reason"] = event.reason
        if event.source:
            out["source"] = event.source
    return out


def validate(events: list[ConversationEvent], source: str = "<events>") -> None:
    """Whole-file rules: time never goes back, and no agent speaks in a turn after ending it."""
    last_t = 0.0
    ended: set[tuple[str, str, str]] = set()
    for index, event in enumerate(events, start=1):
        if event.t_ms < last_t:
            raise ConversationFormatError(f"t_ms {event.t_ms} goes back in time (previous {last_t})", source, index)
        last_t = event.t_ms
        if isinstance(event, TextLine):
            key = (event.agent_id, event.session_id, event.turn_id)
            if key in ended:
                raise ConversationFormatError(
                    f"agent {event.agent_id} sends {event.kind} in turn {event.turn_id} after its END_OF_TURN",
                    source, index,
                )
            if event.kind == END_OF_TURN:
                ended.add(key)


def parse_lines(lines: Iterable[str], source: str = "<events>") -> Conversation:
    """Parse JSONL text (blank lines are skipped); raises `ConversationFormatError`."""
    events: list[ConversationEvent] = []
    header: dict[str, Any] = {}
    line_of_event: list[int] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConversationFormatError(f"not JSON: {exc.msg}", source, number) from None
        if isinstance(obj, dict) and HEADER_KEY in obj:
            if events or header:
                raise ConversationFormatError("the header must be the first line", source, number)
            if obj[HEADER_KEY] != FORMAT_VERSION:
                raise ConversationFormatError(
                    f"unsupported format version {obj[HEADER_KEY]!r} (this reader knows {FORMAT_VERSION})", source, number
                )
            header = obj
            continue
        events.append(event_from_json(obj, source, number))
        line_of_event.append(number)
    try:
        validate(events, source)
    except ConversationFormatError as exc:  # report the file's line number, not the event index
        line = line_of_event[exc.line - 1] if exc.line else None
        raise ConversationFormatError(str(exc).split(": ", 1)[1], source, line) from None
    extra = {k: v for k, v in header.items() if k not in (HEADER_KEY, "title", "description")}
    return Conversation(events, header.get("title", ""), header.get("description", ""), extra)


def load(path: str | Path) -> Conversation:
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        return parse_lines(f, str(path))


def dump_lines(conversation: Conversation) -> Iterator[str]:
    header = {HEADER_KEY: FORMAT_VERSION, **conversation.extra}
    if conversation.title:
        header["title"] = conversation.title
    if conversation.description:
        header["description"] = conversation.description
    yield json.dumps(header, ensure_ascii=False)
    for event in conversation.events:
        yield json.dumps(event_to_json(event), ensure_ascii=False)


def save(conversation: Conversation, path: str | Path) -> None:
    validate(conversation.events, str(path))
    Path(path).write_text("".join(line + "\n" for line in dump_lines(conversation)), encoding="utf-8")
