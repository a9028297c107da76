"""The OpenAI-compatible adapter: a streaming chat completion becomes a turn of token events.

Works with any server that speaks the chat-completions streaming protocol (OpenAI, vLLM, Ollama,
llama.cpp server, ...): POST `<base_url>/chat/completions` with `"stream": true`, read the
Server-Sent Events, publish each `choices[0].delta.content` as a TOKEN the moment it arrives, and
END_OF_TURN at `data: [DONE]` (or when the server closes the stream cleanly).

Pure core: `SseDecoder` (bytes -> SSE `data` payloads, any chunking) and `delta_text`. Thin shell:
`stream_deltas` (aiohttp; yields text deltas, raises `StreamStalled`/`StreamBroken`) and
`speak_chat_completion` (publishes them through the SDK).

When the stream goes wrong after it started: a stall (no bytes for `stall_timeout_s`) or a
broken stream (connection reset, truncated body, an `error` event, unparseable JSON) ends the
turn with what arrived (policy `end`, the default: the gate speaks the complete sentences and
flushes the fragment) or cancels it (policy `cancel`: nothing of the turn is spoken), logs a
warning, closes the connection and returns an `AdapterResult` saying what happened; it does not
raise. Failures before the first byte (connection refused, a non-2xx status) raise
`UpstreamError` and publish nothing: there is no turn yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from agents.sdk import Publisher, new_turn_id

log = logging.getLogger(__name__)

DONE = "done"  # the server said [DONE] (or closed cleanly after the last chunk)
STALLED = "stalled"  # no bytes for stall_timeout_s
BROKEN = "broken"  # the stream broke or carried an error
POLICIES = ("end", "cancel")


class AdapterError(RuntimeError):
    """Base of the adapter's errors."""


class UpstreamError(AdapterError):
    """The server could not be reached or refused the request (non-2xx); nothing was published."""


class StreamStalled(AdapterError):
    """The stream sent nothing for longer than the stall timeout."""


class StreamBroken(AdapterError):
    """The stream ended abnormally: connection lost, bad JSON or an error event."""


class SseDecoder:
    """Incremental Server-Sent Events parser: `feed(bytes)` returns the `data` payloads of the
    events completed by these bytes. Handles CRLF/LF, multi-line data and comment lines."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:  # a blank line dispatches the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
            # other fields (event, id, retry) carry nothing the adapter needs

    def close(self) -> list[str]:
        """Payloads left when the stream ends without a final blank line."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events


def delta_text(payload: dict[str, Any]) -> str:
    """The text of the first choice's delta in one chunk (empty when it carries none)."""
    if "error" in payload:
        raise StreamBroken(f"server sent an error event: {payload['error']!r}")
    choices = payload.get("choices") or []
    for choice in choices:
        if choice.get("index", 0) == 0:
            return (choice.get("delta") or {}).get("content") or ""
    return ""


def finish_reason(payload: dict[str, Any]) -> str | None:
    for choice in payload.get("choices") or []:
        if choice.get("index", 0) == 0:
            return choice.get("finish_reason")
    return None


async def stream_deltas(http, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                        stall_timeout_s: float = 10.0, connect_timeout_s: float = 10.0) -> AsyncIterator[str]:
    """POST a streaming chat completion and yield each non-empty content delta as it arrives.

    Raises `UpstreamError` before the stream starts, `StreamStalled`/`StreamBroken` during it."""
    import aiohttp

    body = {**body, "stream": True}
    try:
        response = await asyncio.wait_for(http.post(url, json=body, headers=headers), connect_timeout_s)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise UpstreamError(f"cannot reach {url}: {exc!r}") from exc
    async with response:
        if response.status // 100 != 2:
            detail = (await response.text())[:500]
            raise UpstreamError(f"{url} answered HTTP {response.status}: {detail}")
        decoder = SseDecoder()
        while True:
            try:
                chunk = await asyncio.wait_for(response.content.readany(), stall_timeout_s)
            except asyncio.TimeoutError:
                response.close()  # drop the connection: the server may still be generating
                raise StreamStalled(f"no data from {url} for {stall_timeout_s:g} s") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise StreamBroken(f"stream from {url} broke: {exc!r}") from exc
            payloads = decoder.feed(chunk) if chunk else decoder.close()
            for data in payloads:
                if data.strip() == "[DONE]":
                    return
                try:
                    payload = json.loads(data)
                except json.JSONDecodeError as exc:
                    raise StreamBroken(f"stream from {url} sent non-JSON data: {data[:200]!r}") from exc
                text = delta_text(payload)
                if text:
                    yield text
            if not chunk:
                return  # the server closed the stream; without [DONE] we take it as the end


@dataclass
class AdapterResult:
    """How a turn went: `outcome` is done, stalled or broken; `text` is what was published."""

    session_id: str
    turn_id: str
    outcome: str
    tokens: int
    text: str
    error: str | None = None


def chat_completions_url(base_url: str) -> str:
    """`http://host:8000/v1` -> `http://host:8000/v1/chat/completions` (a full URL is kept)."""
    base = base_url.rstrip("/")
    return base if base.endswith("/chat/completions") else base + "/chat/completions"


async def speak_chat_completion(
    publisher: Publisher,
    http,
    session_id: str,
    *,
    base_url: str,
    model: str,
    messages: Sequence[dict[str, Any]],
    api_key: str | None = None,
    turn_id: str | None = None,
    agent_id: str | None = None,
    language: str | None = None,
    voice: str | None = None,
    stall_timeout_s: float = 10.0,
    on_interrupted: str = "end",
    extra_body: dict[str, Any] | None = None,
) -> AdapterResult:
    """Stream one chat completion into a turn of `session_id` (see the module doc for failures)."""
    if on_interrupted not in POLICIES:
        raise ValueError(f"on_interrupted must be one of {POLICIES}, got {on_interrupted!r}")
    url = chat_completions_url(base_url)
    body = {"model": model, "messages": list(messages), **(extra_body or {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    turn = publisher.turn(session_id, turn_id or new_turn_id(), agent_id=agent_id, language=language, voice=voice)
    await publisher.ensure_agent_topic(turn.events.agent_id)  # before the first token, not on it
    pieces: list[str] = []
    outcome, error = DONE, None
    deltas = stream_deltas(http, url, body, headers=headers, stall_timeout_s=stall_timeout_s)
    try:
        async for text in deltas:
            await turn.token(text)
            pieces.append(text)
    except (StreamStalled, StreamBroken) as exc:
        outcome, error = (STALLED if isinstance(exc, StreamStalled) else BROKEN), str(exc)
        log.warning("turn %s/%s %s after %d tokens: %s; %s", session_id, turn.turn_id, outcome, len(pieces), exc,
                    "ending it with what arrived" if on_interrupted == "end" else "cancelling it")
    finally:
        await deltas.aclose()
    if outcome != DONE and on_interrupted == "cancel":
        await turn.cancel(reason=f"upstream {outcome}", source="openai-adapter")
    else:
        await turn.end()
    return AdapterResult(session_id, turn.turn_id, outcome, len(pieces), "".join(pieces), error)
