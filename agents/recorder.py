"""Recording conversations from the bus: every agent's text topic plus the control topic.

Pure core: `TurnTracker` decides when a turn is over (END_OF_TURN seen and every claim pending
in it resolved, or the turn cancelled) and `to_conversation` turns decoded records into the file
format, times taken from the records' own `produced_at_us`/`issued_at_us` relative to the first
one. Thin shell: `record` follows every topic matching the pattern (an agent that appears
mid-recording is picked up within 0.2 s), starts each partition at the recording's start time
(`offsets_for_times`), and stops after a duration or once N turns are over. Each record goes
through the shell's `RecordPolicy` (stage ``recorder``): a record that cannot be decoded or breaks
the contract is left out of the recording and reported to the policy's error callback (default:
a warning naming the record and the reason, and the policy's counter), never dead-lettered here:
the recorder is a reader beside the pipeline, whose own consumers dead-letter the same record.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from voicebus.agents.conversation_file import Conversation, ControlLine, ConversationEvent, TextLine
from voicebus.agents.sdk import END_OF_TURN, EVIDENCE_FAILED, EVIDENCE_PENDING, EVIDENCE_READY
from voicebus.clock import now_us
from voicebus.settings import Settings
from voicebus.schemas.messages import ControlEvent, TextEvent, typed

if TYPE_CHECKING:
    from voicebus.shell import ErrorCallback, RecordFailure

log = logging.getLogger(__name__)


class RecordError(ValueError):
    """Bad recording parameters."""


@dataclass(frozen=True)
class RecordedRecord:
    """A decoded record as it came off the bus: its type, typed message and consumption order."""

    message_type: str  # TextEvent or ControlEvent
    value: TextEvent | ControlEvent
    order: int

    @property
    def at_us(self) -> int:
        return self.value.issued_at_us if isinstance(self.value, ControlEvent) else self.value.produced_at_us


@dataclass
class _TurnState:
    ended: bool = False
    pending: set[str] = field(default_factory=set)
    first_at_us: int = 0


class TurnTracker:
    """Counts finished turns. A turn is over when its END_OF_TURN arrived and no claim is still
    pending (a slow retrieval may resolve after the speaker ended), or when it was cancelled."""

    def __init__(self) -> None:
        self._turns: dict[tuple[str, str], _TurnState] = {}
        self.finished: set[tuple[str, str]] = set()

    def observe(self, message_type: str, value: TextEvent | ControlEvent) -> None:
        if isinstance(value, ControlEvent):
            if not value.is_cancel:
                return
            # No clocks compared (the canceller's and the agent's differ): a cancel names its
            # turn, or lists them (the gate's resolution), or, listing none, covers every turn of
            # the session seen so far, as every stage applies it (pipeline/cancel.py).
            session = value.session_id
            if value.turn_id is not None:
                named = [value.turn_id]
            else:
                named = list(value.turn_ids) or [t for s, t in self._turns if s == session]
            for turn_id in named:
                self.finished.add((session, turn_id))
                self._turns.setdefault((session, turn_id), _TurnState())
            return
        key = (value.session_id, value.turn_id)
        state = self._turns.get(key)
        if state is None:
            state = self._turns[key] = _TurnState(first_at_us=value.produced_at_us)
        kind = value.kind
        if kind == EVIDENCE_PENDING:
            state.pending.add(value.claim_id)
        elif kind in (EVIDENCE_READY, EVIDENCE_FAILED):
            state.pending.discard(value.claim_id)
        elif kind == END_OF_TURN:
            state.ended = True
        if state.ended and not state.pending:
            self.finished.add(key)


def to_conversation(records: list[RecordedRecord], title: str = "", description: str = "") -> Conversation:
    """Order records by their own timestamps (ties: consumption order, which is production order
    within a partition) and express times as offsets from the first."""
    ordered = sorted(records, key=lambda r: (r.at_us, r.order))
    origin = ordered[0].at_us if ordered else 0
    events: list[ConversationEvent] = []
    for r in ordered:
        v = r.value
        t_ms = (r.at_us - origin) / 1000.0
        if isinstance(v, TextEvent):
            events.append(TextLine(
                t_ms=t_ms, agent_id=v.agent_id, session_id=v.session_id, turn_id=v.turn_id, kind=str(v.kind),
                text=v.text or "", claim_id=v.claim_id, language=v.language, voice=v.voice,
                floor=v.floor, priority=int(v.priority or 0),
            ))
        else:
            events.append(ControlLine(t_ms=t_ms, session_id=v.session_id, turn_id=v.turn_id, action=v.action,
                                      reason=v.reason, source=v.source))
    return Conversation(events, title, description)


async def _skip_logged(failure: "RecordFailure") -> None:
    """The recorder's default error callback: the record is left out of the recording, said so."""
    record_ = failure.record
    log.warning("recorder: left out %s[%s]@%s (%s): %s", record_.topic, record_.partition, record_.offset,
                failure.reason, failure.error)


def recorded_topics_pattern(settings: Settings) -> str:
    return "^(?:" + re.escape(settings.text_topic_prefix) + r"[A-Za-z0-9._-]+|" + re.escape(settings.control_topic) + ")$"


async def record(
    settings: Settings,
    *,
    duration_s: float | None = None,
    turns: int | None = None,
    since_us: int | None = None,
    ready: asyncio.Event | None = None,
    title: str = "",
    description: str = "",
    on_error: "ErrorCallback | None" = None,
) -> Conversation:
    """Record text and control events produced since `since_us` (default: now) until
    `duration_s` passed or `turns` turns are over, whichever comes first (at least one bound is
    required). `ready` is set once the consumer reads the control topic. A record that fails to
    decode or breaks the contract is left out and handed to `on_error` (default: logged; the
    pipeline's own consumers dead-letter it)."""
    from aiokafka import TopicPartition

    from voicebus.bus import ensure_topics, make_admin, make_consumer
    from voicebus.codecs import codec_for
    from voicebus.shell import RecordPolicy

    if duration_s is None and turns is None:
        raise RecordError("give a duration or a number of turns to stop after")
    if turns is not None and turns < 1:
        raise RecordError(f"turns must be >= 1, got {turns}")
    since_us = now_us() if since_us is None else since_us
    await ensure_topics(settings, [settings.control_topic])
    codec = codec_for(settings)
    policy = RecordPolicy("recorder", settings, codec, None, on_error=on_error or _skip_logged)
    pattern = re.compile(recorded_topics_pattern(settings))
    # No consumer group: the recorder assigns partitions itself and keeps its own positions, so an
    # agent topic that appears mid-recording is added without a rebalance (a rebalance would
    # reset every position and lose or repeat records).
    consumer = make_consumer(settings, group_id=None, enable_auto_commit=False, metadata_max_age_ms=500)
    admin = make_admin(settings)
    await consumer.start()
    await admin.start()
    positions: dict[TopicPartition, int] = {}
    records: list[RecordedRecord] = []
    tracker = TurnTracker()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration_s if duration_s is not None else None
    next_discovery = 0.0

    async def follow_new_topics() -> None:
        topics = sorted(t for t in await admin.list_topics() if pattern.match(t))
        described = await admin.describe_topics(topics) if topics else []
        new = [TopicPartition(d["topic"], p["partition"]) for d in described for p in d.get("partitions", ())
               if TopicPartition(d["topic"], p["partition"]) not in positions]
        if not new:
            return
        found = await consumer.offsets_for_times({tp: since_us // 1000 for tp in new})
        ends = await consumer.end_offsets(new)
        for tp in new:
            positions[tp] = found[tp].offset if found.get(tp) is not None else ends[tp]
        consumer.assign(list(positions))
        for tp, offset in positions.items():
            consumer.seek(tp, offset)
        if ready is not None and any(tp.topic == settings.control_topic for tp in positions):
            ready.set()

    try:
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                break
            if turns is not None and len(tracker.finished) >= turns:
                break
            if now >= next_discovery:
                await follow_new_topics()
                next_discovery = now + 0.2
            if not positions:
                await asyncio.sleep(0.05)
                continue
            batch = await consumer.getmany(timeout_ms=100)
            for tp, messages in batch.items():
                for message in messages:
                    positions[tp] = message.offset + 1
                    accepted = await policy.accept(message)
                    if accepted is None:
                        continue  # reported to on_error with its reason
                    decoded = accepted.message
                    if decoded.type not in ("TextEvent", "ControlEvent"):
                        continue
                    record_ = RecordedRecord(decoded.type, typed(decoded.type, decoded.value), len(records))
                    if record_.at_us < since_us:
                        continue  # offsets_for_times works in ms; drop the sub-ms earlier ones
                    records.append(record_)
                    tracker.observe(decoded.type, record_.value)
    finally:
        await admin.close()
        await consumer.stop()
    return to_conversation(records, title, description)
