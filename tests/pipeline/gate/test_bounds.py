"""The gate core's bounds: no sentence over the text limit, a bounded
segmenter buffer (run-on text, unclosed code fences), bounded session state, idle expiry, and a
turn that still ends when the gate fails on it."""

import json

import pytest

from voicebus.gate.core import GateConfig, GateInputError, GateSession, TurnRejected, split_text
from voicebus.gate.segmenter import StreamingSegmenter
from voicebus.settings import Settings
from voicebus.schemas.contract import LIMITS
from tests.pipeline.gate.test_core import Turn

S = 1_000_000
CONFIG = GateConfig.from_settings(Settings(speculative_release=False))  # one request per sentence


def feed(session, events, t0=5_000 * S):
    out = []
    for i, e in enumerate(events):
        out.extend(session.apply(e, t0 + i))
    return out


def words_of(requests):
    return " ".join(r.text for r in requests).split()


def test_run_on_text_without_punctuation_is_spoken_in_pieces_within_the_text_limit():
    t = Turn()
    text = " ".join(f"word{i}" for i in range(4000))  # ~35 KB, not one stop
    session = GateSession("s1", CONFIG)
    out = feed(session, t.tokens(text + " ", size=5) + [t.end()])
    assert all(len(r.text.encode()) <= LIMITS.max_text_bytes for r in out)
    assert all(len(r.text) <= CONFIG.max_buffer_chars for r in out)
    assert words_of(out) == text.split()  # cut between words, nothing lost or doubled
    assert [r.sentence_seq for r in out] == list(range(len(out)))
    assert [r.is_last_in_turn for r in out] == [False] * (len(out) - 1) + [True]
    assert len(out) > 10
    # Released while the text streams, not at the end of the turn.
    assert len(feed(GateSession("s1", CONFIG), Turn().tokens(text, size=5))) > 10


def test_a_buffered_answer_longer_than_the_text_limit_goes_out_in_pieces():
    config = GateConfig.from_settings(Settings(gate_mode="buffered"))
    t = Turn()
    text = "".join(f"This is sentence number {i} of a very long buffered answer. " for i in range(600))  # ~36 KB
    out = feed(GateSession("s1", config), t.tokens(text, size=7) + [t.end()])
    assert len(out) >= 3
    assert all(0 < len(r.text.encode()) <= LIMITS.max_text_bytes for r in out)
    assert words_of(out) == text.split()
    assert [r.sentence_seq for r in out] == list(range(len(out)))
    assert [r.is_last_in_turn for r in out] == [False] * (len(out) - 1) + [True]


def test_an_unclosed_code_fence_keeps_the_state_small():
    t = Turn()
    session = GateSession("s1", CONFIG)
    out = feed(session, t.tokens("Here is the code:\n\n```python\n") + [t._event("TOKEN", f"x{i} = {i}\n")
                                                                         for i in range(20_000)])
    assert [r.text for r in out] == ["Here is the code:", "Code block omitted."]  # said once
    assert len(json.dumps(session.to_state())) < 4 * CONFIG.max_buffer_chars  # was 1.4 MB
    more = feed(session, t.tokens("```\n\nThat was all. Bye.") + [t.end()])
    assert [r.text for r in more] == ["That was all.", "Bye."]
    assert more[-1].is_last_in_turn


def test_the_segmenter_bound_cuts_at_the_same_place_however_the_text_is_split():
    text = " ".join(f"w{i}" for i in range(3000)) + ". Done."

    def run(size):
        seg, out = StreamingSegmenter("en", max_buffer_chars=300), []
        for i in range(0, len(text), size):
            out += seg.feed(text[i:i + size])
        return [s.text for s in out + seg.flush()]

    assert run(1) == run(7) == run(400)
    assert max(map(len, run(7))) <= 300


@pytest.mark.parametrize("text,limit", [("a b c d e f", 3), ("ééé ééé ééé", 7), ("x" * 50, 16), ("", 4),
                                        ("ok fine", 100), ("😀😀😀 😀😀", 9)])
def test_split_text_keeps_every_piece_within_the_limit_and_every_word(text, limit):
    pieces = split_text(text, limit)
    assert all(len(p.encode()) <= limit for p in pieces)
    assert "".join("".join(pieces).split()) == "".join(text.split())
    if len(text.encode()) <= limit:
        assert pieces == [text]


@pytest.mark.parametrize("floor_policy", ["queue", "preempt"])
def test_a_session_over_its_state_bound_ends_its_oldest_turns(floor_policy):
    # Turns of several agents at equal priority: under ``queue`` they wait for the floor (room for
    # all of them, so only the state bound ends any), under ``preempt`` each cuts the one before.
    config = GateConfig.from_settings(Settings(gate_max_session_state_bytes=64 * 1024, floor_policy=floor_policy,
                                               floor_max_waiting_turns=64))
    session = GateSession("s1", config)
    out = []
    for n in range(200):  # 200 turns left open, each with ~1.5 KB of unfinished text
        t = Turn(turn=f"t{n}", agent=f"agent{n}")
        out += feed(session, t.tokens("no end in sight " * 100, size=40))
        more, encoded = session.shed(6_000 * S)
        out += more
        assert len(encoded.encode()) <= config.max_state_bytes
    ended = {r.turn_id for r in out if r.is_last_in_turn}
    if floor_policy == "queue":
        # The turn speaking keeps the floor; the newest waiting turns are refused first.
        assert "t0" not in ended and len(ended) > 100
    else:
        assert not ended  # each newer turn replaced the one waiting to preempt (a cancel): none shed
    for turn_id in ended:  # every turn it ended was ended properly: in order, once
        seqs = [r.sentence_seq for r in out if r.turn_id == turn_id]
        assert seqs == list(range(len(seqs)))
        assert sum(r.is_last_in_turn for r in out if r.turn_id == turn_id) == 1


def test_an_idle_session_expires_and_its_open_turns_end():
    config = GateConfig.from_settings(Settings(gate_session_idle_s=60))
    session = GateSession("s1", config)
    t = Turn()
    feed(session, t.tokens("A first sentence. And an unfinished") + [t.pending("c1")], t0=100 * S)
    assert session.expires_at_us() is not None and session.expires_at_us() >= 100 * S + 60 * S
    out = session.expire(session.expires_at_us())
    assert [r.text for r in out] == ["And an unfinished"]  # released as on a hold timeout
    assert out[-1].is_last_in_turn
    assert session.idle


def test_a_turn_the_gate_fails_on_still_ends():
    session = GateSession("s1", CONFIG)
    t = Turn()
    first = feed(session, t.tokens("One sentence here. Then"))
    assert [r.text for r in first] == ["One sentence here."]
    closing = session.end_failed_turn(t.tokens(" more")[0], 6_000 * S, RuntimeError("a bug"))
    assert [(r.sentence_seq, r.text, r.is_last_in_turn) for r in closing] == [(1, "", True)]
    assert feed(session, t.tokens(" words.") + [t.end()]) == []  # the turn is over
    # Bad input inside a turn (a mark without a claim id) is not a reason to end it.
    u = Turn(turn="t2")
    feed(session, u.tokens("Still fine. "))
    assert session.end_failed_turn(u.pending(None), 6_000 * S, GateInputError("no claim id")) == []


def test_a_turn_that_cannot_be_spoken_ends_at_once_and_ignores_the_rest():
    session = GateSession("s1", CONFIG)
    stored = session.to_state()
    t = Turn(language="klingon")
    event = t.tokens("Qapla'. ")[0]
    with pytest.raises(TurnRejected) as err:
        session.apply(event, 0)
    session = GateSession.from_state("s1", CONFIG, stored)  # what the worker does after a failure
    closing = session.end_failed_turn(event, 0, err.value)
    assert [(r.text, r.is_last_in_turn) for r in closing] == [("", True)]
    assert feed(session, t.tokens("More words. ") + [t.end()]) == []
