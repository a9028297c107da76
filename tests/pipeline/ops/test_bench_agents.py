"""`voicebus bench agents` in miniature, through the real broker and a gate worker
subprocess: one round of short blocks; the JSON has the documented shape, every request it
waited for arrived, new agents joined, and each block announced itself as it started (the
whole benchmark runs for minutes: long benchmarks show progress)."""

from __future__ import annotations

import pytest

from voicebus.ops.bench.agents import run_bench

pytestmark = pytest.mark.kafka


async def test_a_short_bench_agents_run_reports_every_figure_and_its_progress(make_settings):
    lines: list[str] = []
    result = await run_bench(make_settings(), block_s=2.0, rounds=1, rate_per_min=120.0, n_others=1,
                             progress=lines.append)
    assert [line.split(" (")[0] for line in lines[:3]] == [f"bench agents: block {i}/3" for i in (1, 2, 3)], lines
    assert [name in line for name, line in zip(("quiet", "churn,", "churn_unseen"), lines)] == [True] * 3, lines
    assert lines[-1].startswith("bench agents: blocks done"), lines
    assert result["agents_joined"] >= 1
    assert result["requests"]["received"] >= result["requests"]["expected"] > 0, result["requests"]
    for key in ("new_agent_first_turn_ms", "later_turns_ms"):
        assert result[key]["n"] > 0 and 0 < result[key]["p50"] <= result[key]["p95"], result[key]
    for phase in ("quiet", "churn", "churn_unseen"):
        assert set(result["others_ms"][phase]) == {"p50", "p99", "n"}
    assert result["others_ms"]["quiet"]["n"] > 0 and result["others_ms"]["churn"]["n"] > 0, result["others_ms"]
