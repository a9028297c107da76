"""The player edge: an aiohttp app that streams each session's audio to its WebSocket players.

`make_app(settings)` builds the app. Its `cleanup_ctx` owns the Kafka side (`KafkaLink`: one
consumer of the audio and control topics, one producer for cancels and playback reports) and
stops it on shutdown; each WebSocket connection owns one sender task. Routing, cancel, slow-client
and replay logic live in the pure `players.router.SessionRouter`; this module is the thin shell.

Routes: ``/`` (the web player), ``/web/*`` (its files), ``/ws`` (the protocol of
`docs/protocol.md`), ``/metrics`` (Prometheus), ``/healthz``.

Closed by default (docs/edge.md): `make_app` refuses settings that would serve the public default
secret (or an empty one) beyond loopback (`InsecureEdgeConfig`); ``/metrics`` answers loopback
clients only unless it has its own port (`Settings.edge_metrics_port`); a browser page of another
origin than the edge's own (or a loopback one) cannot open ``/ws`` unless
`Settings.edge_allowed_origins` lists it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import WSMsgType, web

from pipeline import tracing
from pipeline.clock import now_us
from pipeline.codecs import codec_for
from pipeline.settings import DEFAULT_EDGE_SECRET, ENV_PREFIX, Settings
from pipeline.shell import ControlFollower, RecordFailure, RecordPolicy, Supervisor
from pipeline.tracing import StageTracer, tracer_for
from players import protocol
from players.auth import TokenError, verify_token
from players.heard import HEARD_KINDS, Rendered
from players.metrics import EdgeMetrics
from players.router import ClientChannel, ClientClosed, ConnectionRefused, OutFrame, SessionRouter
from schemas.contract import ControlAction, PlaybackKind

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
TRACER_KEY = web.AppKey("tracer", StageTracer)
SENT_TRACES_KEY = web.AppKey("sent_traces", OrderedDict)  # (client, turn, sentence) -> (edge.send context, sent_at_us)
MAX_SENT_TRACES = 10_000  # sentences whose edge.send context waits for the player's report (tracing on)


class InsecureEdgeConfig(RuntimeError):
    """The settings would expose the edge with a secret anyone knows (or none): it refuses to start."""


def is_loopback_host(host: str) -> bool:
    """Whether a listen address or host name only reaches this machine (``localhost``, 127.0.0.0/8,
    ``::1``). Empty, ``0.0.0.0``, ``::`` and other names are not."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    """Raise `InsecureEdgeConfig` when the edge would mint or check tokens with an empty secret,
    or listen beyond loopback with the public default secret."""
    var = f"{ENV_PREFIX}EDGE_SECRET"
    if not settings.edge_secret:
        raise InsecureEdgeConfig(f"{var} is empty: every player token would be forgeable. "
                                 f"Set it to a long random string (e.g. `openssl rand -hex 32`).")
    if settings.edge_secret == DEFAULT_EDGE_SECRET and not is_loopback_host(settings.edge_host):
        raise InsecureEdgeConfig(
            f"refusing to listen on {settings.edge_host!r} with the default {var} (it is public: anyone could "
            f"mint a token for any session). Set {var} to a long random string (e.g. `openssl rand -hex 32`), "
            f"or listen on loopback ({ENV_PREFIX}EDGE_HOST=127.0.0.1).")
    if settings.edge_metrics_port and settings.edge_metrics_port == settings.edge_port:
        raise InsecureEdgeConfig(f"{ENV_PREFIX}EDGE_METRICS_PORT must differ from {ENV_PREFIX}EDGE_PORT "
                                 f"({settings.edge_port}); 0 keeps /metrics on the player port for loopback clients")


def origin_allowed(origin: str | None, host: str | None, allowed: str) -> bool:
    """The Origin policy of ``/ws`` (pure): no Origin header (not a browser) passes; the edge's own
    origin (Origin's host:port equals the request's Host) passes; ``*`` in `allowed` passes all;
    otherwise an origin must be listed in `allowed` (comma-separated), or, when `allowed` is empty,
    be a loopback origin (``http://localhost:3000``)."""
    if origin is None:
        return True
    from urllib.parse import urlsplit

    wanted = {o.strip().rstrip("/").lower() for o in allowed.split(",") if o.strip()}
    origin = origin.strip().rstrip("/").lower()
    if "*" in wanted or origin in wanted:
        return True
    try:
        parts = urlsplit(origin)
        netloc, hostname = parts.netloc, parts.hostname or ""
    except ValueError:
        return False
    if host and netloc and netloc == host.lower():
        return True
    return not wanted and parts.scheme in ("http", "https") and is_loopback_host(hostname)


def host_allowed(host: str | None, secret: str) -> bool:
    """With the public default secret (a loopback-only edge) the request's ``Host`` must be a
    loopback name too (``localhost``, ``127.0.0.1``, ``[::1]``), which shuts out DNS rebinding;
    with a real secret any Host passes (a proxy may forward a public name)."""
    if secret != DEFAULT_EDGE_SECRET:
        return True
    from urllib.parse import urlsplit

    try:
        hostname = urlsplit(f"//{host or ''}").hostname or ""
    except ValueError:
        return False
    return is_loopback_host(hostname)


class KafkaLink:
    """The edge's Kafka clients, owned by the app's cleanup_ctx: an audio consumer (no group:
    every edge sees every session), a `ControlFollower` with its own consumer (control never waits
    behind audio), and one producer for cancels, playback reports and dead letters.

    Every record goes through one `RecordPolicy` (stage ``edge``): a record that cannot be decoded,
    breaks the contract (a negative sentence_seq, ...) or makes the router raise is dead-lettered
    with its reason and the edge goes on with the next one. The consume and follow tasks run under
    a `Supervisor`: a task that dies anyway is restarted, and ``/healthz`` says so."""

    def __init__(self, settings: Settings, router: SessionRouter, metrics: EdgeMetrics,
                 tracer: StageTracer | None = None) -> None:
        self.settings, self.router, self.metrics = settings, router, metrics
        self.tracer = tracer if tracer is not None else tracer_for(settings, "edge")
        self.codec = codec_for(settings)
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
        await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.heard_topic, s.deadletter_topic])
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
        self.supervisor.start("heard", self._heard_loop)
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
        return self.ready.is_set() and bool(self.supervisor.health()) and self.supervisor.healthy

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
            new = [tp for tp in tps if tp not in self._positions]
            if new:  # (seek_to_end() without partitions would move every one)
                await self.consumer.seek_to_end(*new)
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
                        self.metrics.consumed_bytes.inc(len(record.value or b""))
                        await self.policy.process(
                            record, "AudioChunk",
                            lambda d: self.router.route(d.message.value, consumed_ns, received_us, self._trace_of(d, record)))
                        self._positions[tp] = record.offset + 1
        except BaseException:
            await self._close_consumer()
            raise

    def _trace_of(self, decoded: Any, record: Any) -> Any:
        """Tracing on: the trace context of a sentence's first chunk (the one the edge's send span hangs under)."""
        if not self.tracer.enabled or decoded.message.value["chunk_seq"] != 0:
            return None
        return self.tracer.context_of(record.headers)

    async def publish(self, topic: str, message_type: str, value: dict,
                      headers: list[tuple[str, bytes]] | None = None) -> None:
        from pipeline.bus import publish

        await publish(self.producer, self.codec, topic, message_type, value, headers)

    async def publish_heard(self, heard: dict) -> None:
        """Publish one TurnHeard; a failure is logged (the report it came from is on the
        playback topic, so what was heard can still be rebuilt)."""
        from aiokafka.errors import KafkaError

        from pipeline.codecs import CodecError

        try:
            await self.publish(self.settings.heard_topic, "TurnHeard", heard)
        except (KafkaError, CodecError) as exc:
            log.warning("could not publish TurnHeard of %s/%s: %s", heard["session_id"], heard["turn_id"], exc)

    async def _heard_loop(self) -> None:
        """Publish the turns whose wait for more players' heard reports is over."""
        while True:
            for heard in self.router.heard.due(now_us()):
                await self.publish_heard(heard)
            await asyncio.sleep(0.05)


def make_app(settings: Settings, *, with_kafka: bool = True, router: SessionRouter | None = None,
             stall_timeout_s: float = 10.0, hello_timeout_s: float = HELLO_TIMEOUT_S,
             tracer: StageTracer | None = None) -> web.Application:
    """The edge app. `with_kafka=False` runs it without the bus (the router is then fed directly).
    Raises `InsecureEdgeConfig` for settings that would expose it (`check_exposure`). `tracer`:
    default `pipeline.tracing.tracer_for` the settings (off unless ``VOICEBUS_TRACING``)."""
    check_exposure(settings)
    metrics = router.metrics if router is not None else EdgeMetrics()
    router = router or SessionRouter.from_settings(settings, metrics, stall_timeout_s=stall_timeout_s)
    app = web.Application()
    app[SETTINGS_KEY], app[ROUTER_KEY], app[METRICS_KEY] = settings, router, metrics
    app[LINK_KEY] = None
    app[REPORTS_KEY] = deque(maxlen=1000)
    app[CLIENTS_KEY] = set()
    app[HELLO_TIMEOUT_KEY] = hello_timeout_s
    app[TRACER_KEY] = tracer if tracer is not None else tracer_for(settings, "edge")
    app[SENT_TRACES_KEY] = OrderedDict()
    if with_kafka:
        app.cleanup_ctx.append(_kafka_ctx)
    if settings.edge_metrics_port:
        app.cleanup_ctx.append(_metrics_site_ctx)
    app.on_shutdown.append(_close_clients)
    app.router.add_get("/", _index)
    app.router.add_get("/ws", _websocket)
    if not settings.edge_metrics_port:
        app.router.add_get("/metrics", _loopback_metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_static("/web/", WEB_DIR)
    return app


async def _kafka_ctx(app: web.Application) -> AsyncIterator[None]:
    link = KafkaLink(app[SETTINGS_KEY], app[ROUTER_KEY], app[METRICS_KEY], app[TRACER_KEY])
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


def _metrics_handler(edge_app: web.Application):
    async def metrics(request: web.Request) -> web.Response:
        edge_app[ROUTER_KEY].update_queue_gauges()
        body = edge_app[METRICS_KEY].render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    return metrics


async def _loopback_metrics(request: web.Request) -> web.Response:
    """``/metrics`` on the player port: for this machine only (a scraper beside the edge)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    address = peer[0] if isinstance(peer, (tuple, list)) and peer else ""
    if not is_loopback_host(str(address)):
        log.warning("refused /metrics to %s: served to loopback clients only", address)
        raise web.HTTPForbidden(text=f"/metrics is served to loopback clients only; set {ENV_PREFIX}EDGE_METRICS_PORT "
                                     f"(and {ENV_PREFIX}EDGE_METRICS_HOST) to serve it on a port of its own\n")
    return await _metrics_handler(request.app)(request)


async def _metrics_site_ctx(app: web.Application) -> AsyncIterator[None]:
    """``/metrics`` on its own listener (`Settings.edge_metrics_host`/`edge_metrics_port`),
    started and stopped with the edge."""
    settings = app[SETTINGS_KEY]
    metrics_app = web.Application()
    metrics_app.router.add_get("/metrics", _metrics_handler(app))
    runner = web.AppRunner(metrics_app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.edge_metrics_host, settings.edge_metrics_port).start()
        log.info("edge metrics on http://%s:%d/metrics", settings.edge_metrics_host, settings.edge_metrics_port)
        yield
    finally:
        await runner.cleanup()


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
    if msg.type == WSMsgType.ERROR:  # e.g. over MAX_WS_MESSAGE_BYTES: aiohttp already closed it (1009)
        log.warning("closed a connection before hello (code %s): %s", ws.close_code, msg.data)
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
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=protocol.MAX_WS_MESSAGE_BYTES, compress=False)
    await ws.prepare(request)
    origin = request.headers.get("Origin")
    if not origin_allowed(origin, request.host, settings.edge_allowed_origins):
        # Upgraded first, then closed with a code: a browser page sees 4403 (a refused handshake is only 1006).
        log.warning("refused /ws from origin %r (host %r): not in %sEDGE_ALLOWED_ORIGINS", origin, request.host, ENV_PREFIX)
        error = protocol.OriginNotAllowed(f"origin {origin!r} may not open this edge's /ws "
                                          f"(allowed: the edge's own origin, {ENV_PREFIX}EDGE_ALLOWED_ORIGINS)")
        await _fail(request, ws, error, error.close_code)
        return ws
    if not host_allowed(request.host, settings.edge_secret):
        # DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 is "same origin"
        # to this edge, and with the public default secret it could mint tokens for any session.
        log.warning("refused /ws for Host %r: with the default %sEDGE_SECRET only loopback names are served",
                    request.host, ENV_PREFIX)
        error = protocol.OriginNotAllowed(f"Host {request.host!r} is not a loopback name; an edge with the default "
                                          f"{ENV_PREFIX}EDGE_SECRET serves loopback names only")
        await _fail(request, ws, error, error.close_code)
        return ws
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
    if app[TRACER_KEY].enabled:
        channel.on_timeline_sent = lambda frame, sent_at_us: _trace_sent(app, channel, frame, sent_at_us)
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
            if msg.type == WSMsgType.ERROR:  # e.g. over MAX_WS_MESSAGE_BYTES: aiohttp already closed it (1009)
                log.warning("closed client %s of session %s (code %s): %s", channel.client_id, channel.session_id,
                            ws.close_code, msg.data)
                continue
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
        # Without a turn id: the turns of the session this edge knows, by id (no clock compared
        # anywhere). Knowing none, the list stays empty: each stage cancels the turns it has seen.
        turn_ids = router.known_turns(channel.session_id) if turn_id is None else []
        router.cancel(channel.session_id, turn_id, turn_ids, source="edge")  # locally at once
        await _publish(link, channel, settings.control_topic, "ControlEvent", {
            "session_id": channel.session_id, "turn_id": turn_id, "action": ControlAction.CANCEL,
            "reason": str(message.get("reason") or "barge-in")[:200], "source": "edge", "issued_at_us": now_us(),
            "turn_ids": turn_ids,
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
        if report["kind"] == PlaybackKind.AUDIBLE_START and started and report["audible_at_us"] > started:
            router.metrics.stage_latency.labels("first_token_to_audible").observe((report["audible_at_us"] - started) / 1e6)
        app[REPORTS_KEY].append(report)
        heard = None
        if report["kind"] in HEARD_KINDS and "rendered_sentence_seq" in message:
            rendered = Rendered(channel.client_id, int(message["rendered_sentence_seq"]),
                                int(message.get("rendered_samples") or 0), report["kind"] == PlaybackKind.STOPPED,
                                report["audible_at_us"] or report["reported_at_us"])
            heard = router.heard.report(channel.session_id, report["turn_id"], rendered,
                                        router.players_of_turn(channel.session_id, report["turn_id"]), now_us())
        if heard is not None and link is not None:
            await link.publish_heard(heard)  # first: an agent waits on it, the playback record does not
        headers = _trace_report(app, report) if app[TRACER_KEY].enabled else None
        await _publish(link, channel, settings.playback_topic, "PlaybackReport", report, headers)


def _trace_sent(app: web.Application, channel: ClientChannel, frame: OutFrame, sent_at_us: int) -> None:
    """Tracing on: a sentence's first audio went to one player: its ``edge.send`` span (edge
    received .. sent), kept for that player's report of the sentence. Runs in the player's
    sender task: a failure here is logged, never allowed to stop the audio."""
    timeline = frame.timeline or {}
    try:
        context = app[TRACER_KEY].record(
            tracing.EDGE_SEND, frame.trace, timeline.get("edge_received_at_us") or sent_at_us, sent_at_us,
            **{tracing.SESSION: channel.session_id, tracing.TURN: frame.turn_id, tracing.SENTENCE: frame.sentence,
               tracing.CLIENT: channel.client_id})
    except Exception:  # noqa: BLE001 - tracing must never cost a player its audio
        log.exception("tracing: recording edge.send for %s failed", channel.client_id)
        return
    if context is None:
        return
    sent = app[SENT_TRACES_KEY]
    sent[(channel.client_id, frame.turn_id, frame.sentence)] = (context, sent_at_us)
    while len(sent) > MAX_SENT_TRACES:
        sent.popitem(last=False)


def _trace_report(app: web.Application, report: dict) -> list[tuple[str, bytes]] | None:
    """Tracing on: the headers of a playback report. AUDIBLE_START closes its sentence's trace
    with an ``audible`` span (sent .. the player heard it, mapped to the server clock); other
    reports carry the sentence's ``edge.send`` context."""
    tracer, sent = app[TRACER_KEY], app[SENT_TRACES_KEY]
    key = (report["client_id"], report["turn_id"], report["sentence_seq"])
    found = sent.get(key)
    if found is None:
        return None
    context, sent_at_us = found
    if report["kind"] == PlaybackKind.AUDIBLE_START and report["audible_at_us"]:
        del sent[key]
        context = tracer.record(tracing.AUDIBLE, context, sent_at_us, report["audible_at_us"],
                                **{tracing.SESSION: report["session_id"], tracing.TURN: report["turn_id"],
                                   tracing.SENTENCE: report["sentence_seq"], tracing.CLIENT: report["client_id"]})
    return tracer.headers(context)


async def _publish(link: KafkaLink | None, channel: ClientChannel, topic: str, message_type: str, value: dict,
                   headers: list[tuple[str, bytes]] | None = None) -> None:
    """Publish for a client; a failure is told to that client (its connection stays up)."""
    if link is None:
        return
    from aiokafka.errors import KafkaError

    from pipeline.codecs import CodecError

    try:
        await link.publish(topic, message_type, value, headers)
    except (KafkaError, CodecError) as exc:
        log.warning("could not publish %s for %s: %s", message_type, channel.client_id, exc)
        channel.push(OutFrame(protocol.encode_control(
            protocol.ERROR, code="not-recorded", message=f"{message_type} not published: {exc}"[:300])))


def _pong(ping: dict) -> OutFrame:
    return OutFrame(protocol.encode_control(protocol.PONG, t0=ping["t0"], server_time_us=now_us()))
