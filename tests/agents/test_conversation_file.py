import json

import pytest

from voicebus.agents import corpus
from voicebus.agents.conversation_file import (
    ControlLine, ConversationFormatError, TextLine, dump_lines, load, parse_lines,
)
from voicebus.agents.sdk import END_OF_TURN, EVIDENCE_FAILED, EVIDENCE_PENDING, EVIDENCE_READY, TOKEN


def _line(**fields):
    base = {"t_ms": 0, "type": "text", "agent_id": "assistant", "session_id": "s1", "turn_id": "t1",
            "kind": "TOKEN", "text": "Hi"}
    return json.dumps({**base, **fields})


def test_round_trip_keeps_every_field():
    text = [
        '{"voicebus_conversation": 1, "title": "x"}',
        _line(t_ms=10, language="es", voice="ef_dora"),
        _line(t_ms=20, kind="EVIDENCE_PENDING", text="", claim_id="c1"),
        json.dumps({"t_ms": 30, "type": "control", "session_id": "s1", "turn_id": None, "action": "CANCEL",
                    "reason": "barge-in", "source": "user"}),
    ]
    conversation = parse_lines(text)
    assert conversation.title == "x"
    assert conversation.events[0] == TextLine(10.0, "assistant", "s1", "t1", TOKEN, "Hi", None, "es", "ef_dora")
    assert conversation.events[2] == ControlLine(30.0, "s1", None, "CANCEL", "barge-in", "user")
    assert parse_lines(list(dump_lines(conversation))).events == conversation.events


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    (_line(t_ms=-1), "t_ms"),
    (_line(kind="SHOUT"), "'kind' must be one of"),
    (_line(text=""), "needs a non-empty 'text'"),
    (_line(kind="EVIDENCE_READY", text=""), "needs a 'claim_id'"),
    (_line(agent_id="bad agent"), "agent id"),
    (_line(colour="red"), "unknown keys"),
    (json.dumps({"t_ms": 0, "type": "control", "session_id": "s", "action": "PAUSE"}), "'action' must be"),
    (json.dumps({"t_ms": 0, "type": "audio"}), "'type' must be"),
])
def test_bad_lines_are_rejected_with_file_and_line(line, message):
    with pytest.raises(ConversationFormatError, match=message) as info:
        parse_lines(["", line], source="f.jsonl")
    assert str(info.value).startswith("f.jsonl:2:")


def test_time_going_back_and_events_after_the_end_are_rejected():
    with pytest.raises(ConversationFormatError, match=r"f:2: .*goes back in time"):
        parse_lines([_line(t_ms=5), _line(t_ms=4)], source="f")
    with pytest.raises(ConversationFormatError, match=r"f:3: .*after its END_OF_TURN"):
        parse_lines([_line(t_ms=1), _line(t_ms=2, kind="END_OF_TURN", text=""), _line(t_ms=3)], source="f")


def test_shipped_corpus_parses_and_is_what_the_builder_makes():
    built = corpus.build()
    assert set(built) == {p.name for p in corpus.CORPUS_DIR.glob("*.jsonl")}
    for name, expected in built.items():
        shipped = load(corpus.CORPUS_DIR / name)
        assert shipped.title and shipped.description
        assert len(shipped.events) == len(expected.events)
        for got, want in zip(shipped.events, expected.events):
            assert got == type(want)(**{**want.__dict__, "t_ms": round(want.t_ms, 3)}), name


def _turn_text(conversation, turn_id):
    return "".join(e.text for e in conversation.events if isinstance(e, TextLine) and e.turn_id == turn_id)


def test_corpus_timing_is_llm_like():
    for name in corpus.BUILDERS:
        conversation = load(corpus.corpus_path(name))
        spoken = [e for e in conversation.events if isinstance(e, TextLine) and e.agent_id == "assistant"]
        gaps = [b.t_ms - a.t_ms for a, b in zip(spoken, spoken[1:]) if a.turn_id == b.turn_id]
        assert spoken[0].t_ms >= 250 and spoken[0].kind == TOKEN
        assert all(20 <= g <= 60.01 for g in gaps), name


def test_corpus_covers_what_the_issue_lists():
    rag = load(corpus.corpus_path("rag_slow_retrieval"))
    pending = {e.claim_id: e.t_ms for e in rag.events if isinstance(e, TextLine) and e.kind == EVIDENCE_PENDING}
    resolved = {e.claim_id: (e.kind, e.t_ms, e.agent_id) for e in rag.events
                if isinstance(e, TextLine) and e.kind in (EVIDENCE_READY, EVIDENCE_FAILED)}
    assert set(pending) == set(resolved) == {"c1", "c2", "c3"}
    assert all(agent == "retrieval" for _, _, agent in resolved.values())
    end = next(e.t_ms for e in rag.events if isinstance(e, TextLine) and e.kind == END_OF_TURN)
    assert resolved["c1"][1] - pending["c1"] > 2000 and resolved["c1"][1] > end  # the slow retrieval
    assert resolved["c3"][0] == EVIDENCE_FAILED

    markdown = _turn_text(load(corpus.corpus_path("markdown_long")), "t1")
    for feature in ("## ", "\n- ", "**", "*producer*", "```python\n"):
        assert feature in markdown
    assert {e.language for e in load(corpus.corpus_path("spanish")).events} == {"es"}
    assert {e.language for e in load(corpus.corpus_path("portuguese")).events} == {"pt"}

    interrupted = load(corpus.corpus_path("interrupted"))
    cancels = [e for e in interrupted.events if isinstance(e, ControlLine)]
    assert [(c.turn_id, c.action) for c in cancels] == [("t1", "CANCEL")]
    t1_kinds = [e.kind for e in interrupted.events if isinstance(e, TextLine) and e.turn_id == "t1"]
    assert END_OF_TURN not in t1_kinds and t1_kinds.count(TOKEN) > 10
    assert _turn_text(interrupted, "t2").endswith(".")


# --- fuzz: any line is taken whole or refused with the file's error ------------------------------

from hypothesis import HealthCheck, given, settings as hsettings, strategies as st  # noqa: E402

from voicebus.agents.conversation_file import ConversationFormatError, parse_lines  # noqa: E402
from voicebus.codecs import Codec  # noqa: E402
from voicebus.agents.replay import plan_replay  # noqa: E402
from voicebus.agents.sdk import InvalidEventError  # noqa: E402

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_TEXTISH = st.fixed_dictionaries({
    "t_ms": st.one_of(st.integers(-5, 10_000), st.floats(allow_nan=True)), "type": st.sampled_from(["text", "control", "x"]),
    "agent_id": st.text(max_size=8), "session_id": st.text(max_size=140), "turn_id": st.text(max_size=6),
    "kind": st.sampled_from(["TOKEN", "END_OF_TURN", "EVIDENCE_PENDING", "nope"]), "text": st.text(max_size=8),
}, optional={"language": st.one_of(st.none(), st.sampled_from(["en", "es", "pt", "j", "klingon", ""])),
             "claim_id": st.text(max_size=5), "action": st.sampled_from(["CANCEL", "MUTE"])})


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_JSON.map(json.dumps), _TEXTISH.map(json.dumps), st.text(max_size=30)), max_size=6))
def test_any_lines_parse_into_what_replay_can_publish_or_raise_the_format_error(lines):
    """Fuzz: a conversation file is either refused with ConversationFormatError or
    every event replay makes of it encodes (the pipeline can act on it): a language the engine
    cannot speak, an over-long id or a control character used to pass and fail mid-replay."""
    try:
        conversation = parse_lines(lines)
    except ConversationFormatError:
        return
    codec = Codec()
    try:
        _, copies = plan_replay(conversation.events, sessions=3)
    except InvalidEventError:  # refused whole before anything is published (e.g. a copy's id too long)
        return
    for copy in copies:
        for item in copy.schedule:
            codec.encode(item.message_type, item.value)


def test_a_language_no_stage_can_speak_is_refused_at_parse():
    """Regression: the file used to pass, and its replay failed half-way (the codec refuses it)."""
    line = json.dumps({"t_ms": 0, "type": "text", "agent_id": "a", "session_id": "s", "turn_id": "t",
                       "kind": "TOKEN", "text": "Qapla'.", "language": "klingon"})
    with pytest.raises(ConversationFormatError, match=r"<events>:1: TextEvent: language 'klingon' cannot be spoken"):
        parse_lines([line])
