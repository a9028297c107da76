"""`voicebus bench gpu` runs end to end on the CPU with the tiny config and writes its figures
(docs/benchmarks.md); the figures themselves are only meaningful on a GPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def test_the_bench_runs_on_the_cpu_and_writes_both_modes_per_concurrency(tmp_path, capsys):
    from voicebus.cli import main

    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--tiny", "--device", "cpu", "--concurrency", "1,2", "--repeats", "1",
                 "--sentences", "1", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    env = data["environment"]
    assert env["device"] == "cpu" and env["config"] == "tiny" and env["weights"] == "random" and env["threads"] == 1
    assert [level["sessions"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level["speedup"] > 0
        for mode in ("unbatched", "batched"):
            r = level[mode]
            assert r["speech_s"] > 0 and r["wall_s"] > 0 and r["throughput"] == pytest.approx(r["speech_s"] / r["wall_s"], rel=0.01)
            assert 0 < r["ttfa_p50_s"] <= r["ttfa_max_s"] <= r["wall_s"]
        # the same sentences in both modes: the same speech
        assert level["batched"]["speech_s"] == level["unbatched"]["speech_s"]
    # batched, every session's first audio comes with the one forward pass
    two = data["levels"][1]["batched"]
    assert two["ttfa_p50_s"] == two["ttfa_max_s"]
    assert "speedup" in capsys.readouterr().out


def test_the_bench_runs_under_bfloat16_autocast_with_its_stfts_in_float32(tmp_path):
    from voicebus.cli import main

    out = tmp_path / "gpu.json"
    # a complex tensor of half precision has no multiply on the CPU: the inverse STFT would fail
    assert main(["bench", "gpu", "--tiny", "--device", "cpu", "--concurrency", "2", "--repeats", "1",
                 "--sentences", "1", "--threads", "1", "--dtype", "bfloat16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["dtype"] == "bfloat16"
    [level] = data["levels"]
    assert level["batched"]["speech_s"] == level["unbatched"]["speech_s"] > 0


def test_concurrency_levels_are_positive_integers():
    from voicebus.ops.bench.gpu import parse_concurrency

    assert parse_concurrency("1,2,4") == [1, 2, 4]
    for bad in ("", "0,2", "1,x"):
        with pytest.raises(SystemExit):
            parse_concurrency(bad)
