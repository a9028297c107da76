"""Replaying a recorded conversation onto the bus at its recorded timing, N copies at once.

Pure core: `plan_replay` turns a conversation's events into one schedule per copy (session ids
made distinct per copy, `seq` numbered per agent and turn from 0 like the SDK does). Thin shell:
`replay` publishes each copy's schedule in its own task, sleeping until each event's deadline
(start + t_ms / speed, against absolute deadlines so a slow send does not push later events
back), stamping `produced_at_us`/`issued_at_us` when it sends. The demo and the benchmarks call
`replay(settings, events, speed, sessions)`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from voicebus.agents.conversation_file import ControlLine, ConversationEvent, TextLine
from voicebus.agents.sdk import Publisher, cancel_event, text_event
from voicebus.clock import now_us
from voicebus.schemas.messages import ControlEvent, TextEvent, TurnHeard
from voicebus.settings import Settings

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """Bad replay parameters (speed, number of sessions)."""


@dataclass(frozen=True)
class ScheduledEvent:
    """One record to publish `t_ms` (recorded time, before speed) after the start."""

    t_ms: float
    message_type: str  # "TextEvent" or "ControlEvent"
    value: TextEvent | ControlEvent  # its timestamp (0 here) is stamped on send


@dataclass
class ReplayCopy:
    index: int
    session_ids: dict[str, str]  # recorded session id -> this copy's session id
    schedule: list[ScheduledEvent]


@dataclass
class ReplayReport:
    """What a replay did: each copy's session ids, when it started, and how late sends were."""

    run_id: str
    started_at_us: int
    copies: list[ReplayCopy]
    events_sent: int = 0
    lateness_ms: list[float] = field(default_factory=list)  # per event: send time - deadline

    @property
    def session_ids(self) -> list[str]:
        return [sid for copy in self.copies for sid in copy.session_ids.values()]

    @property
    def max_lateness_ms(self) -> float:
        return max(self.lateness_ms, default=0.0)


def copy_session_id(session_id: str, run_id: str, index: int) -> str:
    return f"{session_id}.{run_id}.{index}"


def plan_replay(events: Sequence[ConversationEvent], sessions: int = 1, run_id: str | None = None,
                keep_session_ids: bool = False) -> tuple[str, list[ReplayCopy]]:
    """One schedule per copy. Copy i's session ids are `<recorded id>.<run_id>.<i>` (or the
    recorded ids unchanged when `keep_session_ids` and a single copy)."""
    if sessions < 1:
        raise ReplayError(f"sessions must be >= 1, got {sessions}")
    if keep_session_ids and sessions != 1:
        raise ReplayError("keep_session_ids needs sessions == 1 (copies must not share a session)")
    run_id = run_id or uuid.uuid4().hex[:8]
    recorded_sessions = list(dict.fromkeys(e.session_id for e in events))
    copies = []
    for index in range(sessions):
        mapping = {s: (s if keep_session_ids else copy_session_id(s, run_id, index)) for s in recorded_sessions}
        seq: dict[tuple[str, str, str], int] = defaultdict(int)
        schedule = []
        for e in events:
            session_id = mapping[e.session_id]
            if isinstance(e, TextLine):
                key = (e.agent_id, session_id, e.turn_id)
                value = text_event(
                    session_id=session_id, turn_id=e.turn_id, agent_id=e.agent_id, seq=seq[key], kind=e.kind,
                    text=e.text, claim_id=e.claim_id, language=e.language, voice=e.voice, floor=e.floor,
                    priority=e.priority, produced_at_us=0,
                )
                seq[key] += 1
                schedule.append(ScheduledEvent(e.t_ms, "TextEvent", value))
            elif isinstance(e, ControlLine):
                value = cancel_event(session_id, e.turn_id, reason=e.reason, source=e.source or "replay",
                                     issued_at_us=0)
                schedule.append(ScheduledEvent(e.t_ms, "ControlEvent", value))
        copies.append(ReplayCopy(index, mapping, schedule))
    return run_id, copies


async def replay(
    settings: Settings,
    events: Sequence[ConversationEvent],
    speed: float = 1.0,
    sessions: int = 1,
    *,
    publisher: Publisher | None = None,
    run_id: str | None = None,
    keep_session_ids: bool = False,
    on_send: Callable[[int, ScheduledEvent, int], None] | None = None,
) -> ReplayReport:
    """Publish `events` at their recorded timing divided by `speed`, `sessions` copies at once.

    Uses `publisher` when given (it stays open), else owns one for the duration. `on_send(copy
    index, event, sent_at_us)` is called after each record is handed to the producer (benchmarks
    take the first token's time from it). Returns once every record was acked."""
    if not speed > 0:
        raise ReplayError(f"speed must be > 0, got {speed}")
    run_id, copies = plan_replay(events, sessions, run_id, keep_session_ids)
    if publisher is None:
        async with Publisher(settings) as owned:
            return await _run(owned, copies, run_id, speed, on_send)
    return await _run(publisher, copies, run_id, speed, on_send)


async def _run(publisher: Publisher, copies: list[ReplayCopy], run_id: str, speed: float,
               on_send: Callable[[int, ScheduledEvent, int], None] | None) -> ReplayReport:
    # Create every agent topic before the clock starts, so the first send is not late by a
    # topic creation.
    for agent_id in dict.fromkeys(e.value.agent_id for c in copies for e in c.schedule
                                  if isinstance(e.value, TextEvent)):
        await publisher.ensure_agent_topic(agent_id)
    loop = asyncio.get_running_loop()
    start = loop.time()
    report = ReplayReport(run_id, now_us(), copies)

    async def run_copy(copy: ReplayCopy) -> list[asyncio.Future]:
        deliveries = []
        for item in copy.schedule:
            deadline = start + item.t_ms / 1000.0 / speed
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at_us = now_us()
            if isinstance(item.value, TextEvent):
                value = replace(item.value, produced_at_us=sent_at_us)
                deliveries.append(await publisher.publish_text_event(value, wait=False))
            else:
                value = replace(item.value, issued_at_us=sent_at_us)
                deliveries.append(await publisher.publish_control_event(value, wait=False))
            report.lateness_ms.append((loop.time() - deadline) * 1000.0)
            report.events_sent += 1
            if on_send is not None:
                on_send(copy.index, item, sent_at_us)
        return deliveries

    results = await asyncio.gather(*(run_copy(c) for c in copies))
    await asyncio.gather(*(f for deliveries in results for f in deliveries))
    return report


# --- what the listeners heard of a replay ---------------------------------------------------------


def replayed_turns(copies: Sequence[ReplayCopy]) -> list[tuple[str, str]]:
    """(session id as published, turn id) of every turn of every copy, in the order they start."""
    return list(dict.fromkeys((e.value.session_id, e.value.turn_id) for c in copies for e in c.schedule
                              if e.value.turn_id))


class HeardCollector:
    """A `HeardFollower` callback keeping the TurnHeard of the given turns published at or after
    ``since_us`` (a replay under recorded session ids must not report an earlier run's turn)."""

    def __init__(self, turns: Sequence[tuple[str, str]], since_us: int) -> None:
        self.turns = list(dict.fromkeys(turns))
        self.since_us = since_us
        self.heard: dict[tuple[str, str], TurnHeard] = {}
        self._all = asyncio.Event()
        if not self.turns:
            self._all.set()

    def __call__(self, record: TurnHeard) -> None:
        key = (record.session_id, record.turn_id)
        if key in self.turns and record.published_at_us >= self.since_us:
            self.heard[key] = record
            if len(self.heard) == len(self.turns):
                self._all.set()

    async def wait(self, timeout_s: float) -> dict[tuple[str, str], TurnHeard]:
        """The TurnHeard collected for each turn once every turn has one or ``timeout_s`` passed."""
        try:
            await asyncio.wait_for(self._all.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return dict(self.heard)


def describe_heard(turns: Sequence[tuple[str, str]], heard: dict[tuple[str, str], TurnHeard],
                   timeout_s: float) -> list[str]:
    """One line per turn: what its listeners heard (TurnHeard), or that no player reported it."""
    lines = []
    for session_id, turn_id in turns:
        record = heard.get((session_id, turn_id))
        if record is None:
            lines.append(f"  {session_id} {turn_id}: no TurnHeard within {timeout_s:g} s "
                         "(no player on the session, or none that reports what it rendered)")
            continue
        unheard = list(record.unheard_words)
        how = "interrupted, heard" if record.interrupted else "heard whole"
        tail = (f" ({len(unheard)} words not heard: {' '.join(unheard[:8])}{' ...' if len(unheard) > 8 else ''})"
                if unheard else "")
        lines.append(f"  {session_id} {turn_id}: {how}: {record.heard_text!r}{tail}")
    return lines
