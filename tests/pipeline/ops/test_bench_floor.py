"""`voicebus bench floor`: the playback layout it measures with, and one short run through the real
broker and pipeline (tiny model): the documented figures, nothing spliced, every preemption a cut."""

from __future__ import annotations

import argparse

import pytest
from rich.console import Console

from voicebus.ops.bench.floor import _bench, playback

RATE = 24000


def frame(at_ms: float, samples: int = 2400) -> tuple[int, int, int, int]:
    return (int(at_ms * 1000), 0, 0, samples)  # 2400 samples: 100 ms


def test_a_player_plays_each_frame_on_arrival_or_when_the_audio_before_it_ends():
    assert playback([frame(0), frame(50), frame(400)], RATE) == (0, 500_000)  # 0-100-200, a gap, 400-500
    # a turn queued behind audio still playing starts when it ends
    assert playback([frame(100)], RATE, busy_until_us=300_000) == (300_000, 400_000)


@pytest.mark.kafka
async def test_a_short_bench_floor_run_reports_every_figure(make_settings):
    settings = make_settings()
    args = argparse.Namespace(rounds=1, warmup_rounds=0, quick=False, token_ms=40.0, offset_ms=300.0, tiny=True,
                              bootstrap=settings.bootstrap, log_level=None)
    result = await _bench(args, settings, Console(stderr=True, quiet=True))
    assert result["queue"]["spliced"] == 0 and result["queue"]["gap_ms"]["n"] == 1
    assert result["queue"]["floor_wait_ms"]["p50"] > 0
    assert result["preempt"]["cut"] == 1 and result["preempt"]["stop_to_audio_ms"]["p50"] < 100
