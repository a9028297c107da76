"""`voicebus demo --console`: the pipeline with two hand-off lanes and the web console, until Ctrl-C.

Starts what `voicebus demo` starts, with an incremental and a buffered lane
(`voicebus.ops.runtime.buffered_lane`: a second gate app in buffered mode on its own text and
synthesis topics; one loaded engine), installs the demo console on the edge
(`voicebus.players.console`), prints the console URL on a line of its own (never wrapped: it is written
with a plain `print`, whatever the terminal width) and keeps everything up until Ctrl-C (or
SIGTERM, or `--linger S` seconds when given).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from voicebus.settings import Settings

BANNER = "Open the voicebus console (hear buffered vs streamed hand-off) in a browser:"


def run_console_demo(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    return asyncio.run(_console_demo(args, settings, Console(stderr=False)))


def print_url(url: str, out=None) -> None:
    """The console URL alone on its line, between blank lines, flushed: a terminal never wraps
    what is shorter than its width, and nothing else shares the line (a double click copies it)."""
    out = out or sys.stdout
    out.write(f"\n{BANNER}\n\n{url}\n\n")
    out.flush()


async def _console_demo(args: argparse.Namespace, settings: Settings, console) -> int:
    from voicebus.agents.conversation_file import load
    from voicebus.agents.corpus import corpus_path
    from voicebus.ops.demo_shared import load_engine, stack_options
    from voicebus.ops.runtime import PipelineStack, buffered_lane
    from voicebus.players.console import AGENT_ID, Console, console_key, console_url, install_console, is_loopback

    names = [n.strip() for n in args.conversations.split(",") if n.strip()]
    conversations = {name: load(corpus_path(name)) for name in names}
    engine = await asyncio.to_thread(load_engine, settings, args.tiny, console)
    agent_ids = tuple(sorted({e.agent_id for c in conversations.values() for e in c.events if e.type == "text"}
                             | {AGENT_ID}))
    key = console_key()

    def setup(app, stack) -> None:
        lanes = {name: lane.settings for name, lane in stack.lanes.items()}
        install_console(app, Console(key, lanes, conversations, stack.settings))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lanes = {"incremental": settings, "buffered": buffered_lane(settings)}
    stack = PipelineStack(settings, engine, lanes, agent_ids=agent_ids, edge_setup=setup, **stack_options(args))
    try:
        with console.status("starting the pipeline") as status:
            await stack.start(progress=lambda step: (console.log(f"starting {step}"),
                                                     status.update(f"starting {step}")))
        console.log(f"pipeline up: Kafka at {stack.settings.bootstrap}, incremental and buffered lanes, "
                    f"edge at {stack.edge_url}")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        host = stack.settings.edge_host
        if host not in ("", "0.0.0.0", "::") and not is_loopback(host):
            console.print(f"[yellow]the console answers loopback clients only, and the edge listens on {host} only: "
                          f"set VOICEBUS_EDGE_HOST=127.0.0.1 (or 0.0.0.0) to use it")
        print_url(console_url(host, stack.settings.edge_port, key))
        linger = f"for {args.linger:g} s or " if args.linger > 0 else ""
        console.print(f"The demo keeps running {linger}until you press Ctrl-C.", highlight=False)
        try:
            await asyncio.wait_for(stop.wait(), timeout=args.linger if args.linger > 0 else None)
        except asyncio.TimeoutError:
            pass
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # a second Ctrl-C interrupts the shutdown itself
    finally:
        with console.status("stopping the pipeline"):
            await stack.stop()
    console.log("pipeline stopped")
    return 0
