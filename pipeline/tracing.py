"""One trace per turn: every OpenTelemetry call voicebus makes lives here.

A turn crosses four processes and three Kafka hops. Its W3C trace context (``traceparent``,
``tracestate``) rides in the Kafka headers of every record that belongs to it, and each stage
records its part as a span of that one trace (docs/tracing.md shows a demo turn):

    voicebus.turn            agent (SDK)  first token .. END_OF_TURN published
    └─ gate.hold             gate         sentence complete .. released           (per sentence)
       ├─ synthesis.queue    worker       request received .. synthesis start
       └─ synthesis          worker       synthesis start .. last chunk published
          └─ publish         worker       first chunk ready .. acknowledged
             └─ edge.send    edge         chunk received .. sent to one player   (per player)
                └─ audible   edge         sent .. the player reports it audible

Stages use the small `StageTracer` interface: `context_of(headers)` reads a record's context,
`headers(parent)` writes one, `record(...)` makes a finished span from two timestamps the
pipeline already stamps (epoch µs, the clocks stay where they are: no tracing in the pure
cores), `start(...)` opens a span that ends later (`LiveSpan.end`). A parent is an opaque
`TraceParent` (an OpenTelemetry context); None means "no trace": a stage that gets None passes
None on and records nothing.

Off by default (``VOICEBUS_TRACING``): `tracer_for` then returns `NO_TRACER`, whose methods
return at once without touching OpenTelemetry (no header parsed, no span, nothing exported).
On, spans go to an OTLP collector (``VOICEBUS_OTLP_ENDPOINT``, ``VOICEBUS_OTLP_PROTOCOL``) through
a batching processor, off the event loop; tests pass a provider with an in-memory exporter.

Why not opentelemetry-instrumentation-aiokafka: it patches ``send``/``getone``/``getmany`` of
every aiokafka client class process-wide, so every record (changelog, positions, control,
registry, dead letters) gets a span of its own, each send parented by whatever context happens
to be current (the gate sends many turns' requests in one batch: none is), and the context it
extracts on receive is not handed to the caller, so stage spans could not hang under it.
voicebus uses the same W3C propagator on the records of a turn only, with stage spans as
the parents. aiohttp-server instrumentation sees one span per WebSocket connection (minutes
long, many turns), not per turn, so the edge records its send and audible spans itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from voicebus.settings import Settings

log = logging.getLogger(__name__)

TraceParent = Any  # an opentelemetry.context.Context holding the parent span; opaque to stages
Headers = Sequence[tuple[str, bytes]]

OTLP_PROTOCOLS = ("http/protobuf", "grpc", "none")  # none: spans made and propagated, not exported
TRACE_HEADERS = ("traceparent", "tracestate")

# Attribute names (voicebus.*: no semantic convention names a voice turn).
SESSION = "voicebus.session_id"
TURN = "voicebus.turn_id"
AGENT = "voicebus.agent_id"
SENTENCE = "voicebus.sentence_seq"
WORKER = "voicebus.worker_id"
CLIENT = "voicebus.client_id"

# Span names, one per stage.
TURN_SPAN = "voicebus.turn"
GATE_HOLD = "gate.hold"
SYNTHESIS_QUEUE = "synthesis.queue"
SYNTHESIS = "synthesis"
PUBLISH = "publish"
EDGE_SEND = "edge.send"
AUDIBLE = "audible"


class TracingError(ValueError):
    """Tracing settings that cannot work (an unknown OTLP protocol, ...)."""


class LiveSpan:
    """A span that ends later; `context` is its `TraceParent` for children and headers."""

    __slots__ = ("_span", "context")

    def __init__(self, span: Any, context: TraceParent) -> None:
        self._span = span
        self.context = context

    def end(self, end_us: int | None = None, **attributes: Any) -> None:
        if self._span is None:
            return
        if attributes:
            self._span.set_attributes(_clean(attributes))
        self._span.end(end_time=None if end_us is None else end_us * 1000)
        self._span = None


class StageTracer:
    """The interface stages use. This base is the no-op: tracing off costs a method call."""

    enabled = False

    def context_of(self, headers: Iterable[tuple[str, bytes]] | None) -> TraceParent | None:
        """The trace context a record carries in its headers (None: none, or tracing off)."""
        return None

    def headers(self, parent: TraceParent | None) -> list[tuple[str, bytes]] | None:
        """Kafka headers carrying `parent` (None when there is nothing to carry)."""
        return None

    def record(self, name: str, parent: TraceParent | None, start_us: int, end_us: int,
               **attributes: Any) -> TraceParent | None:
        """A finished span `name` under `parent` from `start_us` to `end_us` (epoch µs, the
        pipeline's own stamps); returns its context. Nothing without a parent."""
        return None

    def start(self, name: str, parent: TraceParent | None, start_us: int, *, root: bool = False,
              **attributes: Any) -> LiveSpan:
        """A span that starts at `start_us` and ends with `LiveSpan.end`. Under `parent`, or (with
        ``root=True`` and no parent) the root of a new trace."""
        return _NO_SPAN


_NO_SPAN = LiveSpan(None, None)
NO_TRACER = StageTracer()


class OtelTracer(StageTracer):
    """`StageTracer` on an OpenTelemetry SDK tracer provider, W3C trace-context propagation."""

    enabled = True

    def __init__(self, provider: "TracerProvider", stage: str) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.stage = stage
        self._tracer = provider.get_tracer("voicebus", attributes={"voicebus.stage": stage})
        self._propagator = TraceContextTextMapPropagator()

    def context_of(self, headers: Iterable[tuple[str, bytes]] | None) -> TraceParent | None:
        if not headers:
            return None
        carrier = {k: v.decode("ascii", "replace") for k, v in headers if k in TRACE_HEADERS and v is not None}
        if "traceparent" not in carrier:
            return None
        context = self._propagator.extract(carrier)
        from opentelemetry import trace

        return context if trace.get_current_span(context).get_span_context().is_valid else None

    def headers(self, parent: TraceParent | None) -> list[tuple[str, bytes]] | None:
        if parent is None:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=parent)
        return [(k, v.encode("ascii")) for k, v in carrier.items()] or None

    def record(self, name: str, parent: TraceParent | None, start_us: int, end_us: int,
               **attributes: Any) -> TraceParent | None:
        if parent is None:
            return None
        span = self._tracer.start_span(name, context=parent, start_time=start_us * 1000,
                                       attributes=_clean(attributes))
        span.end(end_time=max(start_us, end_us) * 1000)
        from opentelemetry import trace

        return trace.set_span_in_context(span)

    def start(self, name: str, parent: TraceParent | None, start_us: int, *, root: bool = False,
              **attributes: Any) -> LiveSpan:
        if parent is None and not root:
            return _NO_SPAN
        from opentelemetry import trace
        from opentelemetry.context import Context

        span = self._tracer.start_span(name, context=parent if parent is not None else Context(),
                                       start_time=start_us * 1000, attributes=_clean(attributes))
        return LiveSpan(span, trace.set_span_in_context(span))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str/bool/int/float values; None means "not set"."""
    return {k: v for k, v in attributes.items() if v is not None}


_providers: dict[tuple[str, str], "TracerProvider"] = {}


def tracer_for(settings: "Settings", stage: str, provider: "TracerProvider | None" = None) -> StageTracer:
    """The tracer of a stage (``agent``, ``gate``, ``worker``, ``edge``): `NO_TRACER` when
    tracing is off, else one on `provider` (default: the process's OTLP-exporting provider,
    made once per endpoint from the settings)."""
    if not settings.tracing:
        return NO_TRACER
    if provider is None:
        provider = otlp_provider(settings)
    return OtelTracer(provider, stage)


def otlp_provider(settings: "Settings") -> "TracerProvider":
    """A tracer provider exporting to ``settings.otlp_endpoint`` over ``settings.otlp_protocol``
    in batches (a background thread: the event loop never waits for the collector). One per
    process and endpoint; the SDK flushes it at exit."""
    if settings.otlp_protocol not in OTLP_PROTOCOLS:
        raise TracingError(f"VOICEBUS_OTLP_PROTOCOL={settings.otlp_protocol!r}: one of {', '.join(OTLP_PROTOCOLS)}")
    key = (settings.otlp_protocol, settings.otlp_endpoint)
    provider = _providers.get(key)
    if provider is not None:
        return provider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if settings.otlp_protocol == "none":
        exporter: Any = DroppingExporter()
    elif settings.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingError("VOICEBUS_OTLP_PROTOCOL=grpc needs the gRPC exporter: pip install 'voicebus[otlp-grpc]' "
                               "(or use http/protobuf, the default)") from exc

        # Empty endpoint: the exporter's own default (and the standard OTEL_EXPORTER_OTLP_* variables).
        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint or None)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=settings.otlp_endpoint or None)
    provider = _providers[key] = make_provider(BatchSpanProcessor(exporter), settings.otlp_service_name)
    log.info("tracing: spans to %s over OTLP %s", settings.otlp_endpoint or "the OTLP default endpoint",
             settings.otlp_protocol)
    return provider


def _dropping_exporter_class() -> type:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class _Dropping(SpanExporter):
        """Takes every span and sends it nowhere: tracing's own cost, without a collector's."""

        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    return _Dropping


def DroppingExporter() -> Any:  # noqa: N802 - a class made on first use (the SDK is imported lazily)
    """An exporter that drops every span (``VOICEBUS_OTLP_PROTOCOL=none``, the TTFA benchmark's
    "on" arm): the spans are made, propagated and handed to the batch processor, never sent."""
    return _dropping_exporter_class()()


def make_provider(processor: Any, service_name: str = "voicebus") -> "TracerProvider":
    """A tracer provider with one span processor (tests: a `SimpleSpanProcessor` on an
    `InMemorySpanExporter`; the TTFA benchmark: a processor that drops what it gets)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    return provider


def span_tree(spans: Iterable[Any]) -> list[str]:
    """Finished SDK spans as an indented text tree, one line per span, children by start time:
    ``name  +start ms  duration ms  attributes``, times from the earliest span's start."""
    spans = list(spans)
    if not spans:
        return []
    by_id = {s.context.span_id: s for s in spans}
    children: dict[Any, list[Any]] = {}
    roots = []
    for s in spans:
        if s.parent is not None and s.parent.span_id in by_id:
            children.setdefault(s.parent.span_id, []).append(s)
        else:
            roots.append(s)
    origin = min(s.start_time for s in spans)
    lines: list[str] = []

    def walk(span: Any, depth: int) -> None:
        attrs = " ".join(f"{k.removeprefix('voicebus.')}={v}" for k, v in sorted((span.attributes or {}).items())
                         if k not in (SESSION, TURN))
        lines.append(f"{'  ' * depth}{span.name:<{24 - 2 * depth}} +{(span.start_time - origin) / 1e6:8.1f} ms "
                     f"{(span.end_time - span.start_time) / 1e6:8.1f} ms  {attrs}".rstrip())
        for child in sorted(children.get(span.context.span_id, []), key=lambda c: c.start_time):
            walk(child, depth + 1)

    for root in sorted(roots, key=lambda r: r.start_time):
        walk(root, 0)
    return lines
