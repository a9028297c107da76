"""The player edge: an aiohttp app that streams each session's audio to its WebSocket players.

`make_app(settings)` builds the app. Its `cleanup_ctx` owns the Kafka side (`KafkaLink`: one
consumer of the audio and control topics, one producer for cancels and playback reports) and
stops it on shutdown; each WebSocket connection owns one sender task. Routing, cancel, slow-client
and replay logic live in the pure `players.router.SessionRouter`; this module is the thin shell.

Routes: ``/`` (the web player), ``/web/*`` (its files), ``/ws`` (the protocol of
`docs/protocol.md`), ``/metrics`` (Prometheus), ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import WSMsgType, web

from pipeline.clock import now_us
from pipeline.codecs import codec_for
from pipeline.settings import Settings
from players import protocol
from players.auth import TokenError, verify_token
from players.metrics import EdgeMetrics
from players.router import ClientChannel, ClientClosed, OutFrame, SessionRouter, UnroutableChunk
from schemas.contract import ControlAction

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
HELLO_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0  # a stuck client may never read our close frame: abort the transport after this

SETTINGS_KEY = web.AppKey("settings", Settings)
ROUTER_KEY = web.AppKey("router", SessionRouter)
METRICS_KEY = web.AppKey("metrics", EdgeMetrics)
LINK_KEY = web.AppKey("kafka_link", object)  # KafkaLink, or None without Kafka
REPORTS_KEY = web.AppKey("reports", deque)  # the latest playback reports, newest last
CLIENTS_KEY = web.AppKey("client_sockets", set)
HELLO_TIMEOUT_KEY = web.AppKey("hello_timeout_s", float)


class KafkaLink:
    """The edge's Kafka clients: consumes audio + control (control first in every batch: control
    overtakes data), publishes cancels and playback reports. Owned by the app's cleanup_ctx."""

    def __init__(self, settings: Settings, router: SessionRouter, metrics: EdgeMetrics) -> None:
        self.settings, self.router, self.metrics = settings, router, metrics
        self.codec = codec_for(settings)
        self.producer: Any = None
        self.consumer: Any = None
        self.task: asyncio.Task | None = None
        self.ready = asyncio.Event()

    async def start(self) -> None:
        from aiokafka import TopicPartition

        from pipeline.bus import ensure_topics, make_consumer, make_producer

        s = self.settings
        await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.deadletter_topic])
        self.producer = make_producer(s)
        await self.producer.start()
        # No consumer group: every edge sees every session (clients of a session may be on any edge).
        self.consumer = make_consumer(s, group_id=None)
        await self.consumer.start()
        tps = [TopicPartition(t, p) for t in (s.control_topic, s.audio_topic) for p in sorted(await self.producer.partitions_for(t))]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, so "ready" means nothing published from here on is missed
            await self.consumer.position(tp)
        self.task = asyncio.create_task(self._consume(), name="edge-kafka-consumer")
        self.ready.set()
        log.info("edge consuming %s and %s from %s", s.audio_topic, s.control_topic, s.bootstrap)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self.task is not None and not self.task.done()

    async def _consume(self) -> None:
        from pipeline.bus import dead_letter, decode_or_dead_letter

        s = self.settings
        while True:
            batches = await self.consumer.getmany(timeout_ms=100)
            consumed_ns, received_us = time.perf_counter_ns(), now_us()
            records = [r for tp, rs in batches.items() for r in rs]
            records.sort(key=lambda r: r.topic != s.control_topic)  # stable: control first
            for record in records:
                expect = "ControlEvent" if record.topic == s.control_topic else "AudioChunk"
                decoded = await decode_or_dead_letter(self.producer, s, self.codec, record, expect=expect)
                if decoded is None:
                    self.metrics.bad_records.inc()
                elif expect == "ControlEvent":
                    self.router.apply_control(decoded.value)
                else:
                    try:
                        self.router.route(decoded.value, consumed_ns, received_us)
                    except UnroutableChunk as exc:
                        self.metrics.bad_records.inc()
                        await dead_letter(self.producer, s, record, exc)

    async def publish(self, topic: str, message_type: str, value: dict) -> None:
        from pipeline.bus import publish

        await publish(self.producer, self.codec, topic, message_type, value)


def make_app(settings: Settings, *, with_kafka: bool = True, router: SessionRouter | None = None,
             stall_timeout_s: float = 10.0, hello_timeout_s: float = HELLO_TIMEOUT_S) -> web.Application:
    """The edge app. `with_kafka=False` runs it without the bus (the router is then fed directly)."""
    metrics = router.metrics if router is not None else EdgeMetrics()
    router = router or SessionRouter(metrics, client_queue_frames=settings.client_queue_frames,
                                     replay_frames=2 * settings.client_queue_frames, stall_timeout_s=stall_timeout_s)
    app = web.Application()
    app[SETTINGS_KEY], app[ROUTER_KEY], app[METRICS_KEY] = settings, router, metrics
    app[LINK_KEY] = None
    app[REPORTS_KEY] = deque(maxlen=1000)
    app[CLIENTS_KEY] = set()
    app[HELLO_TIMEOUT_KEY] = hello_timeout_s
    if with_kafka:
        app.cleanup_ctx.append(_kafka_ctx)
    app.on_shutdown.append(_close_clients)
    app.router.add_get("/", _index)
    app.router.add_get("/ws", _websocket)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_static("/web/", WEB_DIR)
    return app


async def _kafka_ctx(app: web.Application) -> AsyncIterator[None]:
    link = KafkaLink(app[SETTINGS_KEY], app[ROUTER_KEY], app[METRICS_KEY])
    try:
        await link.start()
    except BaseException:
        await link.stop()
        raise
    app[LINK_KEY] = link
    yield
    await link.stop()


async def _close_clients(app: web.Application) -> None:
    for ws in list(app[CLIENTS_KEY]):
        await ws.close(code=protocol.CLOSE_GOING_AWAY, message=b"edge shutting down")


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(WEB_DIR / "index.html")


async def _metrics(request: web.Request) -> web.Response:
    request.app[ROUTER_KEY].update_queue_gauges()
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _healthz(request: web.Request) -> web.Response:
    link = request.app[LINK_KEY]
    kafka = "disabled" if link is None else ("ready" if link.healthy else "down")
    body = {"status": "ok" if kafka != "down" else "degraded", "kafka": kafka,
            "clients": len(request.app[CLIENTS_KEY]), "protocol": protocol.PROTOCOL_VERSION}
    return web.json_response(body, status=200 if kafka != "down" else 503)


async def _fail(request: web.Request, ws: web.WebSocketResponse, error: protocol.ProtocolError | TokenError,
                close_code: int) -> None:
    """Send `error` and close with `close_code`; a client that has not read what it was already
    sent would not read these either, so it is cut off."""
    transport = request.transport
    if transport is not None and transport.get_write_buffer_size() > 0:
        transport.abort()
        return
    code = getattr(error, "code", None) or getattr(error, "reason", "error")
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ws.send_str(protocol.encode_control(protocol.ERROR, code=code, message=str(error)))
    await ws.close(code=close_code, message=code.encode()[:120])


async def _receive_hello(ws: web.WebSocketResponse, timeout_s: float) -> dict:
    msg = await ws.receive(timeout=timeout_s)
    if msg.type == WSMsgType.BINARY:
        raise protocol.MalformedFrame("the first message must be a hello text frame, got a binary frame")
    if msg.type != WSMsgType.TEXT:
        raise ConnectionResetError("closed before hello")
    hello = protocol.parse_client_message(msg.data)
    if hello["type"] != protocol.HELLO:
        raise protocol.MalformedFrame(f"the first message must be hello, got {hello['type']}")
    return hello


async def _websocket(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings, router = app[SETTINGS_KEY], app[ROUTER_KEY]
    # No permessage-deflate: PCM barely compresses, and deflating per client would cost every fan-out.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=protocol.MAX_TEXT_FRAME_BYTES * 4, compress=False)
    await ws.prepare(request)
    try:
        hello = await _receive_hello(ws, app[HELLO_TIMEOUT_KEY])
    except asyncio.TimeoutError:
        error = protocol.ProtocolError(f"no hello within {app[HELLO_TIMEOUT_KEY]:g} s")
        await _fail(request, ws, error, protocol.CLOSE_HELLO_TIMEOUT)
        return ws
    except protocol.ProtocolError as exc:
        await _fail(request, ws, exc, exc.close_code)
        return ws
    except ConnectionResetError:
        return ws
    session_id = hello["session"]
    try:
        verify_token(settings.edge_secret, hello["token"], session_id)
    except TokenError as exc:
        await _fail(request, ws, exc, protocol.CLOSE_UNAUTHORIZED)
        return ws
    resume = hello.get("resume") if isinstance(hello.get("resume"), dict) else None
    channel = router.connect(session_id, resume=resume)
    app[CLIENTS_KEY].add(ws)
    await ws.send_str(protocol.encode_control(
        protocol.READY, session=session_id, client_id=channel.client_id, server_time_us=now_us(),
        queue_frames=channel.max_frames,
    ))
    sender = asyncio.create_task(_send_loop(request, ws, channel), name=f"edge-sender-{channel.client_id}")
    channel.on_close = sender.cancel
    try:
        await _read_loop(request, ws, channel)
    finally:
        router.disconnect(channel)
        app[CLIENTS_KEY].discard(ws)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ClientClosed):
            await sender
    return ws


async def _send_loop(request: web.Request, ws: web.WebSocketResponse, channel: ClientChannel) -> None:
    try:
        await channel.run_sender(ws.send_bytes, ws.send_str)
    except (ClientClosed, asyncio.CancelledError):
        closed = channel.closed
        if closed is None or closed.code == protocol.CLOSE_NORMAL:
            raise
        # The edge closed this client (too slow): interrupting its blocked send is the point.
        asyncio.current_task().uncancel()
        log.warning("closing client %s of session %s: %s", channel.client_id, channel.session_id, closed.reason)
        await _close_socket(request, ws, closed.code, "too-slow", closed.reason)
    except (ConnectionError, RuntimeError):
        await _close_socket(request, ws, protocol.CLOSE_GOING_AWAY, "send-failed", "")


async def _close_socket(request: web.Request, ws: web.WebSocketResponse, code: int, error: str, message: str) -> None:
    """Close with `code` and the reason in the close frame. A client that has not even read what
    is already in the socket's write buffer would never read a close frame: cut it off instead."""
    transport = request.transport
    if transport is not None and transport.get_write_buffer_size() > 0:
        transport.abort()
        return
    reason = f"{error}: {message}" if message else error
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await ws.close(code=code, message=reason.encode()[:120])
    except (asyncio.TimeoutError, ConnectionError, RuntimeError):
        if transport is not None:
            transport.abort()


async def _read_loop(request: web.Request, ws: web.WebSocketResponse, channel: ClientChannel) -> None:
    app = request.app
    async for msg in ws:
        try:
            if msg.type == WSMsgType.BINARY:
                raise protocol.MalformedFrame("clients send no binary frames")
            if msg.type != WSMsgType.TEXT:
                continue
            message = protocol.parse_client_message(msg.data)
            await _handle_client_message(app, channel, message)
        except protocol.ProtocolError as exc:
            channel.close(protocol.CLOSE_NORMAL, "protocol-error")  # stop its sender; the socket closes below
            await _fail(request, ws, exc, exc.close_code)
            return


async def _handle_client_message(app: web.Application, channel: ClientChannel, message: dict) -> None:
    settings, router, link = app[SETTINGS_KEY], app[ROUTER_KEY], app[LINK_KEY]
    mtype = message["type"]
    if mtype == protocol.PING:
        channel.push(_pong(message), front=True)
    elif mtype == protocol.HELLO:
        raise protocol.MalformedFrame("hello was already received")
    elif mtype == protocol.CANCEL:
        turn_id = message.get("turn_id")
        issued = now_us()
        router.cancel(channel.session_id, turn_id, source="edge")  # locally at once
        await _publish(link, channel, settings.control_topic, "ControlEvent", {
            "session_id": channel.session_id, "turn_id": turn_id, "action": ControlAction.CANCEL,
            "reason": str(message.get("reason") or "barge-in")[:200], "source": "edge", "issued_at_us": issued,
            "turn_ids": [],
        })
    elif mtype == protocol.REPORT:
        report = {
            "session_id": channel.session_id, "turn_id": message["turn_id"], "client_id": channel.client_id,
            "kind": message["kind"], "sentence_seq": int(message.get("sentence_seq") or 0),
            "audible_at_us": int(message.get("audible_at_us") or 0), "reported_at_us": now_us(),
            "detail": str(message.get("detail") or "")[:500],
        }
        router.metrics.reports.labels(report["kind"]).inc()
        started = router.turn_started_at(channel.session_id, report["turn_id"])
        if report["kind"] == "AUDIBLE_START" and started and report["audible_at_us"] > started:
            router.metrics.stage_latency.labels("first_token_to_audible").observe((report["audible_at_us"] - started) / 1e6)
        app[REPORTS_KEY].append(report)
        await _publish(link, channel, settings.playback_topic, "PlaybackReport", report)


async def _publish(link: KafkaLink | None, channel: ClientChannel, topic: str, message_type: str, value: dict) -> None:
    """Publish for a client; a failure is told to that client (its connection stays up)."""
    if link is None:
        return
    from aiokafka.errors import KafkaError

    from pipeline.codecs import CodecError

    try:
        await link.publish(topic, message_type, value)
    except (KafkaError, CodecError) as exc:
        log.warning("could not publish %s for %s: %s", message_type, channel.client_id, exc)
        channel.push(OutFrame(protocol.encode_control(
            protocol.ERROR, code="not-recorded", message=f"{message_type} not published: {exc}"[:300])))


def _pong(ping: dict) -> OutFrame:
    return OutFrame(protocol.encode_control(protocol.PONG, t0=ping["t0"], server_time_us=now_us()))
