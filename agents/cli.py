"""`voicebus record`, `voicebus replay`, `voicebus say`, and `voicebus ask`: the agents' commands."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("record", help="record the text and control topics to a conversation file (JSONL)")
    p.add_argument("out", type=Path, help="the .jsonl file to write")
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--turns", type=int, metavar="N", help="stop once N turns are over (ended or cancelled)")
    p.add_argument("--title", default="", help="title written in the file's header")
    p.set_defaults(func=run_record)

    p = subparsers.add_parser("replay", help="publish a conversation file at its recorded timing")
    p.add_argument("file", help="a .jsonl path, or the name of a shipped conversation (e.g. support)")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 plays twice as fast (default 1)")
    p.add_argument("--sessions", type=int, default=1, metavar="N", help="N copies at once, distinct session ids")
    p.add_argument("--keep-session-ids", action="store_true",
                   help="publish under the recorded session ids (one copy only)")
    p.add_argument("--heard-timeout", type=float, default=15.0, metavar="S",
                   help="after the last event, wait up to S seconds for what the listeners heard of each turn "
                        "(TurnHeard) and print it; 0: do not wait (default 15)")
    p.set_defaults(func=run_replay)

    p = subparsers.add_parser("say", help="stream a text as one agent turn (LLM-like tokens)")
    p.add_argument("text")
    p.add_argument("--agent", default="assistant")
    p.add_argument("--session", required=True)
    p.add_argument("--turn", help="turn id (default: a new one; printed first, before any token)")
    p.add_argument("--language")
    p.add_argument("--voice")
    p.add_argument("--token-ms", type=float, default=30.0, help="pause between tokens (default 30 ms)")
    p.set_defaults(func=run_say)

    p = subparsers.add_parser("ask", help="stream an OpenAI-compatible chat completion as one agent turn")
    p.add_argument("prompt")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", help="bearer token, when the server wants one")
    p.add_argument("--system", help="a system message")
    p.add_argument("--agent", default="assistant")
    p.add_argument("--session", required=True)
    p.add_argument("--language")
    p.add_argument("--voice")
    p.add_argument("--stall-timeout", type=float, default=10.0, metavar="S")
    p.add_argument("--on-interrupted", choices=("end", "cancel"), default="end",
                   help="after a stall or a broken stream: end the turn with what arrived, or cancel it")
    p.add_argument("--max-tokens", type=int, metavar="N", help="ask the server for at most N tokens")
    p.add_argument("--temperature", type=float, help="sampling temperature sent to the server")
    p.add_argument("--seed", type=int, help="sampling seed sent to the server (llama.cpp, vLLM)")
    p.set_defaults(func=run_ask)


def _resolve_conversation_path(name: str) -> Path:
    from voicebus.agents.corpus import corpus_path

    path = Path(name)
    if path.exists():
        return path
    shipped = corpus_path(name)
    if shipped.exists():
        return shipped
    raise FileNotFoundError(f"no conversation file {name!r} (nor a shipped one at {shipped})")


def run_record(args: argparse.Namespace, settings) -> int:
    from voicebus.agents.conversation_file import save
    from voicebus.agents.recorder import RecordError, record

    try:
        conversation = asyncio.run(record(settings, duration_s=args.duration, turns=args.turns, title=args.title))
    except RecordError as exc:
        print(f"voicebus record: {exc}", file=sys.stderr)
        return 2
    save(conversation, args.out)
    print(f"wrote {args.out}: {len(conversation.events)} events, {len(conversation.turns())} turns, "
          f"{conversation.duration_ms / 1000:.2f} s")
    return 0


def run_replay(args: argparse.Namespace, settings) -> int:
    from voicebus.agents.conversation_file import ConversationFormatError, load
    from voicebus.agents.replay import ReplayError, replay

    try:
        conversation = load(_resolve_conversation_path(args.file))
        report, heard_lines = asyncio.run(_replay_and_listen(settings, conversation, args))
    except (FileNotFoundError, ConversationFormatError, ReplayError) as exc:
        print(f"voicebus replay: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {report.events_sent} events in {len(report.copies)} copies (run {report.run_id}); "
          f"max lateness {report.max_lateness_ms:.1f} ms")
    for copy in report.copies:
        print("  " + ", ".join(f"{old} -> {new}" for old, new in copy.session_ids.items()))
    if heard_lines:
        print("what the listeners heard (TurnHeard):")
        print("\n".join(heard_lines))
    return 0


async def _replay_and_listen(settings, conversation, args: argparse.Namespace):
    """The replay, and (unless ``--heard-timeout 0``) the TurnHeard of each replayed turn: the
    follower starts before the first event, so no report is missed."""
    import uuid

    from voicebus.agents.replay import HeardCollector, describe_heard, plan_replay, replay, replayed_turns
    from voicebus.agents.sdk import HeardFollower, Publisher
    from voicebus.clock import now_us

    async with Publisher(settings) as agent:
        if not args.heard_timeout > 0:
            report = await replay(settings, conversation.events, args.speed, args.sessions, publisher=agent,
                                  keep_session_ids=args.keep_session_ids)
            return report, []
        run_id = uuid.uuid4().hex[:8]
        _, copies = plan_replay(conversation.events, args.sessions, run_id, args.keep_session_ids)
        turns = replayed_turns(copies)
        collector = HeardCollector(turns, since_us=now_us())
        async with HeardFollower(agent, on_heard=collector) as _follower:
            report = await replay(settings, conversation.events, args.speed, args.sessions, publisher=agent,
                                  run_id=run_id, keep_session_ids=args.keep_session_ids)
            print(f"replayed; waiting up to {args.heard_timeout:g} s for what the listeners heard "
                  "(--heard-timeout 0: do not wait)", flush=True)
            heard = await collector.wait(args.heard_timeout)
        return report, describe_heard(turns, heard, args.heard_timeout)


def run_say(args: argparse.Namespace, settings) -> int:
    from voicebus.agents.sdk import Publisher, new_turn_id
    from voicebus.agents.tokens import split_like_llm

    turn_id = args.turn or new_turn_id()
    # First, before any token: a caller can cancel the turn (or follow it) while it is spoken.
    print(f"turn {turn_id} of session {args.session} (agent {args.agent})", flush=True)

    async def say() -> str:
        async with Publisher(settings, args.agent) as agent:
            async with agent.turn(args.session, turn_id, language=args.language, voice=args.voice) as turn:
                for i, piece in enumerate(split_like_llm(args.text)):
                    if i:
                        await asyncio.sleep(args.token_ms / 1000.0)
                    await turn.token(piece)
            return turn.turn_id

    turn_id = asyncio.run(say())
    print(f"published turn {turn_id} of session {args.session} to agent {args.agent}")
    return 0


def run_ask(args: argparse.Namespace, settings) -> int:
    import aiohttp

    from voicebus.agents.openai_adapter import UpstreamError, speak_chat_completion
    from voicebus.agents.sdk import Publisher

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]

    extra = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                ("seed", args.seed)) if v is not None}

    async def ask():
        async with Publisher(settings, args.agent) as agent, aiohttp.ClientSession() as http:
            return await speak_chat_completion(
                agent, http, args.session, base_url=args.url, model=args.model, messages=messages,
                api_key=args.api_key, language=args.language, voice=args.voice,
                stall_timeout_s=args.stall_timeout, on_interrupted=args.on_interrupted, extra_body=extra,
            )

    try:
        result = asyncio.run(ask())
    except UpstreamError as exc:
        print(f"voicebus ask: {exc}", file=sys.stderr)
        return 1
    print(f"turn {result.turn_id}: {result.outcome}, {result.tokens} tokens")
    return 0 if result.outcome == "done" else 1
