"""The edge over real WebSockets (aiohttp's test server and client), fed through its router."""

import asyncio
import json
import time
import tracemalloc
from dataclasses import replace

import pytest
from aiohttp import WSMsgType

from voicebus.players import protocol
from voicebus.players.auth import issue_token
from voicebus.players.edge import CLIENTS_KEY, REPORTS_KEY, ROUTER_KEY, WEB_DIR
from voicebus.players.tone import tone_turn
from tests.players.edge_helpers import (
    SECRET, audio, collect, connect, edge_settings, of_type, running_edge, turn_ended,
)
from tests.waiting import eventually


async def test_each_client_gets_only_its_sessions_audio():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        sessions = ["alice", "bob", "carol"]
        sockets = {s: [(await connect(client, s))[0] for _ in range(2)] for s in sessions}
        for i, s in enumerate(sessions):
            for chunk in tone_turn(s, f"{s}-t1", sentences=2, chunks_per_sentence=3, freq_hz=200 + 100 * i):
                router.route(chunk)
        for i, s in enumerate(sessions):
            expected = [c.pcm for c in tone_turn(s, "x", 2, 3, freq_hz=200 + 100 * i)]
            for ws in sockets[s]:
                got = await collect(ws, turn_ended)
                assert [m["turn_id"] for m in of_type(got, "turn_start")] == [f"{s}-t1"]
                frames = audio(got)
                assert [(f.sentence, f.chunk) for f in frames] == [(a, b) for a in range(2) for b in range(3)]
                assert [f.pcm for f in frames] == expected  # this session's tone, nobody else's
                assert frames[-1].last_in_turn and frames[2].last_in_sentence
                assert len(of_type(got, "timeline")) == 2  # one per sentence, with sent_at_us
                assert all(t["sent_at_us"] >= t["edge_received_at_us"] for t in of_type(got, "timeline"))
                await ws.close()


@pytest.mark.parametrize("token_for, expected_code", [
    (lambda: issue_token("not-the-secret", "s1", 60), "bad-signature"),
    (lambda: issue_token(SECRET, "s1", 60, now_s=time.time() - 120), "expired-token"),
    (lambda: issue_token(SECRET, "someone-else", 60), "wrong-session"),
    (lambda: "garbage", "malformed-token"),
])
async def test_bad_tokens_get_an_error_a_close_and_no_audio(token_for, expected_code):
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        good, _ = await connect(client, "s1")
        bad, error = await connect(client, "s1", token=token_for())
        assert error == {"type": "error", "v": 1, "code": expected_code, "message": error["message"]}
        for chunk in tone_turn("s1", "t1", 1, 2):
            app[ROUTER_KEY].route(chunk)
        rest = await collect(bad, lambda m: False)
        assert rest[-1].type == WSMsgType.CLOSE and bad.close_code == protocol.CLOSE_UNAUTHORIZED
        assert not audio(rest)
        assert len(audio(await collect(good, turn_ended))) == 2


async def test_malformed_frames_close_only_the_sender_with_a_clear_error():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        other, _ = await connect(client, "s2")
        same, _ = await connect(client, "s1")
        cases = [("not json at all", "malformed-frame"), ('{"type":"teleport","v":1}', "unknown-message-type"),
                 ('{"type":"ping","v":9,"t0":1}', "unsupported-version"), (b"\x01\x02\x03", "malformed-frame")]
        for payload, code in cases:
            ws, _ = await connect(client, "s1")
            await (ws.send_bytes(payload) if isinstance(payload, bytes) else ws.send_str(payload))
            got = await collect(ws, lambda m: False)
            assert of_type(got, "error")[0]["code"] == code
            assert ws.close_code in (protocol.CLOSE_PROTOCOL_ERROR, protocol.CLOSE_UNSUPPORTED_VERSION)
        no_hello = await client.ws_connect("/ws")
        await no_hello.send_str('{"type":"cancel","v":1}')
        assert of_type(await collect(no_hello, lambda m: False), "error")[0]["message"].startswith("the first message must be hello")
        assert no_hello.close_code == protocol.CLOSE_PROTOCOL_ERROR
        router = app[ROUTER_KEY]
        for s in ("s1", "s2"):
            for chunk in tone_turn(s, "t1", 1, 2):
                router.route(chunk)
        assert len(audio(await collect(same, turn_ended))) == 2
        assert len(audio(await collect(other, turn_ended))) == 2


async def test_client_cancel_stops_playback_and_drops_later_chunks():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        ws, _ = await connect(client, "s1")
        listener, _ = await connect(client, "s1")
        chunks = tone_turn("s1", "t1", sentences=3, chunks_per_sentence=2)
        router.route(chunks[0])
        assert len(audio(await collect(ws, lambda m: audio(m)))) == 1
        await ws.send_str(json.dumps({"type": "cancel", "v": 1, "turn_id": "t1"}))
        for target in (ws, listener):
            got = await collect(target, lambda m: of_type(m, "stop"))
            assert of_type(got, "stop")[0]["turn_id"] == "t1"
        assert all(router.route(c) == 0 for c in chunks[1:])  # later chunks of the turn: dropped
        for chunk in tone_turn("s1", "t2", 1, 1):
            router.route(chunk)
        after = await collect(ws, turn_ended)
        assert [f.turn for f in audio(after)] == [2]  # only the next turn's audio
        assert of_type(after, "turn_start")[0]["turn_id"] == "t2"


async def test_cancel_drops_audio_already_queued_for_a_client():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        channel = router.connect("s1")  # a client whose sender has not run yet: its audio waits
        for chunk in tone_turn("s1", "t1", sentences=2, chunks_per_sentence=4):
            router.route(chunk)
        assert sum(f.is_audio for f in channel.outbox) == 8
        assert router.cancel("s1", "t1") == 8
        assert not any(f.is_audio for f in channel.outbox)
        assert json.loads(channel.outbox[0].payload)["type"] == "stop"  # control overtakes data


async def test_reconnect_mid_turn_resumes_from_the_sentence_being_played():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        chunks = tone_turn("s1", "t1", sentences=3, chunks_per_sentence=2)
        ws, _ = await connect(client, "s1")
        for chunk in chunks[:4]:
            router.route(chunk)
        got = await collect(ws, lambda m: len(audio(m)) == 4)
        await ws.close()  # dropped while playing sentence 1
        resumed, _ = await connect(client, "s1", resume={"turn_id": "t1", "sentence_seq": 1})
        fresh, _ = await connect(client, "s1")
        for chunk in chunks[4:]:
            router.route(chunk)
        got = await collect(resumed, turn_ended)
        assert of_type(got, "turn_start")[0]["turn_id"] == "t1"
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(1, 0), (1, 1), (2, 0), (2, 1)]
        got = await collect(fresh, turn_ended)  # no resume point: the whole buffered turn
        assert [(f.sentence, f.chunk) for f in audio(got)] == [(s, c) for s in range(3) for c in range(2)]
        assert not router.connect("s1").outbox  # the turn has ended: a newcomer gets nothing of it


async def test_ping_pong_and_playback_reports_are_recorded():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        ws, ready = await connect(client, "s1")
        assert ready["type"] == "ready" and ready["session"] == "s1"
        await ws.send_str(json.dumps({"type": "ping", "v": 1, "t0": 12.5}))
        pong = of_type(await collect(ws, lambda m: of_type(m, "pong")), "pong")[0]
        assert pong["t0"] == 12.5 and pong["server_time_us"] > 0
        for chunk in tone_turn("s1", "t1", 1, 1):
            app[ROUTER_KEY].route(chunk)
        await ws.send_str(json.dumps({"type": "report", "v": 1, "kind": "AUDIBLE_START", "turn_id": "t1",
                                      "sentence_seq": 0, "audible_at_us": int(time.time() * 1e6)}))
        await eventually(lambda: app[REPORTS_KEY], timeout_s=5, interval_s=0.01, what="the report reached the edge")
        report = app[REPORTS_KEY][-1]
        assert report.kind == "AUDIBLE_START" and report.client_id == ready["client_id"]
        metrics = (await (await client.get("/metrics")).text())
        assert 'voicebus_stage_latency_seconds_count{stage="first_token_to_audible"} 1.0' in metrics
        assert "voicebus_edge_clients 1.0" in metrics
        assert 'voicebus_stage_latency_seconds_count{stage="synthesis"} 1.0' in metrics
        health = await client.get("/healthz")
        assert health.status == 200 and (await health.json())["kafka"] == "disabled"
        page = await client.get("/")
        assert page.status == 200 and "voicebus player" in await page.text()
        assert (await client.get("/web/worklet.js")).status == 200


async def test_stuck_client_memory_stays_flat_and_it_is_disconnected():
    settings = edge_settings(client_queue_frames=32)
    async with running_edge(settings, with_kafka=False, stall_timeout_s=1.0) as (app, client):
        router = app[ROUTER_KEY]
        stuck, _ = await connect(client, "s1")  # never reads again
        healthy, _ = await connect(client, "s1")
        received = 0

        async def drain():
            nonlocal received
            async for msg in healthy:
                received += msg.type == WSMsgType.BINARY

        reader = asyncio.create_task(drain())
        channel_of_stuck = router.clients_of("s1")[0]
        template = tone_turn("s1", "t", sentences=10, chunks_per_sentence=5)
        tracemalloc.start()
        depth, sizes, routed = 0, [], 0
        for turn in range(40):  # up to 40 turns x 10 sentences x 5 chunks of 150 ms = 300 s of audio
            for chunk in template:
                router.route(replace(chunk, turn_id=f"t{turn}"))
                routed += 1
                depth = max(depth, len(channel_of_stuck.outbox))
                if chunk.is_last_chunk:
                    await asyncio.sleep(0.002)  # a sentence at a time: the healthy listener keeps up
            sizes.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        assert depth <= 32  # bounded queue
        growth_after_warmup = max(sizes[3:]) - sizes[3]
        assert growth_after_warmup < 1024 * 1024, sizes  # flat, while 14 MB of audio went by
        assert router.metrics.drops.labels("slow-client")._value.get() > 0
        assert channel_of_stuck.closed and channel_of_stuck.closed.code == protocol.CLOSE_TOO_SLOW
        await eventually(lambda: len(app[CLIENTS_KEY]) <= 1, timeout_s=10,
                         what="the stuck socket closed (or aborted) by the edge")
        await eventually(lambda: received >= routed, timeout_s=10,
                         what="the session's other listener got everything")
        reader.cancel()


async def test_a_client_that_never_says_hello_is_closed_with_4408():
    async with running_edge(edge_settings(), with_kafka=False, hello_timeout_s=0.2) as (app, client):
        ws = await client.ws_connect("/ws")
        got = await collect(ws, lambda m: False)
        assert of_type(got, "error")[0]["message"] == "no hello within 0.2 s"
        assert ws.close_code == protocol.CLOSE_HELLO_TIMEOUT


async def test_a_full_outbox_skips_the_oldest_sentence_whole_and_tells_the_player():
    async with running_edge(edge_settings(client_queue_frames=8), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        channel = router.connect("s1")  # its sender is not draining: a client that fell behind
        chunks = tone_turn("s1", "t1", sentences=3, chunks_per_sentence=4)
        for chunk in chunks[:9]:  # turn_start + 8 frames would not fit: sentence 0 goes
            router.route(chunk)
        queued = [(f.sentence, json.loads(f.payload)["type"] if not f.is_audio else "audio") for f in channel.outbox]
        assert (-1, "skip") in queued
        assert all(s != 0 for s, kind in queued if kind == "audio")  # no frame of sentence 0 is left
        skip = next(json.loads(f.payload) for f in channel.outbox if not f.is_audio and "skip" in f.payload)
        assert skip == {"type": "skip", "v": 1, "turn_id": "t1", "sentence_seq": 0}
        assert len(channel.outbox) <= 8
        router.route(chunks[9])  # sentence 2 is not affected
        assert channel.outbox[-1].sentence == 2


async def test_a_cancel_flood_is_rate_limited_per_client_and_the_connection_stays_up():
    # A listen-only client sends unlimited cancels with arbitrary turn ids: past its bucket each
    # is refused with a reason it sees, counted, and neither applied nor published.
    settings = edge_settings(edge_cancel_burst=3, edge_cancel_rate_per_s=0.001)
    async with running_edge(settings, with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        ws, _ = await connect(client, "s1")
        for i in range(200):
            await ws.send_str(json.dumps({"type": "cancel", "v": 1, "turn_id": f"made-up-{i}"}))
        await ws.send_str(json.dumps({"type": "ping", "v": 1, "t0": 1}))
        got = await collect(ws, lambda m: of_type(m, "pong") and len(of_type(m, "error")) >= 197)
        refused = of_type(got, "error")
        assert len(refused) == 197 and {e["code"] for e in refused} == {"rate-limited"}
        assert router.metrics.registry.get_sample_value(
            "voicebus_edge_refused_total", {"reason": "cancel-rate-limited"}) == 197
        assert router.metrics.registry.get_sample_value("voicebus_edge_cancels_total", {"source": "edge"}) == 3
        other, _ = await connect(client, "s1")  # another client has its own bucket
        await other.send_str(json.dumps({"type": "cancel", "v": 1, "turn_id": "t9"}))
        await other.send_str(json.dumps({"type": "ping", "v": 1, "t0": 2}))
        assert not of_type(await collect(other, lambda m: of_type(m, "pong")), "error")


@pytest.mark.parametrize("settings, sessions, refused_code", [
    (dict(edge_max_clients_per_session=2), ["a", "a", "a"], "session-full"),
    (dict(edge_max_clients=2), ["a", "b", "c"], "edge-full"),
])
async def test_connections_past_a_limit_are_closed_with_1013_and_a_reason(settings, sessions, refused_code):
    async with running_edge(edge_settings(**settings), with_kafka=False) as (app, client):
        first = [await connect(client, s) for s in sessions[:-1]]
        assert all(ready["type"] == "ready" for _, ready in first)
        ws, error = await connect(client, sessions[-1])
        assert error["type"] == "error" and error["code"] == refused_code
        await collect(ws, lambda m: False)
        assert ws.close_code == protocol.CLOSE_TRY_AGAIN_LATER
        await first[0][0].close()  # a place becomes free
        await eventually(lambda: app[ROUTER_KEY].n_clients < len(sessions) - 1, timeout_s=5, what="the client left")
        _, ready = await connect(client, sessions[-1])
        assert ready["type"] == "ready"


async def test_a_resume_with_a_negative_sentence_is_refused_with_4400_out_of_range():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        ws, error = await connect(client, "s1", resume={"turn_id": "t1", "sentence_seq": -1})
        assert error["type"] == "error" and error["code"] == "out-of-range"
        await collect(ws, lambda m: False)
        assert ws.close_code == protocol.CLOSE_PROTOCOL_ERROR


async def test_a_barge_in_does_not_cancel_a_new_turn_whose_agent_clock_is_behind_the_edge_s():
    # The edge's clock is an hour ahead of the agent's: the next turn's first token "happened"
    # before the barge-in by the edge's clock. Cancels name turns; no clock is compared.
    from voicebus.clock import now_us

    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        ws, _ = await connect(client, "s1")
        router.route(tone_turn("s1", "t1", 2, 1)[0])
        await collect(ws, lambda m: audio(m))
        await ws.send_str(json.dumps({"type": "cancel", "v": 1, "reason": "barge-in"}))
        assert of_type(await collect(ws, lambda m: of_type(m, "stop")), "stop")[0]["turn_id"] == "t1"
        for chunk in tone_turn("s1", "t2", 1, 2):
            router.route(replace(chunk, first_token_at_us=now_us() - 3600 * 1_000_000))
        got = await collect(ws, turn_ended)
        assert of_type(got, "turn_start")[0]["turn_id"] == "t2" and len(audio(got)) == 2


async def test_sockets_that_never_say_hello_count_against_the_connection_limit():
    """Before: only players past their hello were counted; any number of silent sockets could be
    held open (each for the hello timeout), beside a full edge."""
    async with running_edge(edge_settings(edge_max_clients=2), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        silent = [await client.ws_connect("/ws") for _ in range(2)]
        await eventually(lambda: router.awaiting_hello == 2, timeout_s=5, what="two sockets waiting for hello")
        ws, error = await connect(client, "a")
        assert error["type"] == "error" and error["code"] == "edge-full"
        await collect(ws, lambda m: False)
        assert ws.close_code == protocol.CLOSE_TRY_AGAIN_LATER
        await silent[0].close()
        await eventually(lambda: router.awaiting_hello == 1, timeout_s=5, what="the silent socket left")
        _, ready = await connect(client, "a")
        assert ready["type"] == "ready" and router.n_clients == 1 and router.awaiting_hello == 1
        await silent[1].close()


async def test_reports_and_pings_past_their_rate_are_refused_and_counted():
    """Before: a client could send reports (each published on the bus) and pings without limit."""
    async with running_edge(edge_settings(edge_message_burst=5, edge_message_rate_per_s=0.001),
                            with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        ws, _ = await connect(client, "s1")
        for i in range(10):
            await ws.send_str(json.dumps({"type": "ping", "v": 1, "t0": i}))
        got = await collect(ws, lambda m: len(of_type(m, "pong")) + len(of_type(m, "error")) >= 10)
        assert len(of_type(got, "pong")) == 5
        assert {e["code"] for e in of_type(got, "error")} == {"rate-limited"} and len(of_type(got, "error")) == 5
        assert router.metrics.registry.get_sample_value("voicebus_edge_refused_total", {"reason": "ping-rate-limited"}) == 5
        other, _ = await connect(client, "s1")  # another connection has its own bucket
        await other.send_str(json.dumps({"type": "ping", "v": 1, "t0": 1}))
        assert of_type(await collect(other, lambda m: of_type(m, "pong")), "pong")


async def test_the_player_s_files_are_served_and_its_package_s_dev_tools_are_not():
    async with running_edge(edge_settings(), with_kafka=False) as (_, client):
        assert (await client.get("/web/index.js")).status == 200
        # a checkout's players/web/node_modules (the package's type checker, `make player-deps`)
        assert (WEB_DIR / "node_modules" / ".package-lock.json").exists(), "make player-deps installs it"
        assert (await client.get("/web/node_modules/.package-lock.json")).status == 404
        assert (await client.get("/web/node_modules/typescript/package.json")).status == 404


async def test_the_players_of_a_session_get_each_chunk_written_at_once_in_order():
    # Players that keep up get a chunk's frames written straight to their sockets by the fan-out
    # (no outbox, no sender wake-up), and hear exactly what the sender would have sent them.
    async with running_edge(edge_settings(edge_max_clients_per_session=20), with_kafka=False) as (app, client):
        router = app[ROUTER_KEY]
        sockets = [(await connect(client, "s1"))[0] for _ in range(20)]
        queued = []
        for channel in router.clients_of("s1"):
            enqueue = channel._enqueue
            channel._enqueue = lambda frame, front=False, enqueue=enqueue: (queued.append(frame), enqueue(frame, front))
        turn = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=3)
        for chunk in turn:
            router.route(chunk)
            await asyncio.sleep(0.01)  # the chunk period: each socket has taken the previous write
        for ws in sockets:
            got = await collect(ws, turn_ended)
            kinds = [m["type"] if isinstance(m, dict) else "audio" for m in got]
            assert kinds == ["turn_start", "audio", "timeline", "audio", "audio",
                             "audio", "timeline", "audio", "audio", "turn_end"]
            assert [f.pcm for f in audio(got)] == [c.pcm for c in turn]
        assert not [f for f in queued if f.is_audio]
        assert router.metrics.registry.get_sample_value("voicebus_edge_frames_sent_total") == 20 * 6
