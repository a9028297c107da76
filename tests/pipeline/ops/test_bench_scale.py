"""`voicebus bench scale` on the real broker, at its smallest: every frame reaches every listener
once and in order, and the figures say what the edges read, hold and spend (docs/benchmarks.md
has the full grid)."""

from __future__ import annotations

import argparse
import json

import pytest

from voicebus.ops.bench.scale import _turn_template, run
from voicebus.codecs import Codec

pytestmark = pytest.mark.kafka


def test_bench_scale_reports_per_listener_delivery_and_per_edge_cost(make_settings, tmp_path):
    out = tmp_path / "scale.json"
    args = argparse.Namespace(edges="2", sessions="50", encodings="opus", seconds=0.5, quick=False, json=out,
                              partitions=4, listeners=4, listeners_per_process=100)
    assert run(args, make_settings()) == 0
    [r] = json.loads(out.read_text())["runs"]
    assert r["player_loop"] == "uvloop"  # the default where it is installed (the dev extra)
    assert (r["encoding"], r["edges"], r["sessions"], r["listeners"], r["edges_reporting"]) == ("opus", 2, 50, 200, 2)
    assert r["player_processes"] == 2 and r["listeners_reporting"] == 200
    # every listener heard every chunk of its session's turn, once and in order
    assert r["listeners_complete"] == 200 and r["frames_twice"] == r["frames_out_of_order"] == r["listeners_cut"] == 0
    assert r["frames_received"] == r["frames_expected"] == 200 * 3
    assert sum(r["frames_by_edge"]) == 200 * 3  # each session's frames are built by one edge, its owner
    assert sum(r["clients_by_edge"]) == 200 and sorted(p for o in r["owned_partitions_by_edge"] for p in o) == [0, 1, 2, 3]
    # sharded: each edge reads the audio of the sessions it owns, and only that (3 chunks each;
    # records differ by the length of the session id, "s1" .. "s49")
    turn_bytes = r["bus_bytes_per_session_s"] * 0.48
    for frames, read, held in zip(r["frames_by_edge"], r["bytes_by_edge"], r["sessions_held_by_edge"]):
        assert read == pytest.approx(frames / (3 * 4) * turn_bytes, rel=0.01) and held == frames / (3 * 4)
    assert sum(r["bytes_by_edge"]) == pytest.approx(50 * turn_bytes, rel=0.01)
    assert all(rss > 10 for rss in r["rss_mb_by_edge"]) and all(0 < cpu < 4 for cpu in r["cpu_by_edge"])
    assert 0 <= r["frame_p50_ms"] <= r["frame_p99_ms"]
    # from the broker's append time (whole milliseconds) to the listener: later, never much earlier
    assert -1 <= r["bus_to_listener_p50_ms"] <= r["bus_to_listener_p99_ms"] <= r["bus_to_listener_max_ms"]


def test_an_unknown_player_loop_is_refused_before_any_run(make_settings, tmp_path):
    args = argparse.Namespace(edges="1", sessions="1", encodings="opus", seconds=0.5, quick=False, json=None,
                              partitions=4, listeners=1, listeners_per_process=100, player_loop="uvloop,trio")
    with pytest.raises(SystemExit, match="trio"):
        run(args, make_settings())


def test_opus_puts_over_10x_fewer_bytes_per_session_on_the_bus_than_pcm16():
    codec = Codec()
    pcm, opus = ([len(codec.encode("AudioChunk", c)) for c in _turn_template(e, 3.0)] for e in ("pcm16", "opus"))
    assert len(pcm) == len(opus) and sum(pcm) > 10 * sum(opus)
