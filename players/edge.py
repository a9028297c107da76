"""The player edge: an aiohttp app that streams each session's audio to its WebSocket players.

`make_app(settings)` builds the app. Its `cleanup_ctx` owns the Kafka side
(`voicebus.players.link.KafkaLink`: the edge's membership in the edges' consumer group, a
consumer of the audio partitions it owns, a follower of every control partition and of the edge
directory, one producer for cancels, playback reports and directory claims) and stops it on
shutdown; each WebSocket connection owns one sender task. Sharded edges (docs/edge.md): a player whose session another edge owns is
redirected there after its hello; when a rebalance moves a session away its players are told to
reconnect; a resume of a session that moved here is served from its partition, re-read. Routing, cancel, slow-client
and replay logic live in the pure `voicebus.players.router.SessionRouter`; this module is the thin shell.

Routes: ``/`` (the web player), ``/web/*`` (its files), ``/ws`` (the protocol of
`docs/protocol.md`), ``/metrics`` (Prometheus), ``/healthz``, and the OpenAI-compatible speech
endpoint ``/v1/...`` (`voicebus.players.openai_speech`, unless `Settings.speech_api` is off),
``/telephony/twilio`` and ``/telephony/telnyx`` (a phone call, `voicebus.players.telephony`).

Closed by default (docs/edge.md): `make_app` refuses settings that would serve the public default
secret (or an empty one) beyond loopback (`InsecureEdgeConfig`); ``/metrics`` answers loopback
clients only unless it has its own port (`Settings.edge_metrics_port`); a browser page of another
origin than the edge's own (or a loopback one) cannot open ``/ws`` unless
`Settings.edge_allowed_origins` lists it.

Size: about 520 lines, most of it `make_app` and the socket writer: the WebSocket shell. Routing is
in `voicebus.players.router`, the Kafka side in `voicebus.players.link`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from pathlib import Path
from typing import AsyncIterator

from aiohttp import WSMsgType, web

from voicebus import tracing
from voicebus.clock import now_us
from voicebus.credentials import BUS_ACCESS
from voicebus.settings import DEFAULT_EDGE_SECRET, ENV_PREFIX, Settings, reveal
from voicebus.tracing import StageTracer, tracer_for
from voicebus.players import openai_speech, protocol, telephony
from voicebus.players.access import host_allowed, is_loopback_host, origin_allowed  # noqa: F401 - re-exported
from voicebus.players.auth import TokenError, verify_token
from voicebus.players.link import EdgeStartError, KafkaLink, NoOwner  # noqa: F401 - re-exported
from voicebus.players.keys import (CLIENTS_KEY, HELLO_TIMEOUT_KEY, LINK_KEY, METRICS_KEY, REPORTS_KEY,  # noqa: F401
                                   ROUTER_KEY, SENT_TRACES_KEY, SETTINGS_KEY, TRACER_KEY)
from voicebus.players.heard import HEARD_KINDS, Rendered
from voicebus.players.metrics import EdgeMetrics
from voicebus.players.channel import ClientChannel, ClientClosed, OutFrame
from voicebus.players.router import ConnectionRefused, SessionRouter
from voicebus.players.shard import redirect_origins
from voicebus.schemas.contract import CancelReason, PlaybackKind
from voicebus.schemas.messages import ControlEvent, Message, PlaybackReport

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
HELLO_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0  # a stuck client may never read our close frame: abort the transport after this

MAX_SENT_TRACES = 10_000  # sentences whose edge.send context waits for the player's report (tracing on)


class InsecureEdgeConfig(RuntimeError):
    """The settings would expose the edge with a secret anyone knows (or none): it refuses to start."""


def check_exposure(settings: Settings) -> None:
    """Raise `InsecureEdgeConfig` when the edge would mint or check tokens with an empty secret,
    or listen beyond loopback with the public default secret."""
    var = f"{ENV_PREFIX}EDGE_SECRET"
    secret = reveal(settings.edge_secret)
    if not secret:
        raise InsecureEdgeConfig(f"{var} is empty: every player token would be forgeable. "
                                 f"Set it to a long random string (e.g. `openssl rand -hex 32`).")
    if secret == DEFAULT_EDGE_SECRET and not is_loopback_host(settings.edge_host):
        raise InsecureEdgeConfig(
            f"refusing to listen on {settings.edge_host!r} with the default {var} (it is public: anyone could "
            f"mint a token for any session). Set {var} to a long random string (e.g. `openssl rand -hex 32`), "
            f"or listen on loopback ({ENV_PREFIX}EDGE_HOST=127.0.0.1).")
    if settings.edge_metrics_port and settings.edge_metrics_port == settings.edge_port:
        raise InsecureEdgeConfig(f"{ENV_PREFIX}EDGE_METRICS_PORT must differ from {ENV_PREFIX}EDGE_PORT "
                                 f"({settings.edge_port}); 0 keeps /metrics on the player port for loopback clients")


def make_app(settings: Settings, *, with_kafka: bool = True, router: SessionRouter | None = None,
             stall_timeout_s: float = 10.0, hello_timeout_s: float = HELLO_TIMEOUT_S,
             tracer: StageTracer | None = None) -> web.Application:
    """The edge app. `with_kafka=False` runs it without the bus (the router is then fed directly).
    Raises `InsecureEdgeConfig` for settings that would expose it (`check_exposure`). `tracer`:
    default `voicebus.tracing.tracer_for` the settings (off unless ``VOICEBUS_TRACING``)."""
    check_exposure(settings)
    metrics = router.metrics if router is not None else EdgeMetrics()
    router = router or SessionRouter.from_settings(settings, metrics, stall_timeout_s=stall_timeout_s)
    router.wire = protocol.websocket_frame  # a fan-out's frames are framed once (`_socket_writer`)
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
    # the npm package's devDependencies (players/web/node_modules, a checkout's type checker) are
    # nobody's business: matched first, so the static route never serves them
    app.router.add_get("/web/node_modules/{tail:.*}", _not_served)
    app.router.add_static("/web/", WEB_DIR)
    if settings.speech_api:
        openai_speech.setup(app)  # after _kafka_ctx: its publisher starts once the link is up
    telephony.setup(app)
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


async def _not_served(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


async def _close_clients(app: web.Application) -> None:
    for ws in list(app[CLIENTS_KEY]):
        await ws.close(code=protocol.CLOSE_GOING_AWAY, message=b"edge shutting down")


async def _index(request: web.Request) -> web.StreamResponse:
    """The web player, told which edge origins besides its own it may follow (redirects, the edges a
    `ready` lists): ``<html data-edge-origins>``, from ``VOICEBUS_EDGE_REDIRECT_ORIGINS``."""
    import html

    page = (WEB_DIR / "index.html").read_text(encoding="utf-8")
    origins = html.escape(",".join(redirect_origins(request.app[SETTINGS_KEY])), quote=True)
    page = page.replace("<html ", f'<html data-edge-origins="{origins}" ', 1)
    return web.Response(text=page, content_type="text/html")


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
    refused = None if link is None else BUS_ACCESS.refusal_of(link.settings)
    kafka = "disabled" if link is None else ("ready" if link.healthy and refused is None else "down")
    body = {"status": "ok" if kafka != "down" else "degraded", "kafka": kafka,
            "clients": len(request.app[CLIENTS_KEY]), "protocol": protocol.PROTOCOL_VERSION,
            "tasks": {} if link is None else link.health(), "credentials_refused": refused}
    if link is not None:
        body["shard"] = link.shard()
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
    if router.n_clients + router.awaiting_hello >= router.max_clients:
        # A socket that has not said hello yet holds a place too: a flood of silent sockets
        # cannot take the edge's memory and file descriptors past its limit.
        router.metrics.disconnects.labels("edge-full").inc()
        await _fail(request, ws, ConnectionRefused("edge-full", f"this edge serves {router.max_clients} players "
                                                   f"(and sockets before their hello) already"),
                    protocol.CLOSE_TRY_AGAIN_LATER)
        return ws
    router.awaiting_hello += 1
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
    finally:
        router.awaiting_hello -= 1
    session_id = hello["session"]
    try:
        verify_token(settings.edge_secret, hello["token"], session_id)
    except TokenError as exc:
        await _fail(request, ws, exc, protocol.CLOSE_UNAUTHORIZED)
        return ws
    resume = hello.get("resume") if isinstance(hello.get("resume"), dict) else None
    link = app[LINK_KEY]
    if link is not None:
        # Sharded edges (docs/edge.md): only the owner of the session's partition serves it.
        try:
            owner = await link.owner_url(session_id)
        except NoOwner as exc:
            await _fail(request, ws, exc, exc.close_code)
            return ws
        if owner is not None:
            router.metrics.redirects.inc()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(protocol.encode_control(protocol.REDIRECT, url=owner, session=session_id,
                                                          partition=link.partition_of(session_id)))
            await ws.close(code=protocol.CLOSE_REDIRECT, message=b"redirect")
            return ws
        if not router.served(session_id) and (resume is not None or link.recently_taken(session_id)):
            # it moved here (or this edge just started): the replay comes from the partition; a
            # player whose edge died before it saw its turn start has no resume to send
            await link.backfill(session_id)
    try:
        channel = router.connect(session_id, resume=resume)
    except ConnectionRefused as exc:
        log.warning("refused a player of session %s: %s", session_id, exc)
        await _fail(request, ws, exc, exc.close_code)
        return ws
    app[CLIENTS_KEY].add(ws)
    shard = {} if link is None else {"edge": link.edge_id, "edges": link.directory.urls() or [link.url]}
    await ws.send_str(protocol.encode_control(
        protocol.READY, session=session_id, client_id=channel.client_id, server_time_us=now_us(),
        queue_frames=channel.max_frames, **shard,
    ))
    if app[TRACER_KEY].enabled:
        channel.on_timeline_sent = lambda frame, sent_at_us: _trace_sent(app, channel, frame, sent_at_us)
    channel.write_now = _socket_writer(request, ws)
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


def _socket_writer(request: web.Request, ws: web.WebSocketResponse):
    """The channel's `write_now`: a fan-out's frames, already WebSocket frames (no
    permessage-deflate on this socket, so the same bytes suit every player), written straight to
    the transport when its buffer is empty; a socket with bytes still waiting (a player not
    keeping up) or closing refuses them and the channel queues them for its sender, whose
    backpressure and slow-client rules apply."""
    def write(data: bytes) -> bool:
        transport = request.transport
        if transport is None or transport.is_closing() or ws.closed or transport.get_write_buffer_size():
            return False
        transport.write(data)
        return True

    return write


async def _send_loop(request: web.Request, ws: web.WebSocketResponse, channel: ClientChannel) -> None:
    try:
        await channel.run_sender(ws.send_bytes, ws.send_str)
    except (ClientClosed, asyncio.CancelledError):
        closed = channel.closed
        if closed is None or closed.code == protocol.CLOSE_NORMAL:
            raise
        # The edge closed this client (too slow, or its session moved): interrupting its blocked send is the point.
        asyncio.current_task().uncancel()
        if closed.code == protocol.CLOSE_SERVICE_RESTART:
            log.info("client %s of session %s: its session moved to another edge, told to reconnect",
                     channel.client_id, channel.session_id)
            transport = request.transport
            if transport is not None and transport.get_write_buffer_size() == 0:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await ws.send_str(protocol.encode_control(protocol.RECONNECT, reason=closed.reason))
            await _close_socket(request, ws, closed.code, closed.reason, "")
            return
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
    if mtype in (protocol.PING, protocol.REPORT) and not channel.message_bucket.take():
        router.metrics.refused.labels(f"{mtype}-rate-limited").inc()
        channel.push(OutFrame(protocol.encode_control(
            protocol.ERROR, code="rate-limited",
            message=f"{mtype} refused: at most {router.message_burst} reports and pings at once and "
                    f"{router.message_rate_per_s:g} per second per connection")), front=True)
        return
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
        await _publish(link, channel, settings.control_topic, "ControlEvent", ControlEvent.cancel(
            channel.session_id, turn_id, reason=str(message.get("reason") or CancelReason.BARGE_IN)[:200], source="edge",
            issued_at_us=now_us(), turn_ids=turn_ids))
    elif mtype == protocol.REPORT:
        report = PlaybackReport(
            session_id=channel.session_id, turn_id=message["turn_id"], client_id=channel.client_id,
            kind=PlaybackKind(message["kind"]), sentence_seq=int(message.get("sentence_seq") or 0),
            audible_at_us=int(message.get("audible_at_us") or 0), reported_at_us=now_us(),
            detail=str(message.get("detail") or "")[:500],
        )
        router.metrics.reports.labels(report.kind).inc()
        started = router.turn_started_at(channel.session_id, report.turn_id)
        if report.kind == PlaybackKind.AUDIBLE_START and started and report.audible_at_us > started:
            router.metrics.stage_latency.labels("first_token_to_audible").observe((report.audible_at_us - started) / 1e6)
        if report.kind == PlaybackKind.AUDIBLE_START:
            router.heard.audible(channel.session_id, report.turn_id, report.audible_at_us)
        app[REPORTS_KEY].append(report)
        heard = None
        if report.kind in HEARD_KINDS and "rendered_sentence_seq" in message:
            rendered = Rendered(channel.client_id, int(message["rendered_sentence_seq"]),
                                int(message.get("rendered_samples") or 0), report.kind == PlaybackKind.STOPPED,
                                report.audible_at_us or report.reported_at_us)
            heard = router.heard.report(channel.session_id, report.turn_id, rendered,
                                        router.players_of_turn(channel.session_id, report.turn_id), now_us())
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


def _trace_report(app: web.Application, report: PlaybackReport) -> list[tuple[str, bytes]] | None:
    """Tracing on: the headers of a playback report. AUDIBLE_START closes its sentence's trace
    with an ``audible`` span (sent .. the player heard it, mapped to the server clock); other
    reports carry the sentence's ``edge.send`` context."""
    tracer, sent = app[TRACER_KEY], app[SENT_TRACES_KEY]
    key = (report.client_id, report.turn_id, report.sentence_seq)
    found = sent.get(key)
    if found is None:
        return None
    context, sent_at_us = found
    if report.kind == PlaybackKind.AUDIBLE_START and report.audible_at_us:
        del sent[key]
        context = tracer.record(tracing.AUDIBLE, context, sent_at_us, report.audible_at_us,
                                **{tracing.SESSION: report.session_id, tracing.TURN: report.turn_id,
                                   tracing.SENTENCE: report.sentence_seq, tracing.CLIENT: report.client_id})
    return tracer.headers(context)


async def _publish(link: KafkaLink | None, channel: ClientChannel, topic: str, message_type: str, value: "Message | dict",
                   headers: list[tuple[str, bytes]] | None = None) -> None:
    """Publish for a client; a failure is told to that client (its connection stays up)."""
    if link is None:
        return
    from aiokafka.errors import KafkaError

    from voicebus.codecs import CodecError

    try:
        await link.publish(topic, message_type, value, headers)
    except (KafkaError, CodecError) as exc:
        log.warning("could not publish %s for %s: %s", message_type, channel.client_id, exc)
        channel.push(OutFrame(protocol.encode_control(
            protocol.ERROR, code="not-recorded", message=f"{message_type} not published: {exc}"[:300])))


def _pong(ping: dict) -> OutFrame:
    return OutFrame(protocol.encode_control(protocol.PONG, t0=ping["t0"], server_time_us=now_us()))
