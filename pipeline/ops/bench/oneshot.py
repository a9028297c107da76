"""`voicebus bench ttfa`'s one-shot part: a whole text spoken at once, through the OpenAI-compatible
speech endpoint (``POST /v1/audio/speech``, first byte of the answer) and through the native path
(the agents SDK publishes the same text as one token and the turn's end; a WebSocket listener's
first audio frame), alternated in one run on the same pipeline (A/B).

Both clocks start just before the text leaves the client and stop at its first audio bytes, so the
difference is what the HTTP door costs against the bus's own client: the request's parsing, the
edge's publish of the turn, the tap and the format's encoder. Each turn is abandoned once its first
audio arrived (the HTTP client closes its response; the listener cancels), as the time to first
audio does not depend on the rest.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from voicebus.latency import summary


async def native_first_audio_ms(stack: Any, settings: Any, text: str) -> float:
    """Publish `text` as one turn (one token, then its end); ms until a listener's first audio."""
    from voicebus.agents.sdk import Publisher
    from voicebus.players.listener import Listener

    session_id, turn_id = f"native-{uuid.uuid4().hex[:8]}", "t1"
    async with Listener(stack.edge_url, session_id, settings.edge_secret) as listener:
        async with Publisher(settings, agent_id="bench") as publisher:
            await publisher.ensure_agent_topic("bench")  # outside the clock, as the endpoint's is at start
            turn = publisher.turn(session_id, turn_id, language="en")
            started = time.perf_counter()
            await turn.token(text)
            await turn.end()
            await listener.wait_first_audio(turn_id, 300)
            elapsed = (time.perf_counter() - started) * 1000
            await listener.cancel(turn_id, reason="bench: first audio measured")
    return elapsed


async def openai_first_byte_ms(session: Any, base_url: str, text: str, fmt: str = "pcm") -> float:
    """POST `text` to ``/v1/audio/speech``; ms until the answer's first audio byte."""
    started = time.perf_counter()
    async with session.post(f"{base_url}/audio/speech", json={
            "model": "tts-1", "voice": "af_heart", "input": text, "response_format": fmt}) as response:
        response.raise_for_status()
        await response.content.readany()
        elapsed = (time.perf_counter() - started) * 1000
    return elapsed  # leaving the block closes the connection: the endpoint cancels the turn


async def measure(stack: Any, settings: Any, texts: list[tuple[int, str]], runs: int, idle) -> list[dict]:
    """`runs` rounds of every (sentences, text): both paths, in alternating order; `idle` is awaited
    after each turn (the workers finish what they had started)."""
    import aiohttp

    base_url = f"http://127.0.0.1:{settings.edge_port}/v1"
    samples: list[dict] = []
    async with aiohttp.ClientSession() as session:
        for run in range(runs):
            for length, text in texts:
                order = ("native", "openai") if (run + length) % 2 == 0 else ("openai", "native")
                for path in order:
                    if path == "native":
                        ms = await native_first_audio_ms(stack, settings, text)
                    else:
                        ms = await openai_first_byte_ms(session, base_url, text)
                    samples.append({"path": path, "sentences": length, "first_audio_ms": ms})
                    await idle()
    return samples


def summarise(samples: list[dict]) -> dict:
    out: dict = {}
    for path in ("native", "openai"):
        mine = [s for s in samples if s["path"] == path]
        out[path] = {"first_audio_ms": summary(s["first_audio_ms"] for s in mine),
                     "by_length": {str(n): summary(s["first_audio_ms"] for s in mine if s["sentences"] == n)
                                   for n in sorted({s["sentences"] for s in mine})}}
    out["openai_minus_native_p50_ms"] = out["openai"]["first_audio_ms"]["p50"] - out["native"]["first_audio_ms"]["p50"]
    out["samples"] = samples
    return out


def markdown(results: dict) -> str:
    n, o = results["native"], results["openai"]
    lines = ["", "One-shot text (the whole answer at once), first audio bytes at the client: the OpenAI-compatible "
                 "endpoint (`POST /v1/audio/speech`, `pcm`) vs the native path (SDK publish, WebSocket listener), "
                 "alternated in one run:", "",
             "| answer | native p50 / p95 (ms) | /v1/audio/speech p50 / p95 (ms) |", "|---|---|---|"]
    for length in n["by_length"]:
        a, b = n["by_length"][length], o["by_length"][length]
        lines.append(f"| {length} sentence(s) | {a['p50']:.0f} / {a['p95']:.0f} | {b['p50']:.0f} / {b['p95']:.0f} |")
    lines.append(f"| **all** | **{n['first_audio_ms']['p50']:.0f}** / {n['first_audio_ms']['p95']:.0f} "
                 f"| **{o['first_audio_ms']['p50']:.0f}** / {o['first_audio_ms']['p95']:.0f} |")
    lines += ["", f"The endpoint's cost over the native path: p50 {results['openai_minus_native_p50_ms']:+.1f} ms.", ""]
    return "\n".join(lines)
