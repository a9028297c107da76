"""`voicebus bench scale` on the real broker, at its smallest: every frame arrives and the figures
say what the edges read (docs/benchmarks.md has the full grid)."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeline.bench.scale import _turn_template, run
from pipeline.codecs import Codec

pytestmark = pytest.mark.kafka


def test_bench_scale_reports_bytes_frames_memory_and_latency_per_edge(make_settings, tmp_path):
    out = tmp_path / "scale.json"
    args = argparse.Namespace(edges="2", sessions="4", encodings="opus", seconds=0.5, quick=False, json=out)
    assert run(args, make_settings()) == 0
    [r] = json.loads(out.read_text())["runs"]
    assert (r["encoding"], r["edges"], r["sessions"], r["edges_reporting"]) == ("opus", 2, 4, 2)
    assert r["frames_received"] == r["frames_expected"] == 4 * 3
    assert r["frames_by_edge"] == [6, 6]  # each edge builds frames for its own players' sessions only
    # not sharded yet: each edge reads every session's audio
    assert r["bytes_by_edge"][0] == r["bytes_by_edge"][1] == 4 * r["bus_bytes_per_session_s"] * 0.48
    assert r["rss_mb_per_edge"] > 10 and 0 <= r["frame_p50_ms"] <= r["frame_p99_ms"]


def test_opus_puts_over_10x_fewer_bytes_per_session_on_the_bus_than_pcm16():
    codec = Codec()
    pcm, opus = ([len(codec.encode("AudioChunk", c)) for c in _turn_template(e, 3.0)] for e in ("pcm16", "opus"))
    assert len(pcm) == len(opus) and sum(pcm) > 10 * sum(opus)
