"""What a named case of `voicebus bench hostile` reports: its `Observation`, and the names of the
observables (a counter, a dead letter's header) the cases read. Shared by the cases of
`voicebus.ops.bench.hostile_cases` and `voicebus.ops.bench.hostile_faults`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DLQ_COUNTER = "voicebus_records_dead_lettered_total"
REASON_HEADER = "voicebus.error.reason"


@dataclass
class Observation:
    """What one case saw: whether the rejection was reported, how, and the figures behind it."""

    reported: bool
    reason: str
    inputs: int
    detail: dict[str, Any] = field(default_factory=dict)
