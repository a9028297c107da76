"""The gate core (pure): segmenter + evidence + cancel for one session, requests out."""

import json

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from voicebus.gate.core import FAILURE_NOTICES, Gate, GateConfig, GateInputError, GateSession, gate_sentences
from voicebus.schemas.contract import SEGMENTER_LANGUAGE
from voicebus.settings import Settings, SettingsError
from voicebus.schemas.messages import ControlEvent, TextEvent

S = 1_000_000
# The requests of the segmenter and evidence rules, one per sentence: speculation off (its own
# tests below run it on, and check that after settlement it gives exactly these requests).
CONFIG = GateConfig.from_settings(Settings(hold_timeout_s=2.0, speculative_release=False))


class Turn:
    """Writes one agent's TextEvents for one turn, numbering them like an agent does."""

    def __init__(self, turn="t1", session="s1", agent="llm", t0=1_000 * S, **fields):
        self.session, self.turn, self.agent, self.t = session, turn, agent, t0
        self.seq = 0
        self.fields = fields

    def _event(self, kind, text="", claim_id=None, **extra):
        self.t += 1000
        event = TextEvent.from_record({
            "session_id": self.session, "turn_id": self.turn, "agent_id": self.agent, "seq": self.seq,
            "kind": kind, "text": text, "claim_id": claim_id, "language": None, "voice": None,
            "produced_at_us": self.t, **self.fields, **extra})
        self.seq += 1
        return event

    def tokens(self, text, size=3):
        return [self._event("TOKEN", text[i:i + size]) for i in range(0, len(text), size)]

    def pending(self, claim):
        return self._event("EVIDENCE_PENDING", claim_id=claim)

    def ready(self, claim):
        return self._event("EVIDENCE_READY", claim_id=claim)

    def failed(self, claim):
        return self._event("EVIDENCE_FAILED", claim_id=claim)

    def end(self):
        return self._event("END_OF_TURN")


def cancel(session="s1", turn=None, at=0, turn_ids=()):
    return ControlEvent.cancel(session, turn, reason="barge-in", source="test", issued_at_us=at, turn_ids=turn_ids)


def run(events, config=CONFIG):
    gate = Gate(config)
    out = []
    for i, e in enumerate(events):
        out.extend(gate.apply(e, 5_000 * S + i))
    return out, gate


def texts(requests):
    return [r.text for r in requests]


def test_a_turn_becomes_ordered_requests_with_the_last_flagged():
    t = Turn()
    out, _ = run(t.tokens("Hello there. How are you today? ") + [t.end()])
    assert texts(out) == ["Hello there.", "How are you today?"]
    assert [r.sentence_seq for r in out] == [0, 1]
    assert [r.is_last_in_turn for r in out] == [False, True]
    first = out[0]
    assert (first.language, first.voice, first.speed) == ("a", "af_heart", 1.0)
    assert first.first_token_at_us == 1_000 * S + 1000
    assert first.text_complete_at_us <= first.released_at_us


def test_a_turn_speaks_at_its_own_speed_through_a_restart():
    t = Turn(speed=1.5)
    session = GateSession("s1", CONFIG)
    events = t.tokens("Fast words here. Then more words. ") + [t.end()]
    out = [r for i, e in enumerate(events[:4]) for r in session.apply(e, 5_000 * S + i)]
    # the speed is in the session's state: a gate that restarts keeps it
    restored = GateSession.from_state("s1", CONFIG, json.loads(json.dumps(session.to_state())))
    out += [r for i, e in enumerate(events[4:]) for r in restored.apply(e, 6_000 * S + i)]
    assert texts(out) == ["Fast words here.", "Then more words."]
    assert [r.speed for r in out] == [1.5, 1.5]
    other = Turn(turn="t2")
    assert {r.speed for r in run(other.tokens("Normal pace. ") + [other.end()])[0]} == {1.0}


def test_a_sentence_is_released_before_the_end_of_turn():
    t = Turn()
    gate = Gate(CONFIG)
    released_at = []
    for i, e in enumerate(t.tokens("It works. Then more", size=2)):
        if gate.apply(e, i):
            released_at.append(i)
    assert released_at, "the first sentence must not wait for END_OF_TURN"


def test_languages_map_to_kokoro_codes_and_voices():
    es = Turn(turn="es", language="es")
    pt = Turn(turn="pt", language="pt", voice="pm_alex")
    out, _ = run(es.tokens("Hola. ") + [es.end()] + pt.tokens("Olá. ") + [pt.end()])
    assert [(r.language, r.voice) for r in out] == [("e", "ef_dora"), ("p", "pm_alex")]
    with pytest.raises(GateInputError):
        run(Turn(language="klingon").tokens("Qapla'."))


def test_a_japanese_turn_is_segmented_without_spaces_and_gets_a_japanese_voice():
    ja = Turn(turn="ja", language="ja")
    out, _ = run(ja.tokens("今日は晴れです。明日は雨です！") + [ja.end()])
    assert [(r.text, r.language, r.voice) for r in out if r.text] == [
        ("今日は晴れです。", "j", "jf_alpha"), ("明日は雨です！", "j", "jf_alpha")]
    assert set(FAILURE_NOTICES) == set(SEGMENTER_LANGUAGE.values())  # a notice in every language


def test_redelivered_events_repeat_nothing():
    t = Turn()
    events = t.tokens("One. Two. Three. ") + [t.end()]
    once, _ = run(events)
    twice, _ = run(events[:7] + events[2:] + events)
    assert texts(twice) == texts(once)
    assert [r.sentence_seq for r in twice] == [0, 1, 2]


def test_end_of_turn_after_everything_was_released_sends_an_empty_last_request():
    t = Turn()
    out, _ = run([t.end()])
    assert [(r.text, r.is_last_in_turn, r.sentence_seq) for r in out] == [("", True, 0)]
    # a failed claim whose notice already went out, its last sentence dropped at the flush:
    t = Turn()
    out, _ = run(t.tokens("Intro. ") + [t.pending("c"), t.failed("c")] + t.tokens("Bad one. Bad two.") + [t.end()])
    assert texts(out) == ["Intro.", FAILURE_NOTICES["en"], ""]
    assert [r.is_last_in_turn for r in out] == [False, False, True]
    assert [r.sentence_seq for r in out] == [0, 1, 2]


def test_pending_holds_until_ready_from_another_agent():
    t = Turn()
    retrieval = Turn(agent="retriever")
    gate = Gate(CONFIG)
    out = []
    for e in t.tokens("Let me check. ") + [t.pending("c1")] + t.tokens("Your order shipped Monday. It comes Friday. ") + [t.end()]:
        out.extend(gate.apply(e, 0))
    assert texts(out) == ["Let me check."]
    out.extend(gate.apply(retrieval.ready("c1"), 0))
    assert texts(out) == ["Let me check.", "Your order shipped Monday.", "It comes Friday."]
    assert out[-1].is_last_in_turn and out[-1].agent_id == "llm"


def test_ready_before_the_mark_is_not_lost():
    t = Turn()
    retrieval = Turn(agent="retriever")
    out, _ = run([retrieval.ready("c1")] + t.tokens("Alpha. ") + [t.pending("c1")] + t.tokens("Beta. ") + [t.end()])
    assert texts(out) == ["Alpha.", "Beta."]


def test_failed_claim_is_replaced_by_a_spoken_notice_and_later_claims_still_flow():
    t = Turn(language="es")
    out, _ = run(t.tokens("Veamos. ") + [t.pending("c1")] + t.tokens("Dato falso. ") + [t.pending("c2")]
                 + t.tokens("Dato bueno. ") + [t.end(), t.ready("c2"), t.failed("c1")])
    assert texts(out) == ["Veamos.", FAILURE_NOTICES["es"], "Dato bueno."]
    assert [r.sentence_seq for r in out] == [0, 1, 2]
    assert out[-1].is_last_in_turn


@pytest.mark.parametrize("policy, expected", [("release", ["Alpha.", "Beta."]), ("drop", ["Alpha.", FAILURE_NOTICES["en"]])])
def test_hold_timeout_policy(policy, expected):
    config = GateConfig.from_settings(Settings(hold_timeout_s=2.0, hold_timeout_policy=policy, speculative_release=False))
    t = Turn()
    session = GateSession("s1", config)
    out = []
    for e in t.tokens("Alpha. ") + [t.pending("lost")] + t.tokens("Beta. ") + [t.end()]:
        out.extend(session.apply(e, 10 * S))
    assert texts(out) == ["Alpha."]
    assert session.next_deadline_us() == 12 * S
    assert session.tick(12 * S - 1) == []
    out.extend(session.tick(12 * S))
    assert texts(out) == expected
    assert out[-1].is_last_in_turn
    assert session.next_deadline_us() is None


def test_cancel_of_a_turn_drops_buffered_and_held_text_and_ignores_later_events():
    t1, t2 = Turn("t1"), Turn("t2", t0=2_000 * S)
    events = (t1.tokens("Spoken. ") + [t1.pending("c")] + t1.tokens("Held. Buffered") + [cancel(turn="t1")]
              + t1.tokens(" more. ") + [t1.ready("c"), t1.end()] + t2.tokens("Next turn. ") + [t2.end()])
    out, gate = run(events)
    assert [(r.turn_id, r.text) for r in out] == [("t1", "Spoken."), ("t2", "Next turn.")]
    assert gate.session("s1").is_cancelled("t1")


def test_session_cancel_covers_the_turns_the_gate_holds_by_order_not_by_clock():
    old, new = Turn("old", t0=1 * S), Turn("new", t0=5 * S)
    late = Turn("late", t0=2 * S)  # its agent's clock says it started before the cancel; first seen after it
    out, gate = run(old.tokens("Old text") + [cancel(at=3 * S)] + old.tokens(" here. ") + [old.end()]
                    + late.tokens("Late. ") + [late.end()] + new.tokens("New. ") + [new.end()])
    assert texts(out) == ["Late.", "New."]  # a turn first seen after the cancel is a new turn
    assert gate.session("s1").is_cancelled("old")


def test_a_far_future_cancel_timestamp_mutes_nothing():
    """Regression: a whole-session cancel with issued_at_us far ahead used to cancel
    every turn that started before it, i.e. every later turn of the session, for good."""
    t1, t2 = Turn("t1", t0=1 * S), Turn("t2", t0=2 * S)
    out, _ = run(t1.tokens("First. ") + [t1.end(), cancel(at=2**62)] + t2.tokens("Second. ") + [t2.end()])
    assert texts(out) == ["First.", "Second."]


def test_a_whole_session_cancel_is_resolved_into_the_turns_it_cancelled():
    t1, t2 = Turn("t1"), Turn("t2")
    session = GateSession("s1", CONFIG)
    for e in t1.tokens("One. ") + [t1.end()] + t2.tokens("Two two"):
        session.apply(e, e.produced_at_us)
        assert session.controls == []
    session.apply(cancel(at=1), 10**12)
    [resolution] = session.controls
    assert resolution.turn_ids == ("t1", "t2") and resolution.turn_id is None
    assert resolution.source == "gate"
    session.apply(cancel(at=2), 10**12)  # nothing new to cancel: no resolution to publish
    assert session.controls == []


def test_listed_turns_are_cancelled_even_before_the_gate_sees_them():
    t1, t2 = Turn("t1"), Turn("t2")
    out, _ = run([cancel(turn_ids=["t2"])] + t1.tokens("Kept. ") + [t1.end()] + t2.tokens("Gone. ") + [t2.end()])
    assert texts(out) == ["Kept."]


def test_cancel_before_any_text_of_the_turn():
    t = Turn()
    out, _ = run([cancel(turn="t1")] + t.tokens("Never said. ") + [t.end()])
    assert out == []


def test_events_of_another_session_are_rejected():
    with pytest.raises(GateInputError):
        GateSession("other", CONFIG).apply(Turn().end(), 0)


def test_gate_sentences_runs_many_sessions():
    a, b = Turn(session="a"), Turn(session="b")
    out = gate_sentences(a.tokens("From a. ") + b.tokens("From b. ") + [b.end(), a.end()], CONFIG)
    assert sorted((r.session_id, r.text) for r in out) == [("a", "From a."), ("b", "From b.")]


TEXT = "Intro first. The price is 1,234.56 dollars. Dr. Smith agrees! Is it true? Yes. "


def _script(cuts, mark_at, ready_after, failed):
    """A turn with one claim marked at a word boundary, its events split at `cuts`."""
    t = Turn()
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(TEXT)]:
        if last < mark_at <= cut:
            if mark_at > last:
                events.append(t._event("TOKEN", TEXT[last:mark_at]))
            events.append(t.pending("c"))
            last = mark_at
        if cut > last:
            events.append(t._event("TOKEN", TEXT[last:cut]))
            last = cut
    retriever = Turn(agent="retriever")  # resolutions come from another agent, at any point
    resolve = retriever.failed("c") if failed else retriever.ready("c")
    events.insert(min(len(events), ready_after), resolve)
    events.append(t.end())
    return events


marks = st.sampled_from([i + 1 for i, c in enumerate(TEXT) if c == " "])


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, len(TEXT) - 1), max_size=40), marks, st.integers(0, 60), st.booleans())
def test_any_split_gives_the_same_requests_and_state_survives_json(cuts, mark_at, ready_after, failed):
    reference = texts(gate_sentences(_script([], mark_at, 10**6, failed), CONFIG))
    events = _script(cuts, mark_at, ready_after, failed)
    # The way the gate worker stores it: state through JSON between every two events.
    state, out = None, []
    for i, e in enumerate(events):
        session = GateSession.from_state("s1", CONFIG, json.loads(json.dumps(state)) if state else None)
        out.extend(session.apply(e, i))
        state = session.to_state()
    assert texts(out) == reference
    assert [r.sentence_seq for r in out] == list(range(len(out)))
    assert out[-1].is_last_in_turn and sum(r.is_last_in_turn for r in out) == 1
    spoken = "".join(t for t in texts(out) if t not in FAILURE_NOTICES.values()).replace(" ", "")
    if not failed:  # nothing lost or repeated
        assert spoken == TEXT.replace(" ", "")


@hsettings(max_examples=40, deadline=None)
@given(st.integers(0, 30), st.integers(0, 30))
def test_crash_and_redelivery_from_any_point_repeats_nothing(crash_at, rewind):
    """State stored after event `crash_at`; the broker re-delivers from `crash_at - rewind`."""
    t = Turn()
    events = t.tokens("One two. Three four five. ", size=2) + [t.pending("c")] + t.tokens("Six. ") + [t.ready("c"), t.end()]
    crash_at = min(crash_at, len(events) - 1)
    straight, _ = run(events)
    session = GateSession("s1", CONFIG)
    out = []
    for e in events[: crash_at + 1]:
        out.extend(session.apply(e, 0))
    restored = GateSession.from_state("s1", CONFIG, json.loads(json.dumps(session.to_state())))
    for e in events[max(0, crash_at + 1 - rewind):]:
        out.extend(restored.apply(e, 0))
    assert [(r.sentence_seq, r.text) for r in out] == [(r.sentence_seq, r.text) for r in straight]


def test_claim_ids_reused_by_the_next_turn_still_match():
    t1, t2 = Turn("t1"), Turn("t2", t0=2_000 * S)
    r1, r2 = Turn("t1", agent="retriever"), Turn("t2", agent="retriever")
    out, _ = run(t1.tokens("One. ") + [t1.pending("c"), r1.ready("c")] + t1.tokens("Two. ") + [t1.end()]
                 + [r2.failed("c")] + t2.tokens("Three. ") + [t2.pending("c")] + t2.tokens("Four. ") + [t2.end()])
    assert [(r.turn_id, r.text) for r in out] == [
        ("t1", "One."), ("t1", "Two."), ("t2", "Three."), ("t2", FAILURE_NOTICES["en"])]


def test_bench_helpers_number_events_and_find_the_releasing_ones():
    from voicebus.ops.bench.gate import TEXT, bench_core, releasing_events, turn_events

    events = turn_events("s", "t", TEXT, 4)
    assert "".join(e.text for e in events) == TEXT and [e.seq for e in events] == list(range(len(events)))
    released_by = releasing_events(events)
    # one per request the core gives (with speculation, a tentative release and its settlement)
    assert len(released_by) == len(gate_sentences(events, GateConfig(), now_us=0)) >= 3
    assert released_by == sorted(released_by) and released_by[-1] == len(events) - 1
    assert TEXT[: 4 * (released_by[0] + 1)].startswith("The quick brown fox jumps. I")  # the next non-space char
    figures = bench_core(repeat=1)
    assert figures["events"] == len(events) and figures["us_per_event"] > 0


def test_buffered_mode_sends_the_whole_turn_as_one_request_at_its_end():
    config = GateConfig.from_settings(Settings(gate_mode="buffered"))
    t = Turn()
    gate = Gate(config)
    out = []
    events = t.tokens("First one. ") + [t.pending("c")] + t.tokens("Second one. Third one. ") + [t.ready("c")]
    for e in events:
        out.extend(gate.apply(e, 0))
    assert out == []
    out = gate.apply(t.end(), 7)
    assert [(r.text, r.sentence_seq, r.is_last_in_turn) for r in out] == [
        ("First one. Second one. Third one.", 0, True)]
    with pytest.raises(SettingsError):
        GateConfig.from_settings(Settings(gate_mode="sometimes"))
    with pytest.raises(SettingsError):
        GateConfig.from_settings(Settings(hold_timeout_policy="forever"))


# --- speculative release (docs/gate.md, "Speculative release") --------------------------------------

SPEC = GateConfig.from_settings(Settings(hold_timeout_s=2.0, speculative_release=True, first_clause_min_words=0))
PLAIN = GateConfig.from_settings(Settings(hold_timeout_s=2.0, speculative_release=False, first_clause_min_words=0))


def settle(requests):
    """What a worker following the protocol publishes: (sentence_seq, text, is_last_in_turn) in
    order. A tentative request is held; tentative with empty text withdraws it; a final request
    with its sentence_seq settles it (empty text: confirmed, its text spoken; else replaced)."""
    held, spoken = {}, []
    for r in requests:
        seq = r.sentence_seq
        if r.tentative:
            if r.text:
                held[seq] = r.text
            else:
                assert held.pop(seq, None) is not None, f"withdrawal of {seq} that is not held"
            continue
        text = r.text or held.get(seq, "") if seq in held else r.text
        held.pop(seq, None)
        spoken.append((seq, text, r.is_last_in_turn))
    assert not held, f"tentative requests never settled: {held}"
    return spoken


def steps(events, config=SPEC):
    """The requests each event gave, one list per event."""
    gate = Gate(config)
    return [gate.apply(e, 5_000 * S + i) for i, e in enumerate(events)]


def brief(requests):
    return [(r.sentence_seq, r.text, r.tentative) for r in requests]


def test_a_certain_stop_is_released_tentative_at_once_and_the_next_token_confirms_it():
    t = Turn()
    events = [t._event("TOKEN", "Hello"), t._event("TOKEN", " world."), t._event("TOKEN", " How"),
              t._event("TOKEN", " are you?"), t.end()]
    got = [brief(rs) for rs in steps(events)]
    assert got == [[], [(0, "Hello world.", True)], [(0, "", False)], [(1, "How are you?", True)], [(1, "", False)]]
    assert steps(events)[-1][0].is_last_in_turn
    assert settle([r for rs in steps(events) for r in rs]) == [(0, "Hello world.", False), (1, "How are you?", True)]


@pytest.mark.parametrize("text", ["Call Dr. Smith now.", "It is 3.14 now.", "Ask J. Smith today.",
                                  "We met in the U.S. Army.", "See p. 4 first."])
def test_no_speculation_after_an_abbreviation_a_number_or_an_initial(text):
    t = Turn()
    events = [t._event("TOKEN", w) for w in _words(text)] + [t.end()]
    out = [r for rs in steps(events) for r in rs]
    tentative_texts = [r.text for r in out if r.tentative]
    assert tentative_texts == [text]  # only the real end, never at the abbreviation's dot
    assert settle(out) == [(0, text, True)]


def _words(text):
    """Tokens the way an LLM streams them: each word with its leading space."""
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


@pytest.mark.parametrize("tokens, retracted, final", [
    (["Go", " to", " example.", "com", " now!"], "Go to example.", "Go to example.com now!"),
    (["Wait", " here.", " and", " then", " go."], "Wait here.", "Wait here. and then go."),
    (["Really?", " no", " way."], "Really?", "Really? no way."),
])
def test_a_stop_that_turns_out_no_end_is_withdrawn_and_its_seq_reused(tokens, retracted, final):
    t = Turn()
    events = [t._event("TOKEN", tok) for tok in tokens] + [t.end()]
    per_event = steps(events)
    out = [r for rs in per_event for r in rs]
    first = out.index(next(r for r in out if r.tentative and r.text == retracted))
    # The token that undoes the stop withdraws it at once (tentative, empty text, same seq).
    assert brief([out[first + 1]]) == [(0, "", True)]
    assert settle(out) == [(0, final, True)]


def test_a_closing_quote_after_the_stop_replaces_the_tentative_text_under_the_same_seq():
    t = Turn()
    events = [t._event("TOKEN", "He said \"stop."), t._event("TOKEN", "\""), t._event("TOKEN", " Then"), t.end()]
    out = [r for rs in steps(events) for r in rs]
    assert brief(out)[:2] == [(0, "He said \"stop.", True), (0, "He said \"stop.\"", False)]
    assert settle(out) == [(0, "He said \"stop.\"", False), (1, "Then", True)]


def test_no_speculation_while_a_claim_is_pending_or_when_off():
    t = Turn()
    events = t.tokens("One two. ", size=100) + [t.pending("c")] + [t._event("TOKEN", "Three four.")]
    # "One two." went out tentative before the mark; "Three four." may be held: never tentative.
    assert [r.text for rs in steps(events) for r in rs if r.tentative] == ["One two."]
    t = Turn()
    events = [t._event("TOKEN", "Hello world."), t._event("TOKEN", " How"), t.end()]
    assert not [r for rs in steps(events, PLAIN) for r in rs if r.tentative]
    assert GateConfig.from_settings(Settings()).speculative_release is True  # the default


SPEC_TEXT = ("Hello world. Call Dr. Smith at 3.14 p.m. today! Is it done? Go to example.com now. "
             "He said \"stop.\" Then he left. Wait here. and then go. Ask J. Smith.")


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, len(SPEC_TEXT) - 1), max_size=40))
def test_any_split_with_speculation_speaks_exactly_what_the_plain_gate_speaks(cuts):
    t, bounds, events = Turn(), sorted(set(cuts)) + [len(SPEC_TEXT)], []
    last = 0
    for cut in bounds:
        if cut > last:
            events.append(t._event("TOKEN", SPEC_TEXT[last:cut]))
            last = cut
    events.append(t.end())
    plain = [(r.sentence_seq, r.text, r.is_last_in_turn) for rs in steps(events, PLAIN) for r in rs]
    # Through JSON between every two events, as the gate worker keeps it.
    state, out = None, []
    for i, e in enumerate(events):
        session = GateSession.from_state("s1", SPEC, json.loads(json.dumps(state)) if state else None)
        out.extend(session.apply(e, i))
        state = session.to_state()
    assert settle(out) == plain


def test_a_turn_the_gate_fails_on_withdraws_its_tentative_sentence_before_ending():
    t = Turn()
    session = GateSession("s1", SPEC)
    out = session.apply(t._event("TOKEN", "Hello world."), 0)
    assert brief(out) == [(0, "Hello world.", True)]
    closing = session.end_failed_turn(t._event("TOKEN", " more"), 1, RuntimeError("a bug"))
    # the worker must not wait for a settlement that will never come
    assert brief(closing) == [(0, "", True), (0, "", False)] and closing[-1].is_last_in_turn
    assert settle(out + closing) == [(0, "", True)]


# --- pronunciation (docs/protocol.md, "Pronunciation") ----------------------------------------------

LEXICON = [{"match": "SQL", "regex": False, "phonemes": None, "say": "sequel"},
           {"match": "Kokoro", "regex": False, "phonemes": "kˈOkəɹO", "say": None},
           {"match": r"v(\d)\.(\d)", "regex": True, "phonemes": None, "say": "version"}]


def test_apply_lexicon_says_and_wraps_whole_words_once():
    from voicebus.gate.core import apply_lexicon

    text = "SQL and MySQL, sql, SQL's Kokoro in [Kokoro](/kˈOkoɹO/) v2.1."
    assert apply_lexicon(text, LEXICON) == (
        "sequel and MySQL, sql, sequel's [Kokoro](/kˈOkəɹO/) in [Kokoro](/kˈOkoɹO/) version.")
    # a replacement is not rewritten by a later entry
    assert apply_lexicon("SQL", [{"match": "SQL", "say": "S Q L"}, {"match": "S", "say": "ess"}]) == "S Q L"
    assert apply_lexicon("Hi.", None) == "Hi." and apply_lexicon("", LEXICON) == ""


def test_a_turns_lexicon_rewrites_what_it_releases_through_a_restart():
    t = Turn()
    first = t._event("TOKEN", "I use SQL", lexicon=LEXICON)  # only the first event carries it
    events = [first] + t.tokens(" daily. Kokoro speaks. ", size=2) + [t.end()]
    session = GateSession("s1", CONFIG)
    out = [r for i, e in enumerate(events[:3]) for r in session.apply(e, 5_000 * S + i)]
    state = json.loads(json.dumps(session.to_state()))
    assert state["turns"]["t1"]["lexicon"] == [{"match": "SQL", "say": "sequel"},
                                                {"match": "Kokoro", "phonemes": "kˈOkəɹO"},
                                                {"match": r"v(\d)\.(\d)", "regex": True, "say": "version"}]
    restored = GateSession.from_state("s1", CONFIG, state)
    out += [r for i, e in enumerate(events[3:]) for r in restored.apply(e, 6_000 * S + i)]
    assert texts(out) == ["I use sequel daily.", "[Kokoro](/kˈOkəɹO/) speaks."]
    # a turn without one keeps no lexicon in the state
    plain = Turn(turn="t2")
    session.apply(plain.tokens("Hi")[0], 7_000 * S)
    assert "lexicon" not in session.to_state()["turns"]["t2"]


def test_the_lexicon_rewrites_both_sides_of_a_speculative_settlement():
    t = Turn()
    events = [t._event("TOKEN", "Ask SQL.", lexicon=LEXICON), t._event("TOKEN", " Then"), t.end()]
    got = [brief(rs) for rs in steps(events)]
    assert got[0] == [(0, "Ask sequel.", True)]
    assert got[1] == [(0, "", False)]  # confirmed: the same rewritten text
    assert settle([r for rs in steps(events) for r in rs]) == [(0, "Ask sequel.", False), (1, "Then", True)]


def test_a_turn_with_a_lexicon_the_contract_refuses_is_rejected():
    from voicebus.gate.core import TurnRejected

    t = Turn()
    with pytest.raises(TurnRejected, match="exactly one of phonemes and say"):
        GateSession("s1", CONFIG).apply(t._event("TOKEN", "Hi.", lexicon=[{"match": "x"}]), 0)


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_an_inline_phoneme_span_is_one_word_whatever_the_split(size):
    t = Turn()
    text = "I like [Dr. U.S.](/dˈɑk.təɹ ju ˈɛs?/) a lot. [Kokoro](/kˈOkəɹO/). See [1]. Done."
    out, _ = run(t.tokens(text, size) + [t.end()])
    assert texts(out) == ["I like [Dr. U.S.](/dˈɑk.təɹ ju ˈɛs?/) a lot.", "[Kokoro](/kˈOkəɹO/).", "See [1].",
                          "Done."]
    speculated = [r for rs in steps(Turn(turn=f"t{size}").tokens(text, size) + [t.end()]) for r in rs]
    assert not any(r.tentative and "Dr." in r.text and "lot" not in r.text for r in speculated)


def test_split_text_never_cuts_inside_a_phoneme_span():
    from voicebus.gate.core import split_text

    span = "[New York](/nˈu jˈɔɹk/)"
    text = "Say " + "word " * 4 + span + " now"
    for limit in range(len(span.encode()), len(text.encode())):  # a span longer than the limit is cut
        for piece in split_text(text, limit):
            assert piece.count("[") == piece.count("](/") == piece.count("/)")
