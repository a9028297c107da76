"""`voicebus.ops.demo_llm`'s reading of a turn back from the bus (what `voicebus demo --llm` and the
real-LLM test report), through the real broker: every record of the text and synthesis topics
from the beginning to their end, and each sentence's release latency from them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from voicebus.agents.sdk import Publisher
from voicebus.ops.bench.agents import turn_events
from voicebus.bus import ensure_topics, make_producer, publish
from voicebus.codecs import Codec
from voicebus.ops.demo_llm import read_topics, turn_release_latencies
from voicebus.gate.core import gate_sentences
from voicebus.topics import text_topic

pytestmark = pytest.mark.kafka


async def test_a_turn_is_read_back_and_each_sentence_gets_its_release_latency(make_settings):
    settings = make_settings(partitions=2, speculative_release=False)  # one request per sentence
    events = [replace(e, produced_at_us=1_000_000 + i * 20_000)
              for i, e in enumerate(turn_events("s1", "t1", "reader", "One here. Two there. "))]
    # The gate releases "One here." on event 2 and "Two there." on END_OF_TURN (event 6); as if it
    # had done so 30 ms after each.
    requests = [r for i in (2, 6) for r in gate_sentences(events[: i + 1], settings, now_us=events[i].produced_at_us)
                if r.sentence_seq == (0 if i == 2 else 1)]
    requests = [replace(r, released_at_us=r.released_at_us + 30_000) for r in requests]
    await ensure_topics(settings, [settings.synthesis_topic])
    async with Publisher(settings, "reader") as agent:  # creates and registers the text topic
        for e in events:
            await agent.publish_text_event(e)
    producer = make_producer(settings)
    await producer.start()
    try:
        for r in requests:
            await publish(producer, Codec(), settings.synthesis_topic, "SynthesisRequest", r)
    finally:
        await producer.stop()
    records = await read_topics(settings, [text_topic(settings, "reader"), settings.synthesis_topic, "no-such-topic"])
    assert sorted((topic, kind) for topic, kind, _ in records) == sorted(
        [(text_topic(settings, "reader"), "TextEvent")] * len(events) + [(settings.synthesis_topic, "SynthesisRequest")] * 2)
    assert await turn_release_latencies(settings, "reader") == {("s1", "t1"): [30.0, 30.0]}
