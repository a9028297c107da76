"""`voicebus bench ttfa`'s summary and markdown on synthetic samples (pure: no Kafka, no model)."""

import json

import pytest

from voicebus.ops.bench.ttfa import markdown_table, summarise

META = {"runs": 2, "lengths": [1, 4], "concurrency": [1], "token_ms": 30.0, "engine": "tiny random weights",
        "device": "cpu", "wall_s": 1.0, "quick": True}


def _sample(mode, sentences, ttfa, audible=None, sessions=1):
    stages = {"sentence complete": 100.0, "released": 110.0, "request received": 112.0, "synthesis start": 113.0,
              "first audio": ttfa - 6, "published": ttfa - 5, "edge received": ttfa - 3, "sent": ttfa - 2, "received": ttfa}
    out = {"mode": mode, "sentences": sentences, "sessions": sessions, "ttfa_ms": ttfa, "stages": stages,
           "model_ttfa_ms": ttfa - 120, "overhead_ms": 8.0, "starvation_ms": 0.0, "starvation_gaps": 0, "audio_s": 3.0,
           "agent_first_token_skew_ms": 0.1}
    if audible is not None:
        out["audible_ms"] = audible
        stages["audible"] = audible
    return out


def _samples(browser):
    rows = []
    for ttfa_inc, ttfa_buf in ((200.0, 400.0), (220.0, 440.0)):
        for n in (1, 4):
            scale = 1 if n == 1 else 3
            rows.append(_sample("incremental", n, ttfa_inc, ttfa_inc + 50 if browser else None))
            rows.append(_sample("buffered", n, ttfa_buf * scale, ttfa_buf * scale + 50 if browser else None))
    return rows


def _conc(browser):
    return [_sample(m, 4, t, t + 60 if browser else None) for m, t in (("incremental", 210.0), ("buffered", 1300.0))]


def _cancels(browser):
    runs = []
    for ms in (40.0, 50.0):
        run = {"cancel_to_last_audio_received_ms": 0.0, "frames_in_flight_at_cancel": 0, "frames_after_stop": 0,
               "worker_cancel_to_last_chunk_published_ms": 2.0, "worker_saw_cancel_after_ms": 10.0, "stopped_by_edge": True}
        if browser:
            run |= {"page_audible_before_cancel": True, "cancel_to_page_silence_ms": ms,
                    "page_silent_quanta_checked": True, "page_loud_quanta_after_stop": 0, "page_quanta_after_stop": 400}
        runs.append(run)
    return runs


def test_summary_with_a_browser_has_audible_figures():
    r = summarise(_samples(True), _conc(True), _cancels(True), META | {"browser": "chromium"})
    for mode in ("incremental", "buffered"):
        assert {"p50", "p95", "n"} <= set(r[mode]["ttfa_ms"]) and r[mode]["audible_ms"]["n"] == 4
        assert r[mode]["by_length"]["1"]["stages_p50_ms"]["audible"] == r[mode]["by_length"]["1"]["audible_ms"]["p50"]
        assert r[mode]["by_concurrency"]["1"]["audible_ms"]["n"] == 1
    assert r["incremental"]["audible_ms"]["p50"] == pytest.approx(260.0)
    assert r["buffered"]["by_length"]["4"]["audible_ms"]["p50"] == pytest.approx(1310.0)
    assert r["ratio_audible_p50"] == pytest.approx(r["buffered"]["audible_ms"]["p50"] / 260.0)
    assert r["ratio_audible_p50_by_length"]["1"] == pytest.approx(470.0 / 260.0)
    assert r["cancel"]["cancel_to_page_silence_ms"]["p50"] == pytest.approx(45.0)
    assert r["cancel"]["page_loud_quanta_after_stop_total"] == 0
    json.dumps(r)  # the JSON the bench writes

    md = markdown_table(r)
    header = next(line for line in md.splitlines() if line.startswith("| answer | sentence complete"))
    assert header.rstrip(" |").endswith("received | audible")
    row4 = next(line for line in md.splitlines() if line.startswith("| 4 | "))
    assert row4.split("|")[-2].strip() == "260"  # audible p50 of the 4-sentence incremental answers
    assert "Time to audible start in the browser" in md and "renders silence p50 45 ms" in md


def test_without_a_browser_nothing_audible_is_reported():
    r = summarise(_samples(False), _conc(False), _cancels(False), META)
    assert "ratio_audible_p50" not in r and "audible_ms" not in r["incremental"]
    assert "audible" not in r["incremental"]["by_length"]["1"]["stages_p50_ms"]
    assert "cancel_to_page_silence_ms" not in r["cancel"]
    assert r["ratio_p50"] == pytest.approx(r["buffered"]["ttfa_ms"]["p50"] / r["incremental"]["ttfa_ms"]["p50"])
    md = markdown_table(r)
    assert "audible" not in md and "browser" not in md
    assert "| 1 sentence(s) | 210 / " in md


def test_a_traced_lane_adds_the_tracing_difference():
    """`--tracing`: samples of a third mode, "traced", give its TTFA and overhead beside the
    untraced incremental lane's and their difference; the buffered comparison is unchanged."""
    samples = _samples(False) + [_sample("traced", n, t) | {"overhead_ms": 8.5} for n in (1, 4) for t in (201.0, 221.0)]
    r = summarise(samples, _conc(False), _cancels(False), META)
    assert r["traced"]["ttfa_ms"]["n"] == 4
    assert r["tracing_delta_ms"]["ttfa_p50"] == pytest.approx(1.0)
    assert r["tracing_delta_ms"]["overhead_p50"] == pytest.approx(0.5)
    paired = r["tracing_delta_ms"]["paired_overhead"]  # every traced turn minus its untraced twin
    assert paired["n"] == 4 and paired["p50"] == pytest.approx(0.5) and paired["ci95_p50"] == pytest.approx([0.5, 0.5])
    assert r["ratio_p50"] == pytest.approx(summarise(_samples(False), _conc(False), _cancels(False), META)["ratio_p50"])
    r["tracing_path_cost_us"] = {"n": 10, "p50": 400.0, "p95": 900.0, "mean": 450.0}
    r["tracing_path_cpu_us"] = {"n": 10, "p50": 300.0, "p95": 350.0, "mean": 310.0}
    r["tracing_off_path_cost_us"] = {"n": 10, "p50": 1.5, "p95": 2.0, "mean": 1.6}
    md = markdown_table(r)
    assert "Tracing A/B" in md and "(+1.0 ms)" in md and "95 % CI [+0.5, +0.5] ms" in md and "(+0.5 ms)" in md and "p50 400 µs" in md and "CPU time p50 300 µs" in md and "p50 1.5 µs" in md


def test_the_tracing_path_cost_is_measured_on_and_off():
    from voicebus.ops.bench.ttfa import tracing_path_cost_us

    on, off = tracing_path_cost_us(50), tracing_path_cost_us(50, enabled=False)
    assert len(on["wall"]) == len(on["cpu"]) == len(off["wall"]) == 50 and all(c > 0 for c in on["cpu"])
    assert sorted(off["wall"])[25] < sorted(on["wall"])[25]


def test_a_sentence_released_before_its_confirming_token_did_not_wait_for_it():
    """Speculative release: the gate released the sentence (tentative) before the next token
    came, so none of the overhead is the confirming token's wait (it was counted as the whole
    token interval, and the rest came out negative: -20.5 ms p50)."""
    from voicebus.ops.bench.ttfa import _confirming_token_wait_ms

    tokens = [0, 30_000, 60_000, 90_000]
    waited = {"text_complete_at_us": 61_000, "released_at_us": 92_000}
    assert _confirming_token_wait_ms(waited, tokens) == pytest.approx(29.0)
    tentative = {"text_complete_at_us": 61_000, "released_at_us": 61_500}
    assert _confirming_token_wait_ms(tentative, tokens) == 0.0
    assert _confirming_token_wait_ms({"text_complete_at_us": 95_000, "released_at_us": 96_000}, tokens) == 0.0


def test_the_one_shot_paths_are_summarised_side_by_side():
    from voicebus.ops.bench import oneshot

    samples = [{"path": p, "sentences": n, "first_audio_ms": ms}
               for p, base in (("native", 300.0), ("openai", 310.0)) for n in (1, 4) for ms in (base, base + 20)]
    results = oneshot.summarise(samples)
    assert results["native"]["first_audio_ms"]["p50"] == 310.0 and results["openai"]["first_audio_ms"]["p50"] == 320.0
    assert results["openai_minus_native_p50_ms"] == 10.0
    table = oneshot.markdown(results)
    assert "/v1/audio/speech" in table and "| 4 sentence(s) |" in table and "+10.0 ms" in table
