"""The OpenAI-compatible adapter publishing a fake server's stream through the real broker."""

import asyncio

import aiohttp
import pytest

from voicebus.agents.openai_adapter import BROKEN, DONE, STALLED, UpstreamError, speak_chat_completion
from voicebus.agents.sdk import Publisher
from voicebus.topics import text_topic
from tests.agents.bus_helpers import TopicReader, count_kind
from tests.agents.fake_openai import FakeChatServer, Script

pytestmark = pytest.mark.kafka

TOKENS = ["Sure", ".", " The", " office", " opens", " at", " nine", ".", " Anything", " else", "?"]


@pytest.fixture
async def fake_server():
    server = FakeChatServer(Script(TOKENS, interval_s=0.06))
    await server.start()
    yield server
    await server.stop()


async def _speak(settings, server, **kwargs):
    async with Publisher(settings, "llm") as agent, aiohttp.ClientSession() as http:
        return await speak_chat_completion(agent, http, "s1", base_url=server.url, model="fake",
                                           messages=[{"role": "user", "content": "hours?"}], **kwargs)


async def test_tokens_are_published_as_they_arrive_and_the_turn_ends_at_done(make_settings, fake_server):
    settings = make_settings()
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        result = await _speak(settings, fake_server, language="en", voice="af_heart")
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert (result.outcome, result.tokens, result.text) == (DONE, len(TOKENS), "".join(TOKENS))
    assert [r.value["text"] for r in got[:-1]] == TOKENS
    assert [r.value["seq"] for r in got] == list(range(len(TOKENS) + 1))
    assert {r.value["turn_id"] for r in got} == {result.turn_id}
    assert got[0].value["voice"] == "af_heart"
    # streamed, not buffered: every token was published after the server wrote it and the first
    # ones long before the server finished (a buffering adapter would publish all at the end)
    lags_ms = sorted((r.value["produced_at_us"] - sent) / 1000 for r, sent in zip(got, fake_server.sent_at_us))
    print(f"adapter: server write -> token published: median {lags_ms[len(lags_ms) // 2]:.2f} ms, "
          f"max {lags_ms[-1]:.2f} ms")
    assert lags_ms[0] >= 0
    assert fake_server.sent_at_us[-1] - got[0].value["produced_at_us"] > 0.4e6
    assert fake_server.requests[0]["model"] == "fake" and fake_server.requests[0]["stream"] is True


async def test_a_stall_ends_the_turn_with_what_arrived(make_settings, fake_server):
    settings = make_settings()
    fake_server.script.stall_after = 4
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        result = await _speak(settings, fake_server, stall_timeout_s=0.4)
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert (result.outcome, result.tokens) == (STALLED, 4)
    assert [r.value["kind"] for r in got] == ["TOKEN"] * 4 + ["END_OF_TURN"]


async def test_a_broken_stream_can_cancel_the_turn_instead(make_settings, fake_server):
    settings = make_settings()
    fake_server.script.break_after = 3
    async with TopicReader(settings, [text_topic(settings, "llm"), settings.control_topic]) as reader:
        result = await _speak(settings, fake_server, on_interrupted="cancel")
        got = await reader.wait_for(lambda got: any(r.type == "ControlEvent" for r in got) and len(got) >= 4)
    assert result.outcome == BROKEN and result.error
    assert [r.value.get("kind") for r in got if r.type == "TextEvent"] == ["TOKEN"] * 3
    [cancel] = [r.value for r in got if r.type == "ControlEvent"]
    assert (cancel["session_id"], cancel["turn_id"], cancel["source"]) == ("s1", result.turn_id, "openai-adapter")


async def test_an_http_error_publishes_nothing(make_settings, fake_server):
    settings = make_settings()
    fake_server.script.status = 500
    with pytest.raises(UpstreamError, match="HTTP 500"):
        await _speak(settings, fake_server)
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        async with Publisher(settings, "llm") as agent:
            async with agent.turn("marker") as turn:
                await turn.token("x")
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert {r.value["session_id"] for r in got} == {"marker"}  # nothing of s1 before the marker turn


@pytest.mark.parametrize("raw, why", [
    (b"data: \xff\xfe{}\n\n", "not UTF-8"),
    (b"data: 42\n\n", "JSON object, got int"),
    (b'data: ["a"]\n\n', "JSON object, got list"),
    (b'data: {"choices": "x"}\n\n', "'choices' is not a list"),
    (b'data: {"choices": [{"index": 0, "delta": {"content": 5}}]}\n\n', "not a string"),
])
async def test_a_bad_payload_ends_the_turn_with_a_clear_error(make_settings, fake_server, raw, why, caplog):
    settings = make_settings()
    fake_server.script.raw_after, fake_server.script.raw = 3, raw
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        async with asyncio.timeout(30):
            result = await _speak(settings, fake_server)
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert result.outcome == BROKEN and why in result.error
    assert [r.value["kind"] for r in got] == ["TOKEN"] * 3 + ["END_OF_TURN"]
    assert any(why in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


async def test_a_line_that_never_ends_ends_the_turn_at_the_line_limit(make_settings, fake_server):
    settings = make_settings(sse_max_line_bytes=64 * 1024)
    fake_server.script.endless_line_after = 2
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        async with asyncio.timeout(30):  # without a bound the line grows until memory runs out
            result = await _speak(settings, fake_server)
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert result.outcome == BROKEN and "65536" in result.error
    assert [r.value["kind"] for r in got] == ["TOKEN"] * 2 + ["END_OF_TURN"]


async def test_a_cancelled_adapter_still_ends_its_turn(make_settings, fake_server):
    settings = make_settings()
    fake_server.script.stall_after = 2
    async with TopicReader(settings, [text_topic(settings, "llm")]) as reader:
        task = asyncio.create_task(_speak(settings, fake_server, stall_timeout_s=60))
        await reader.wait_for(count_kind("TOKEN", 2))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await reader.wait_for(count_kind("END_OF_TURN"))
    assert [r.value["kind"] for r in got] == ["TOKEN"] * 2 + ["END_OF_TURN"]
