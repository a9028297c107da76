"""`voicebus bench scale` on the real broker, at its smallest: every frame arrives and the figures
say what the edges read (docs/benchmarks.md has the full grid)."""

from __future__ import annotations

import argparse
import json

import pytest

from voicebus.ops.bench.scale import _turn_template, run
from voicebus.codecs import Codec

pytestmark = pytest.mark.kafka


def test_bench_scale_reports_bytes_frames_memory_and_latency_per_edge(make_settings, tmp_path):
    out = tmp_path / "scale.json"
    args = argparse.Namespace(edges="2", sessions="8", encodings="opus", seconds=0.5, quick=False, json=out,
                              partitions=4)
    assert run(args, make_settings()) == 0
    [r] = json.loads(out.read_text())["runs"]
    assert (r["encoding"], r["edges"], r["sessions"], r["edges_reporting"]) == ("opus", 2, 8, 2)
    assert r["frames_received"] == r["frames_expected"] == 8 * 3
    assert sum(r["frames_by_edge"]) == 8 * 3  # each session's frames are built by one edge, its owner
    # sharded: each edge reads the audio of the sessions it owns, and only that (3 chunks each)
    turn_bytes = r["bus_bytes_per_session_s"] * 0.48
    for frames, read, held in zip(r["frames_by_edge"], r["bytes_by_edge"], r["sessions_held_by_edge"]):
        assert read == pytest.approx(frames / 3 * turn_bytes) and held == frames / 3
    assert sum(r["bytes_by_edge"]) == pytest.approx(8 * turn_bytes)
    assert r["rss_mb_per_edge"] > 10 and 0 <= r["frame_p50_ms"] <= r["frame_p99_ms"]


def test_opus_puts_over_10x_fewer_bytes_per_session_on_the_bus_than_pcm16():
    codec = Codec()
    pcm, opus = ([len(codec.encode("AudioChunk", c)) for c in _turn_template(e, 3.0)] for e in ("pcm16", "opus"))
    assert len(pcm) == len(opus) and sum(pcm) > 10 * sum(opus)
