"""The OpenAI-compatible adapter: a streaming chat completion becomes a turn of token events.

Works with any server that speaks the chat-completions streaming protocol (OpenAI, vLLM, Ollama,
llama.cpp server, ...): POST `<base_url>/chat/completions` with `"stream": true`, read the
Server-Sent Events, publish each `choices[0].delta.content` as a TOKEN the moment it arrives, and
END_OF_TURN at `data: [DONE]` (or when the server closes the stream cleanly).

Pure core: `SseDecoder` (bytes -> SSE `data` payloads, any chunking) and `delta_text`. Thin shell:
`stream_deltas` (aiohttp; yields text deltas, raises `StreamStalled`/`StreamBroken`) and
`speak_chat_completion` (publishes them through the SDK).

When the stream goes wrong after it started: a stall (no bytes for `stall_timeout_s`) or a
broken stream (connection reset, truncated body, an `error` event, unparseable JSON, invalid
UTF-8, a payload that is not a chat-completion chunk object, a line longer than
`Settings.sse_max_line_bytes`) ends the turn with what arrived (policy `end`, the default: the
gate speaks the complete sentences and flushes the fragment) or cancels it (policy `cancel`:
nothing of the turn is spoken), logs a warning, closes the connection and returns an
`AdapterResult` saying what happened; it does not raise. Any other failure once the turn is open
(a publish that fails, the task being cancelled) still closes the turn the same way, logs an
error and raises. Failures before the first byte (connection refused, a non-2xx status) raise
`UpstreamError` and publish nothing: there is no turn yet.

Memory is bounded: the decoder holds at most `max_line_bytes` of an unfinished line and of one
event's data (`SseLineTooLong` beyond it), whatever the server sends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from voicebus.agents.sdk import Publisher, new_turn_id
from voicebus.schemas.messages import TurnHeard

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


class SseLineTooLong(StreamBroken):
    """A line (or one event's data) exceeded the decoder's `max_line_bytes`."""


DEFAULT_MAX_LINE_BYTES = 1024 * 1024  # Settings.sse_max_line_bytes


class SseDecoder:
    """Incremental Server-Sent Events parser: `feed(bytes)` returns the `data` payloads of the
    events completed by these bytes. Handles CRLF/LF, multi-line data and comment lines.

    Raises `StreamBroken` for a line that is not UTF-8 and `SseLineTooLong` when an unfinished
    line or one event's data grows past `max_line_bytes`: what it buffers stays bounded."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be positive, got {max_line_bytes}")
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of _buffer already searched for a newline (no rescans: linear time)
        self._data: list[str] = []
        self._data_bytes = 0
        self._error: StreamBroken | None = None

    def feed(self, chunk: bytes) -> list[str]:
        """The payloads these bytes complete. A fault after some complete events in the same
        bytes returns those events first and is raised by `raise_pending` (or the next call)."""
        self.raise_pending()
        self._buffer += chunk
        events: list[str] = []
        try:
            self._parse(events)
        except StreamBroken as exc:
            self._error = exc
            if not events:
                raise
        return events

    def raise_pending(self) -> None:
        """Raise the fault found after the events the last `feed` returned, if any."""
        if self._error is not None:
            raise self._error

    def _parse(self, events: list[str]) -> None:
        start = 0
        while True:
            newline = self._buffer.find(b"\n", max(start, self._scanned))
            if newline < 0:
                del self._buffer[:start]
                self._scanned = len(self._buffer)
                if self._scanned > self.max_line_bytes:
                    raise SseLineTooLong(f"an SSE line grew past {self.max_line_bytes} bytes without ending")
                return
            raw = bytes(self._buffer[start:newline])
            start = newline + 1
            if len(raw) > self.max_line_bytes:
                raise SseLineTooLong(f"an SSE line of {len(raw)} bytes exceeds {self.max_line_bytes}")
            try:
                line = raw.rstrip(b"\r").decode("utf-8")
            except UnicodeDecodeError as exc:
                raise StreamBroken(f"an SSE line is not UTF-8 ({exc.reason} at byte {exc.start}): {raw[:80]!r}") from None
            if not line:  # a blank line dispatches the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data, self._data_bytes = [], 0
                continue
            if line.startswith(":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data_bytes += len(value) + 1
                if self._data_bytes > self.max_line_bytes:
                    raise SseLineTooLong(f"an SSE event's data grew past {self.max_line_bytes} bytes")
                self._data.append(value)
            # other fields (event, id, retry) carry nothing the adapter needs

    def close(self) -> list[str]:
        """Payloads left when the stream ends without a final blank line."""
        self.raise_pending()
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data, self._data_bytes = [], 0
        return events


def _first_choice(payload: Any) -> dict[str, Any] | None:
    """The choice with index 0 of a chunk; `StreamBroken` for anything not shaped like a chunk."""
    if not isinstance(payload, dict):
        raise StreamBroken(f"a chunk is a JSON object, got {type(payload).__name__}: {str(payload)[:100]!r}")
    if "error" in payload:
        raise StreamBroken(f"server sent an error event: {payload['error']!r}")
    choices = payload.get("choices") or []
    if not isinstance(choices, list):
        raise StreamBroken(f"'choices' is not a list: {str(choices)[:100]!r}")
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamBroken(f"a choice is not an object: {str(choice)[:100]!r}")
        if choice.get("index", 0) == 0:
            return choice
    return None


def delta_text(payload: Any) -> str:
    """The text of the first choice's delta in one chunk (empty when it carries none)."""
    choice = _first_choice(payload)
    if choice is None:
        return ""
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        raise StreamBroken(f"'delta' is not an object: {str(delta)[:100]!r}")
    content = delta.get("content") or ""
    if not isinstance(content, str):
        raise StreamBroken(f"'delta.content' is not a string: {str(content)[:100]!r}")
    return content


def finish_reason(payload: Any) -> str | None:
    choice = _first_choice(payload)
    return None if choice is None else choice.get("finish_reason")


async def stream_deltas(http, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                        stall_timeout_s: float = 10.0, connect_timeout_s: float = 10.0,
                        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> AsyncIterator[str]:
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
        decoder = SseDecoder(max_line_bytes)
        while True:
            try:
                chunk = await asyncio.wait_for(response.content.readany(), stall_timeout_s)
            except asyncio.TimeoutError:
                response.close()  # drop the connection: the server may still be generating
                raise StreamStalled(f"no data from {url} for {stall_timeout_s:g} s") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise StreamBroken(f"stream from {url} broke: {exc!r}") from exc
            try:
                payloads = decoder.feed(chunk) if chunk else decoder.close()
            except StreamBroken as exc:
                response.close()  # the rest of this stream is not read
                raise type(exc)(f"stream from {url}: {exc}") from exc  # keeps SseLineTooLong
            for data in payloads:
                if data.strip() == "[DONE]":
                    return
                try:
                    payload = json.loads(data)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise StreamBroken(f"stream from {url} sent non-JSON data: {data[:200]!r}") from exc
                text = delta_text(payload)
                if text:
                    yield text
            try:
                decoder.raise_pending()  # a fault that followed these payloads in the same bytes
            except StreamBroken as exc:
                response.close()
                raise type(exc)(f"stream from {url}: {exc}") from exc
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
    max_line_bytes: int | None = None,
) -> AdapterResult:
    """Stream one chat completion into a turn of `session_id` (see the module doc for failures).
    `max_line_bytes` defaults to the publisher's `Settings.sse_max_line_bytes`."""
    if on_interrupted not in POLICIES:
        raise ValueError(f"on_interrupted must be one of {POLICIES}, got {on_interrupted!r}")
    url = chat_completions_url(base_url)
    body = {"model": model, "messages": list(messages), **(extra_body or {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    turn = publisher.turn(session_id, turn_id or new_turn_id(), agent_id=agent_id, language=language, voice=voice)
    await publisher.ensure_agent_topic(turn.events.agent_id)  # before the first token, not on it
    pieces: list[str] = []
    outcome, error = DONE, None
    if max_line_bytes is None:
        max_line_bytes = publisher.settings.sse_max_line_bytes
    deltas = stream_deltas(http, url, body, headers=headers, stall_timeout_s=stall_timeout_s,
                           max_line_bytes=max_line_bytes)
    try:
        async for text in deltas:
            await turn.token(text)
            pieces.append(text)
    except (StreamStalled, StreamBroken) as exc:
        outcome, error = (STALLED if isinstance(exc, StreamStalled) else BROKEN), str(exc)
        log.warning("turn %s/%s %s after %d tokens: %s; %s", session_id, turn.turn_id, outcome, len(pieces), exc,
                    "ending it with what arrived" if on_interrupted == "end" else "cancelling it")
    except UpstreamError:
        raise  # before the first byte: nothing was published, there is no turn to close
    except (Exception, asyncio.CancelledError) as exc:
        # Not a stream fault (a publish failed, the caller cancelled us): a started turn is still
        # closed, so the gate and the player are not left waiting for it, then the error goes on.
        log.error("turn %s/%s failed after %d tokens: %r%s", session_id, turn.turn_id, len(pieces), exc,
                  "; closing it" if pieces else "")
        if not pieces:
            raise
        try:
            await _close_turn(turn, BROKEN, on_interrupted)
        except Exception as close_exc:  # e.g. the bus is down: the first error is the one raised
            log.error("turn %s/%s could not be closed either: %r", session_id, turn.turn_id, close_exc)
        raise
    finally:
        await deltas.aclose()
    await _close_turn(turn, outcome, on_interrupted)
    return AdapterResult(session_id, turn.turn_id, outcome, len(pieces), "".join(pieces), error)


async def _close_turn(turn, outcome: str, on_interrupted: str) -> None:
    """End the turn, or cancel it when it did not finish and the policy says so."""
    if outcome != DONE and on_interrupted == "cancel":
        await turn.cancel(reason=f"upstream {outcome}", source="openai-adapter")
    else:
        await turn.end()


class Conversation:
    """A chat conversation spoken through voicebus, whose history is what the listener *heard*.

    Each `reply` appends the user's message, streams the model's answer into a turn
    (`speak_chat_completion`) and appends the assistant message. With a `HeardFollower` it first
    waits (up to `heard_timeout_s`) for the turn's TurnHeard: after a barge-in (``interrupted``)
    the assistant message is only the heard text (the words whose start was rendered), so the
    model continues from what the user actually heard, not from everything it generated. A turn
    nobody heard (no TurnHeard in time) keeps the generated text, and says so in the log.
    ``speak_options`` go to `speak_chat_completion` (api_key, language, voice, ...)."""

    def __init__(self, publisher: Publisher, http, session_id: str, *, base_url: str, model: str,
                 heard=None, system: str | None = None, heard_timeout_s: float = 10.0, **speak_options: Any) -> None:
        self.publisher, self.http, self.session_id = publisher, http, session_id
        self.base_url, self.model, self.heard = base_url, model, heard
        self.heard_timeout_s = heard_timeout_s
        self.speak_options = speak_options
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []

    async def reply(self, user_text: str) -> tuple[AdapterResult, TurnHeard | None]:
        """One exchange; returns the adapter's result and the TurnHeard (None without one)."""
        from voicebus.agents.sdk import HeardTimeout

        self.messages.append({"role": "user", "content": user_text})
        result = await speak_chat_completion(self.publisher, self.http, self.session_id, base_url=self.base_url,
                                             model=self.model, messages=self.messages, **self.speak_options)
        heard, text = None, result.text
        if self.heard is not None:
            try:
                heard = await self.heard.wait(result.session_id, result.turn_id, self.heard_timeout_s)
            except HeardTimeout as exc:
                log.warning("%s; the conversation keeps the generated text", exc)
        if heard is not None and heard.interrupted:
            text = heard.heard_text
        if text:
            self.messages.append({"role": "assistant", "content": text})
        return result, heard
