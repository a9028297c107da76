"""Agents and what listeners heard, on the real broker: the SDK's HeardFollower hands an agent
the TurnHeard of its turn (await or callback), and the OpenAI adapter's conversation keeps only
the heard text as the assistant's message after a barge-in."""

import asyncio

import aiohttp
import pytest

from voicebus.agents.openai_adapter import Conversation
from voicebus.agents.sdk import HeardFollower, HeardTimeout, Publisher
from voicebus.bus import ensure_topics, make_producer, publish
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.schemas.messages import TurnHeard
from tests.agents.fake_openai import FakeChatServer, Script

pytestmark = pytest.mark.kafka

TOKENS = ["Sure", ".", " The", " office", " opens", " at", " nine", "."]


def turn_heard(session_id: str, turn_id: str, text: str, interrupted: bool, unheard: list[str]) -> TurnHeard:
    return TurnHeard(session_id=session_id, turn_id=turn_id, heard_text=text, interrupted=interrupted,
                     unheard_words=tuple(unheard), sentence_seq=1, rendered_samples=4800, client_id="c1", reports=1,
                     started_at_us=0, stopped_at_us=now_us(), published_at_us=now_us())


async def publish_heard(settings, *records: TurnHeard) -> None:
    await ensure_topics(settings, [settings.heard_topic])
    producer = make_producer(settings)
    await producer.start()
    try:
        for record in records:
            await publish(producer, Codec(), settings.heard_topic, "TurnHeard", record)
    finally:
        await producer.stop()


async def test_an_agent_awaits_or_is_called_back_with_what_was_heard(make_settings):
    settings = make_settings()
    before = turn_heard("s1", "t-early", "Hello.", False, [])
    await publish_heard(settings, before)  # published before the follower started: found by the lookback
    called = []
    async with Publisher(settings, "llm") as agent, HeardFollower(agent, on_heard=called.append) as heard:
        assert await heard.wait("s1", "t-early", timeout_s=5) == before
        waiting = asyncio.create_task(heard.wait("s1", "t-1", timeout_s=20))
        record = turn_heard("s1", "t-1", "Sure. The office", True, ["opens", "at", "nine."])
        await publish_heard(settings, record)
        assert await waiting == record
        assert called[-1] == record
        with pytest.raises(HeardTimeout):
            await heard.wait("s1", "t-never", timeout_s=0.3)


async def test_after_a_barge_in_the_conversation_keeps_only_what_was_heard(make_settings):
    settings = make_settings()
    server = FakeChatServer(Script(TOKENS, interval_s=0.02))
    await server.start()
    try:
        async with Publisher(settings, "llm") as agent, HeardFollower(agent) as heard, aiohttp.ClientSession() as http:
            chat = Conversation(agent, http, "s1", base_url=server.url, model="fake", heard=heard, system="Be brief.",
                                heard_timeout_s=20, turn_id="t-1")
            # the edge's TurnHeard for the turn arrives while the conversation waits for it
            barge_in = asyncio.create_task(publish_heard(
                settings, turn_heard("s1", "t-1", "Sure. The office", True, ["opens", "at", "nine."])))
            result, got = await chat.reply("When do you open?")
            await barge_in
            assert result.text == "".join(TOKENS) and got.interrupted
            assert chat.messages[-1] == {"role": "assistant", "content": "Sure. The office"}
            chat.speak_options["turn_id"] = "t-2"
            await publish_heard(settings, turn_heard("s1", "t-2", "Sure. The office opens at nine.", False, []))
            await chat.reply("And on Sunday?")
            # the model saw the heard text, not everything it had generated
            assert server.requests[1]["messages"][:4] == [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "When do you open?"},
                {"role": "assistant", "content": "Sure. The office"}, {"role": "user", "content": "And on Sunday?"}]
            assert chat.messages[-1]["content"] == "".join(TOKENS)  # heard whole: the generated text stays
    finally:
        await server.stop()
