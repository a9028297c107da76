"""The SDK publishing through the real broker."""

import asyncio

import pytest

from voicebus.agents.sdk import Publisher
from voicebus.topics import session_key, text_topic
from tests.agents.bus_helpers import TopicReader, count_kind

pytestmark = pytest.mark.kafka


async def test_two_agents_stream_turns_at_once_each_to_its_topic_keyed_by_session(make_settings):
    settings = make_settings()
    assistant, retrieval = text_topic(settings, "assistant"), text_topic(settings, "retrieval")

    async def speak(agent, session):
        async with agent.turn(session, "t1", language="en") as turn:
            await turn.token("Your plan")
            await turn.evidence_pending("c1")
            await turn.tokens(iter([" includes", " storage", "."]))
        return turn

    async with TopicReader(settings, [assistant, retrieval, settings.control_topic]) as reader:
        async with Publisher(settings, "assistant") as agent:
            evidence = agent.evidence_source("s-a", "t1", agent_id="retrieval")
            turns = await asyncio.gather(speak(agent, "s-a"), speak(agent, "s-b"), evidence.evidence_ready("c1"))
            await agent.cancel("s-b", "t1", reason="barge-in")
        got = await reader.wait_for(lambda got: len(got) >= 2 * 6 + 2)

    for session in ("s-a", "s-b"):
        mine = [r for r in got if r.topic == assistant and r.value["session_id"] == session]
        assert [(r.value["seq"], r.value["kind"], r.value["text"]) for r in mine] == [
            (0, "TOKEN", "Your plan"), (1, "EVIDENCE_PENDING", ""), (2, "TOKEN", " includes"),
            (3, "TOKEN", " storage"), (4, "TOKEN", "."), (5, "END_OF_TURN", ""),
        ]
        assert all(r.key == session_key(session) and r.value["language"] == "en" for r in mine)
        stamps = [r.value["produced_at_us"] for r in mine]
        assert stamps == sorted(stamps)
    [ready] = [r for r in got if r.topic == retrieval]
    assert ready.value | {"produced_at_us": 0} == {
        "session_id": "s-a", "turn_id": "t1", "agent_id": "retrieval", "seq": 0, "kind": "EVIDENCE_READY",
        "text": "", "claim_id": "c1", "language": None, "voice": None, "floor": None, "priority": 0, "speed": None, "lexicon": None,
        "produced_at_us": 0}
    [cancel] = [r for r in got if r.topic == settings.control_topic]
    assert (cancel.type, cancel.key, cancel.value["turn_id"], cancel.value["action"]) == (
        "ControlEvent", b"s-b", "t1", "CANCEL")
    assert all(t.ended for t in turns[:2])


async def test_a_turn_block_that_raises_still_ends_the_turn(make_settings):
    settings = make_settings()
    async with TopicReader(settings, [text_topic(settings, "bot")]) as reader:
        async with Publisher(settings, "bot") as agent:
            with pytest.raises(RuntimeError, match="model crashed"):
                async with agent.turn("s1") as turn:
                    await turn.token("Half an")
                    raise RuntimeError("model crashed")
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert [r.value["kind"] for r in got] == ["TOKEN", "END_OF_TURN"]
    assert got[1].value["turn_id"] == turn.turn_id


async def test_a_publisher_whose_start_fails_stops_the_producer_it_had_started(make_settings, monkeypatch):
    """`async with Publisher`: a start that fails after the producer is up (here its agent topic
    cannot be made ready) stops that producer on the way out, instead of leaking a live client."""
    from voicebus.bus import TopicCreationError

    publisher = Publisher(make_settings(), "assistant")

    async def refused(agent_id: str) -> str:
        raise TopicCreationError(f"{agent_id}: refused by the broker")
    monkeypatch.setattr(publisher, "ensure_agent_topic", refused)  # the fault, after the producer started
    with pytest.raises(TopicCreationError):
        async with publisher:
            pytest.fail("a publisher that did not start must not be entered")
    assert publisher._producer is None
