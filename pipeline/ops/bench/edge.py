"""`voicebus bench edge`: the player edge's own overhead, from chunk consumed to frame sent.

The edge runs in this process without Kafka (the chunk is handed to its `SessionRouter` the way
the Kafka consumer does, and "consumed" is that moment); N WebSocket players of one session run
in a separate process and read everything. Every (chunk, client) pair is one sample, measured
right after `send_bytes` returned for that client. Prints p50/p99/max per client count and the
ratio to one client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from dataclasses import replace

from voicebus.latency import percentile


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("edge", help="edge overhead chunk consumed -> frame sent, p50/p99 per client count")
    p.add_argument("--clients", default="1,10,100", help="comma-separated client counts (default 1,10,100)")
    p.add_argument("--chunks", type=int, default=200, help="chunks routed per client count (default 200)")
    p.add_argument("--interval-ms", type=float, default=10.0, help="pause between chunks (default 10 ms)")
    p.add_argument("--chunk-ms", type=int, default=150, help="audio per chunk (default 150 ms, 24 kHz PCM16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings) -> int:
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    results = asyncio.run(_bench(settings, counts, args.chunks, args.interval_ms / 1000, args.chunk_ms))
    base = results[counts[0]]["p99"]
    print(f"edge overhead, chunk consumed -> frame sent ({args.chunks} chunks of {args.chunk_ms} ms, "
          f"one every {args.interval_ms:g} ms, clients in a separate process)")
    print(f"{'clients':>8} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 / p99(' + str(counts[0]) + ')':>14}")
    for n in counts:
        r = results[n]
        print(f"{n:>8} {r['samples']:>8} {r['p50'] * 1e3:>8.3f} {r['p99'] * 1e3:>8.3f} {r['max'] * 1e3:>8.3f} {r['p99'] / base:>14.2f}")
    return 0


async def _bench(settings, counts: list[int], chunks: int, interval_s: float, chunk_ms: int) -> dict:
    from aiohttp import web

    from voicebus.players.auth import issue_token
    from voicebus.players.edge import make_app
    from voicebus.players.metrics import EdgeMetrics
    from voicebus.players.router import SessionRouter
    from voicebus.players.tone import tone_turn

    results = {}
    for n in counts:
        metrics = EdgeMetrics(keep_overhead_samples=n * chunks)
        # all N players are of one session: the per-session connection limit must admit them
        router = SessionRouter(metrics, client_queue_frames=max(256, chunks), max_clients=max(1000, n),
                               max_clients_per_session=n)
        runner = web.AppRunner(make_app(settings, with_kafka=False, router=router))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        ctx = multiprocessing.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        token = issue_token(settings.edge_secret, "bench", 600)
        players = ctx.Process(target=_players_main, args=(f"http://127.0.0.1:{port}/ws", token, n, ready, stop), daemon=True)
        players.start()
        try:
            while not ready.is_set():
                await asyncio.sleep(0.05)
            while len(router.clients_of("bench")) < n:
                await asyncio.sleep(0.05)
            template = tone_turn("bench", "t", sentences=max(1, chunks // 10), chunks_per_sentence=10, chunk_ms=chunk_ms)
            for i, chunk in enumerate(template[:chunks]):
                router.route(replace(chunk, turn_id=f"t{i // 50}"))
                await asyncio.sleep(interval_s)
            deadline = time.monotonic() + 30
            while len(metrics.overhead_samples) < n * min(chunks, len(template)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            players.join(10)
            if players.is_alive():
                players.terminate()
            await runner.cleanup()
        samples = list(metrics.overhead_samples)
        results[n] = {"samples": len(samples), "p50": statistics.median(samples), "p99": percentile(samples, 99),
                      "max": max(samples)}
    return results


def _players_main(url: str, token: str, n: int, ready, stop) -> None:
    asyncio.run(_players(url, token, n, ready, stop))


async def _players(url: str, token: str, n: int, ready, stop) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        sockets = []
        for _ in range(n):
            ws = await http.ws_connect(url, max_msg_size=0)
            await ws.send_str(json.dumps({"type": "hello", "v": 1, "session": "bench", "token": token}))
            sockets.append(ws)

        async def drain(ws):
            async for _ in ws:
                pass

        readers = [asyncio.create_task(drain(ws)) for ws in sockets]
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for ws in sockets:
            await ws.close()
