"""A session's floor: which of its turns speaks now, which wait, and what the waiting ones hold.

Several agents may speak into one session. The listener must hear whole turns, never two spliced
sentence by sentence, so the gate (the one place that sees all of a session's turns) gives the
floor to one turn at a time. `Floor` is pure, like the rest of the gate's core: the clock comes in
as ``now_us`` arguments and the whole state is a JSON-serialisable dict, stored with the session's.

The rules (docs/protocol.md, "The floor"):

- A turn that opens while no turn holds the floor gets it at once.
- Otherwise it *preempts* when its priority is above the holder's, or when its policy is
  ``preempt`` and its priority is not below the holder's; else it *queues*.
- A queued turn's requests are held here (its text is still segmented and released as usual) and
  go out, in order, the moment the turn gets the floor: when the holder's last request
  (``is_last_in_turn``) has gone out, or the holder is cancelled. Waiting turns get the floor in
  priority order, then in the order they opened. At most ``max_waiting`` turns wait; a turn
  beyond that is refused.
- A preempting turn waits too, at the head of the queue, until its first request is released;
  only then is the holder cut (the gate publishes a cancel for it), so the listener hears the old
  turn until the new one has something to say, not silence.
- A turn's audio plays on after its text has ended: the turn that last ended holding the floor
  (`recent`) may still be heard. A turn that would preempt it is granted the floor at once, and
  cuts it too at its first request (a cancel of a turn already played to its end changes nothing:
  the edge has reported what was heard of it, and later reports are ignored).

What a holder has released goes out as it is released, so the worker synthesizes a queued turn's
first sentences right after the holder's last ones, while the holder's audio still plays.
"""

from __future__ import annotations

import logging

from voicebus.schemas.contract import FLOOR_PREEMPT, FLOOR_QUEUE, FloorEventKind
from voicebus.schemas.messages import SynthesisRequest, TextEvent

log = logging.getLogger(__name__)

# The floor's events, as the FloorEvent schema names them (schemas/floor_event.avsc).
GRANTED = FloorEventKind.GRANTED  # the turn got the floor (at once, or after waiting)
QUEUED = FloorEventKind.QUEUED  # the turn waits behind the holder
PREEMPTING = FloorEventKind.PREEMPTING  # the turn will cut the holder once it has its first sentence
CUT = FloorEventKind.CUT  # the turn was speaking (or about to) and was preempted
REFUSED = FloorEventKind.REFUSED  # too many turns waiting: the turn is ended with nothing spoken


class Floor:
    """One session's floor. Feed it the turns that open (`open`) and every request the session
    produces (`route`); it returns what may go out now and which turns were cut."""

    def __init__(self, max_waiting: int, state: dict | None = None) -> None:
        state = state or {}
        self.max_waiting = max_waiting
        self.holder: str | None = state.get("holder")
        self.holder_priority: int = state.get("holder_priority", 0)
        # The turn that last ended holding the floor (its audio may still play): {"turn", "priority"}.
        self.recent: dict | None = state.get("recent")
        self.cut_pending_by: str | None = state.get("cut_pending_by")  # granted, cuts `recent` when it speaks
        # Waiting turns in the order they get the floor: {"turn", "priority", "opened_us", "preempt"}.
        self.waiting: list[dict] = [dict(w) for w in state.get("waiting", [])]
        # Waiting turns' requests, as records (the state is JSON), in the order they were released.
        self.held: dict[str, list[dict]] = {t: list(r) for t, r in state.get("held", {}).items()}
        # Floor events since the last `take_events` (not part of the state).
        self.events: list[dict] = []

    def to_state(self) -> dict:
        return {"holder": self.holder, "holder_priority": self.holder_priority, "recent": self.recent,
                "cut_pending_by": self.cut_pending_by, "waiting": self.waiting, "held": self.held}

    # --- turns ---------------------------------------------------------------------------------
    def open(self, turn_id: str, policy: str, priority: int, now_us: int) -> tuple[str, list[tuple[str, str]]]:
        """A turn opened. Returns its fate (`GRANTED`, `QUEUED`, `PREEMPTING` or `REFUSED`) and the
        turns cut now (a pending preempter replaced by a newer one of the same priority), each as
        (cut turn, the turn that cut it)."""
        def outranks(other: int) -> bool:
            return priority > other or (policy == FLOOR_PREEMPT and priority >= other)

        if self.holder is None:
            self._grant(turn_id, priority, now_us, opened_us=now_us)
            if self.recent is not None and outranks(self.recent["priority"]):
                self.cut_pending_by = turn_id
                self._event(turn_id, PREEMPTING, now_us, now_us)
            return GRANTED, []
        pending = self.waiting[0] if self.waiting and self.waiting[0]["preempt"] else None
        outranks_holder = outranks(self.holder_priority)
        entry = {"turn": turn_id, "priority": priority, "opened_us": now_us, "preempt": False}
        cut: list[tuple[str, str]] = []
        if outranks_holder and (pending is None or priority >= pending["priority"]):
            if pending is not None:
                self.waiting.pop(0)
                if priority == pending["priority"]:
                    # A newer answer replaces one that had not started yet.
                    cut.append((pending["turn"], turn_id))
                    self.held.pop(pending["turn"], None)
                    self._event(pending["turn"], CUT, now_us, pending["opened_us"])
                else:
                    pending["preempt"] = False  # it waits behind the higher one now
                    self._enqueue(pending)
            entry["preempt"] = True
            self.waiting.insert(0, entry)
            self._event(turn_id, PREEMPTING, now_us, now_us)
            return PREEMPTING, cut
        queued = sum(1 for w in self.waiting if not w["preempt"])
        if queued >= self.max_waiting:
            self._event(turn_id, REFUSED, now_us, now_us,
                        reason=f"{queued} turns already wait for the floor (limit {self.max_waiting})")
            return REFUSED, cut
        self._enqueue(entry)
        self._event(turn_id, QUEUED, now_us, now_us)
        return QUEUED, cut

    def close(self, turn_id: str, now_us: int) -> list[SynthesisRequest]:
        """The turn will not speak any more (cancelled): forget what it holds; when it held the
        floor, pass it on. Returns the requests that may go out now."""
        self.held.pop(turn_id, None)
        self.waiting = [w for w in self.waiting if w["turn"] != turn_id]
        if self.cut_pending_by == turn_id:
            self.cut_pending_by = None
        if self.recent is not None and self.recent["turn"] == turn_id:
            self.recent = None
        if self.holder == turn_id:
            self.holder = None  # cancelled: not `recent`, there is nothing of it left to cut
            return self._pass(now_us)
        return []

    def waits(self, turn_id: str) -> bool:
        return any(w["turn"] == turn_id for w in self.waiting)

    # --- requests ------------------------------------------------------------------------------
    def route(self, requests: list[SynthesisRequest],
              now_us: int) -> tuple[list[SynthesisRequest], list[tuple[str, str]]]:
        """The session's requests, in the order it produced them. Returns those that may go out
        now (in order) and the turns cut, each as (cut turn, the turn that cut it): the caller
        cancels them; their requests are dropped."""
        out: list[SynthesisRequest] = []
        cut: list[tuple[str, str]] = []
        for request in requests:
            turn_id = request.turn_id
            if any(turn_id == gone for gone, _by in cut):
                continue
            head = self.waiting[0] if self.waiting else None
            if head is not None and head["turn"] == turn_id and head["preempt"]:
                # The preempting turn has its first sentence: cut the holder (and the turn before
                # it, whose audio may still play), take the floor.
                for speaking in (self.holder, self.recent["turn"] if self.recent else None):
                    if speaking is not None:
                        cut.append((speaking, turn_id))
                        self._event(speaking, CUT, now_us, now_us)
                self.holder, self.recent = None, None
                self.waiting.pop(0)
                self._grant(turn_id, head["priority"], now_us, opened_us=head["opened_us"])
            elif turn_id == self.cut_pending_by:
                self.cut_pending_by = None
                if self.recent is not None:
                    cut.append((self.recent["turn"], turn_id))
                    self._event(self.recent["turn"], CUT, now_us, now_us)
                    self.recent = None
            if turn_id == self.holder:
                out.append(request)
                if request.is_last_in_turn:
                    out.extend(self._pass(now_us))
            elif self.waits(turn_id):
                self.held.setdefault(turn_id, []).append(request.to_record())
            else:
                out.append(request)  # a turn outside the floor (refused, or never opened here)
        return out, cut

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    # --- internals -----------------------------------------------------------------------------
    def _enqueue(self, entry: dict) -> None:
        # After every waiting turn of the same or higher priority: priority first, then order.
        at = len(self.waiting)
        for i, w in enumerate(self.waiting):
            if not w["preempt"] and w["priority"] < entry["priority"]:
                at = i
                break
        self.waiting.insert(at, entry)

    def _grant(self, turn_id: str, priority: int, now_us: int, *, opened_us: int) -> None:
        self.holder = turn_id
        self.holder_priority = priority
        self._event(turn_id, GRANTED, now_us, opened_us)

    def _pass(self, now_us: int) -> list[SynthesisRequest]:
        """The holder is done: the next waiting turn gets the floor and its held requests go out
        (and the one after it, when the whole next turn was held already)."""
        if self.holder is not None:
            self.recent = {"turn": self.holder, "priority": self.holder_priority}
        self.holder = None
        out: list[SynthesisRequest] = []
        while self.holder is None and self.waiting:
            nxt = self.waiting.pop(0)
            self._grant(nxt["turn"], nxt["priority"], now_us, opened_us=nxt["opened_us"])
            if nxt["preempt"] and self.recent is not None:
                # The turn it meant to cut ended its text first, but its audio still plays: cut
                # it when this turn has its first sentence, as planned.
                self.cut_pending_by = nxt["turn"]
            held = [SynthesisRequest.from_record(r) for r in self.held.pop(nxt["turn"], [])]
            out.extend(held)
            if any(r.is_last_in_turn for r in held):
                self.recent = {"turn": nxt["turn"], "priority": nxt["priority"]}
                self.holder = None
        return out

    def _event(self, turn_id: str, kind: str, now_us: int, opened_us: int, reason: str = "") -> None:
        self.events.append({"turn_id": turn_id, "event": kind, "at_us": now_us,
                            "waited_us": max(0, now_us - opened_us), "reason": reason})


def turn_floor(event: TextEvent, default_policy: str) -> tuple[str, int]:
    """A turn's floor policy and priority, from its first event (absent fields: the defaults)."""
    policy = event.floor or default_policy
    if policy not in (FLOOR_QUEUE, FLOOR_PREEMPT):
        policy = default_policy
    return policy, int(event.priority or 0)
