"""Per-stage latency of a turn, from the timestamps every message carries.

A turn's first audio passes these stages; each is reported in milliseconds after the turn's
first token was produced (all clocks are this machine's wall clock, epoch µs):

    first sentence complete -> released by the gate -> request received by a worker ->
    synthesis start -> first audio ready -> published -> edge received -> sent to the client ->
    received by the client (time to first audio) -> audible (browser players only)
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from voicebus.schemas.messages import SynthesisRequest, TextEvent

STAGES = [
    ("sentence complete", "text_complete_at_us"),
    ("released", "released_at_us"),
    ("request received", "request_received_at_us"),
    ("synthesis start", "synthesis_started_at_us"),
    ("first audio", "audio_ready_at_us"),
    ("published", "published_at_us"),
    ("edge received", "edge_received_at_us"),
    ("sent", "sent_at_us"),
]


def first_audio_stages(timeline: dict, received_at_us: int | None, audible_at_us: int | None = None) -> dict[str, float]:
    """Stage times (ms after the first token) of the sentence that carried the first audio."""
    origin = timeline["first_token_at_us"]
    out = {name: (timeline[key] - origin) / 1000 for name, key in STAGES if timeline.get(key)}
    if received_at_us:
        out["received"] = (received_at_us - origin) / 1000
    if audible_at_us:
        out["audible"] = (audible_at_us - origin) / 1000
    return out


def model_ttfa_ms(timeline: dict) -> float:
    """The model's own time to first audio for that sentence (synthesis start -> first audio)."""
    return (timeline["audio_ready_at_us"] - timeline["synthesis_started_at_us"]) / 1000


def overhead_ms(timeline: dict, received_at_us: int) -> float:
    """What the bus, gate, worker queue and edge add: time to first audio minus the wait for the
    first sentence's text minus the model's own time to first audio."""
    ttfa = (received_at_us - timeline["first_token_at_us"]) / 1000
    text_wait = (timeline["text_complete_at_us"] - timeline["first_token_at_us"]) / 1000
    return ttfa - text_wait - model_ttfa_ms(timeline)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of `values`; nan when empty."""
    data = sorted(values)
    if not data:
        return float("nan")
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary(values: Iterable[float]) -> dict[str, float]:
    data = list(values)
    return {
        "n": len(data),
        "p50": percentile(data, 50),
        "p95": percentile(data, 95),
        "mean": statistics.fmean(data) if data else float("nan"),
    }


def release_latencies_ms(events: Sequence[TextEvent], requests: Sequence[SynthesisRequest],
                         settings=None) -> list[float]:
    """Release latency of each sentence of one turn: from the moment the text
    event that released the sentence was produced (``produced_at_us``; the event the gate's pure
    core releases the sentence on, found by replaying the turn's events offline through
    `GateSession` with the gate's config) to the request's ``released_at_us``. `events` are the
    turn's TextEvents, `requests` its SynthesisRequests (any order). With speculative release a
    sentence is released by its tentative request (its confirmation carries no text; a
    replacement releases it anew). Requests whose text differs from the replay's (a config that
    differs from the gate's), withdrawn ones and empty end-of-turn requests are left out."""
    from voicebus.gate.core import GateConfig, GateSession

    ordered = sorted(events, key=lambda e: e.seq)
    if not ordered:
        return []
    config = GateConfig() if settings is None else GateConfig.from_settings(settings)
    core = GateSession(ordered[0].session_id, config)
    released_by = _releases((event.produced_at_us, r) for event in ordered for r in core.apply(event, 0))
    sent = _releases((r.released_at_us, r) for r in sorted(requests, key=lambda r: r.released_at_us))
    out = []
    for seq in sorted(released_by):
        produced_us, text = released_by[seq]
        if seq in sent and sent[seq][1] == text:
            out.append((sent[seq][0] - produced_us) / 1000)
    return out


def _releases(stamped) -> dict[int, tuple[int, str]]:
    """sentence_seq -> (when, text) of the request that released each sentence still standing:
    a request with text releases it (a tentative one, or a replacement); a confirmation (no text,
    not tentative) keeps the tentative release; a withdrawal (no text, tentative) removes it."""
    out: dict[int, tuple[int, str]] = {}
    for at, request in stamped:
        seq, text = request.sentence_seq, request.text
        if text:
            out[seq] = (at, text)
        elif request.tentative:
            out.pop(seq, None)
    return out
