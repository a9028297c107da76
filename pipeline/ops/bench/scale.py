"""`voicebus bench scale`: what each edge reads, builds and holds as edges, sessions and listeners grow.

Tone audio (no model) through the real broker: for each encoding (PCM16, Opus) x edges x
sessions, N edge processes (the real `voicebus.players.edge` app with its Kafka link, each in its own
process as deployed, one consumer group sharing the audio topic's partitions) and player
processes of light WebSocket players (`_Listener`: the protocol spoken on a bare asyncio
transport, thousands per process, on uvloop where it is installed: ``--player-loop``),
``--listeners`` per session. Listener j of session i first
reaches edge (i * listeners + j) % N (what a round-robin load balancer does); an edge that does
not own the session redirects it to the owner. This process waits until the edges agree who owns
which partition, publishes every session's turn in real time (one chunk per session every chunk
period, each session on its own offset within the period, as independent workers would), waits
until the players got every frame, then reports:

- ``bytes_per_edge``: bytes of audio records the edge fetched (``voicebus_edge_consumed_bytes_total``):
  with sharding, the partitions it owns only (``bytes_max_over_mean``: the fullest edge's share);
- ``frames_per_edge``: audio frames it built and sent (its own sessions' listeners);
- ``sessions_held_per_edge``, ``clients_by_edge``, ``owned_partitions_by_edge``;
- ``rss_mb_by_edge``: each edge process's peak resident memory (``ru_maxrss``);
- ``cpu_by_edge``: the share of one core each edge used while the audio streamed;
- ``peak_queued_frames_by_edge``, ``peak_replay_mb_by_edge``: the most frames waiting in its
  players' outboxes at once (a player process that cannot keep up fills them, each bounded) and
  the most bytes in its replay buffers (sampled every 200 ms);
- ``listeners_complete``, ``frames_received`` / ``frames_expected``, ``frames_twice``,
  ``frames_out_of_order``: per listener, every chunk of the turn once and in order
  (``listeners_cut``: closed by an edge before the turn's end; these players do not reconnect);
- ``bus_to_listener_p50_ms`` / ``_p99_ms``: a chunk on the bus (the broker's append time, the
  run's audio topic uses ``LogAppendTime``; millisecond resolution) -> its frame read by a
  listener, over every frame of every listener;
- ``frame_p50_ms`` / ``frame_p99_ms``: inside the edge, chunk consumed -> frame handed to the socket;
- ``bus_bytes_per_session_s``: what one speaking session puts on the audio topic per second;
- ``publisher_behind_ms``: how far this process fell behind publishing in real time (above a
  chunk period the machine, not the edge, is the limit: the grid stops there).

The broker: the one at ``VOICEBUS_BOOTSTRAP`` when it answers, else a throwaway one started for
the run and stopped after it; given ``--bootstrap``, that one and none started (`bench_kafka`).

The topics of a run have ``--partitions`` partitions (default 24, the deployment default: an even
share for 1, 2, 3, 4, 6 and 8 edges; a session's partition is the hash of its id, so shares are
even only on average).

Size: about 580 lines: one benchmark (its edges, light listeners, load and report). Benchmarks are
not on the runtime path.
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
from dataclasses import replace
from typing import TYPE_CHECKING

from voicebus.cli import add_json_argument, write_json
from voicebus.latency import percentile
from voicebus.logs import configure_logging
from voicebus.ops.bench.cli import add_stage_log_level, bench_kafka

if TYPE_CHECKING:
    from voicebus.schemas.messages import AudioChunk

CHUNK_MS = 160  # whole 20 ms Opus frames; PCM uses the same, so the two grids match chunk for chunk
QUICK = {"edges": [1, 2], "sessions": [10]}
PARTITIONS = 24
LISTENERS_PER_PROCESS = 2500  # light players per player process (each a socket and a few hundred bytes)
SLOTS = 16  # steps of a chunk period over which the sessions' chunks are spread
# The light players' event loop: uvloop reads a frame for about half the CPU of asyncio's own
# loop, and on a machine the players share with the edges every core-second they do not take
# is one the edges get (the players are the bench's load, not what it measures).
PLAYER_LOOPS = ("uvloop", "asyncio")


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "scale", help="bytes, frames, memory and frame latency per edge for edges x sessions, PCM16 and Opus")
    p.add_argument("--edges", default="1,2,4", help="comma-separated edge counts (default 1,2,4)")
    p.add_argument("--sessions", default="100,1000", help="comma-separated session counts (default 100,1000)")
    p.add_argument("--encodings", default="pcm16,opus", help="comma-separated: pcm16, opus (default both)")
    p.add_argument("--seconds", type=float, default=3.0, help="audio each session speaks per run (default 3)")
    p.add_argument("--listeners", type=int, default=1,
                   help="players per session (default 1): listeners = sessions x this, all on the session's edge")
    p.add_argument("--listeners-per-process", type=int, default=LISTENERS_PER_PROCESS,
                   help=f"light players per player process (default {LISTENERS_PER_PROCESS})")
    p.add_argument("--player-loop", default=None,
                   help="the light players' event loop, comma-separated for an A/B in one run: uvloop, asyncio "
                        "(default uvloop where installed, as in the dev extra)")
    p.add_argument("--partitions", type=int, default=PARTITIONS,
                   help=f"partitions of the run's topics, shared by the edges (default {PARTITIONS})")
    p.add_argument("--quick", action="store_true", help=f"the smallest grid: edges {QUICK['edges']}, "
                                                         f"sessions {QUICK['sessions']}, 2 s")
    add_json_argument(p, "the runs")
    add_stage_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings) -> int:
    configure_logging(getattr(args, "log_level", None))
    _player_loops(args)  # a wrong name fails before a broker is started
    with bench_kafka(args, settings) as live:
        return _run(args, live)


def _player_loops(args: argparse.Namespace) -> list[str]:
    """``--player-loop``'s loops; uvloop where installed (the dev extra), else asyncio."""
    import importlib.util

    default = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    loops = [name.strip() for name in (getattr(args, "player_loop", None) or default).split(",")]
    unknown = sorted(set(loops) - set(PLAYER_LOOPS))
    if unknown:
        raise SystemExit(f"--player-loop: {', '.join(unknown)}? (one or more of {', '.join(PLAYER_LOOPS)})")
    return loops


def _run(args: argparse.Namespace, settings) -> int:
    edges = QUICK["edges"] if args.quick else [int(n) for n in args.edges.split(",") if n.strip()]
    sessions = QUICK["sessions"] if args.quick else [int(n) for n in args.sessions.split(",") if n.strip()]
    seconds = 2.0 if args.quick else args.seconds
    encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    log_level = getattr(args, "log_level", None)
    runs = []
    listeners = max(1, getattr(args, "listeners", 1))
    per_process = getattr(args, "listeners_per_process", LISTENERS_PER_PROCESS)
    player_loops = _player_loops(args)
    print(f"bench scale: {seconds:g} s of tone per session, {CHUNK_MS} ms chunks, broker {settings.bootstrap}, "
          f"players on {', '.join(player_loops)}")
    print(f"{'encoding':>8} {'edges':>5} {'sessions':>8} {'listeners':>9} {'players':>7} {'bus KB/s/session':>16} {'MB/edge':>8} "
          f"{'max/mean':>8} {'frames/edge':>11} {'RSS MB/edge':>11} {'CPU/edge':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'bus p99':>7} {'complete':>8} {'behind ms':>9}")
    for encoding in encodings:
        for n_sessions in sessions:
            for n_edges, player_loop in ((n, loop) for n in edges for loop in player_loops):
                r = asyncio.run(_one(settings.replace(partitions=getattr(args, "partitions", PARTITIONS)),
                                     encoding, n_edges, n_sessions, seconds, log_level, listeners, per_process,
                                     player_loop))
                runs.append(r)
                cpu = max(r["cpu_by_edge"], default=float("nan"))
                print(f"{encoding:>8} {n_edges:>5} {n_sessions:>8} {r['listeners']:>9} {player_loop:>7} "
                      f"{r['bus_bytes_per_session_s'] / 1e3:>16.2f} {r['bytes_per_edge'] / 1e6:>8.2f} "
                      f"{r['bytes_max_over_mean']:>8.2f} {r['frames_per_edge']:>11.0f} {r['rss_mb_per_edge']:>11.1f} "
                      f"{cpu:>8.0%} {r['frame_p50_ms']:>7.2f} {r['frame_p99_ms']:>7.2f} "
                      f"{r['bus_to_listener_p99_ms']:>7.2f} {r['frames_received'] / r['frames_expected']:>8.0%} "
                      f"{r['publisher_behind_ms']:>9.0f}", flush=True)
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


def _turn_template(encoding: str, seconds: float) -> list[AudioChunk]:
    from voicebus.players.tone import tone_turn
    from voicebus.schemas.contract import AudioEncoding

    chunks = max(1, round(seconds * 1000 / CHUNK_MS))
    return tone_turn("x", "t", sentences=1, chunks_per_sentence=chunks, chunk_ms=CHUNK_MS,
                     encoding=AudioEncoding.OPUS if encoding == "opus" else AudioEncoding.PCM16LE)


async def _one(settings, encoding: str, n_edges: int, n_sessions: int, seconds: float,
               log_level: str | None = None, listeners: int = 1,
               per_process: int = LISTENERS_PER_PROCESS, player_loop: str = PLAYER_LOOPS[0]) -> dict:
    from voicebus.bus import ensure_topics, make_producer, session_key
    from voicebus.codecs import codec_for
    from voicebus.players.auth import issue_token

    from voicebus.ops.daemon import free_port

    run_id = uuid.uuid4().hex[:8]
    n_listeners = n_sessions * listeners
    s = settings.replace(audio_topic=f"voicebus.bench.scale.{run_id}.audio",
                         control_topic=f"voicebus.bench.scale.{run_id}.control",
                         playback_topic=f"voicebus.bench.scale.{run_id}.playback",
                         deadletter_topic=f"voicebus.bench.scale.{run_id}.deadletter",
                         edges_topic=f"voicebus.bench.scale.{run_id}.edges",
                         edge_group_id=f"voicebus-bench-scale-{run_id}",
                         audio_encoding=encoding, edge_max_clients=max(1000, n_listeners),
                         edge_max_clients_per_session=listeners,
                         # the run measures the fan-out: an edge starved past its heartbeats (a busy
                         # machine) must not be taken for dead and its sessions moved mid-turn
                         edge_session_timeout_ms=max(settings.edge_session_timeout_ms, 60_000))
    await ensure_topics(s, [s.audio_topic, s.control_topic, s.playback_topic, s.deadletter_topic, s.edges_topic])
    await _stamp_on_append(s, s.audio_topic)
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
    clients: list = []
    heard: list[dict] = []
    client_cpu: list = []
    behind_s = 0.0
    template = _turn_template(encoding, seconds)
    sessions = [f"s{i}" for i in range(n_sessions)]
    bus_us = [[0] * len(template) for _ in sessions]  # (session, chunk) -> when the broker appended it
    window = (0.0, 0.0)
    try:
        while len(ports) < n_edges:
            kind, index, value = await asyncio.to_thread(results.get, True, 120)
            if kind == "port":
                ports[index] = value
        await _settled([ports[i] for i in range(n_edges)], s.partitions)
        # listener j of session i first reaches edge (i * listeners + j) % N: what a round-robin balancer does
        plan = [(i, sessions[i], ports[(i * listeners + j) % n_edges], issue_token(s.edge_secret, sessions[i], 3600))
                for i in range(n_sessions) for j in range(listeners)]
        shares = [plan[at:at + per_process] for at in range(0, len(plan), per_process)]
        ready, done = ctx.Queue(), ctx.Queue()
        clients = [ctx.Process(target=_players_main, args=(k, share, len(template), ready, stop, done, player_loop),
                               daemon=True)
                   for k, share in enumerate(shares)]
        for p in clients:
            p.start()
        for _ in clients:
            kind, index, value = await asyncio.to_thread(ready.get, True, 60 + per_process / 20)
            if kind == "error":
                raise RuntimeError(f"player process {index}: {value}")
        codec = codec_for(s)
        encoded = [[codec.encode("AudioChunk", replace(c, session_id=sid), s.audio_topic) for c in template]
                   for sid in sessions]
        bus_bytes = sum(len(e) for e in encoded[0])
        # Each session speaks on its own clock, as independent workers do: session i's chunks go
        # out i/n of a chunk period after the period starts (in SLOTS steps), not all at one instant.
        slots = [[i for i in range(n_sessions) if i * SLOTS // n_sessions == slot] for slot in range(SLOTS)]
        period = CHUNK_MS / 1000
        producer = make_producer(s, linger_ms=2)
        await producer.start()
        try:
            started, behind_s = time.monotonic() + 0.2, 0.0
            window = (started, started)
            acks: list = []
            for k in range(len(template)):
                for slot, members in enumerate(slots):
                    due = started + k * period + slot * period / SLOTS
                    behind_s = max(behind_s, time.monotonic() - due)
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    for i in members:
                        sent_us = time.time_ns() // 1000
                        acks.append((i, k, sent_us, await producer.send(s.audio_topic, encoded[i][k],
                                                                        key=session_key(sessions[i]))))
            for i, k, sent_us, ack in acks:
                meta = await ack
                # LogAppendTime: the broker's clock when the chunk went on the bus (ms); else when it was sent
                bus_us[i][k] = meta.timestamp * 1000 if meta.timestamp_type == 1 and meta.timestamp > 0 else sent_us
        finally:
            await producer.stop()
        deadline, reports = time.monotonic() + 30 + seconds * 4, 0
        while reports < len(clients):
            try:
                kind, index, value = await asyncio.to_thread(done.get, True, max(0.5, deadline - time.monotonic()))
            except queue.Empty:  # frames went missing (or the machine cannot keep up): report how many came
                if stop.is_set():
                    break
                stop.set()
                deadline = time.monotonic() + 30
                continue
            reports += 1
            heard.extend(value["listeners"])
            client_cpu.append(value["cpu"])
            window = (window[0], max(window[1], value["last_frame_at"]))
    finally:
        stop.set()
        for _ in edges:
            try:
                kind, index, value = await asyncio.to_thread(results.get, True, 30)
            except Exception:  # noqa: BLE001 - an edge that did not answer is reported as missing
                break
            if kind == "stats":
                stats.append(value)
        for p in edges + clients:
            p.join(10)
            if p.is_alive():
                p.terminate()
    stats.sort(key=lambda st: st["index"])
    samples = [x for st in stats for x in st["overhead_s"]]
    delays, complete, twice, out_of_order = [], 0, 0, 0
    for listener in heard:
        seqs = [k for k, _ in listener["frames"]]
        complete += sorted(set(seqs)) == list(range(len(template))) and len(seqs) == len(template)
        twice += len(seqs) - len(set(seqs))
        out_of_order += sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)
        delays.extend(t - bus_us[listener["session"]][k] for k, t in listener["frames"])
    received = sum(len(listener["frames"]) for listener in heard)

    return {
        "edges": n_edges, "sessions": n_sessions, "encoding": encoding,
        "listeners_per_session": listeners, "listeners": n_listeners, "player_processes": len(clients),
        "player_loop": player_loop,
        "bus_bytes_per_session_s": bus_bytes / (len(template) * CHUNK_MS / 1000),
        "bytes_per_edge": statistics.mean(st["consumed_bytes"] for st in stats) if stats else 0,
        "bytes_max_over_mean": (max(st["consumed_bytes"] for st in stats)
                                / max(1.0, statistics.mean(st["consumed_bytes"] for st in stats))) if stats else 0,
        "sessions_held_per_edge": statistics.mean(st["sessions_held"] for st in stats) if stats else 0,
        "sessions_held_by_edge": [st["sessions_held"] for st in stats],
        "clients_by_edge": [st["clients"] for st in stats],
        "owned_partitions_by_edge": [st["owned"] for st in stats],
        "peak_queued_frames_by_edge": [st["peak_queued_frames"] for st in stats],
        "peak_replay_mb_by_edge": [st["peak_replay_mb"] for st in stats],
        "partitions": s.partitions,
        "frames_per_edge": statistics.mean(st["frames_sent"] for st in stats) if stats else 0,
        "rss_mb_per_edge": statistics.mean(st["rss_mb"] for st in stats) if stats else 0,
        "rss_mb_by_edge": [st["rss_mb"] for st in stats],
        # share of one core each edge used while the audio streamed (first chunk sent -> last frame heard)
        "cpu_by_edge": [_cpu_share(st["usage"], *window) for st in stats],
        "cpu_by_player_process": [_cpu_share(u, *window) for u in client_cpu],
        "stream_s": window[1] - window[0],
        "frame_p50_ms": statistics.median(samples) * 1e3 if samples else float("nan"),
        "frame_p99_ms": percentile(samples, 99) * 1e3 if samples else float("nan"),
        # chunk on the bus (broker append time, ms resolution) -> frame read by the listener
        "bus_to_listener_p50_ms": statistics.median(delays) / 1e3 if delays else float("nan"),
        "bus_to_listener_p99_ms": percentile(delays, 99) / 1e3 if delays else float("nan"),
        "bus_to_listener_max_ms": max(delays) / 1e3 if delays else float("nan"),
        "bytes_by_edge": [st["consumed_bytes"] for st in stats],
        "frames_by_edge": [st["frames_sent"] for st in stats],
        "frames_expected": n_listeners * len(template),
        "frames_received": received,
        "listeners_reporting": len(heard),
        "listeners_complete": complete,  # every chunk of the turn, once each
        "listeners_cut": sum(1 for listener in heard if listener["cut"]),  # closed by an edge before the end
        "frames_twice": twice,
        "frames_out_of_order": out_of_order,
        "publisher_behind_ms": behind_s * 1e3,  # how far the publisher fell behind real time (a machine that cannot keep up)
        "edges_reporting": len(stats),
    }


def _cpu_share(usage: list, start: float, end: float) -> float:
    """CPU seconds per second (1.0: one core) between `start` and `end` (monotonic seconds) from
    (monotonic, cpu seconds) samples."""
    if not usage or end <= start:
        return float("nan")
    before = max((u for u in usage if u[0] <= start), default=usage[0], key=lambda u: u[0])
    after = min((u for u in usage if u[0] >= end), default=usage[-1], key=lambda u: u[0])
    return (after[1] - before[1]) / (after[0] - before[0]) if after[0] > before[0] else float("nan")


def _usage() -> tuple[float, float]:
    return time.monotonic(), time.process_time()


async def _stamp_on_append(settings, topic: str) -> None:
    """The run's audio topic stamps each record with the broker's clock when it is appended
    (``LogAppendTime``): the bus-to-listener delay starts when the chunk is on the bus."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from voicebus.bus import make_admin

    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic,
                                                  configs={"message.timestamp.type": "LogAppendTime"})])
    finally:
        await admin.close()


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
    router = SessionRouter.from_settings(settings, metrics)
    app = make_app(settings, router=router)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", settings.edge_port, backlog=4096)
    await site.start()
    while not app[LINK_KEY].healthy:
        await asyncio.sleep(0.05)
    results.put(("port", index, settings.edge_port))
    peak_queued = peak_replay = peak_clients = 0
    usage = [_usage()]
    while not stop.is_set():
        # every 200 ms, not faster: at thousands of players the walk over their outboxes costs the edge
        await asyncio.sleep(0.2)
        # what the edge holds for its players: their outboxes (bounded per player) and the replay buffers
        peak_queued = max(peak_queued, sum(len(c.outbox) for sid in list(router._sessions)
                                            for c in router.clients_of(sid)))
        peak_replay = max(peak_replay, router.replay_bytes)
        peak_clients = max(peak_clients, router.n_clients)
        usage.append(_usage())
    usage.append(_usage())
    stats = {
        "index": index,
        "consumed_bytes": metrics.registry.get_sample_value("voicebus_edge_consumed_bytes_total") or 0,
        "frames_sent": metrics.registry.get_sample_value("voicebus_edge_frames_sent_total") or 0,
        "sessions_held": metrics.registry.get_sample_value("voicebus_edge_sessions") or 0,
        "clients": peak_clients,
        "owned": sorted(app[LINK_KEY].owned),
        "peak_queued_frames": peak_queued,
        "peak_replay_mb": peak_replay / 1e6,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "usage": usage,
        "overhead_s": list(metrics.overhead_samples or ()),
    }
    await runner.cleanup()
    results.put(("stats", index, stats))


def _players_main(index: int, plan: list, expected: int, ready, stop, done, loop: str = PLAYER_LOOPS[0]) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.run(_players(index, plan, expected, ready, stop, done))
    else:
        asyncio.run(_players(index, plan, expected, ready, stop, done))


class _Listener(asyncio.Protocol):
    """One light WebSocket player (a few hundred bytes of state, no task of its own): the upgrade,
    the hello, then it parses frames as they come, answers pings, and notes each audio frame's
    chunk number and arrival time. Many share one process and its event loop."""

    def __init__(self, host: str, port: int, session: str, token: str, expected: int, on_complete) -> None:
        self.host, self.port, self.session, self.token = host, port, session, token
        self.expected, self.on_complete = expected, on_complete
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.upgraded = False
        self.reply: asyncio.Future = asyncio.get_running_loop().create_future()  # ready or redirect
        self.frames: list[tuple[int, int]] = []  # (chunk_seq, arrival wall-clock us)
        self.last_at = 0.0
        self.cut = False

    def connection_made(self, transport) -> None:
        import base64
        import os

        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        transport.write(f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())

    def connection_lost(self, exc) -> None:
        if not self.reply.done():
            self.reply.set_exception(ConnectionError(f"closed before ready: {exc}"))
        elif len(self.frames) < self.expected:
            self.cut = True  # the edge closed it mid-turn (its session moved): these players do not follow

    def _send(self, opcode: int, payload: bytes) -> None:
        import os

        mask = os.urandom(4)  # a client masks what it sends (RFC 6455)
        n = len(payload)
        head = bytes([0x80 | opcode, 0x80 | n]) if n < 126 else bytes([0x80 | opcode, 0xFE]) + n.to_bytes(2, "big")
        self.transport.write(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def data_received(self, data: bytes) -> None:
        from voicebus.players.protocol import AUDIO_HEADER

        arrived = time.time_ns() // 1000
        buf = self.buffer
        buf += data
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not buf.startswith(b"HTTP/1.1 101"):
                self.reply.set_exception(ConnectionError(bytes(buf[:end]).decode(errors="replace")))
                self.transport.close()
                return
            del buf[:end + 4]
            self.upgraded = True
            self._send(1, json.dumps({"type": "hello", "v": 1, "session": self.session, "token": self.token}).encode())
        while len(buf) >= 2:
            opcode, n, at = buf[0] & 0x0F, buf[1] & 0x7F, 2
            if n == 126:
                if len(buf) < 4:
                    return
                n, at = int.from_bytes(buf[2:4], "big"), 4
            elif n == 127:
                if len(buf) < 10:
                    return
                n, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < at + n:
                return
            if opcode == 2:
                self.frames.append((AUDIO_HEADER.unpack_from(buf, at)[6], arrived))
                if len(self.frames) == self.expected:
                    self.last_at = time.monotonic()
                    self.on_complete()
            elif opcode == 1 and not self.reply.done():
                self.reply.set_result(json.loads(bytes(buf[at:at + n])))
            elif opcode == 9:  # the edge's heartbeat
                self._send(10, bytes(buf[at:at + n]))
            del buf[:at + n]


async def _players(index: int, plan: list, expected: int, ready, stop, done) -> None:
    from urllib.parse import urlsplit

    loop = asyncio.get_running_loop()
    listeners: list[tuple[int, _Listener]] = []
    pending = len(plan)
    all_in = asyncio.Event()

    def complete() -> None:
        nonlocal pending
        pending -= 1
        if pending == 0:
            all_in.set()

    async def connect(session_index: int, session: str, port: int, token: str) -> None:
        host = "127.0.0.1"
        for _ in range(4):  # an edge that does not own the session names the one that does
            _, listener = await loop.create_connection(
                lambda: _Listener(host, port, session, token, expected, complete), host, port)
            reply = await asyncio.wait_for(listener.reply, 60)
            if reply.get("type") != "redirect":
                break
            listener.transport.close()
            where = urlsplit(reply["url"])
            host, port = where.hostname or host, where.port or port
        if reply.get("type") != "ready":
            raise ConnectionError(f"session {session}: {reply}")
        listeners.append((session_index, listener))

    try:
        for at in range(0, len(plan), 100):  # 100 handshakes at a time
            await asyncio.gather(*(connect(*p) for p in plan[at:at + 100]))
    except Exception as exc:  # noqa: BLE001 - told to the bench, which stops the run
        ready.put(("error", index, repr(exc)))
        return
    usage = [_usage()]
    ready.put(("ready", index, len(listeners)))
    while not all_in.is_set() and not stop.is_set():
        try:
            await asyncio.wait_for(all_in.wait(), 0.25)
        except asyncio.TimeoutError:
            usage.append(_usage())
    usage.append(_usage())
    done.put(("done", index, {
        "listeners": [{"session": i, "frames": listener.frames, "cut": listener.cut} for i, listener in listeners],
        "cpu": usage, "last_frame_at": max((listener.last_at for _, listener in listeners), default=0.0),
    }))
    for _, listener in listeners:
        listener.transport.close()
