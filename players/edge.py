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
from pipeline.codecs import Codec
from pipeline.settings import Settings
from players import protocol
from players.auth import TokenError, verify_token
from players.metrics import EdgeMetrics
from schemas.contract import ControlAction
from pipeline.shell import ControlFollower, RecordFailure, RecordPolicy, Supervisor
from players.router import ClientChannel, ClientClosed, ConnectionRefused, OutFrame, SessionRouter

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
    """The edge's Kafka clients, owned by the app's cleanup_ctx: an audio consumer (no group:
    every edge sees every session), a `ControlFollower` with its own consumer (control never waits
    behind audio), and one producer for cancels, playback reports and dead letters.

    Every record goes through one `RecordPolicy` (stage ``edge``): a record that cannot be decoded,
    breaks the contract (a negative sentence_seq, ...) or makes the router raise is dead-lettered
    with its reason and the edge goes on with the next one. The consume and follow tasks run under
    a `Supervisor`: a task that dies anyway is restarted, and ``/healthz`` says so."""

    def __init__(self, settings: Settings, router: SessionRouter, metrics: EdgeMetrics) -> None:
        self.settings, self.router, self.metrics = settings, router, metrics
        self.codec = Codec(max_text_bytes=settings.max_text_bytes)
        self.producer: Any = None
        self.consumer: Any = None
        self.policy: RecordPolicy | None = None
        self.follower: ControlFollower | None = None
        self.supervisor = Supervisor("edge", registry=metrics.registry)
        self._positions: dict[Any, int] = {}  # audio partition -> next offset to read
        self.ready = asyncio.Event()

    async def start(self) -> None:
        from pipeline.bus import ensure_topics, make_producer

        s = self.settings
        await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.deadletter_topic])
        self.producer = make_producer(s)
        await self.producer.start()
        self.policy = RecordPolicy("edge", s, self.codec, self.producer, on_error=self._on_bad_record,
                                   registry=self.metrics.registry)
        # Cancels first: caught up to the end of the control topic before any audio is read.
        self.follower = ControlFollower(s, self.policy, self.router.apply_control, lookback_s=s.edge_cancel_lookback_s)
        await self.follower.start()
        await self._open_consumer()
        self.supervisor.start("control", self.follower.follow)
        self.supervisor.start("audio", self._consume)
        self.ready.set()
        log.info("edge consuming %s and %s from %s", s.audio_topic, s.control_topic, s.bootstrap)

    async def stop(self) -> None:
        await self.supervisor.stop()
        if self.follower is not None:
            await self.follower.stop()
        await self._close_consumer()
        if self.producer is not None:
            await self.producer.stop()

    @property
    def healthy(self) -> bool:
        """Started, and every task is running (not dead, not waiting to be restarted)."""
        health = self.supervisor.health()
        # not running with restarts: dead and waiting for its restart (not yet running: just started)
        waiting = any(not h["running"] and h["restarts"] for h in health.values())
        return self.ready.is_set() and bool(health) and self.supervisor.healthy and not waiting

    def health(self) -> dict[str, dict[str, Any]]:
        """Per task: running, restarts, last error (for ``/healthz``)."""
        return self.supervisor.health()

    async def _on_bad_record(self, failure: RecordFailure) -> None:
        self.metrics.bad_records.inc()
        assert self.policy is not None
        await self.policy.dead_letter(failure)

    async def _open_consumer(self) -> None:
        """The audio consumer: no consumer group (every edge sees every session: clients of a
        session may be on any edge), at the end of each partition the first time, then where the
        previous consumer stopped (a restart after the task died)."""
        from aiokafka import TopicPartition

        from pipeline.bus import make_consumer

        s = self.settings
        self.consumer = make_consumer(s, group_id=None)
        await self.consumer.start()
        try:
            tps = [TopicPartition(s.audio_topic, p) for p in sorted(await self.producer.partitions_for(s.audio_topic))]
            self.consumer.assign(tps)
            await self.consumer.seek_to_end(*[tp for tp in tps if tp not in self._positions])
            for tp in tps:
                if tp in self._positions:
                    self.consumer.seek(tp, self._positions[tp])
                # resolved now, so "ready" means nothing published from here on is missed
                self._positions[tp] = await self.consumer.position(tp)
        except BaseException:
            await self._close_consumer()
            raise

    async def _close_consumer(self) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            await consumer.stop()

    async def _consume(self) -> None:
        """Route audio records until cancelled. Each record's failure is the policy's; if the
        loop itself dies (its consumer failed), the Supervisor restarts it with a new consumer."""
        assert self.policy is not None
        if self.consumer is None:
            await self._open_consumer()
        try:
            while True:
                batches = await self.consumer.getmany(timeout_ms=100)
                consumed_ns, received_us = time.perf_counter_ns(), now_us()
                for tp, records in batches.items():
                    for record in records:
                        await self.policy.process(
                            record, "AudioChunk",
                            lambda d: self.router.route(d.message.value, consumed_ns, received_us))
                        self._positions[tp] = record.offset + 1
        except BaseException:
            await self._close_consumer()
            raise

    async def publish(self, topic: str, message_type: str, value: dict) -> None:
        from pipeline.bus import publish

        await publish(self.producer, self.codec, topic, message_type, value)


def make_app(settings: Settings, *, with_kafka: bool = True, router: SessionRouter | None = None,
             stall_timeout_s: float = 10.0, hello_timeout_s: float = HELLO_TIMEOUT_S) -> web.Application:
    """The edge app. `with_kafka=False` runs it without the bus (the router is then fed directly)."""
    metrics = router.metrics if router is not None else EdgeMetrics()
    router = router or SessionRouter.from_settings(settings, metrics, stall_timeout_s=stall_timeout_s)
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
            "clients": len(request.app[CLIENTS_KEY]), "protocol": protocol.PROTOCOL_VERSION,
            "tasks": {} if link is None else link.health()}
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
    try:
        channel = router.connect(session_id, resume=resume)
    except ConnectionRefused as exc:
        log.warning("refused a player of session %s: %s", session_id, exc)
        await _fail(request, ws, exc, exc.close_code)
        return ws
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
        if not channel.cancel_bucket.take():
            router.metrics.refused.labels("cancel-rate-limited").inc()
            channel.push(OutFrame(protocol.encode_control(
                protocol.ERROR, code="rate-limited",
                message=f"cancel refused: at most {router.cancel_burst} at once and {router.cancel_rate_per_s:g} per second"
                        f" per connection")), front=True)
            return
        turn_id = message.get("turn_id")
        issued = now_us()
        router.cancel(channel.session_id, turn_id, issued, source="edge")  # locally at once
        await _publish(link, channel, settings.control_topic, "ControlEvent", {
            "session_id": channel.session_id, "turn_id": turn_id, "action": ControlAction.CANCEL,
            "reason": str(message.get("reason") or "barge-in")[:200], "source": "edge", "issued_at_us": issued,
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
