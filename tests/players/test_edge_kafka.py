"""The edge on the real broker: chunks from the audio topic reach their session's players, a
client's cancel lands on the control topic, a bus cancel stops players, reports are recorded."""

import asyncio
import json
from dataclasses import replace

import pytest

from voicebus.bus import make_consumer, make_producer, publish
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.players.edge import LINK_KEY
from voicebus.players.router import SessionRouter
from voicebus.players.tone import tone_turn
from tests.foreign import foreign_encode
from tests.players.edge_helpers import SECRET, audio, collect, connect, of_type, publish_audio, running_edge, turn_ended
from tests.waiting import eventually

pytestmark = pytest.mark.kafka


async def read_topic(settings, topic: str, expect: str | None, until, timeout: float = 20.0, raw: bool = False) -> list:
    """Decoded values (`raw`: the records) of `topic` from the beginning until `until(values)`."""
    codec, values = Codec(), []
    consumer = make_consumer(settings, topic, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        async with asyncio.timeout(timeout):
            while not until(values):
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    values.extend(r if raw else codec.decode(r.value, expect=expect).value for r in records)
    finally:
        await consumer.stop()
    return values


async def test_chunks_on_the_bus_reach_only_their_sessions_players(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client):
        assert (await (await client.get("/healthz")).json())["kafka"] == "ready"
        a1, _ = await connect(client, "A")
        a2, _ = await connect(client, "A")
        b, _ = await connect(client, "B")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            for chunk in tone_turn("A", "ta", 2, 2, freq_hz=300) + tone_turn("B", "tb", 1, 3, freq_hz=500):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            await producer.send_and_wait(settings.audio_topic, b"not avro", key=b"A")  # dead-lettered, ignored
            odd = replace(tone_turn("A", "ta", 1, 1)[0], pcm=b"\x01\x02\x03").to_record()  # not whole PCM16 samples
            await producer.send_and_wait(settings.audio_topic, foreign_encode("AudioChunk", odd), key=b"A")
        finally:
            await producer.stop()
        for ws in (a1, a2):
            got = await collect(ws, turn_ended, timeout=15)
            assert of_type(got, "turn_start")[0]["turn_id"] == "ta"
            assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
            assert audio(got)[0].pcm == tone_turn("A", "x", 1, 1, freq_hz=300)[0].pcm
        got = await collect(b, turn_ended, timeout=15)
        assert of_type(got, "turn_start")[0]["turn_id"] == "tb" and len(audio(got)) == 3
        timeline = of_type(got, "timeline")[0]
        assert timeline["published_at_us"] <= timeline["edge_received_at_us"] <= timeline["sent_at_us"]
        async def metrics_after_bad_records():
            text = await (await client.get("/metrics")).text()
            return text if "voicebus_edge_bad_records_total 2.0" in text else None
        # the bad record, published last, is dead-lettered; the edge carries on
        metrics = await eventually(metrics_after_bad_records, timeout_s=15, interval_s=0.1,
                                   what="both bad records counted")
        # one sample per accepted sentence start (ta: 2, tb: 1); the rejected odd chunk adds none
        assert 'voicebus_stage_latency_seconds_count{stage="bus_to_edge"} 3.0' in metrics
        assert (await (await client.get("/healthz")).json())["kafka"] == "ready"
        dead = await read_topic(settings, settings.deadletter_topic, None, lambda v: len(v) >= 2, raw=True)
        # the contract refuses the odd chunk in the codec, before the router sees it
        assert sorted(dict(r.headers)["voicebus.error.reason"] for r in dead) == [b"contract-violation", b"malformed"]


async def test_client_cancel_lands_on_the_control_topic_and_reports_on_the_playback_topic(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client):
        ws, ready = await connect(client, "S")
        for chunk in tone_turn("S", "t1", 3, 2)[:2]:
            app[LINK_KEY].router.route(chunk)
        await collect(ws, lambda m: len(audio(m)) == 2)
        await ws.send_str(json.dumps({"type": "report", "v": 1, "kind": "AUDIBLE_START", "turn_id": "t1",
                                      "sentence_seq": 0, "audible_at_us": now_us()}))
        await ws.send_str(json.dumps({"type": "cancel", "v": 1, "turn_id": "t1", "reason": "barge-in"}))
        assert of_type(await collect(ws, lambda m: of_type(m, "stop")), "stop")[0]["turn_id"] == "t1"
        events = await read_topic(settings, settings.control_topic, "ControlEvent", lambda v: v)
        assert events[0]["session_id"] == "S" and events[0]["turn_id"] == "t1"
        assert events[0]["action"] == "CANCEL" and events[0]["source"] == "edge" and events[0]["reason"] == "barge-in"
        reports = await read_topic(settings, settings.playback_topic, "PlaybackReport", lambda v: v)
        assert reports[0]["kind"] == "AUDIBLE_START" and reports[0]["client_id"] == ready["client_id"]
        # a barge-in without a turn id names the turns this edge knows: no clock is compared anywhere
        app[LINK_KEY].router.route(tone_turn("S", "t2", 1, 1)[0])
        await ws.send_str(json.dumps({"type": "cancel", "v": 1, "reason": "barge-in"}))
        events = await read_topic(settings, settings.control_topic, "ControlEvent", lambda v: len(v) >= 2)
        assert events[1]["turn_id"] is None and events[1]["turn_ids"] == ["t1", "t2"]


async def test_a_cancel_from_the_bus_stops_players_and_drops_the_turns_later_chunks(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client):
        ws, _ = await connect(client, "S")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            chunks = tone_turn("S", "t1", 2, 2)
            await publish(producer, codec, settings.audio_topic, "AudioChunk", chunks[0])
            await collect(ws, lambda m: audio(m), timeout=15)
            await publish(producer, codec, settings.control_topic, "ControlEvent", {
                "session_id": "S", "turn_id": None, "action": "CANCEL", "reason": "agent", "source": "agent",
                "issued_at_us": now_us()})
            got = await collect(ws, lambda m: of_type(m, "stop"), timeout=15)
            assert of_type(got, "stop")[0]["turn_id"] == "t1"
            for chunk in chunks[1:]:
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            for chunk in tone_turn("S", "t2", 1, 1):  # a turn that started after the cancel plays
                await publish(producer, codec, settings.audio_topic, "AudioChunk", replace(chunk, first_token_at_us=now_us()))
        finally:
            await producer.stop()
        got = await collect(ws, turn_ended, timeout=15)
        assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t2"]  # t1's late chunks never came
        assert len(audio(got)) == 1


class RouterWithABug(SessionRouter):
    """A router with a bug that only one kind of chunk triggers (turn "boom"): the edge must
    survive any exception a record makes its handler raise, not only the ones it expects."""

    def route(self, chunk, *args, **kwargs):
        if chunk.turn_id == "boom":
            raise RuntimeError("a bug in the router")
        return super().route(chunk, *args, **kwargs)


async def test_a_bad_record_is_dead_lettered_with_its_reason_and_the_next_chunk_still_plays(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings, router=RouterWithABug.from_settings(settings)) as (app, client):
        ws, _ = await connect(client, "S")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            good = tone_turn("S", "t1", 1, 2)
            await publish(producer, codec, settings.audio_topic, "AudioChunk", good[0])
            # written by a producer that bypasses our codec: Avro takes a negative int
            negative = foreign_encode("AudioChunk", replace(tone_turn("S", "t1", 1, 1)[0], sentence_seq=-1).to_record())
            await producer.send_and_wait(settings.audio_topic, negative, key=b"S")
            await publish(producer, codec, settings.audio_topic, "AudioChunk", tone_turn("S", "boom", 1, 1)[0])
            await publish(producer, codec, settings.audio_topic, "AudioChunk", good[1])
        finally:
            await producer.stop()
        got = await collect(ws, turn_ended, timeout=15)
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1)]
        assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t1"]
        dead = await read_topic(settings, settings.deadletter_topic, None, lambda v: len(v) >= 2, raw=True)
        reasons = {dict(r.headers)["voicebus.error.reason"]: dict(r.headers) for r in dead}
        assert set(reasons) == {b"contract-violation", b"handler-error"}
        assert b"sentence_seq -1" in reasons[b"contract-violation"]["voicebus.error.message"]
        assert reasons[b"handler-error"]["voicebus.error.stage"] == b"edge"
        assert b"a bug in the router" in reasons[b"handler-error"]["voicebus.error.message"]
        health = await (await client.get("/healthz")).json()
        assert health["kafka"] == "ready" and health["tasks"]["audio"]["restarts"] == 0
        metrics = await (await client.get("/metrics")).text()
        assert 'voicebus_records_dead_lettered_total{reason="handler-error",stage="edge"} 1.0' in metrics
        assert 'voicebus_records_dead_lettered_total{reason="contract-violation",stage="edge"} 1.0' in metrics


async def test_a_consume_task_that_dies_is_restarted_where_it_stopped_and_healthz_says_so(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client):
        link = app[LINK_KEY]
        ws, _ = await connect(client, "S")
        backoff = asyncio.Event()

        async def held_backoff(seconds: float) -> None:  # the test decides when the first restart happens
            await backoff.wait()
            await asyncio.sleep(seconds)  # then the real backoff: a restart that fails again must not spin

        link.supervisor.sleep = held_backoff
        await link.consumer.stop()  # its consumer is gone: the task dies outside any record
        response = await eventually(_status(client, 503), timeout_s=15, what="/healthz reports the dead task")
        body = await response.json()
        assert body["kafka"] == "down" and body["tasks"]["audio"]["restarts"] == 1
        assert "ConsumerStoppedError" in body["tasks"]["audio"]["last_error"]
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:  # published while the task is down: the restarted consumer resumes where it stopped
            for chunk in tone_turn("S", "t1", 1, 2):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        finally:
            await producer.stop()
        backoff.set()
        got = await collect(ws, turn_ended, timeout=15)
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1)]
        body = await (await eventually(_status(client, 200), timeout_s=15, what="healthy again")).json()
        assert body["tasks"]["audio"]["running"] and body["tasks"]["audio"]["restarts"] == 1


def _status(client, status: int):
    async def probe():
        response = await client.get("/healthz")
        return response if response.status == status else None

    return probe


async def test_a_retried_chunk_and_a_re_spoken_sentence_are_heard_once(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client):
        ws, _ = await connect(client, "S")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            first = tone_turn("S", "t1", 2, 3)
            for chunk in first[:2] + [first[1]]:  # a producer retry duplicates chunk (0, 1)
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            # the worker died after chunk (0, 1); its successor speaks the sentence again from its start
            again = tone_turn("S", "t1", 2, 3)
            again[-1] = replace(again[-1], end_reason="sentence-failed")  # its last sentence could not be spoken whole
            for chunk in again:
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        finally:
            await producer.stop()
        got = await collect(ws, turn_ended, timeout=15)
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        assert [m.get("reason") for m in of_type(got, "turn_end")] == ["sentence-failed"]


async def test_a_cancel_published_before_the_edge_started_still_drops_its_turn(make_settings):
    settings = make_settings(edge_secret=SECRET, edge_cancel_lookback_s=60.0)
    producer, codec = make_producer(settings), Codec()
    await producer.start()
    try:
        from voicebus.bus import ensure_topics

        await ensure_topics(settings, [settings.control_topic, settings.audio_topic])
        await publish(producer, codec, settings.control_topic, "ControlEvent", {
            "session_id": "S", "turn_id": "t1", "action": "CANCEL", "reason": "agent", "source": "agent",
            "issued_at_us": now_us()})
        async with running_edge(settings) as (app, client):
            ws, _ = await connect(client, "S")
            for chunk in tone_turn("S", "t1", 1, 2) + tone_turn("S", "t2", 1, 1):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            got = await collect(ws, turn_ended, timeout=15)
    finally:
        await producer.stop()
    assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t2"] and len(audio(got)) == 1


async def test_a_player_resuming_on_a_restarted_edge_gets_the_rest_of_its_turn(make_settings):
    """Chaos (kind ``edge``): the edge a player listened to died mid-turn; audio kept
    coming while no edge ran. A new edge reads the recent audio back into its replay buffers
    before it serves anyone, so the player's ``resume`` gets its turn from the sentence it was
    playing: nothing lost, and the sentences it had heard whole are not sent again."""
    settings = make_settings(edge_secret=SECRET, edge_resume_lookback_s=30.0)
    turn = tone_turn("S", "t1", 3, 2)  # sentences 0, 1, 2 of two chunks each
    producer, codec = make_producer(settings), Codec()
    await producer.start()
    try:
        from voicebus.bus import ensure_topics

        await ensure_topics(settings, [settings.control_topic, settings.audio_topic])
        # heard by the player through the edge that died: sentence 0 whole, sentence 1's first chunk;
        # published while no edge ran: the rest of sentence 1 and sentence 2's first chunk
        for chunk in turn[:5]:
            await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        async with running_edge(settings) as (app, client):
            ws, ready = await connect(client, "S", resume={"turn_id": "t1", "sentence_seq": 1})
            assert ready["type"] == "ready"
            await publish(producer, codec, settings.audio_topic, "AudioChunk", turn[5])  # live, after the restart
            got = await collect(ws, turn_ended, timeout=15)
    finally:
        await producer.stop()
    assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t1"]
    assert [(f.sentence, f.chunk) for f in audio(got)] == [(1, 0), (1, 1), (2, 0), (2, 1)]


async def test_a_player_without_resume_on_a_restarted_edge_gets_the_turn_it_never_saw_start(make_settings):
    """Bench chaos (kind ``edge``, 4 sessions): the edge died before this player saw its
    turn start, so the player has no ``resume`` to send; the turn's audio was published while no
    edge ran. A starting edge serves such a player from the partition too, re-read (it took the
    partition just now): the whole turn, nothing lost."""
    settings = make_settings(edge_secret=SECRET, edge_resume_lookback_s=30.0)
    turn = tone_turn("S", "t1", 2, 2)  # sentences 0, 1 of two chunks each
    producer, codec = make_producer(settings), Codec()
    await producer.start()
    try:
        from voicebus.bus import ensure_topics

        await ensure_topics(settings, [settings.control_topic, settings.audio_topic])
        for chunk in turn[:3]:  # published while no edge ran
            await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        async with running_edge(settings) as (app, client):
            ws, ready = await connect(client, "S")
            assert ready["type"] == "ready"
            await publish(producer, codec, settings.audio_topic, "AudioChunk", turn[3])  # live
            got = await collect(ws, turn_ended, timeout=15)
    finally:
        await producer.stop()
    assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t1"]
    assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


async def test_a_player_back_between_turns_on_a_restarted_edge_gets_the_turn_spoken_while_none_ran(make_settings):
    """Bench chaos (kind ``edge``, 3 sessions): the player had heard turn t1 to its end when
    its edge died; turn t2 was spoken and ended while no edge ran. The player comes back with
    ``resume {t1, finished}`` and hears t2 whole (and nothing of t1 again): without it, an ended
    turn is not sent to a player, and t2 was lost."""
    from voicebus.bus import ensure_topics

    settings = make_settings(edge_secret=SECRET, edge_resume_lookback_s=30.0)
    await ensure_topics(settings, [settings.control_topic, settings.audio_topic])
    # t1 heard through the edge that died; t2 published whole while no edge ran
    await publish_audio(settings, tone_turn("S", "t1", 1, 2) + tone_turn("S", "t2", 2, 1))
    async with running_edge(settings) as (app, client):
        ws, ready = await connect(client, "S", resume={"turn_id": "t1", "sentence_seq": 1, "finished": True})
        assert ready["type"] == "ready"
        got = await collect(ws, turn_ended, timeout=15)
    assert [m["turn_id"] for m in of_type(got, "turn_start")] == ["t2"]
    assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (1, 0)]


@pytest.mark.timeout(300)
async def test_an_edge_whose_broker_is_gone_still_stops(kafka_jars, tmp_path, tmp_path_factory):
    """bench chaos left an orphaned edge: SIGTERMed when its broker had died too, it kept retrying
    its directory tombstone for minutes. Each Kafka farewell of a stopping edge is now bounded
    (`voicebus.bus.farewell`): the edge stops, saying what it could not do."""
    import shutil

    from voicebus.ops.broker import QUICK_START_JVM_OPTIONS
    from voicebus.ops.cluster import LocalCluster
    from voicebus.bus import FAREWELL_TIMEOUT_S, ensure_topics
    from tests.conftest import _settings_factory, distinct_free_ports

    port, controller_port = distinct_free_ports(2)
    cluster = LocalCluster(tmp_path / "kafka", kafka_jars, ports=[(port, controller_port)],
                           jvm_options=QUICK_START_JVM_OPTIONS, die_with_parent=True)
    cluster.start(180)
    try:
        settings = _settings_factory(cluster.bootstrap, port, controller_port, tmp_path_factory)(edge_secret=SECRET)
        await ensure_topics(settings, [settings.control_topic, settings.audio_topic, settings.edges_topic])
        async with asyncio.timeout(60 + 6 * FAREWELL_TIMEOUT_S):  # minutes before the fix
            async with running_edge(settings) as (app, client):
                await eventually(lambda: app[LINK_KEY] is not None and app[LINK_KEY].ready.is_set(), what="the edge ready")
                await asyncio.to_thread(cluster.kill, 1)
    finally:
        cluster.stop()
        shutil.rmtree(tmp_path / "kafka", ignore_errors=True)
