"""`voicebus traces`: a minimal OTLP/HTTP receiver that prints each trace as a span tree.

For looking at voicebus's traces on a machine without a collector (Jaeger, Tempo, an
OpenTelemetry Collector are the real thing: point ``VOICEBUS_OTLP_ENDPOINT`` at one). It
accepts ``POST /v1/traces`` in OTLP protobuf (the default ``http/protobuf`` exporter), keeps
spans by trace, and prints a trace's tree (`voicebus.tracing.span_tree`) once no span of it has
arrived for ``--quiet`` seconds. docs/tracing.md shows its output for a demo turn.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, Callable

from voicebus.settings import Settings


def register(subparsers) -> None:
    p = subparsers.add_parser("traces", help="receive OTLP/HTTP spans and print each trace as a tree (no collector needed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318, help="listen port (default 4318, OTLP/HTTP's)")
    p.add_argument("--quiet", type=float, default=2.0, metavar="S",
                   help="print a trace once none of its spans arrived for S seconds (default 2)")
    p.add_argument("--linger", type=float, default=0.0, metavar="S", help="stop after S seconds (default: Ctrl-C)")
    p.set_defaults(func=run_traces)


def spans_of(body: bytes) -> list[SimpleNamespace]:
    """The spans of one OTLP ExportTraceServiceRequest (protobuf), shaped like the SDK's
    finished spans as far as `voicebus.tracing.span_tree` reads them."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {kv.key: _value(kv.value) for kv in span.attributes}
                out.append(SimpleNamespace(
                    name=span.name, trace_id=span.trace_id.hex(), context=SimpleNamespace(span_id=span.span_id),
                    parent=SimpleNamespace(span_id=span.parent_span_id) if span.parent_span_id else None,
                    start_time=span.start_time_unix_nano, end_time=span.end_time_unix_nano, attributes=attributes))
    return out


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class TraceCollector:
    """Spans by trace id; `due(now)` hands over the traces that went quiet."""

    def __init__(self, quiet_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.clock = clock
        self._traces: dict[str, list[Any]] = {}
        self._last: dict[str, float] = {}

    def add(self, spans: list[Any]) -> None:
        now = self.clock()
        for span in spans:
            self._traces.setdefault(span.trace_id, []).append(span)
            self._last[span.trace_id] = now

    def due(self) -> list[tuple[str, list[Any]]]:
        now = self.clock()
        ready = [t for t, last in self._last.items() if now - last >= self.quiet_s]
        out = [(t, self._traces.pop(t)) for t in ready]
        for t in ready:
            del self._last[t]
        return out


def format_trace(trace_id: str, spans: list[Any]) -> str:
    from voicebus.tracing import SESSION, TURN, span_tree

    first = min(spans, key=lambda s: s.start_time)
    head = f"trace {trace_id}  session {first.attributes.get(SESSION, '?')}  turn {first.attributes.get(TURN, '?')}  " \
           f"({len(spans)} spans)"
    return "\n".join([head, *span_tree(spans)])


async def serve(host: str, port: int, collector: TraceCollector, emit: Callable[[str], None],
                linger_s: float = 0.0) -> None:
    from aiohttp import web

    async def receive(request: web.Request) -> web.Response:
        collector.add(spans_of(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        emit(f"OTLP/HTTP receiver on http://{host}:{port}/v1/traces "
             f"(VOICEBUS_TRACING=1 VOICEBUS_OTLP_ENDPOINT=http://{host}:{port}/v1/traces)")
        started = time.monotonic()
        while not linger_s or time.monotonic() - started < linger_s:
            await asyncio.sleep(0.2)
            for trace_id, spans in collector.due():
                emit(format_trace(trace_id, spans))
        for trace_id, spans in collector._traces.items():
            emit(format_trace(trace_id, spans))
    finally:
        await runner.cleanup()


def run_traces(args, settings: Settings) -> int:
    collector = TraceCollector(args.quiet)
    try:
        asyncio.run(serve(args.host, args.port, collector, lambda text: print(text, flush=True), args.linger))
    except KeyboardInterrupt:
        pass
    return 0
