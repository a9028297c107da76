"""`voicebus bench hostile`'s core: what the hostile agent puts on the real broker is what it
claims (every record of a refused kind is refused by the codec and contract the stages use, the
others decode), and the comparison of normal turns with the clean run. The whole benchmark
against live stage processes is `voicebus bench hostile --quick` (docs/benchmarks.md)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from aiokafka.structs import TopicPartition

from voicebus.agents.sdk import Publisher
from voicebus.ops.bench.hostile import (
    HOSTILE_AGENT, KIND_HEADER, REFUSED_KINDS, HeardResult, HostileAgent, affected, sentence_hashes,
)
from voicebus.bus import ensure_topics, make_consumer, make_producer
from voicebus.codecs import CodecError, codec_for
from voicebus.topics import fixed_topics, text_topic
from voicebus.players.listener import HeardTurn

TOPIC_TYPES = {"text": "TextEvent", "control": "ControlEvent", "synthesis": "SynthesisRequest", "audio": "AudioChunk"}


@pytest.mark.kafka
async def test_the_hostile_agent_sends_refused_kinds_that_every_decoder_refuses_and_valid_kinds_that_decode(
        make_settings):
    settings = make_settings(partitions=2)
    await ensure_topics(settings, [*fixed_topics(settings), text_topic(settings, HOSTILE_AGENT)])
    producer = make_producer(settings, enable_idempotence=False)
    await producer.start()
    try:
        async with Publisher(settings, HOSTILE_AGENT) as publisher:
            agent = HostileAgent(settings, producer, publisher, random.Random(1), scale=1)
            await agent.records([b"normal-session"])
    finally:
        await producer.stop()
    topics = {"text": text_topic(settings, HOSTILE_AGENT), "control": settings.control_topic,
              "synthesis": settings.synthesis_topic, "audio": settings.audio_topic}
    codec = codec_for(settings)
    seen: Counter[str] = Counter()
    consumer = make_consumer(settings, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics.values() for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for record in records:
                    kind = dict(record.headers or []).get(KIND_HEADER, b"").decode()
                    if not kind:
                        continue  # the SDK's valid turns (run-on text, an unclosed fence, ...)
                    family, _, what = kind.partition(":")
                    expect = TOPIC_TYPES[family]
                    assert topics[family] == tp.topic, kind
                    seen[kind] += 1
                    if what in REFUSED_KINDS:
                        with pytest.raises(CodecError):
                            codec.decode(record.value, expect=expect)
                    elif kind not in ("text:wrong-partition",):  # decodes; the gate refuses it by partition
                        assert codec.decode(record.value, expect=expect).type == expect, kind
    finally:
        await consumer.stop()
    sent = {k: v for k, v in agent.inputs.items() if k.split(":")[1] not in
            ("run-on", "unclosed-fence", "emoji-and-controls")}
    assert seen == sent
    assert {k.split(":")[0] for k in seen} == set(TOPIC_TYPES)


def _turn(frames: list[tuple[int, bytes]]) -> HeardTurn:
    turn = HeardTurn("t")
    for i, (sentence, pcm) in enumerate(frames):
        turn.frames.append((i, sentence, i, len(pcm) // 2))
        turn.pcm += pcm
    return turn


def test_sentence_hashes_split_the_audio_by_sentence():
    a = sentence_hashes(_turn([(0, b"\x01\x00" * 3), (0, b"\x02\x00"), (1, b"\x03\x00")]))
    b = sentence_hashes(_turn([(0, b"\x01\x00" * 3 + b"\x02\x00"), (1, b"\x03\x00")]))  # other chunking, same audio
    c = sentence_hashes(_turn([(0, b"\x01\x00" * 3), (1, b"\x02\x00\x03\x00")]))  # a sample moved across sentences
    assert a == b and len(a) == 2 and a != c


def test_a_turn_is_affected_when_it_did_not_end_ended_with_a_reason_or_sounds_different():
    clean = [HeardResult((0, t), True, "", ["h0", "h1"]) for t in range(4)]
    hostile = [HeardResult((0, 0), True, "", ["h0", "h1"]), HeardResult((0, 1), False, "", ["h0"]),
               HeardResult((0, 2), True, "synthesis-failed", ["h0", "h1"]), HeardResult((0, 3), True, "", ["h0", "hX"])]
    assert [key for key, _why in affected(clean, hostile)] == [(0, 1), (0, 2), (0, 3)]


def test_memory_per_round_tells_a_leak_from_high_water_marks():
    from voicebus.ops.bench.hostile import memory_per_round

    # after the clean run, then rounds 1..6: a step up (a larger forward pass), a release, flat
    steps = [2000.0, 2070.0, 2870.0, 2870.1, 2870.2, 2440.0, 2440.1]
    leak = [50.0, 51.0, 53.0, 55.0, 57.0, 59.0, 61.0]
    assert memory_per_round({"worker": steps, "edge": leak, "short": [1.0, 2.0, 3.0]}) == {
        "worker": 0.1, "edge": 2.0, "short": None}
