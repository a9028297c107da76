"""`voicebus topics grow` on the real broker: it grows only a drained deployment, every
session-keyed topic together, and a session that the growth moves to another partition is heard
whole, once and in order across it, through the gate, workers (tone, no model) and an edge."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace

import pytest

from voicebus.agents.sdk import Publisher
from voicebus.bus import ensure_topics, make_consumer, make_producer, partitions_of, publish, read_to_end
from voicebus.codecs import Codec
from voicebus.gate.app import GateWorker
from voicebus.gate.core import GateConfig, GateSession
from voicebus.ops.bench.chaos import Frame, score_turn
from voicebus.players.tone import tone_turn
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import TextEvent
from voicebus.topics import partition_of, session_key, text_topic, worker_group_id
from voicebus.topics_grow import GrowthError, NotDrained, grow_partitions
from tests.players.edge_helpers import SECRET, audio, collect, connect, of_type, running_edge, turn_ended

pytestmark = pytest.mark.kafka


def text_event(session: str, turn: str, seq: int, kind: str, text: str = "") -> TextEvent:
    return TextEvent(session_id=session, turn_id=turn, agent_id="a1", seq=seq, kind=TextEventKind(kind), text=text,
                     produced_at_us=1_000_000 + seq)


async def counts(settings, topics) -> dict[str, int]:
    out = {t: 0 for t in topics}
    for tp in await partitions_of(settings, topics):
        out[tp.topic] += 1
    return out


async def test_grow_waits_for_open_turns_then_grows_every_session_keyed_topic_together(make_settings):
    settings = make_settings(partitions=2)
    agent_topic = text_topic(settings, "a1")
    await ensure_topics(settings)
    await ensure_topics(settings, [agent_topic])
    session = GateSession("s1", GateConfig.from_settings(settings))
    session.apply(text_event("s1", "t1", 0, "TOKEN", "Hello there"), 1_000_000)
    assert not session.idle  # a turn the agent has not ended
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(settings.gate_changelog_topic, json.dumps(session.to_state()).encode(), key=b"s1")
        with pytest.raises(NotDrained, match="session s1: a turn is open in the gate"):
            await grow_partitions(settings, 4, quiet_s=0.2, wait_s=2, say=lambda _: None)
        assert set((await counts(settings, [settings.audio_topic, agent_topic])).values()) == {2}  # nothing grew
        session.apply(text_event("s1", "t1", 1, "END_OF_TURN"), 2_000_000)
        assert session.idle
        await producer.send_and_wait(settings.gate_changelog_topic, json.dumps(session.to_state()).encode(), key=b"s1")
    finally:
        await producer.stop()
    grown = await grow_partitions(settings, 4, quiet_s=0.5, wait_s=30, say=lambda _: None)
    keyed = [settings.control_topic, settings.synthesis_topic, settings.audio_topic, settings.playback_topic,
             settings.heard_topic, settings.floor_topic, settings.deadletter_topic, settings.gate_changelog_topic,
             agent_topic]
    assert sorted(grown) == sorted(keyed)
    assert set((await counts(settings, keyed)).values()) == {4}
    # keyed by agent and by edge, not by session: left as they are
    assert set((await counts(settings, [settings.agents_topic, settings.edges_topic])).values()) == {2}
    with pytest.raises(GrowthError, match="4 partitions already"):
        await grow_partitions(settings, 4, quiet_s=0.2, wait_s=2, say=lambda _: None)


async def test_grow_waits_until_the_synthesis_workers_have_committed_every_request(make_settings):
    settings = make_settings(partitions=2)
    await ensure_topics(settings)
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(settings.synthesis_topic, b"a request", key=b"s1")
    finally:
        await producer.stop()
    with pytest.raises(NotDrained, match="synthesis workers have 1 request"):
        await grow_partitions(settings, 3, quiet_s=0.2, wait_s=2, say=lambda _: None)
    workers = make_consumer(settings, settings.synthesis_topic, group_id=worker_group_id(settings),
                            auto_offset_reset="earliest", enable_auto_commit=False)
    await workers.start()
    try:
        while not await workers.getmany(timeout_ms=500):
            pass
        await workers.commit()
    finally:
        await workers.stop()
    assert settings.synthesis_topic in await grow_partitions(settings, 3, quiet_s=0.5, wait_s=30, say=lambda _: None)


def heard(messages, connection: int) -> list[Frame]:
    """The audio a listener got, as the chaos bench scores it (a turn-ending empty frame aside)."""
    return [Frame(i, f.sentence, f.chunk, f.last_in_sentence, len(f.pcm) // 2, connection)
            for i, f in enumerate(audio(messages)) if f.pcm]


async def tone_workers(settings, stop: asyncio.Event) -> None:
    """Stands in for the synthesis workers (no model): in their consumer group, each request
    becomes two chunks of tone on the audio topic (an empty-text request, one empty chunk that ends
    the turn), committed once published."""
    codec = Codec()
    consumer = make_consumer(settings, settings.synthesis_topic, group_id=worker_group_id(settings),
                             auto_offset_reset="earliest", enable_auto_commit=False)
    producer = make_producer(settings)
    await consumer.start()
    await producer.start()
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100)
            for records in batches.values():
                for record in records:
                    request = codec.decode(record.value, expect="SynthesisRequest").value
                    chunks = tone_turn(request["session_id"], request["turn_id"], 1, 2)
                    if not request["text"]:
                        chunks = [replace(chunks[-1], pcm=b"")]
                    for chunk in chunks:
                        await publish(producer, codec, settings.audio_topic, "AudioChunk", replace(
                            chunk, sentence_seq=request["sentence_seq"],
                            is_last_in_turn=request["is_last_in_turn"] and chunk.is_last_chunk))
            if batches:
                await consumer.commit()
    finally:
        await producer.stop()
        await consumer.stop()


@contextlib.asynccontextmanager
async def pipeline(settings):
    """The gate (in this process), the tone workers and an edge with its aiohttp test client."""
    gate, stop = GateWorker(settings), asyncio.Event()
    await gate.start()
    workers = asyncio.create_task(tone_workers(settings, stop))
    try:
        async with running_edge(settings) as (_, client):
            yield client
    finally:
        stop.set()
        await workers
        await gate.stop()


async def speak(settings, session: str, text: str) -> str:
    async with Publisher(settings, agent_id="a1") as agent:
        async with agent.turn(session) as turn:
            await turn.token(text)
    return turn.turn_id


async def test_a_session_the_growth_moves_is_heard_whole_once_and_in_order_across_it(make_settings):
    settings = make_settings(edge_secret=SECRET, partitions=2, speculative_release=False)
    sid = next(s for s in (f"s{i}" for i in range(100)) if partition_of(s, 2) != partition_of(s, 4))
    await ensure_topics(settings)
    await ensure_topics(settings, [text_topic(settings, "a1")])
    async with pipeline(settings) as client:
        ws, ready = await connect(client, sid)
        assert ready["type"] == "ready"
        first_turn = await speak(settings, sid, "The first turn is here. It has two sentences.")
        first = await collect(ws, turn_ended, timeout=30)
        # the agent stopped at a turn boundary: once drained, every session-keyed topic grows
        await grow_partitions(settings, 4, quiet_s=1.0, wait_s=60, say=lambda _: None)
        await ws.close()
    grown = settings.replace(partitions=4)
    async with pipeline(grown) as client:  # the stages restart with the new count
        ws, ready = await connect(client, sid, resume={"turn_id": first_turn, "sentence_seq": 1, "finished": True})
        assert ready["type"] == "ready"
        second_turn = await speak(grown, sid, "The second turn follows. It moved to a new partition.")
        second = await collect(ws, turn_ended, timeout=30)
        await ws.close()
    assert [m["turn_id"] for m in of_type(first, "turn_start")] == [first_turn]
    assert [m["turn_id"] for m in of_type(second, "turn_start")] == [second_turn]  # the first is not heard again
    for messages, connection in ((first, 0), (second, 1)):
        assert score_turn(heard(messages, connection), 2) == {
            "lost": 0, "heard_twice": 0, "out_of_order": 0, "unexpected": 0, "max_gap_ms": 0.0}
    # the second turn's text, requests and audio were on the session's new partition
    records = await read_to_end(grown, [text_topic(grown, "a1"), grown.synthesis_topic, grown.audio_topic])
    partitions = {(r.topic, r.partition) for r in records if r.key == session_key(sid)}
    assert {p for _, p in partitions} == {partition_of(sid, 2), partition_of(sid, 4)}
