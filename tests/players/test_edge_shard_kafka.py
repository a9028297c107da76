"""Sharded edges on the real broker: each edge reads only the audio partitions it owns, a player
that reaches the wrong edge is redirected to the owner and hears its turn, and a rebalance (an
edge joins, an edge leaves) tells the players of moved sessions to reconnect, where `resume`
replays from the sentence being played (the new owner re-reads it from the partition)."""

import json

import pytest
from aiohttp import WSMsgType

from voicebus.bus import ensure_topics, make_producer, publish
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.topics import partition_of
from voicebus.players import protocol
from voicebus.players.auth import issue_token
from voicebus.players.edge import LINK_KEY, ROUTER_KEY
from voicebus.players.listener import Listener
from voicebus.players.tone import tone_turn
from tests.players.edge_helpers import SECRET, audio, collect, of_type, publish_audio, turn_ended
from tests.players.shard_helpers import free_ports, inprocess_edge, session_on, wait_settled
from tests.waiting import eventually

pytestmark = pytest.mark.kafka

PARTITIONS = 4


async def _hello(client_or_http, url: str, session: str, resume: dict | None = None):
    """Open `url`, say hello; returns (ws, first reply)."""
    ws = await client_or_http.ws_connect(url)
    hello = {"type": "hello", "v": 1, "session": session, "token": issue_token(SECRET, session, 60)}
    if resume:
        hello["resume"] = resume
    await ws.send_str(json.dumps(hello))
    msg = await ws.receive(timeout=10)
    return ws, (json.loads(msg.data) if msg.type == WSMsgType.TEXT else msg)


async def test_a_player_on_the_wrong_edge_is_redirected_to_the_owner_and_hears_its_turn(make_settings):
    settings = make_settings(edge_secret=SECRET, partitions=PARTITIONS, edge_session_timeout_ms=6000)
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic])
    port_a, port_b = free_ports(2)
    async with inprocess_edge(settings, port_a, "edge-a") as (app_a, client_a), \
            inprocess_edge(settings, port_b, "edge-b") as (app_b, client_b):
        await wait_settled([app_a, app_b], PARTITIONS)
        link_a, link_b = app_a[LINK_KEY], app_b[LINK_KEY]
        assert link_a.owned and link_b.owned and not link_a.owned & link_b.owned
        session = session_on(PARTITIONS, link_b.owned)
        other = session_on(PARTITIONS, link_a.owned, prefix="T")
        async with Listener(f"http://127.0.0.1:{port_a}", session, SECRET) as listener:
            assert listener.redirects == [f"ws://127.0.0.1:{port_b}/ws"]  # A sent it to B, the owner
            assert listener.ready["edge"] == "edge-b"
            assert sorted(listener.ready["edges"]) == sorted([f"ws://127.0.0.1:{p}/ws" for p in (port_a, port_b)])
            await publish_audio(settings, tone_turn(session, "t1", 2, 3) + tone_turn(other, "t2", 2, 3))
            heard = await listener.wait_turn_end("t1", timeout=20)
            assert [(s, c) for _, s, c, _ in heard.frames] == [(s, c) for s in range(2) for c in range(3)]
            # control still reaches every edge: an agent's cancel stops the turn at the owner, and
            # the other edge (which follows every control partition too) has applied it as well
            await publish_audio(settings, tone_turn(session, "t3", 2, 3)[:2])
            await listener.wait_first_audio("t3", timeout=20)
            producer, codec = make_producer(settings), Codec()
            await producer.start()
            try:
                await publish(producer, codec, settings.control_topic, "ControlEvent", {
                    "session_id": session, "turn_id": "t3", "action": "CANCEL", "reason": "agent", "source": "agent",
                    "issued_at_us": now_us()})
            finally:
                await producer.stop()
            assert (await listener.wait_turn_end("t3", timeout=20)).stopped
            await eventually(lambda: app_a[ROUTER_KEY].cancels.is_cancelled(session, "t3"), timeout_s=10,
                             what="the other edge applied the cancel")
        metrics_a = await (await client_a.get("/metrics")).text()
        assert "voicebus_edge_redirects_total 1.0" in metrics_a
        # each edge fetched its own partitions only: A read the other session's turn, B this one's
        bytes_a = app_a[LINK_KEY].metrics.consumed_bytes._value.get()
        bytes_b = app_b[LINK_KEY].metrics.consumed_bytes._value.get()
        assert bytes_a > 0 and bytes_b > 0
        chunk_bytes = len(Codec().encode("AudioChunk", tone_turn(session, "t1", 2, 3)[0], settings.audio_topic))
        assert bytes_a < 7 * chunk_bytes and bytes_b < 9 * chunk_bytes  # 6 (+ 2 of t3) chunks each, not 14
        health = await (await client_b.get("/healthz")).json()
        assert health["shard"]["edge_id"] == "edge-b" and health["shard"]["owned"] == sorted(link_b.owned)


async def test_an_edge_joining_moves_sessions_whose_players_reconnect_and_resume_at_the_sentence(make_settings):
    settings = make_settings(edge_secret=SECRET, partitions=PARTITIONS, edge_session_timeout_ms=6000)
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic])
    port_a, port_b = free_ports(2)
    sessions = [session_on(PARTITIONS, {p}, prefix=f"P{p}-") for p in range(PARTITIONS)]
    async with inprocess_edge(settings, port_a, "edge-a") as (app_a, client_a):
        await wait_settled([app_a], PARTITIONS)
        sockets = {}
        for sid in sessions:
            ws, ready = await _hello(client_a, "/ws", sid)
            assert ready["type"] == "ready", ready
            sockets[sid] = ws
        # sentences 0 and 1 of each session's turn; sentence 2 (the last) comes after the move
        await publish_audio(settings, [c for sid in sessions for c in tone_turn(sid, f"turn-{sid}", 3, 2)[:4]])
        for sid, ws in sockets.items():
            got = await collect(ws, lambda m: len(audio(m)) == 4, timeout=20)
            assert [(f.sentence, f.chunk) for f in audio(got)] == [(0, 0), (0, 1), (1, 0), (1, 1)]

        async with inprocess_edge(settings, port_b, "edge-b") as (app_b, client_b):
            await wait_settled([app_a, app_b], PARTITIONS)
            moved = app_b[LINK_KEY].owned
            assert moved and len(moved) < PARTITIONS
            for sid, ws in sockets.items():
                if partition_of(sid, PARTITIONS) in moved:
                    got = await collect(ws, lambda m: m and not isinstance(m[-1], dict), timeout=20)
                    assert got[0] == {"type": "reconnect", "v": 1, "reason": "moved"}, got
                    assert got[-1].type == WSMsgType.CLOSE and got[-1].data == protocol.CLOSE_SERVICE_RESTART
                else:
                    assert not ws.closed  # a session that stayed keeps its connection
            metrics_a = await (await client_a.get("/metrics")).text()
            assert f"voicebus_edge_moved_clients_total {float(len(moved))}" in metrics_a

            resumed = {}
            for sid in sessions:
                if partition_of(sid, PARTITIONS) not in moved:
                    continue
                # the player was playing sentence 1: it reconnects where it was (A), which redirects it
                resume = {"turn_id": f"turn-{sid}", "sentence_seq": 1}
                ws, reply = await _hello(client_a, "/ws", sid, resume)
                assert reply["type"] == "redirect" and reply["url"] == f"ws://127.0.0.1:{port_b}/ws", reply
                ws, ready = await _hello(client_b, "/ws", sid, resume)
                assert ready["type"] == "ready" and ready["edge"] == "edge-b", ready
                resumed[sid] = ws
            await publish_audio(settings, [c for sid in resumed for c in tone_turn(sid, f"turn-{sid}", 3, 2)[4:]])
            for sid, ws in resumed.items():
                got = await collect(ws, turn_ended, timeout=20)
                # B re-read the partition: the turn again from the start of sentence 1, then the rest live
                assert [(f.sentence, f.chunk) for f in audio(got)] == [(1, 0), (1, 1), (2, 0), (2, 1)], sid
                assert of_type(got, "turn_start")[0]["turn_id"] == f"turn-{sid}"
            backfilled = app_b[LINK_KEY].metrics.backfill_bytes._value.get()
            assert backfilled > 0
            for ws in list(sockets.values()) + list(resumed.values()):
                await ws.close()


async def test_when_an_edge_leaves_its_sessions_move_and_a_resume_on_the_survivor_replays(make_settings):
    settings = make_settings(edge_secret=SECRET, partitions=PARTITIONS, edge_session_timeout_ms=6000)
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic])
    port_a, port_b = free_ports(2)
    async with inprocess_edge(settings, port_a, "edge-a") as (app_a, client_a):
        async with inprocess_edge(settings, port_b, "edge-b") as (app_b, client_b):
            await wait_settled([app_a, app_b], PARTITIONS)
            session = session_on(PARTITIONS, app_b[LINK_KEY].owned)
            ws, ready = await _hello(client_b, "/ws", session)
            assert ready["type"] == "ready"
            await publish_audio(settings, tone_turn(session, "t1", 3, 2)[:4])
            got = await collect(ws, lambda m: len(audio(m)) == 4, timeout=20)
        # B stopped (its players got 1001 going away): A takes B's partitions at once (B left the group)
        await wait_settled([app_a], PARTITIONS)
        assert (await ws.receive(timeout=5)).type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
        ws, ready = await _hello(client_a, "/ws", session, {"turn_id": "t1", "sentence_seq": 1})
        assert ready["type"] == "ready" and ready["edge"] == "edge-a", ready
        await publish_audio(settings, tone_turn(session, "t1", 3, 2)[4:])
        got = await collect(ws, turn_ended, timeout=20)
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(1, 0), (1, 1), (2, 0), (2, 1)]
        await ws.close()


async def test_a_forged_directory_record_is_dead_lettered_and_never_followed(make_settings):
    """Whoever may write the edges topic names an attacker's URL as the owner of every partition:
    the edges refuse the unsigned claim (dead-lettered with its reason, counted), so no player is
    redirected there and `ready.edges` never lists it."""
    from voicebus.bus import read_to_end
    from voicebus.players.shard import DIRECTORY_PARTITION, directory_record
    from voicebus.topics import edge_group_id

    settings = make_settings(edge_secret=SECRET, partitions=PARTITIONS, edge_session_timeout_ms=6000)
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic])
    port_a, port_b = free_ports(2)
    async with inprocess_edge(settings, port_a, "edge-a") as (app_a, client_a), \
            inprocess_edge(settings, port_b, "edge-b") as (app_b, client_b):
        await wait_settled([app_a, app_b], PARTITIONS)
        key, value = directory_record(edge_group_id(settings), "evil", "ws://attacker.example:9/ws", set(range(PARTITIONS)))
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(settings.edges_topic, value, key=key, partition=DIRECTORY_PARTITION)
        finally:
            await producer.stop()

        async def dead_lettered():
            records = await read_to_end(settings, [settings.deadletter_topic])
            found = [dict(r.headers) for r in records if r.key == key]
            return found if len(found) >= 2 else None

        letters = await eventually(dead_lettered, timeout_s=20, what="both edges dead-lettered the forged claim")
        assert {h["voicebus.error.reason"] for h in letters} == {b"forged-directory-record"}
        assert {h["voicebus.error.stage"] for h in letters} == {b"edge"}
        session = session_on(PARTITIONS, app_b[LINK_KEY].owned)
        async with Listener(f"http://127.0.0.1:{port_a}", session, SECRET) as listener:
            assert listener.redirects == [f"ws://127.0.0.1:{port_b}/ws"]
            assert "attacker" not in json.dumps(listener.ready)
        metrics_a = await (await client_a.get("/metrics")).text()
        assert 'voicebus_records_dead_lettered_total{reason="forged-directory-record",stage="edge"} 1.0' in metrics_a
