"""Shared helpers of the edge tests: an edge app under aiohttp's test client, a protocol client."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer

from voicebus.settings import Settings
from voicebus.players import protocol
from voicebus.players.auth import issue_token
from voicebus.players.edge import make_app

SECRET = "test-secret"


def edge_settings(**overrides) -> Settings:
    return Settings(edge_secret=SECRET, **overrides)


@contextlib.asynccontextmanager
async def running_edge(settings: Settings, **kwargs):
    app = make_app(settings, **kwargs)
    async with TestClient(TestServer(app)) as client:
        yield app, client


async def connect(client, session: str, token: str | None = None, resume: dict | None = None):
    """Open /ws, say hello; returns (ws, ready message)."""
    ws = await client.ws_connect("/ws")
    hello = {"type": "hello", "v": 1, "session": session, "token": token or issue_token(SECRET, session, 60)}
    if resume:
        hello["resume"] = resume
    await ws.send_str(json.dumps(hello))
    msg = await ws.receive(timeout=5)
    return ws, (json.loads(msg.data) if msg.type == WSMsgType.TEXT else msg)


async def collect(ws, until, timeout: float = 5.0) -> list:
    """Receive decoded messages (dicts for text, AudioFrame for binary) until `until(messages)`."""
    messages: list = []
    async with asyncio.timeout(timeout):
        while not until(messages):
            msg = await ws.receive()
            if msg.type == WSMsgType.TEXT:
                messages.append(json.loads(msg.data))
            elif msg.type == WSMsgType.BINARY:
                messages.append(protocol.decode_audio(msg.data))
            else:
                messages.append(msg)
                break
    return messages


def audio(messages) -> list[protocol.AudioFrame]:
    return [m for m in messages if isinstance(m, protocol.AudioFrame)]


def of_type(messages, mtype: str) -> list[dict]:
    return [m for m in messages if isinstance(m, dict) and m.get("type") == mtype]


def turn_ended(messages) -> bool:
    return bool(of_type(messages, "turn_end"))


async def publish_audio(settings: Settings, chunks) -> None:
    """Publish AudioChunks to the audio topic, in order, with a producer of its own."""
    from voicebus.bus import make_producer, publish
    from voicebus.codecs import Codec

    producer, codec = make_producer(settings), Codec()
    await producer.start()
    try:
        for chunk in chunks:
            await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
    finally:
        await producer.stop()
