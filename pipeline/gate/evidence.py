"""Evidence gating for one turn: which sentences may be spoken now, which wait, which are dropped.

An agent marks a claim *pending* in its token stream (EVIDENCE_PENDING with a claim id) while a
retrieval is still running, and someone (the agent, or another service on its own topic) later
resolves it *ready* or *failed*. This module owns the rules, as a pure core driven by explicit
``now_us`` arguments (no clock, no Kafka):

- A mark sits at a character offset of the turn's text (everything fed to the segmenter so far
  when the mark arrived). A sentence is *behind* a mark when any of its characters comes after
  the mark (``mark.offset < sentence.end``).
- A sentence is released when every mark it is behind is resolved. Sentences are released in
  order: one waiting sentence holds back every sentence after it.
- A sentence *belongs* to the last mark it is behind (the claim's text runs from its mark to the
  next mark or the end of the turn). When that claim failed, the sentence is dropped instead of
  released; the first dropped sentence of a claim comes out as a `Dropped` with ``first=True`` so
  the caller can put a notice in its place (see docs/gate.md for what the listener hears).
- A resolution may arrive before its mark: `EarlyResolutions` keeps it (per session, bounded by
  count and age) until the mark arrives.
- A mark still pending ``hold_timeout_us`` after it arrived is resolved by the hold-timeout
  policy: ``release`` (as if ready) or ``drop`` (as if failed, reason ``timeout``).

Every state is a plain JSON-serialisable dict (`to_state` / `from_state`), because the gate keeps
it in its changelog.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

PENDING = "pending"
READY = "ready"
FAILED = "failed"

POLICY_RELEASE = "release"
POLICY_DROP = "drop"
HOLD_TIMEOUT_POLICIES = (POLICY_RELEASE, POLICY_DROP)

REASON_FAILED = "failed"
REASON_TIMEOUT = "timeout"


class EvidenceError(ValueError):
    """An evidence event or setting the gate cannot act on (unknown status, bad policy, ...)."""

    reason = "gate-rejected"  # the dead-letter header's reason


@dataclass
class Mark:
    claim_id: str
    offset: int
    placed_at_us: int
    status: str = PENDING
    reason: str = ""  # why it resolved: "" (ready in time), "failed", "timeout"
    resolved_at_us: int = -1
    notice_given: bool = False

    def to_state(self) -> list:
        return [self.claim_id, self.offset, self.placed_at_us, self.status, self.reason,
                self.resolved_at_us, self.notice_given]

    @classmethod
    def from_state(cls, s: list) -> "Mark":
        return cls(*s)


@dataclass(frozen=True)
class Released:
    """A held (or never held) sentence that may be spoken now."""

    payload: Any
    claim_id: str | None  # the claim it belongs to, None when before every mark


@dataclass(frozen=True)
class Dropped:
    """A sentence of a failed (or dropped on timeout) claim; it must not be spoken."""

    payload: Any
    claim_id: str
    reason: str  # "failed" or "timeout"
    first: bool  # the first dropped sentence of this claim: where a notice goes


@dataclass
class EvidenceGate:
    """The evidence marks of one turn and the queue of sentences waiting behind them.

    `payload`s are the caller's JSON-serialisable sentence records; the gate only reads their
    end offset, given alongside.
    """

    hold_timeout_us: int
    hold_timeout_policy: str = POLICY_RELEASE
    marks: list[Mark] = field(default_factory=list)
    queue: list[tuple[int, Any]] = field(default_factory=list)  # (end offset, payload), in order

    def __post_init__(self) -> None:
        if self.hold_timeout_policy not in HOLD_TIMEOUT_POLICIES:
            raise EvidenceError(
                f"hold timeout policy {self.hold_timeout_policy!r} is not one of {HOLD_TIMEOUT_POLICIES}"
            )

    # --- input ---------------------------------------------------------------------------------
    def place(self, claim_id: str, offset: int, now_us: int, early: tuple[str, int] | None = None) -> None:
        """A pending mark at `offset`; `early` is a resolution (status, at_us) that came first."""
        if self.mark(claim_id) is not None:
            return  # the same claim marked twice in one turn: the first mark counts
        if self.marks and offset < self.marks[-1].offset:
            raise EvidenceError(f"mark {claim_id!r} at {offset} is before the previous mark")
        mark = Mark(claim_id, offset, now_us)
        self.marks.append(mark)
        if early is not None:
            status, at_us = early
            self._resolve(mark, status, REASON_FAILED if status == FAILED else "", at_us)

    def resolve(self, claim_id: str, status: str, now_us: int) -> bool:
        """Resolve the pending mark of `claim_id`; False when this turn has no such pending mark."""
        if status not in (READY, FAILED):
            raise EvidenceError(f"evidence status {status!r} is not {READY!r} or {FAILED!r}")
        mark = self.mark(claim_id)
        if mark is None or mark.status != PENDING:
            return False
        self._resolve(mark, status, REASON_FAILED if status == FAILED else "", now_us)
        return True

    def offer(self, end: int, payload: Any) -> None:
        """A complete sentence ending at character offset `end` (exclusive), in order."""
        self.queue.append((end, payload))

    def expire(self, now_us: int) -> list[str]:
        """Resolve every mark pending for `hold_timeout_us` or longer by the policy; their ids."""
        expired = []
        for mark in self.marks:
            if mark.status == PENDING and now_us - mark.placed_at_us >= self.hold_timeout_us:
                status = READY if self.hold_timeout_policy == POLICY_RELEASE else FAILED
                self._resolve(mark, status, REASON_TIMEOUT, now_us)
                expired.append(mark.claim_id)
        return expired

    # --- output --------------------------------------------------------------------------------
    def drain(self) -> list[Released | Dropped]:
        """Every queued sentence that is no longer held, in order; stops at the first held one."""
        out: list[Released | Dropped] = []
        while self.queue:
            end, payload = self.queue[0]
            behind = [m for m in self.marks if m.offset < end]
            if any(m.status == PENDING for m in behind):
                break
            self.queue.pop(0)
            owner = behind[-1] if behind else None
            if owner is not None and owner.status == FAILED:
                out.append(Dropped(payload, owner.claim_id, owner.reason, not owner.notice_given))
                owner.notice_given = True
            else:
                out.append(Released(payload, owner.claim_id if owner else None))
        return out

    # --- queries -------------------------------------------------------------------------------
    def mark(self, claim_id: str) -> Mark | None:
        for m in self.marks:
            if m.claim_id == claim_id:
                return m
        return None

    def pending_claims(self) -> list[str]:
        return [m.claim_id for m in self.marks if m.status == PENDING]

    @property
    def held(self) -> int:
        """How many complete sentences wait behind a pending mark."""
        return len(self.queue)

    def next_deadline_us(self) -> int | None:
        """When the earliest pending mark times out (None: nothing pending)."""
        pending = [m.placed_at_us + self.hold_timeout_us for m in self.marks if m.status == PENDING]
        return min(pending) if pending else None

    def clear(self) -> None:
        """Forget queued sentences (cancel); marks stay so late resolutions are recognised."""
        self.queue.clear()

    # --- state ---------------------------------------------------------------------------------
    def to_state(self) -> dict:
        return {"marks": [m.to_state() for m in self.marks], "queue": [[e, p] for e, p in self.queue]}

    @classmethod
    def from_state(cls, state: dict, hold_timeout_us: int, hold_timeout_policy: str) -> "EvidenceGate":
        return cls(
            hold_timeout_us,
            hold_timeout_policy,
            [Mark.from_state(m) for m in state.get("marks", [])],
            [(e, p) for e, p in state.get("queue", [])],
        )

    @staticmethod
    def _resolve(mark: Mark, status: str, reason: str, now_us: int) -> None:
        mark.status = status
        mark.reason = reason
        mark.resolved_at_us = now_us


@dataclass
class EarlyResolutions:
    """Resolutions (ready/failed) that arrived before their pending mark, for one session.

    Kept until the mark arrives, at most `max_entries` (oldest forgotten first) and at most
    `max_age_us` old: a resolution whose mark never comes must not live forever.
    """

    max_entries: int = 256
    max_age_us: int = 10 * 60 * 1_000_000
    entries: dict[str, tuple[str, int]] = field(default_factory=dict)  # claim id -> (status, at_us)

    def add(self, claim_id: str, status: str, now_us: int) -> None:
        if status not in (READY, FAILED):
            raise EvidenceError(f"evidence status {status!r} is not {READY!r} or {FAILED!r}")
        self.entries.pop(claim_id, None)
        self.entries[claim_id] = (status, now_us)
        while len(self.entries) > self.max_entries:
            self.entries.pop(next(iter(self.entries)))

    def take(self, claim_id: str, now_us: int) -> tuple[str, int] | None:
        self.prune(now_us)
        return self.entries.pop(claim_id, None)

    def prune(self, now_us: int) -> None:
        for claim_id in [c for c, (_, at) in self.entries.items() if now_us - at > self.max_age_us]:
            del self.entries[claim_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def to_state(self) -> dict:
        return {c: [s, at] for c, (s, at) in self.entries.items()}

    @classmethod
    def from_state(cls, state: dict, **limits: int) -> "EarlyResolutions":
        return cls(**limits, entries={c: (s, at) for c, (s, at) in state.items()})
