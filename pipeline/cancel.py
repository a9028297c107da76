"""Cancellation state: which turns (or whole sessions) were cancelled, as every stage sees it.

A `ControlEvent` with action CANCEL names a session and either one turn or, with `turn_id` null,
every turn of the session issued *before* the cancel. `CancelRegistry` is the pure core the gate,
the synthesis workers and the edge share: feed it control events, ask it whether a turn is
cancelled. It is bounded (oldest sessions are forgotten first) so a long-running worker does not
grow without limit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _SessionCancels:
    turns: set[str] = field(default_factory=set)
    all_before_us: int = -1  # every turn whose first event is older than this is cancelled


class CancelRegistry:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self._sessions: OrderedDict[str, _SessionCancels] = OrderedDict()
        self._max_sessions = max_sessions

    def apply(self, event: dict) -> None:
        """Record a decoded ControlEvent (only CANCEL is acted on)."""
        if event.get("action") != "CANCEL":
            return
        self.cancel(event["session_id"], event.get("turn_id"), event.get("issued_at_us", 0))

    def cancel(self, session_id: str, turn_id: str | None, issued_at_us: int = 0) -> None:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _SessionCancels()
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if turn_id is None:
            entry.all_before_us = max(entry.all_before_us, issued_at_us)
        else:
            entry.turns.add(turn_id)

    def is_cancelled(self, session_id: str, turn_id: str, turn_started_at_us: int | None = None) -> bool:
        """Whether `turn_id` of `session_id` is cancelled. A whole-session cancel covers the turns
        that started before it was issued (`turn_started_at_us`; unknown start: covered)."""
        entry = self._sessions.get(session_id)
        if entry is None:
            return False
        if turn_id in entry.turns:
            return True
        if entry.all_before_us >= 0:
            return turn_started_at_us is None or turn_started_at_us <= entry.all_before_us
        return False
