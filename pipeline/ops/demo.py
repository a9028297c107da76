"""`voicebus demo`: the whole pipeline on this machine, end to end.

It starts the local Kafka (or uses `VOICEBUS_BOOTSTRAP` when a broker answers there; given
``--bootstrap``, uses that broker and starts none), gate
workers, synthesis workers with the real Kokoro weights (offline pack unless configured
otherwise) and the edge. Then, in one of two modes:

* ``--console`` (the default when stdin is a terminal): an incremental and a buffered lane
  (`voicebus.ops.runtime.buffered_lane`) and the demo console on the edge (`voicebus.players.console`);
  prints ONE console URL on a line of its own and keeps the pipeline up until Ctrl-C.
* ``--batch`` (the default otherwise: CI, scripts, tests): replays the shipped conversations;
  prints the player URL with a session token for each session; writes each turn's audio to WAV;
  and prints a per-stage latency table of each turn's first audio.

``--llm`` instead asks a real LLM on this machine and speaks its answers (`voicebus.ops.demo_llm`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from voicebus.latency import first_audio_stages
from voicebus.logs import add_log_level_argument, configure_logging
from voicebus.ops.demo_shared import load_engine, stack_options, wav_path
from voicebus.settings import Settings

DEFAULT_CONVERSATIONS = ["support", "rag_slow_retrieval", "markdown_long", "spanish", "portuguese", "interrupted"]
TABLE_STAGES = ["sentence complete", "released", "synthesis start", "first audio", "published", "sent", "received"]
HEADERS = ["text done", "released", "synth start", "first audio", "published", "edge sent", "TTFA"]


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the whole pipeline on the shipped conversations")
    p.add_argument("--conversations", default=",".join(DEFAULT_CONVERSATIONS),
                   help="comma-separated names from agents/conversations/ (default: all)")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="where the WAV files go (default out/demo)")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor (default 1.0: recorded timing)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight model (noise, for a quick smoke run)")
    p.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="--batch: keep the pipeline up S seconds after the last turn; console: stop after S seconds "
                        "(default: until Ctrl-C)")
    p.add_argument("--turn-timeout", type=float, default=180.0, metavar="S")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--console", dest="mode", action="store_const", const="console",
                      help="serve the web console until Ctrl-C (default when stdin is a terminal)")
    mode.add_argument("--batch", dest="mode", action="store_const", const="batch",
                      help="replay the conversations, write WAVs and the latency table, exit "
                           "(default when stdin is not a terminal)")
    p.add_argument("--llm", action="store_true",
                   help="ask a real LLM (llama-cpp-python server, SmolLM2-135M; extra voicebus[llm]) and speak its "
                        "answers (voicebus.ops.demo_llm)")
    p.add_argument("--ask", action="append", metavar="Q",
                   help="--llm: a question to ask (repeatable; default: read them from the terminal, else three "
                        "shipped ones)")
    add_log_level_argument(p, "WARNING", help="log level of the pipeline: this process and its gate processes "
                                              "(default WARNING)")
    p.set_defaults(func=run_demo, mode=None)


def demo_mode(asked: str | None, stdin) -> str:
    """``console`` or ``batch``: what was asked, else the console for a person at a terminal and
    the batch run for everything else (CI, scripts, tests), which would otherwise wait forever."""
    if asked:
        return asked
    return "console" if stdin is not None and stdin.isatty() else "batch"


def run_demo(args: argparse.Namespace, settings: Settings) -> int:
    import sys

    from rich.console import Console

    from voicebus.players.edge import InsecureEdgeConfig, check_exposure

    configure_logging(getattr(args, "log_level", None))
    console = Console(width=max(120, Console().width))
    try:
        check_exposure(settings)
    except InsecureEdgeConfig as exc:
        console.print(f"[red]voicebus demo: {exc}")
        return 2
    if args.llm:
        from voicebus.ops.demo_llm import run_llm_demo

        return run_llm_demo(args, settings, console, interactive=demo_mode(args.mode, sys.stdin) == "console")
    if demo_mode(args.mode, sys.stdin) == "console":
        from voicebus.ops.demo_console import run_console_demo

        return run_console_demo(args, settings)
    return asyncio.run(_demo(args, settings, console))


async def _demo(args: argparse.Namespace, settings: Settings, console) -> int:
    from rich.table import Table

    from voicebus.agents.conversation_file import load
    from voicebus.agents.corpus import corpus_path
    from voicebus.agents.replay import copy_session_id, replay
    from voicebus.ops.runtime import PipelineStack
    from voicebus.players.auth import issue_token, player_url
    from voicebus.paths import UnsafePath
    from voicebus.players.listener import Listener

    names = [n.strip() for n in args.conversations.split(",") if n.strip()]
    conversations = {name: load(corpus_path(name)) for name in names}
    engine = await asyncio.to_thread(load_engine, settings, args.tiny, console)
    table = Table(title="first audio of each turn: ms after the turn's first token")
    table.add_column("conversation / turn")
    for header in HEADERS:
        table.add_column(header, justify="right")
    table.add_column("audio s", justify="right")
    failures = 0
    with console.status("starting the pipeline") as status:
        agent_ids = tuple(sorted({e.agent_id for c in conversations.values() for e in c.events if e.type == "text"}))
        stack = PipelineStack(settings, engine, agent_ids=agent_ids, **stack_options(args))
        try:
            await stack.start(progress=lambda step: (console.log(f"starting {step}"), status.update(f"starting {step}")))
        except BaseException:
            await stack.stop()  # what started before the failure (broker, gate process, worker) is stopped
            raise
    try:
        console.log(f"pipeline up: Kafka at {stack.settings.bootstrap}, edge at {stack.edge_url}")
        run_id = time.strftime("%H%M%S")
        for name, conversation in conversations.items():
            sessions = {sid: copy_session_id(sid, run_id, 0) for sid in conversation.sessions()}
            listeners = {sid: Listener(stack.edge_url, sid, stack.settings.edge_secret) for sid in sessions.values()}
            for listener in listeners.values():
                await listener.start()
            try:
                for sid in sessions.values():
                    token = issue_token(stack.settings.edge_secret, sid, stack.settings.token_ttl_s)
                    console.print(f"[bold]{name}[/]: player {player_url(stack.edge_url, sid, token)}")
                console.log(f"replaying {name!r}: {conversation.title}")
                await replay(stack.settings, conversation.events, speed=args.speed, run_id=run_id)
                for recorded_sid, turn_id in conversation.turns():
                    listener = listeners[sessions[recorded_sid]]
                    cancelled = any(getattr(e, "type", "") == "control" and e.session_id == recorded_sid
                                    and e.turn_id in (None, turn_id) for e in conversation.events)
                    try:
                        turn = await listener.wait_turn_end(turn_id, 15.0 if cancelled else args.turn_timeout)
                    except TimeoutError:
                        turn = listener.turns.get(turn_id)
                        if not cancelled:
                            failures += 1
                            console.print(f"[red]{name}/{turn_id}: turn did not end within {args.turn_timeout:g} s")
                    if turn is None or not turn.frames:
                        table.add_row(f"{name}/{turn_id}" + (" (cancelled before audio)" if cancelled else " (no audio)"),
                                      *["-"] * len(TABLE_STAGES), "0")
                        continue
                    try:
                        target = wav_path(args.out, name, turn_id)
                    except UnsafePath as exc:
                        failures += 1
                        console.print(f"[red]{name}/{turn_id!r}: not written: {exc}")
                        continue
                    if target.name != f"{turn_id}.wav":
                        console.log(f"turn id {turn_id!r} is written as {target.name} (a file name cannot carry it as is)")
                    wav = turn.write_wav(target)
                    timeline = turn.timelines.get(turn.frames[0][1]) or next(iter(turn.timelines.values()), None)
                    stages = first_audio_stages(timeline, turn.first_audio_at_us) if timeline else {}
                    label = f"{name}/{turn_id}" + (" (cancelled)" if turn.stopped else "")
                    table.add_row(label, *[f"{stages[s]:.0f}" if s in stages else "-" for s in TABLE_STAGES],
                                  f"{turn.duration_s:.1f}")
                    console.log(f"wrote {wav} ({turn.duration_s:.1f} s)")
            finally:
                for listener in listeners.values():
                    await listener.stop()
        console.print(table)
        if args.linger > 0:
            console.log(f"pipeline stays up {args.linger:g} s: open a player URL above")
            await asyncio.sleep(args.linger)
    finally:
        with console.status("stopping the pipeline"):
            await stack.stop()
    console.log(f"WAV files in {args.out}/" if not failures else f"[red]{failures} turn(s) failed")
    return 1 if failures else 0
