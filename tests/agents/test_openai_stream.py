"""The adapter's stream reading against a local fake OpenAI-compatible server (no Kafka)."""

import asyncio
import time

import aiohttp
import pytest

from voicebus.agents.openai_adapter import (
    SseDecoder, SseLineTooLong, StreamBroken, StreamStalled, UpstreamError, chat_completions_url, delta_text,
    stream_deltas,
)
from tests.agents.fake_openai import FakeChatServer, Script

TOKENS = ["Hello", " there", ".", " How", " can", " I", " help", "?"]


@pytest.fixture
async def fake_server():
    server = FakeChatServer(Script(TOKENS))
    await server.start()
    yield server
    await server.stop()


async def _collect(server, **kwargs):
    got, at = [], []
    async with aiohttp.ClientSession() as http:
        async for text in stream_deltas(http, chat_completions_url(server.url), {"model": "m", "messages": []},
                                        **kwargs):
            got.append(text)
            at.append(time.monotonic())
    return got, at


def test_sse_decoder_handles_any_chunking_comments_and_multiline_data():
    stream = b": keep-alive\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: x\ndata: [DONE]\n\n"
    for size in (1, 2, 5, len(stream)):
        decoder = SseDecoder()
        payloads = []
        for i in range(0, len(stream), size):
            payloads += decoder.feed(stream[i:i + size])
        assert payloads + decoder.close() == ['{"a":\n1}', "[DONE]"]


async def test_tokens_arrive_as_they_are_streamed(fake_server):
    fake_server.script.interval_s = 0.05
    got, at = await _collect(fake_server)
    assert got == TOKENS
    assert fake_server.requests[0]["stream"] is True
    # each token was yielded after the server wrote it, the first long before the stream finished
    assert all(a >= s for a, s in zip(at, fake_server.sent_at))
    assert at[0] < fake_server.sent_at[-1] - 0.2


async def test_a_stall_raises_stream_stalled_after_the_tokens_that_arrived(fake_server):
    fake_server.script.stall_after = 3
    got = []
    started = time.monotonic()
    with pytest.raises(StreamStalled, match="no data"):
        async with aiohttp.ClientSession() as http:
            async for text in stream_deltas(http, chat_completions_url(fake_server.url), {"model": "m"},
                                            stall_timeout_s=0.3):
                got.append(text)
    assert got == TOKENS[:3]
    assert 0.3 <= time.monotonic() - started < 2.0


async def test_a_dropped_connection_raises_stream_broken(fake_server):
    fake_server.script.break_after = 2
    with pytest.raises(StreamBroken, match="broke"):
        await _collect(fake_server)


async def test_http_errors_and_unreachable_servers_raise_upstream_error(fake_server):
    fake_server.script.status = 503
    with pytest.raises(UpstreamError, match="HTTP 503"):
        await _collect(fake_server)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(UpstreamError, match="cannot reach"):
            async for _ in stream_deltas(http, "http://127.0.0.1:9/v1/chat/completions", {"model": "m"}):
                pass


async def test_a_stream_without_done_ends_at_close(fake_server):
    fake_server.script.send_done = False
    got, _ = await _collect(fake_server)
    assert got == TOKENS


def test_the_sse_decoder_holds_at_most_max_line_bytes_of_an_unfinished_line():
    decoder = SseDecoder(max_line_bytes=4096)
    decoder.feed(b"data: ")
    with pytest.raises(SseLineTooLong, match="4096"):
        for _ in range(10):
            decoder.feed(b"x" * 1000)
    assert len(decoder._buffer) <= 4096 + 1000
    # finished lines count too, and so does one event's data spread over many lines
    with pytest.raises(SseLineTooLong):
        SseDecoder(max_line_bytes=100).feed(b"data: " + b"y" * 200 + b"\n\n")
    with pytest.raises(SseLineTooLong, match="event's data"):
        SseDecoder(max_line_bytes=100).feed(b"data: 0123456789\n" * 20)
    assert SseDecoder(max_line_bytes=100).feed(b"data: 0123456789\n\n" * 20) == ["0123456789"] * 20


def test_invalid_utf8_and_chunks_that_are_not_objects_break_the_stream():
    with pytest.raises(StreamBroken, match="not UTF-8"):
        SseDecoder().feed(b"data: \xff\xfe\n\n")
    for payload in (42, ["a"], "text", None, {"choices": "x"}, {"choices": [7]},
                    {"choices": [{"index": 0, "delta": "x"}]}, {"choices": [{"index": 0, "delta": {"content": 5}}]}):
        with pytest.raises(StreamBroken):
            delta_text(payload)
    assert delta_text({"choices": [{"index": 0, "delta": {"content": None}}]}) == ""


async def test_a_line_that_never_ends_breaks_the_stream_at_the_limit(fake_server):
    fake_server.script.endless_line_after = 2
    with pytest.raises(SseLineTooLong, match="65536"):
        await asyncio.wait_for(_collect(fake_server, max_line_bytes=65536), 20)
    assert fake_server.endless_bytes >= 65536


def test_events_before_a_bad_line_in_the_same_bytes_come_out_first():
    decoder = SseDecoder()
    assert decoder.feed(b"data: one\n\ndata: \xff\n\n") == ["one"]
    with pytest.raises(StreamBroken, match="not UTF-8"):
        decoder.raise_pending()
    with pytest.raises(StreamBroken):
        decoder.feed(b"data: two\n\n")  # a broken stream stays broken


# --- fuzzing: any bytes, any chunking, any JSON -------------------------------------

from hypothesis import HealthCheck, given, settings as hsettings, strategies as st  # noqa: E402

_SSE_PIECES = st.sampled_from([b"data: ", b"data:", b": c", b"event: x", b"id: 1", b"\n", b"\r\n", b"\r", b"\n\n",
                               b"{", b"}", b"[DONE]", b"\xff", b"\xe2\x82", b"\xac", b"x" * 40, b" "])
_SSE_BYTES = st.lists(st.one_of(_SSE_PIECES, st.binary(max_size=12)), max_size=30).map(b"".join)


def _decode(data: bytes, cuts: list[int], max_line_bytes: int):
    """Payloads of `data` fed in pieces cut at `cuts`, and the StreamBroken that ended it (or None)."""
    decoder = SseDecoder(max_line_bytes=max_line_bytes)
    payloads: list[str] = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    try:
        for a, b in zip(bounds, bounds[1:]):
            payloads += decoder.feed(data[a:b])
            assert len(decoder._buffer) <= max_line_bytes + (b - a)  # what it holds stays bounded
        payloads += decoder.close()
    except StreamBroken as exc:  # the only way a stream may fail
        return payloads, exc
    return payloads, None


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_SSE_BYTES, cuts=st.lists(st.integers(0, 10_000), max_size=8), limit=st.sampled_from([16, 64, 4096]))
def test_any_bytes_in_any_pieces_give_the_same_payloads_or_break_the_stream(data, cuts, limit):
    whole, whole_error = _decode(data, [], limit)
    split, split_error = _decode(data, cuts, limit)
    assert all(isinstance(p, str) for p in whole + split)
    # the chunking of the bytes changes neither what comes out nor whether (and why) it broke
    assert split == whole and type(split_error) is type(whole_error)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["choices", "index", "delta", "content", "error", "finish_reason", "x"]),
                         inner, max_size=4), max_leaves=12)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_JSON)
def test_any_json_chunk_gives_text_or_breaks_the_stream(payload):
    try:
        text = delta_text(payload)
    except StreamBroken:
        return
    assert isinstance(text, str)


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), min_size=1,
                               max_size=20), max_size=6),
       cuts=st.lists(st.integers(0, 10_000), max_size=8), crlf=st.booleans())
def test_well_formed_events_come_out_whole_in_any_pieces(values, cuts, crlf):
    newline = b"\r\n" if crlf else b"\n"
    data = b"".join(b": keep-alive" + newline + b"data: " + v.encode() + newline + newline for v in values)
    payloads, error = _decode(data, cuts, 4096)
    assert error is None and payloads == values
