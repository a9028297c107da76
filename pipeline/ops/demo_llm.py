"""`voicebus demo --llm`: a real LLM's answers spoken through the whole pipeline.

Starts what `voicebus demo` starts (Kafka, a gate worker, a synthesis worker, the edge) and the
local OpenAI-compatible server (`voicebus.ops.local_llm.LocalLlmServer`: llama-cpp-python with
SmolLM2-135M-Instruct, extra ``voicebus[llm]``). Each question is streamed through the OpenAI
adapter (`voicebus.agents.openai_adapter.speak_chat_completion`, what `voicebus ask` runs) as a turn of
agent `AGENT_ID`, whose text topic does not exist before the first question: its first turn is
a new agent joining, and the table shows whether that costs anything.

Questions come from ``--ask Q`` (repeatable), else from the terminal (one per line, until an
empty line or Ctrl-D) when stdin is a terminal, else `DEFAULT_QUESTIONS`. The player URL of the
session is printed on a line of its own: open it to hear the answers in a browser. Each answer is
written to ``<out>/llm/<turn>.wav`` and a row of the table: tokens, and, in ms, the model's first
token, the first sentence's release (after the first token), its release latency (the token that
completed it -> released) and the time to first audio at the edge's client.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from voicebus.settings import Settings

AGENT_ID = "llm"
SYSTEM_PROMPT = "You are a helpful voice assistant. Answer in two or three short sentences."
DEFAULT_QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me one tip for sleeping better.",
)
MAX_TOKENS = 96


async def read_topics(settings: Settings, topics: list[str]) -> list[tuple[str, str, dict]]:
    """Every record now on `topics` (from the beginning to the current end), decoded:
    (topic, message type, value). Topics that do not exist are skipped."""
    from voicebus.bus import read_to_end
    from voicebus.codecs import Codec

    codec = Codec()
    return [(r.topic, (decoded := codec.decode(r.value)).type, decoded.value)
            for r in await read_to_end(settings, topics)]


async def turn_release_latencies(settings: Settings, agent_id: str) -> dict[tuple[str, str], list[float]]:
    """Release latency (ms) of every sentence of every turn of `agent_id` so far, per (session, turn)
    (`voicebus.latency.release_latencies_ms`, from the text and synthesis topics)."""
    from voicebus.latency import release_latencies_ms
    from voicebus.schemas.messages import SynthesisRequest, TextEvent
    from voicebus.topics import text_topic

    records = await read_topics(settings, [text_topic(settings, agent_id), settings.synthesis_topic])
    events: dict[tuple[str, str], list[TextEvent]] = {}
    requests: dict[tuple[str, str], list[SynthesisRequest]] = {}
    for _, kind, value in records:
        key = (value["session_id"], value["turn_id"])
        if kind == "TextEvent" and value.get("agent_id") == agent_id:
            events.setdefault(key, []).append(TextEvent.from_record(value))
        elif kind == "SynthesisRequest":
            requests.setdefault(key, []).append(SynthesisRequest.from_record(value))
    return {key: release_latencies_ms(evs, requests.get(key, []), settings) for key, evs in events.items()}


def _prompt() -> str | None:
    try:
        return input("ask> ").strip() or None
    except EOFError:
        return None


async def _questions(args: argparse.Namespace, interactive: bool):
    """The questions to ask, one at a time: the terminal is read (in a thread, so the pipeline in
    this event loop goes on serving) only once the previous answer was spoken."""
    if args.ask:
        for question in args.ask:
            yield question
    elif interactive:
        while (line := await asyncio.to_thread(_prompt)) is not None:
            yield line
    else:
        for question in DEFAULT_QUESTIONS:
            yield question


def run_llm_demo(args: argparse.Namespace, settings: Settings, console, interactive: bool) -> int:
    from voicebus.ops.local_llm import LlmError, LocalLlmServer

    args.out.mkdir(parents=True, exist_ok=True)
    server = LocalLlmServer(log_path=args.out / "llm-server.log")
    try:
        with console.status("starting the LLM server (llama-cpp-python, SmolLM2-135M-Instruct)"):
            server.start()  # in this thread: the server dies with the thread that started it
    except LlmError as exc:
        console.print(f"[red]voicebus demo --llm: {exc}")
        return 2
    try:
        console.log(f"LLM server up in {server.started_in_s:.1f} s at {server.base_url}")
        return asyncio.run(_llm_demo(args, settings, console, server, interactive))
    finally:
        server.stop()


async def _llm_demo(args: argparse.Namespace, settings: Settings, console, server, interactive: bool) -> int:
    import aiohttp
    from rich.table import Table

    from voicebus.agents.openai_adapter import UpstreamError, speak_chat_completion
    from voicebus.agents.sdk import Publisher
    from voicebus.ops.demo_shared import load_engine, stack_options, wav_path
    from voicebus.ops.runtime import PipelineStack
    from voicebus.players.auth import issue_token, player_url
    from voicebus.players.listener import Listener

    engine = await asyncio.to_thread(load_engine, settings, args.tiny, console)
    # no agent topic made in advance: the LLM agent joins
    stack = PipelineStack(settings, engine, **stack_options(args))
    with console.status("starting the pipeline") as status:
        try:
            await stack.start(progress=lambda step: (console.log(f"starting {step}"), status.update(f"starting {step}")))
        except BaseException:
            await stack.stop()
            raise
    table = Table(title=f"answers of {server.alias} (ms; 'released' and TTFA after the answer's first token)")
    for header in ("turn", "question", "tokens", "first token", "sentence 0 released", "release latency",
                   "TTFA", "audio s"):
        table.add_column(header, justify="left" if header == "question" else "right")
    failures = 0
    session = f"llm-{time.strftime('%H%M%S')}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    try:
        console.log(f"pipeline up: Kafka at {stack.settings.bootstrap}, edge at {stack.edge_url}")
        token = issue_token(stack.settings.edge_secret, session, stack.settings.token_ttl_s)
        sys.stdout.write(f"\nHear the answers in a browser:\n\n{player_url(stack.edge_url, session, token)}\n\n")
        sys.stdout.flush()
        async with Listener(stack.edge_url, session, stack.settings.edge_secret) as listener, \
                Publisher(stack.settings, AGENT_ID) as agent, aiohttp.ClientSession() as http:
            n = -1
            async for question in _questions(args, interactive):
                n += 1
                messages.append({"role": "user", "content": question})
                asked = time.time()
                try:
                    result = await speak_chat_completion(
                        agent, http, session, base_url=server.base_url, model=server.alias, messages=messages,
                        turn_id=f"q{n}", extra_body={"max_tokens": MAX_TOKENS, "temperature": 0.3, "seed": 7})
                except UpstreamError as exc:
                    console.print(f"[red]{exc}")
                    failures += 1
                    break
                messages.append({"role": "assistant", "content": result.text})
                try:
                    heard = await listener.wait_turn_end(result.turn_id, args.turn_timeout)
                except TimeoutError:
                    console.print(f"[red]turn {result.turn_id}: no end of turn within {args.turn_timeout:g} s")
                    failures += 1
                    continue
                latencies = (await turn_release_latencies(stack.settings, AGENT_ID)).get((session, result.turn_id), [])
                row = [result.turn_id, question[:40], str(result.tokens)]
                timeline = heard.timelines.get(0) or next(iter(heard.timelines.values()), None)
                if timeline and heard.frames:
                    origin = timeline["first_token_at_us"]
                    row += [f"{(origin / 1e6 - asked) * 1000:.0f}",
                            f"{(timeline['released_at_us'] - origin) / 1000:.0f}",
                            f"{latencies[0]:.1f}" if latencies else "-",
                            f"{(heard.first_audio_at_us - origin) / 1000:.0f}", f"{heard.duration_s:.1f}"]
                    wav = heard.write_wav(wav_path(args.out, "llm", result.turn_id))
                    console.log(f"{result.turn_id}: {result.text.strip()[:200]!r} -> {wav}")
                else:
                    row += ["-"] * 4 + ["0"]
                    failures += 1
                table.add_row(*row)
                if interactive:
                    console.print(table)
        if not interactive:
            console.print(table)
    finally:
        with console.status("stopping the pipeline"):
            await stack.stop()
    console.log(f"WAV files in {Path(args.out) / 'llm'}/" if not failures else f"[red]{failures} answer(s) failed")
    return 1 if failures else 0
