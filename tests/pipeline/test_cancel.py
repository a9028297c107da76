"""`voicebus.cancel.CancelRegistry`, the cancel state gate, workers and edge share (pure)."""

from __future__ import annotations

from voicebus.cancel import MAX_TURNS_PER_SESSION, CancelRegistry
from voicebus.schemas.messages import ControlEvent


def _cancel(session: str, turn: str | None = None, turn_ids=(), issued_at_us: int = 1) -> ControlEvent:
    return ControlEvent.cancel(session, turn, source="test", issued_at_us=issued_at_us, turn_ids=turn_ids)


def test_a_flood_of_made_up_turn_ids_keeps_at_most_the_bound_per_session():
    registry = CancelRegistry()
    registry.observe("s", "real")
    registry.apply(_cancel("s", "real"))
    for i in range(10_000):
        registry.apply(_cancel("s", f"made-up-{i}"))
    registry.apply(_cancel("s", None, [f"listed-{i}" for i in range(5_000)]))
    assert len(registry.cancelled_turns("s")) == MAX_TURNS_PER_SESSION
    assert len(registry._sessions["s"].seen) <= MAX_TURNS_PER_SESSION
    assert registry.is_cancelled("s", "listed-4999") and not registry.is_cancelled("s", "made-up-0")


def test_cancels_for_made_up_sessions_keep_at_most_the_session_bound():
    registry = CancelRegistry(max_sessions=100)
    registry.observe("kept", "t1")
    for i in range(5_000):
        registry.apply(_cancel(f"made-up-{i}", "t"))
        if i % 50 == 0:
            registry.observe("kept", "t1")  # touched: the least recently touched go first
    assert len(registry) == 100 and "kept" in registry._sessions


def test_a_whole_session_cancel_covers_the_turns_seen_not_later_ones_whatever_its_timestamp():
    registry = CancelRegistry()
    registry.observe("s", "before")
    assert registry.apply(_cancel("s", None, issued_at_us=2**62)) == {"before"}  # far future: no clock compared
    registry.observe("s", "after")
    assert registry.is_cancelled("s", "before") and not registry.is_cancelled("s", "after")
    assert registry.apply(_cancel("s", None, ["not-seen-yet"])) == {"not-seen-yet"}  # a gate resolution
    assert registry.is_cancelled("s", "not-seen-yet")
