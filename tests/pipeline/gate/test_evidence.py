"""Evidence gating rules (pure): hold behind pending marks, release in order, drop failed claims,
early resolutions, hold timeouts, JSON state round trip."""

import json

import pytest

from voicebus.gate.evidence import (
    FAILED,
    READY,
    Dropped,
    EarlyResolutions,
    EvidenceError,
    EvidenceGate,
    Released,
)

S = 1_000_000


def texts(events):
    return [(type(e).__name__, e.payload) for e in events]


def roundtrip(gate: EvidenceGate) -> EvidenceGate:
    return EvidenceGate.from_state(json.loads(json.dumps(gate.to_state())), gate.hold_timeout_us, gate.hold_timeout_policy)


def test_sentences_before_the_first_mark_flow_at_once():
    g = EvidenceGate(10 * S)
    g.offer(6, "Hello.")
    assert texts(g.drain()) == [("Released", "Hello.")]
    g.place("c1", 7, 0)
    g.offer(12, "Before.")  # ends after the mark: held
    assert g.drain() == []
    assert g.held == 1


def test_held_until_every_earlier_mark_is_ready_then_in_order():
    g = EvidenceGate(10 * S)
    g.place("c1", 0, 0)
    g.offer(10, "A.")
    g.place("c2", 10, 0)
    g.offer(20, "B.")
    g.offer(30, "C.")
    assert g.resolve("c2", READY, 1) is True
    assert g.drain() == []  # c1 still pending holds everything behind it
    assert g.resolve("c1", READY, 2) is True
    out = g.drain()
    assert texts(out) == [("Released", "A."), ("Released", "B."), ("Released", "C.")]
    assert [e.claim_id for e in out] == ["c1", "c2", "c2"]


def test_a_sentence_spanning_the_mark_is_held():
    g = EvidenceGate(10 * S)
    g.place("c1", 15, 0)  # "The capital is " | "Paris."
    g.offer(21, "The capital is Paris.")
    assert g.drain() == []
    g.resolve("c1", READY, 1)
    assert texts(g.drain()) == [("Released", "The capital is Paris.")]


def test_failed_drops_only_that_claims_text_and_flags_the_first_drop():
    g = EvidenceGate(10 * S)
    g.place("c1", 0, 0)
    g.offer(10, "A1.")
    g.offer(20, "A2.")
    g.place("c2", 20, 0)
    g.offer(30, "B.")
    g.resolve("c1", FAILED, 1)
    g.resolve("c2", READY, 1)
    out = g.drain()
    assert [type(e) for e in out] == [Dropped, Dropped, Released]
    assert [getattr(e, "first", None) for e in out] == [True, False, None]
    assert out[0].reason == "failed" and out[0].claim_id == "c1"
    # text of the failed claim that arrives later is dropped too, without a second notice
    g2 = EvidenceGate(10 * S)
    g2.place("c", 0, 0)
    g2.resolve("c", FAILED, 0)
    g2.offer(5, "x.")
    assert [(type(e), e.first) for e in g2.drain()] == [(Dropped, True)]
    g2.offer(9, "y.")
    assert [(type(e), e.first) for e in g2.drain()] == [(Dropped, False)]


def test_early_resolution_applies_when_the_mark_arrives():
    early = EarlyResolutions()
    early.add("c1", READY, 5)
    g = EvidenceGate(10 * S)
    g.place("c1", 0, 10, early=early.take("c1", 10))
    g.offer(5, "A.")
    assert texts(g.drain()) == [("Released", "A.")]
    assert len(early) == 0
    early.add("c2", FAILED, 5)
    g.place("c2", 5, 10, early=early.take("c2", 10))
    g.offer(9, "B.")
    assert [type(e) for e in g.drain()] == [Dropped]


def test_early_resolutions_are_bounded_by_count_and_age():
    early = EarlyResolutions(max_entries=2, max_age_us=100)
    early.add("a", READY, 0)
    early.add("b", READY, 0)
    early.add("c", READY, 0)
    assert list(early) == ["b", "c"]
    assert early.take("b", 101) is None  # too old
    again = EarlyResolutions.from_state(json.loads(json.dumps(early.to_state())))
    assert list(again) == list(early)


@pytest.mark.parametrize("policy, kind", [("release", Released), ("drop", Dropped)])
def test_hold_timeout_policy(policy, kind):
    g = EvidenceGate(2 * S, policy)
    g.place("lost", 0, 1 * S)
    g.offer(5, "A.")
    assert g.next_deadline_us() == 3 * S
    assert g.expire(3 * S - 1) == []
    assert g.drain() == []
    assert g.expire(3 * S) == ["lost"]
    out = g.drain()
    assert [type(e) for e in out] == [kind]
    if kind is Dropped:
        assert out[0].reason == "timeout"
    assert g.next_deadline_us() is None
    assert g.resolve("lost", READY, 4 * S) is False  # too late: the policy already decided


def test_unknown_policy_and_status_are_typed_errors():
    with pytest.raises(EvidenceError):
        EvidenceGate(S, "maybe")
    with pytest.raises(EvidenceError):
        EvidenceGate(S).resolve("c", "perhaps", 0)


def test_state_round_trips_through_json_mid_hold():
    g = EvidenceGate(10 * S)
    g.offer(3, "A.")
    g.drain()
    g.place("c1", 3, 7)
    g.offer(9, {"text": "B.", "seq": 1})
    g2 = roundtrip(g)
    assert g2.drain() == []
    g2.resolve("c1", READY, 8)
    assert texts(g2.drain()) == [("Released", {"text": "B.", "seq": 1})]
