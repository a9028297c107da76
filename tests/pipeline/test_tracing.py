"""One trace per turn (pipeline/tracing.py): the W3C context rides the Kafka headers from the
agent's first token through the gate, the worker and the edge to the player's audible report,
and every stage's span hangs in one tree. End to end on the real broker with an in-memory
exporter; and tracing off writes no header and makes no span."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from voicebus.agents.sdk import Publisher
from voicebus.bus import make_consumer
from voicebus import tracing
from voicebus.gate.app import GateWorker
from voicebus.settings import Settings
from voicebus.topics import text_topic
from voicebus.tracing import NO_TRACER, make_provider, span_tree, tracer_for
from voicebus.players.edge import LINK_KEY
from voicebus.schemas.contract import PlaybackKind
from tests.players.edge_helpers import SECRET, collect, connect, of_type, running_edge, turn_ended
from tests.waiting import eventually

SESSION, TURN = "s-traced", "t-traced"


class ToneEngine:
    """The worker's engine interface at no CPU cost: 300 ms of PCM per sentence in two pieces.
    The spans are the shell's; the model's speed is not what this test is about."""

    sample_rate = 24_000

    def stream(self, text: str, language: str, voice: str, speed: float = 1.0, chunk_ms: int = 150,
               should_stop=lambda: False, first_clause_min_words: int = 0):
        for _ in range(2):
            if should_stop():
                return
            yield b"\x01\x00" * (self.sample_rate * 150 // 1000)


async def _records(settings, topic: str) -> list:
    """Every record of `topic` up to its end now (the test's own topics: all this test wrote)."""
    consumer = make_consumer(settings, topic, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = await eventually(lambda: consumer.assignment(), what=f"{topic} assigned")
        ends = await consumer.end_offsets(list(partitions))
        records: list = []
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
        return records
    finally:
        await consumer.stop()


def test_tracing_is_off_by_default_and_costs_nothing():
    tracer = tracer_for(Settings(), "gate")
    assert tracer is NO_TRACER and not tracer.enabled
    assert tracer.context_of([("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]) is None
    assert tracer.headers(object()) is None
    assert tracer.record("x", object(), 1, 2) is None
    assert tracer.start("x", None, 1, root=True).context is None


@pytest.mark.kafka
async def test_with_tracing_off_records_carry_no_header(make_settings):
    settings = make_settings()
    async with Publisher(settings, agent_id="assistant") as agent:
        assert agent.tracer is NO_TRACER
        async with agent.turn(SESSION, TURN, language="en") as turn:
            await turn.token("Hello.")
    records = await _records(settings, text_topic(settings, "assistant"))
    assert len(records) == 2 and all(not r.headers for r in records)


def test_headers_carry_the_w3c_context_and_read_back():
    exporter = InMemorySpanExporter()
    tracer = tracer_for(Settings(tracing=True), "agent", make_provider(SimpleSpanProcessor(exporter)))
    root = tracer.start(tracing.TURN_SPAN, None, 1_000_000, root=True)
    headers = tracer.headers(root.context)
    assert [k for k, _ in headers] == ["traceparent"]
    version, trace_id, span_id, flags = headers[0][1].decode().split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16 and int(flags, 16) & 1  # sampled
    child = tracer.record(tracing.GATE_HOLD, tracer.context_of(headers + [("other", b"x")]), 1_000_100, 1_000_300)
    root.end(1_000_500)
    hold, turn = exporter.get_finished_spans()
    assert hold.parent.span_id == turn.context.span_id and hold.context.trace_id == turn.context.trace_id
    assert (hold.start_time, hold.end_time) == (1_000_100_000, 1_000_300_000)  # the stamps, µs -> ns
    assert tracer.context_of([("traceparent", b"garbage")]) is None and tracer.context_of(None) is None
    assert child is not None


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_one_turn_is_one_trace_from_first_token_to_audible(make_settings):
    """Two sentences through the real pipeline (gate, worker, edge, a player
    that reports each sentence audible): one trace, its root the agent's turn, and under it per
    sentence gate.hold -> {synthesis.queue, synthesis -> publish -> edge.send -> audible}."""
    from voicebus.synthesis.worker import SynthesisWorker

    exporter = InMemorySpanExporter()
    provider = make_provider(SimpleSpanProcessor(exporter))
    settings = make_settings(edge_secret=SECRET, tracing=True, first_clause_min_words=0, opening_clause_min_words=0)
    engine = ToneEngine()
    gate = GateWorker(settings, tracer=tracer_for(settings, "gate", provider))
    await gate.start()
    try:
        async with SynthesisWorker(settings, engine, worker_id="w-traced", warm_up=False,
                                   tracer=tracer_for(settings, "worker", provider)), \
                running_edge(settings, tracer=tracer_for(settings, "edge", provider)) as (app, client):
            await eventually(lambda: gate.ready.is_set(), what="the gate assigned")
            ws, ready = await connect(client, SESSION)
            async with Publisher(settings, agent_id="assistant", tracer=tracer_for(settings, "agent", provider)) as agent:
                async with agent.turn(SESSION, TURN, language="en") as turn:
                    for token in ("Hello", " there.", " See", " you", " soon."):
                        await turn.token(token)
            messages = await collect(ws, turn_ended, timeout=60)
            timelines = of_type(messages, "timeline")
            assert sorted(t["sentence_seq"] for t in timelines) == [0, 1]
            for t in timelines:  # the player heard each sentence 20 ms after it was sent
                await ws.send_str(json.dumps({"type": "report", "v": 1, "kind": PlaybackKind.AUDIBLE_START,
                                              "turn_id": TURN, "sentence_seq": t["sentence_seq"],
                                              "audible_at_us": t["sent_at_us"] + 20_000}))
            await eventually(lambda: len([s for s in exporter.get_finished_spans() if s.name == tracing.AUDIBLE]) == 2,
                             what="both audible spans recorded")
            await ws.close()
            assert app[LINK_KEY] is not None
    finally:
        await gate.stop()

    spans = [s for s in exporter.get_finished_spans() if s.attributes.get(tracing.TURN) == TURN]
    print("\n".join(span_tree(spans)))
    assert len({s.context.trace_id for s in spans}) == 1, "one trace per turn"
    # the context rode every hop in the records' headers: text, requests, audio, playback reports
    trace_id = f"{spans[0].context.trace_id:032x}".encode()
    for topic in (text_topic(settings, "assistant"), settings.synthesis_topic, settings.audio_topic,
                  settings.playback_topic):
        records = await _records(settings, topic)
        assert records and all(dict(r.headers)["traceparent"].split(b"-")[1] == trace_id for r in records), topic
    assert all(s.attributes[tracing.SESSION] == SESSION for s in spans)
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == [tracing.TURN_SPAN]
    assert {s.name for s in spans if s.parent is not None and s.parent.span_id not in by_id} == set(), "no orphan"

    def children(span, name):
        return [s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id and s.name == name]

    holds = sorted((h for h in children(roots[0], tracing.GATE_HOLD) if h.attributes["voicebus.chars"]),
                   key=lambda h: h.attributes[tracing.SENTENCE])
    assert [h.attributes[tracing.SENTENCE] for h in holds] == [0, 1]
    for hold in holds:
        [queue] = children(hold, tracing.SYNTHESIS_QUEUE)
        [synthesis] = children(hold, tracing.SYNTHESIS)
        [publish] = children(synthesis, tracing.PUBLISH)
        [send] = children(publish, tracing.EDGE_SEND)
        [audible] = children(send, tracing.AUDIBLE)
        assert send.attributes[tracing.CLIENT] == ready["client_id"]
        # each stage starts where the one before it ended (the pipeline's own stamps)
        assert hold.end_time <= queue.start_time <= queue.end_time <= synthesis.start_time
        assert synthesis.start_time <= publish.start_time <= send.start_time <= send.end_time
        assert send.end_time == audible.start_time and audible.end_time - audible.start_time == 20_000_000
    assert roots[0].start_time <= holds[0].start_time


async def test_spans_reach_an_otlp_http_receiver():
    """The exporter the settings configure (OTLP over HTTP, protobuf) delivers to a receiver:
    `voicebus traces` here, which decodes and prints the tree."""
    from voicebus.ops.daemon import free_port
    from voicebus.tracing import otlp_provider
    from voicebus.ops.tracing_cli import TraceCollector, serve

    port = free_port()
    collector, printed = TraceCollector(quiet_s=0.0), []
    receiver = asyncio.create_task(serve("127.0.0.1", port, collector, printed.append))
    try:
        await eventually(lambda: printed, what="the receiver listening")
        settings = Settings(tracing=True, otlp_endpoint=f"http://127.0.0.1:{port}/v1/traces")
        provider = otlp_provider(settings)
        tracer = tracer_for(settings, "agent", provider)
        root = tracer.start(tracing.TURN_SPAN, None, 1_000_000, root=True, **{tracing.SESSION: "s1", tracing.TURN: "t1"})
        tracer.record(tracing.GATE_HOLD, root.context, 1_000_100, 1_000_300, **{tracing.SENTENCE: 0})
        root.end(1_000_500)
        assert await asyncio.to_thread(provider.force_flush, 10_000)
        await eventually(lambda: len(printed) >= 2, what="the trace printed")
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        provider.shutdown()
    head, *tree = printed[1].splitlines()
    assert "session s1" in head and "turn t1" in head and "(2 spans)" in head
    assert tree[0].startswith("voicebus.turn") and tree[1].startswith("  gate.hold") and "sentence_seq=0" in tree[1]


def test_the_sdk_opens_a_turn_at_its_first_event_and_ends_it_at_its_end_or_cancel():
    from voicebus.agents.sdk import END_OF_TURN, TOKEN, TurnEvents

    exporter = InMemorySpanExporter()
    settings = Settings(tracing=True)
    publisher = Publisher(settings, tracer=tracer_for(settings, "agent", make_provider(SimpleSpanProcessor(exporter))))
    ended = TurnEvents("s1", "t1", "assistant")
    first = ended.make(TOKEN, "Hi.", produced_at_us=1_000)
    headers = [publisher._trace_headers(e) for e in (first, ended.make(END_OF_TURN, produced_at_us=5_000))]
    assert headers[0] == headers[1]  # every event of the turn carries the turn span's context
    cancelled = TurnEvents("s1", "t2", "assistant")
    publisher._trace_headers(cancelled.make(TOKEN, "Hello", produced_at_us=6_000))
    publisher._end_turn_spans("s1", None)  # a whole-session cancel
    done, stopped = exporter.get_finished_spans()
    assert (done.name, done.start_time, done.end_time) == (tracing.TURN_SPAN, 1_000_000, 5_000_000)
    assert done.attributes["voicebus.events"] == 2 and done.attributes[tracing.TURN] == "t1"
    assert stopped.attributes[tracing.TURN] == "t2" and stopped.attributes["voicebus.cancelled"] is True
    assert not publisher._turn_spans
