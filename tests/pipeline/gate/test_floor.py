"""The session's floor in the gate's core: whole turns, in the order the session's policy decides."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given, settings as hsettings, strategies as st

from voicebus.gate.core import GateConfig, GateSession
from voicebus.gate.floor import CUT, GRANTED, PREEMPTING, QUEUED, REFUSED
from tests.pipeline.gate.test_core import S, Turn, cancel

CONFIG = GateConfig(first_clause_min_words=0, speculative_release=False)  # one request per sentence


def interleave(*turns_events):
    """Round-robin the events of several turns, one event of each in turn."""
    out = []
    for i in range(max(len(e) for e in turns_events)):
        out.extend(e[i] for e in turns_events if i < len(e))
    return out


def run(session, events, t0=5_000 * S, controls=None):
    out = []
    for i, e in enumerate(events):
        out.extend(session.apply(e, t0 + i * 1000))
        if controls is not None:
            controls.extend(session.controls)
    return out


def spoken(requests):
    return [(r.turn_id, r.text) for r in requests if r.text]


def host_and_expert(**expert_fields):
    host = Turn("host-1", agent="host")
    expert = Turn("expert-1", agent="expert", **expert_fields)
    # one event of each in turn, the host's first: the host's turn opens first
    return interleave(host.tokens("Welcome to the show. Tonight we talk. About the sea. ", size=4) + [host.end()],
                      expert.tokens("Thanks for having me. The sea is deep. ", size=4) + [expert.end()])


def test_two_agents_overlapping_are_heard_whole_turn_after_whole_turn():
    session = GateSession("s1", CONFIG)
    out = run(session, host_and_expert())
    assert spoken(out) == [("host-1", "Welcome to the show."), ("host-1", "Tonight we talk."),
                           ("host-1", "About the sea."),
                           ("expert-1", "Thanks for having me."), ("expert-1", "The sea is deep.")]
    for turn in ("host-1", "expert-1"):  # each turn numbered from 0, its end flagged once
        mine = [r for r in out if r.turn_id == turn]
        assert [r.sentence_seq for r in mine] == list(range(len(mine)))
        assert [r.is_last_in_turn for r in mine].count(True) == 1 and mine[-1].is_last_in_turn
    assert session.controls == [] and session.idle


def test_a_queued_turn_goes_out_the_moment_the_speaker_ends_and_its_wait_is_reported():
    session = GateSession("s1", CONFIG)
    host, expert = Turn("h", agent="host"), Turn("e", agent="expert")
    run(session, host.tokens("First part. ", size=4))
    events = []
    for i, e in enumerate(expert.tokens("Waiting here. Done. ", size=4) + [expert.end()]):
        assert session.apply(e, 6_000 * S + i) == []  # everything held while the host speaks
        events += session.floor_events
    assert [e.event for e in events] == [QUEUED]
    out = session.apply(host.end(), 7_000 * S)
    # the host's last sentence (its end was certain only at END_OF_TURN), then the whole queued turn
    assert spoken(out) == [("h", "First part."), ("e", "Waiting here."), ("e", "Done.")]
    assert out[0].is_last_in_turn and out[-1].is_last_in_turn
    [granted] = [e for e in session.floor_events if e.event == GRANTED]
    assert granted.turn_id == "e" and granted.waited_us == 7_000 * S - 6_000 * S


def test_a_turn_whose_voice_speaks_another_language_is_told_so_on_every_floor_event():
    session = GateSession("s1", CONFIG)
    host = Turn("h", agent="host", language="en", voice="af_heart")
    expert = Turn("e", agent="expert", language="en", voice="af_heart:0.6+ff_siwis:0.4")
    events = []
    for i, e in enumerate(host.tokens("First part. ", size=4) + expert.tokens("Waiting here. ", size=4)
                          + [expert.end(), host.end()]):
        session.apply(e, 6_000 * S + i)
        events += session.floor_events
    by_turn = {(e.turn_id, e.event): e.warnings for e in events}
    assert by_turn[("h", GRANTED)] == ()
    mismatch = ("voice-language-mismatch: ff_siwis is a French voice; the turn is American English",)
    assert by_turn[("e", QUEUED)] == by_turn[("e", GRANTED)] == mismatch
    # British English text with an American voice is one language: no warning
    other = GateSession("s2", CONFIG)
    british = Turn("b", session="s2", language="en-gb", voice="af_heart").tokens("Hello there. ")
    other.apply(british[0], 6_000 * S)
    assert [e.warnings for e in other.floor_events] == [()]


def test_preempt_cuts_the_speaker_when_the_new_turn_has_its_first_sentence():
    session = GateSession("s1", CONFIG)
    host, expert = Turn("h", agent="host"), Turn("e", agent="expert", floor="preempt")
    out = run(session, host.tokens("One. Two. ", size=3))
    assert spoken(out) == [("h", "One.")]
    out = session.apply(expert.tokens("Stop", size=4)[0], 6_000 * S)
    assert out == [] and session.controls == []  # nothing to say yet: the host goes on
    assert [e.event for e in session.floor_events] == [PREEMPTING]
    out = run(session, host.tokens("Three. ", size=7))
    assert spoken(out) == [("h", "Two.")]
    out = run(session, expert.tokens(" now. More", size=100))
    assert spoken(out) == [("e", "Stop now.")]
    [cut] = session.controls
    assert (cut.turn_id, cut.source, cut.action) == ("h", "floor", "CANCEL")
    assert [e.event for e in session.floor_events] == [CUT, GRANTED]
    assert run(session, host.tokens("Four. ", size=6) + [host.end()]) == []  # the cut turn is silent
    assert session.is_cancelled("h")


def test_preempt_also_cuts_a_turn_whose_text_ended_but_whose_audio_may_still_play():
    session = GateSession("s1", CONFIG)
    host, expert = Turn("h", agent="host"), Turn("e", agent="expert", floor="preempt")
    out = run(session, host.tokens("All of my answer. ", size=6) + [host.end()])
    assert spoken(out) == [("h", "All of my answer.")]
    controls = []
    out = run(session, expert.tokens("Let me add. More", size=5), controls=controls)
    assert spoken(out) == [("e", "Let me add.")]
    assert [(c.turn_id, c.source) for c in controls] == [("h", "floor")]
    # a queued (default) turn after it cuts nothing
    third = Turn("q", agent="third")
    controls = []
    run(session, third.tokens("Me next. ", size=9) + [third.end()], controls=controls)
    assert controls == []


def test_a_preempter_still_cuts_a_speaker_whose_text_ended_before_its_first_sentence():
    """Regression: the speaker's text ended while the preempting turn waited for its first
    sentence; the preemption was forgotten and the speaker's audio played to its end."""
    session = GateSession("s1", CONFIG)
    host, expert = Turn("h", agent="host"), Turn("e", agent="expert", floor="preempt")
    run(session, host.tokens("One. Two. ", size=5))
    assert run(session, expert.tokens("Let", size=3)) == []
    out = run(session, [host.end()])
    assert spoken(out) == [("h", "Two.")]
    controls = []
    out = run(session, expert.tokens(" me. More", size=4), controls=controls)
    assert spoken(out) == [("e", "Let me.")]
    assert [(c.turn_id, c.after_turn_id) for c in controls] == [("h", "e")]


def test_a_higher_priority_agent_preempts_and_an_equal_one_queues():
    session = GateSession("s1", CONFIG)
    host = Turn("h", agent="host")
    peer = Turn("p", agent="peer")  # same priority: queues
    alert = Turn("a", agent="alert", priority=5)
    run(session, host.tokens("Talking. ", size=3))
    assert run(session, peer.tokens("Me too. ", size=8) + [peer.end()]) == []
    controls = []
    out = run(session, alert.tokens("Fire alarm. ", size=12) + [alert.end()], controls=controls)
    assert [(c.turn_id, c.source) for c in controls] == [("h", "floor")]
    # The alert cut the host and spoke; the queued peer follows it, whole.
    assert spoken(out) == [("a", "Fire alarm."), ("p", "Me too.")]
    assert session.is_cancelled("h") and not session.is_cancelled("p")


def test_a_lower_priority_preempt_does_not_cut_a_higher_priority_speaker():
    session = GateSession("s1", CONFIG)
    alert = Turn("a", agent="alert", priority=5)
    chat = Turn("c", agent="chat", floor="preempt")
    run(session, alert.tokens("Alert one. ", size=4))
    assert run(session, chat.tokens("Hi there. ", size=10) + [chat.end()]) == []
    out = run(session, alert.tokens("Alert two. ", size=11) + [alert.end()])
    assert spoken(out) == [("a", "Alert one."), ("a", "Alert two."), ("c", "Hi there.")]


def test_a_cancelled_waiting_turn_never_plays_and_a_cancelled_speaker_passes_the_floor():
    session = GateSession("s1", CONFIG)
    a, b, c = Turn("a", agent="one"), Turn("b", agent="two"), Turn("c", agent="three")
    run(session, a.tokens("Alpha. ", size=7))
    assert run(session, b.tokens("Bravo. ", size=7) + [b.end()]) == []
    assert run(session, c.tokens("Charlie. ", size=9) + [c.end()]) == []
    assert session.apply(cancel(turn="b"), 6_000 * S) == []  # waiting: dropped, nothing goes out
    out = session.apply(cancel(turn="a"), 6_001 * S)  # the speaker: the floor passes to c
    assert spoken(out) == [("c", "Charlie.")] and out[-1].is_last_in_turn
    assert "b" not in {r.turn_id for r in out}
    assert session.idle


def test_a_turn_beyond_the_waiting_bound_is_refused_with_an_end_and_a_reason():
    session = GateSession("s1", GateConfig(first_clause_min_words=0, floor_max_waiting=2, speculative_release=False))
    speaker = Turn("t0", agent="a0")
    run(session, speaker.tokens("Go on. ", size=7))
    for n in (1, 2):
        assert run(session, Turn(f"t{n}", agent=f"a{n}").tokens("Wait. ", size=6)) == []
    late = Turn("t3", agent="a3")
    out = session.apply(late.tokens("Too late. ", size=10)[0], 6_000 * S)
    assert [(r.turn_id, r.sentence_seq, r.text, r.is_last_in_turn) for r in out] == [("t3", 0, "", True)]
    [refused] = session.floor_events
    assert refused.event == REFUSED and "limit 2" in refused.reason
    assert run(session, late.tokens("More. ", size=6) + [late.end()]) == []  # later events ignored


def test_the_floor_survives_a_restart_mid_wait():
    session = GateSession("s1", CONFIG)
    host, expert = Turn("h", agent="host"), Turn("e", agent="expert")
    run(session, host.tokens("Hello. ", size=7))
    run(session, expert.tokens("Queued one. ", size=12) + [expert.end()])
    restored = GateSession.from_state("s1", CONFIG, json.loads(json.dumps(session.to_state())))
    out = restored.apply(host.end(), 7_000 * S)
    assert spoken(out) == [("h", "Hello."), ("e", "Queued one.")]


@hsettings(max_examples=150, deadline=None)
@given(
    order=st.lists(st.integers(min_value=0, max_value=2), min_size=30, max_size=30),
    sizes=st.lists(st.integers(min_value=1, max_value=9), min_size=3, max_size=3),
    policy=st.sampled_from(["queue", "preempt"]),
    cancel_at=st.one_of(st.none(), st.integers(min_value=0, max_value=40)),
)
def test_no_interleaving_of_three_agents_ever_splices_turns(order, sizes, policy, cancel_at):
    """Whatever the arrival order of three agents' events: the output is whole blocks, one turn
    after another, each numbered from 0 without a gap, and a turn that left its block never comes
    back (it was cut or it ended)."""
    texts = ["One a. One b. One c. ", "Two a. Two b. ", "Three a. Three b. Three c. "]
    streams = [Turn(f"t{i}", agent=f"a{i}", floor=policy).tokens(texts[i], size=sizes[i]) for i in range(3)]
    for i, stream in enumerate(streams):
        stream.append(replace(Turn(f"t{i}", agent=f"a{i}").end(), seq=len(stream)))
    events, positions = [], [0, 0, 0]
    for pick in order + [0, 1, 2] * 40:
        if positions[pick] < len(streams[pick]):
            events.append(streams[pick][positions[pick]])
            positions[pick] += 1
    if cancel_at is not None:
        events.insert(min(cancel_at, len(events)), cancel(turn="t1"))
    session = GateSession("s1", CONFIG)
    out = []
    for i, e in enumerate(events):
        out.extend(session.apply(e, 5_000 * S + i * 1000))
    blocks = [r.turn_id for r in out]
    finished = []
    for i, turn in enumerate(blocks):
        if i and blocks[i - 1] != turn:
            finished.append(blocks[i - 1])
        assert turn not in finished, f"turn {turn} spliced: {blocks}"
    for turn in set(blocks):
        seqs = [r.sentence_seq for r in out if r.turn_id == turn and not r.tentative]
        assert seqs == list(range(len(seqs)))
    if policy == "queue" and cancel_at is None:
        assert [r for r in out if r.is_last_in_turn] and len({r.turn_id for r in out if r.is_last_in_turn}) == 3


def test_a_replayed_two_speaker_conversation_keeps_its_recorded_turn_order():
    """A recording whose turns overlap (the expert started while the host still spoke, and an
    alert preempted the expert) replays through the floor as it was heard: host, alert."""
    from voicebus.agents.conversation_file import event_to_json, parse_lines
    from voicebus.agents.replay import plan_replay
    import json as json_

    lines = [{"t_ms": 0, "type": "text", "agent_id": "host", "session_id": "r", "turn_id": "h", "kind": "TOKEN",
              "text": "Welcome to the show. "},
             {"t_ms": 10, "type": "text", "agent_id": "expert", "session_id": "r", "turn_id": "e", "kind": "TOKEN",
              "text": "Thanks for "},
             {"t_ms": 20, "type": "text", "agent_id": "host", "session_id": "r", "turn_id": "h", "kind": "TOKEN",
              "text": "Here is our guest. "},
             {"t_ms": 30, "type": "text", "agent_id": "alert", "session_id": "r", "turn_id": "a", "kind": "TOKEN",
              "text": "Storm warning. ", "priority": 5},
             {"t_ms": 40, "type": "text", "agent_id": "alert", "session_id": "r", "turn_id": "a", "kind": "END_OF_TURN",
              "priority": 5},
             {"t_ms": 50, "type": "text", "agent_id": "expert", "session_id": "r", "turn_id": "e", "kind": "TOKEN",
              "text": "having me. "},
             {"t_ms": 60, "type": "text", "agent_id": "expert", "session_id": "r", "turn_id": "e", "kind": "END_OF_TURN"},
             {"t_ms": 70, "type": "text", "agent_id": "host", "session_id": "r", "turn_id": "h", "kind": "END_OF_TURN"}]
    conversation = parse_lines(json_.dumps(line) for line in lines)
    assert [event_to_json(e).get("priority") for e in conversation.events][3] == 5  # written back as read
    _, [copy] = plan_replay(conversation.events, keep_session_ids=True)
    session = GateSession("r", CONFIG)
    out = []
    for i, scheduled in enumerate(copy.schedule):
        out.extend(session.apply(scheduled.value, 5_000 * S + i * 1000))
    # the alert (priority 5) cut the host at its first sentence; the expert queued behind it
    assert spoken(out) == [("h", "Welcome to the show."), ("a", "Storm warning."), ("e", "Thanks for having me.")]
