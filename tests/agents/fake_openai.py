"""A local OpenAI-compatible chat-completions server for the adapter tests (aiohttp).

It streams a scripted answer as SSE chunks at a chosen token interval and can stall, break the
connection, answer an HTTP error, leave out `data: [DONE]`, write raw bytes after some tokens
(invalid UTF-8, a JSON payload that is not an object), or start a line that never ends. It records
the request bodies it got.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    tokens: list[str]
    interval_s: float = 0.02
    stall_after: int | None = None  # stop sending after this many tokens (until the test ends)
    break_after: int | None = None  # drop the connection after this many tokens
    status: int = 200
    send_done: bool = True
    empty_deltas: bool = True  # send the role-only first chunk and an empty-content chunk, like real servers
    raw_after: int | None = None  # write `raw` after this many tokens, then go on with the rest
    raw: bytes = b""
    endless_line_after: int | None = None  # after this many tokens, write one line forever (4 KiB a write)


@dataclass
class FakeChatServer:
    script: Script
    url: str = ""
    requests: list[dict] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # time.monotonic() of each token write
    sent_at_us: list[int] = field(default_factory=list)  # the same, epoch microseconds
    endless_bytes: int = 0  # bytes of the endless line written so far

    def __post_init__(self) -> None:
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    def _chunk(content: str | None, finish: str | None = None, role: str | None = None) -> bytes:
        delta = {}
        if role:
            delta["role"] = role
        if content is not None:
            delta["content"] = content
        body = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": "fake",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        s = self.script
        if s.status != 200:
            return web.json_response({"error": {"message": "scripted failure"}}, status=s.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if s.empty_deltas:
                await response.write(self._chunk(None, role="assistant"))
                await response.write(self._chunk(""))
            for i, token in enumerate(s.tokens):
                if s.raw_after is not None and i == s.raw_after:
                    await response.write(s.raw)
                if s.endless_line_after is not None and i == s.endless_line_after:
                    await response.write(b"data: ")
                    while not self._release.is_set():
                        await response.write(b"x" * 4096)
                        self.endless_bytes += 4096
                        await asyncio.sleep(0)
                    return response
                if s.stall_after is not None and i == s.stall_after:
                    await self._release.wait()
                    return response
                if s.break_after is not None and i == s.break_after:
                    request.transport.close()
                    return response
                await asyncio.sleep(s.interval_s)
                # split one SSE event across two writes: the client must reassemble it
                data = self._chunk(token)
                await response.write(data[:7])
                await response.write(data[7:])
                self.sent_at.append(time.monotonic())
                self.sent_at_us.append(time.time_ns() // 1000)
            await response.write(self._chunk(None, finish="stop"))
            if s.send_done:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        return response
