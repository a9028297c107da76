"""Cancellation state: which turns were cancelled, as one stage sees it. No clocks compared.

A `ControlEvent` with action CANCEL names a session and either one turn (``turn_id``) or, with
``turn_id`` null, the turns listed in ``turn_ids`` — or, when that list is empty, every turn of
the session that the applying stage has seen so far (`observe`). A whole-session cancel used to
cover the turns "started before ``issued_at_us``", comparing the canceller's wall clock with the
agent's: a clock ahead by d cancelled turns started in the next d, and a far-future timestamp
muted a session for good. Now the order of events at each stage decides, and the gate, which sees
a session's text and control in one place, publishes the turns it cancelled for a whole-session
cancel (a resolution with ``turn_ids``), so a stage that had not seen one of them yet drops it
when it comes.

`CancelRegistry` is the pure core the gate's shell, the synthesis workers and the edge share. It
is bounded: at most ``max_sessions`` sessions (least recently touched forgotten first), and per
session at most ``max_turns`` seen turns and ``max_turns`` cancelled turn ids (oldest forgotten
first), so a client sending cancels with arbitrary turn ids cannot grow it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from voicebus.schemas.messages import ControlEvent

MAX_SESSIONS = 100_000
MAX_TURNS_PER_SESSION = 64


def _remember(ids: OrderedDict[str, None], turn_id: str, limit: int) -> bool:
    """Add ``turn_id`` (newest last); True when it was not there yet."""
    new = turn_id not in ids
    ids[turn_id] = None
    ids.move_to_end(turn_id)
    while len(ids) > limit:
        ids.popitem(last=False)
    return new


@dataclass
class _SessionCancels:
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    cancelled: OrderedDict[str, None] = field(default_factory=OrderedDict)


class CancelRegistry:
    def __init__(self, max_sessions: int = MAX_SESSIONS, max_turns: int = MAX_TURNS_PER_SESSION) -> None:
        self._sessions: OrderedDict[str, _SessionCancels] = OrderedDict()
        self._max_sessions = max_sessions
        self._max_turns = max_turns

    def __len__(self) -> int:
        return len(self._sessions)

    def _entry(self, session_id: str) -> _SessionCancels:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _SessionCancels()
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        return entry

    def observe(self, session_id: str, turn_id: str) -> None:
        """This stage saw ``turn_id`` of ``session_id`` (a later whole-session cancel covers it)."""
        _remember(self._entry(session_id).seen, turn_id, self._max_turns)

    def apply(self, event: ControlEvent) -> set[str]:
        """Record a ControlEvent; returns the turn ids it newly cancelled."""
        if not event.is_cancel:
            return set()
        return self.cancel(event.session_id, event.turn_id, event.turn_ids)

    def cancel(self, session_id: str, turn_id: str | None, turn_ids: tuple[str, ...] | list[str] = ()) -> set[str]:
        """Cancel one turn, the listed turns, or (neither) every turn seen of the session."""
        entry = self._entry(session_id)
        if turn_id is not None:
            targets = [turn_id]
        elif turn_ids:
            targets = list(turn_ids)
        else:
            targets = list(entry.seen)
        return {t for t in targets if _remember(entry.cancelled, t, self._max_turns)}

    def is_cancelled(self, session_id: str, turn_id: str) -> bool:
        entry = self._sessions.get(session_id)
        return entry is not None and turn_id in entry.cancelled

    def cancelled_turns(self, session_id: str) -> list[str]:
        entry = self._sessions.get(session_id)
        return list(entry.cancelled) if entry is not None else []
