"""`voicebus bench scale`: what each edge reads, builds and holds as edges and sessions grow.

Tone audio (no model) through the real broker: for each encoding (PCM16, Opus) x edges x
sessions, N edge processes (the real `voicebus.players.edge` app with its Kafka link, each in its own
process as deployed, one consumer group sharing the audio topic's partitions) and one process of
WebSocket players, one player per session. Player i first reaches edge i % N (what a round-robin
load balancer does); an edge that does not own the session redirects it to the owner. This process
waits until the edges agree who owns which partition, publishes every session's turn in real time
(one chunk per session every chunk period, as many workers would), waits until the players got
every frame, then asks each edge for:

- ``bytes_per_edge``: bytes of audio records the edge fetched (``voicebus_edge_consumed_bytes_total``):
  with sharding, the partitions it owns only (``bytes_max_over_mean``: the fullest edge's share);
- ``frames_per_edge``: audio frames it built and sent (its own sessions);
- ``sessions_held_per_edge``: sessions it keeps any state for (``voicebus_edge_sessions``);
- ``rss_mb_per_edge``: the edge process's peak resident memory (``ru_maxrss``);
- ``peak_queued_frames_by_edge``, ``peak_replay_mb_by_edge``: the most frames waiting in its
  players' outboxes at once (a player process that cannot keep up fills them, each bounded) and
  the most bytes in its replay buffers (sampled every 50 ms);
- ``frame_p50_ms`` / ``frame_p99_ms``: chunk consumed -> frame sent, over every frame of every edge;
- ``bus_bytes_per_session_s``: what one speaking session puts on the audio topic per second;
- ``publisher_behind_ms``: how far this process fell behind publishing in real time (above a
  chunk period the machine, not the edge, is the limit: the grid stops there).

The broker: the one at ``VOICEBUS_BOOTSTRAP`` when it answers, else a throwaway one started for
the run and stopped after it; given ``--bootstrap``, that one and none started (`bench_kafka`).

The topics of a run have ``--partitions`` partitions (default 12: an even share for 1, 2, 3, 4 and
6 edges; a session's partition is the hash of its id, so shares are even only on average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import resource
import statistics
import time
import uuid

from voicebus.cli import add_json_argument, write_json
from voicebus.latency import percentile
from voicebus.logs import configure_logging
from voicebus.ops.bench.cli import add_stage_log_level, bench_kafka

CHUNK_MS = 160  # whole 20 ms Opus frames; PCM uses the same, so the two grids match chunk for chunk
QUICK = {"edges": [1, 2], "sessions": [10]}
PARTITIONS = 12


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "scale", help="bytes, frames, memory and frame latency per edge for edges x sessions, PCM16 and Opus")
    p.add_argument("--edges", default="1,2,4", help="comma-separated edge counts (default 1,2,4)")
    p.add_argument("--sessions", default="100,1000", help="comma-separated session counts (default 100,1000)")
    p.add_argument("--encodings", default="pcm16,opus", help="comma-separated: pcm16, opus (default both)")
    p.add_argument("--seconds", type=float, default=3.0, help="audio each session speaks per run (default 3)")
    p.add_argument("--partitions", type=int, default=PARTITIONS,
                   help=f"partitions of the run's topics, shared by the edges (default {PARTITIONS})")
    p.add_argument("--quick", action="store_true", help=f"the smallest grid: edges {QUICK['edges']}, "
                                                         f"sessions {QUICK['sessions']}, 2 s")
    add_json_argument(p, "the runs")
    add_stage_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings) -> int:
    configure_logging(getattr(args, "log_level", None))
    with bench_kafka(args, settings) as live:
        return _run(args, live)


def _run(args: argparse.Namespace, settings) -> int:
    edges = QUICK["edges"] if args.quick else [int(n) for n in args.edges.split(",") if n.strip()]
    sessions = QUICK["sessions"] if args.quick else [int(n) for n in args.sessions.split(",") if n.strip()]
    seconds = 2.0 if args.quick else args.seconds
    encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    log_level = getattr(args, "log_level", None)
    runs = []
    print(f"bench scale: {seconds:g} s of tone per session, {CHUNK_MS} ms chunks, broker {settings.bootstrap}")
    print(f"{'encoding':>8} {'edges':>5} {'sessions':>8} {'bus KB/s/session':>16} {'MB/edge':>8} {'max/mean':>8} "
          f"{'frames/edge':>11} {'RSS MB/edge':>11} {'p50 ms':>7} {'p99 ms':>7} {'complete':>8} {'behind ms':>9}")
    for encoding in encodings:
        for n_sessions in sessions:
            for n_edges in edges:
                r = asyncio.run(_one(settings.replace(partitions=getattr(args, "partitions", PARTITIONS)),
                                     encoding, n_edges, n_sessions, seconds, log_level))
                runs.append(r)
                print(f"{encoding:>8} {n_edges:>5} {n_sessions:>8} {r['bus_bytes_per_session_s'] / 1e3:>16.2f} "
                      f"{r['bytes_per_edge'] / 1e6:>8.2f} {r['bytes_max_over_mean']:>8.2f} {r['frames_per_edge']:>11.0f} {r['rss_mb_per_edge']:>11.1f} "
                      f"{r['frame_p50_ms']:>7.2f} {r['frame_p99_ms']:>7.2f} {r['frames_received'] / r['frames_expected']:>8.0%} {r['publisher_behind_ms']:>9.0f}",
                      flush=True)
    pcm = [r for r in runs if r["encoding"] == "pcm16"]
    opus = [r for r in runs if r["encoding"] == "opus"]
    if pcm and opus:
        ratio = statistics.median(r["bus_bytes_per_session_s"] for r in pcm) / statistics.median(
            r["bus_bytes_per_session_s"] for r in opus)
        print(f"bytes on the bus per session: PCM16 / Opus = {ratio:.1f}x")
    write_json(args.json, {"chunk_ms": CHUNK_MS, "seconds": seconds, "runs": runs}, indent=2)
    if args.json not in (None, "-"):
        print(f"wrote {args.json}")
    return 0


def _turn_template(encoding: str, seconds: float) -> list[dict]:
    from voicebus.players.tone import tone_turn
    from voicebus.schemas.contract import AudioEncoding

    chunks = max(1, round(seconds * 1000 / CHUNK_MS))
    return tone_turn("x", "t", sentences=1, chunks_per_sentence=chunks, chunk_ms=CHUNK_MS,
                     encoding=AudioEncoding.OPUS if encoding == "opus" else AudioEncoding.PCM16LE)


async def _one(settings, encoding: str, n_edges: int, n_sessions: int, seconds: float,
               log_level: str | None = None) -> dict:
    from voicebus.bus import ensure_topics, make_producer, session_key
    from voicebus.codecs import codec_for
    from voicebus.players.auth import issue_token

    from voicebus.ops.daemon import free_port

    run_id = uuid.uuid4().hex[:8]
    s = settings.replace(audio_topic=f"voicebus.bench.scale.{run_id}.audio",
                         control_topic=f"voicebus.bench.scale.{run_id}.control",
                         playback_topic=f"voicebus.bench.scale.{run_id}.playback",
                         deadletter_topic=f"voicebus.bench.scale.{run_id}.deadletter",
                         edges_topic=f"voicebus.bench.scale.{run_id}.edges",
                         edge_group_id=f"voicebus-bench-scale-{run_id}",
                         audio_encoding=encoding, edge_max_clients=max(1000, n_sessions))
    await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.deadletter_topic, s.edges_topic])
    edge_ports: list[int] = []
    while len(edge_ports) < n_edges:
        port = free_port()
        if port not in edge_ports:
            edge_ports.append(port)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    results = ctx.Queue()
    edges = [ctx.Process(target=_edge_main, args=(s.replace(edge_port=edge_ports[i], edge_id=f"bench-edge-{i}",
                                                            edge_public_url=f"ws://127.0.0.1:{edge_ports[i]}/ws"),
                                                 i, stop, results, log_level), daemon=True) for i in range(n_edges)]
    for p in edges:
        p.start()
    ports: dict[int, int] = {}
    stats: list[dict] = []
    players = None
    behind_s = 0.0
    try:
        while len(ports) < n_edges:
            kind, index, value = await asyncio.to_thread(results.get, True, 120)
            if kind == "port":
                ports[index] = value
        await _settled([ports[i] for i in range(n_edges)], s.partitions)
        template = _turn_template(encoding, seconds)
        expected = n_sessions * len(template)
        sessions = [f"s{i}" for i in range(n_sessions)]
        urls = [f"http://127.0.0.1:{ports[i % n_edges]}/ws" for i in range(n_sessions)]
        tokens = [issue_token(s.edge_secret, sid, 3600) for sid in sessions]
        players_ready, players_done = ctx.Event(), ctx.Queue()
        players = ctx.Process(target=_players_main, args=(list(zip(sessions, urls, tokens)), expected, players_ready,
                                                          stop, players_done), daemon=True)
        players.start()
        while not players_ready.is_set():
            await asyncio.sleep(0.05)
        codec = codec_for(s)
        encoded = [[codec.encode("AudioChunk", {**c, "session_id": sid}, s.audio_topic) for c in template]
                   for sid in sessions]
        bus_bytes = sum(len(e) for e in encoded[0])
        producer = make_producer(s, linger_ms=5)
        await producer.start()
        try:
            started, behind_s = time.monotonic(), 0.0
            for k in range(len(template)):
                behind_s = max(behind_s, time.monotonic() - (started + k * CHUNK_MS / 1000))
                await asyncio.sleep(max(0.0, started + k * CHUNK_MS / 1000 - time.monotonic()))
                sends = [await producer.send(s.audio_topic, encoded[i][k], key=session_key(sid))
                         for i, sid in enumerate(sessions)]
                await asyncio.gather(*sends)
        finally:
            await producer.stop()
        try:
            received = await asyncio.to_thread(players_done.get, True, 30 + seconds * 4)
        except queue.Empty:  # frames went missing (or the machine cannot keep up): report how many came
            stop.set()
            received = await asyncio.to_thread(players_done.get, True, 30)
    finally:
        stop.set()
        for _ in edges:
            try:
                kind, index, value = await asyncio.to_thread(results.get, True, 30)
            except Exception:  # noqa: BLE001 - an edge that did not answer is reported as missing
                break
            if kind == "stats":
                stats.append(value)
        for p in edges + ([players] if players else []):
            p.join(10)
            if p.is_alive():
                p.terminate()
    samples = [x for st in stats for x in st["overhead_s"]]
    return {
        "edges": n_edges, "sessions": n_sessions, "encoding": encoding,
        "bus_bytes_per_session_s": bus_bytes / (len(template) * CHUNK_MS / 1000),
        "bytes_per_edge": statistics.mean(st["consumed_bytes"] for st in stats) if stats else 0,
        "bytes_max_over_mean": (max(st["consumed_bytes"] for st in stats)
                                / max(1.0, statistics.mean(st["consumed_bytes"] for st in stats))) if stats else 0,
        "sessions_held_per_edge": statistics.mean(st["sessions_held"] for st in stats) if stats else 0,
        "sessions_held_by_edge": [st["sessions_held"] for st in stats],
        "peak_queued_frames_by_edge": [st["peak_queued_frames"] for st in stats],
        "peak_replay_mb_by_edge": [st["peak_replay_mb"] for st in stats],
        "partitions": s.partitions,
        "frames_per_edge": statistics.mean(st["frames_sent"] for st in stats) if stats else 0,
        "rss_mb_per_edge": statistics.mean(st["rss_mb"] for st in stats) if stats else 0,
        "frame_p50_ms": statistics.median(samples) * 1e3 if samples else float("nan"),
        "frame_p99_ms": percentile(samples, 99) * 1e3 if samples else float("nan"),
        "bytes_by_edge": [st["consumed_bytes"] for st in stats],
        "frames_by_edge": [st["frames_sent"] for st in stats],
        "frames_expected": n_sessions * len(template),
        "publisher_behind_ms": behind_s * 1e3,  # how far the publisher fell behind real time (a machine that cannot keep up)
        "frames_received": received,
        "edges_reporting": len(stats),
    }


async def _settled(ports: list[int], partitions: int, timeout_s: float = 120.0) -> None:
    """Until every edge's /healthz says the same edge owns each partition, and each one once."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            shards = []
            for port in ports:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                    shards.append((await response.json()).get("shard") or {})
            owned = {sh.get("edge_id"): set(sh.get("owned", ())) for sh in shards}
            every = sorted(p for o in owned.values() for p in o)
            agreed = all(owner is not None and int(p) in owned.get(owner, ())
                         for sh in shards for p, owner in sh.get("owners", {}).items())
            if every == list(range(partitions)) and agreed:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"edges did not settle their shares in {timeout_s:.0f} s: {shards}")
            await asyncio.sleep(0.2)


def _edge_main(settings, index: int, stop, results, log_level: str | None = None) -> None:
    if log_level:  # else as before: Python's own last resort, warnings and above
        configure_logging(log_level)
    asyncio.run(_edge(settings, index, stop, results))


async def _edge(settings, index: int, stop, results) -> None:
    from aiohttp import web

    from voicebus.players.edge import LINK_KEY, make_app
    from voicebus.players.metrics import EdgeMetrics
    from voicebus.players.router import SessionRouter

    metrics = EdgeMetrics(keep_overhead_samples=2_000_000)
    router = SessionRouter.from_settings(settings, metrics, max_clients_per_session=1)
    app = make_app(settings, router=router)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", settings.edge_port)
    await site.start()
    while not app[LINK_KEY].healthy:
        await asyncio.sleep(0.05)
    results.put(("port", index, settings.edge_port))
    peak_queued = peak_replay = 0
    while not stop.is_set():
        await asyncio.sleep(0.05)
        # what the edge holds for its players: their outboxes (bounded per player) and the replay buffers
        peak_queued = max(peak_queued, sum(len(c.outbox) for sid in list(router._sessions)
                                            for c in router.clients_of(sid)))
        peak_replay = max(peak_replay, router.replay_bytes)
    stats = {
        "consumed_bytes": metrics.registry.get_sample_value("voicebus_edge_consumed_bytes_total") or 0,
        "frames_sent": metrics.registry.get_sample_value("voicebus_edge_frames_sent_total") or 0,
        "sessions_held": metrics.registry.get_sample_value("voicebus_edge_sessions") or 0,
        "peak_queued_frames": peak_queued,
        "peak_replay_mb": peak_replay / 1e6,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "overhead_s": list(metrics.overhead_samples or ()),
    }
    await runner.cleanup()
    results.put(("stats", index, stats))


def _players_main(sessions: list, expected: int, ready, stop, done) -> None:
    asyncio.run(_players(sessions, expected, ready, stop, done))


async def _players(sessions: list, expected: int, ready, stop, done) -> None:
    import aiohttp

    received = 0
    all_in = asyncio.Event()

    async def drain(ws):
        nonlocal received
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                received += 1
                if received >= expected:
                    all_in.set()

    async def connect(session: str, url: str, token: str):
        from urllib.parse import urljoin

        for _ in range(4):  # an edge that does not own the session names the one that does
            ws = await http.ws_connect(url, max_msg_size=0)
            await ws.send_str(json.dumps({"type": "hello", "v": 1, "session": session, "token": token}))
            msg = await ws.receive()  # "ready": the edge has registered this player
            reply = json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {}
            if reply.get("type") != "redirect":
                break
            await ws.close()
            url = urljoin(url, reply["url"])
        assert reply.get("type") == "ready", msg
        sockets.append(ws)
        readers.append(asyncio.create_task(drain(ws)))  # read at once: the edge's pings need answers

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        sockets: list = []
        readers: list = []
        for at in range(0, len(sessions), 50):  # 50 handshakes at a time
            await asyncio.gather(*(connect(*s) for s in sessions[at:at + 50]))
        ready.set()
        while not all_in.is_set() and not stop.is_set():
            await asyncio.sleep(0.05)
        done.put(received)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for ws in sockets:
            await ws.close()
