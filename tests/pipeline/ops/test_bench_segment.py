"""`voicebus bench segment`'s speculative-release count (docs/benchmarks.md)."""

from __future__ import annotations

from voicebus.ops.bench.segment import _speculation


def test_speculation_counts_confirmed_and_retracted_sentences():
    rows = _speculation([("g", "en", "Hello world. Go to example.com now. Call Dr. Smith. She works at Yahoo! in Paris.")])
    # 4 sentences spoken; 5 tentative releases: 4 confirmed, "She works at Yahoo!" withdrawn by " in"
    assert rows[0] == ["g", "1", "4", "5", "4 (100%)", "1 (20.0%)", "30 / 100"]
    assert rows[-1][0] == "all" and rows[-1][1:] == rows[0][1:]


def test_the_cases_ship_in_the_package_and_the_bench_runs_from_any_folder(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    import voicebus
    from voicebus.cli import main
    from voicebus.ops.bench.segment import DEFAULT_CASES

    assert DEFAULT_CASES.is_file() and Path(voicebus.__file__).parent in DEFAULT_CASES.parents
    monkeypatch.chdir(tmp_path)  # nothing read relative to the working folder
    assert main(["bench", "segment", "--repeat", "1", "--no-clause-sweep"]) == 0
    out = capsys.readouterr().out
    assert "en/GOLDEN_EN_RULES_TEST_CASES  48" in out
    for lang in ("fr", "it", "hi", "ja", "zh"):  # voicebus's own streamed sets, scored beside pySBD
        assert f"{lang}/{lang.upper()}_STREAMED_CASES" in out
