"""Per-stage latency arithmetic (voicebus.latency) and the listener's starvation measure."""

import pytest

from voicebus.latency import first_audio_stages, overhead_ms, percentile, summary
from voicebus.players.listener import HeardTurn

TIMELINE = {
    "first_token_at_us": 1_000_000, "text_complete_at_us": 1_300_000, "released_at_us": 1_330_000,
    "request_received_at_us": 1_332_000, "synthesis_started_at_us": 1_333_000,
    "audio_ready_at_us": 2_333_000, "published_at_us": 2_335_000, "edge_received_at_us": 2_336_000,
    "sent_at_us": 2_337_000,
}


def test_stages_are_milliseconds_after_the_first_token():
    stages = first_audio_stages(TIMELINE, received_at_us=2_338_000, audible_at_us=2_400_000)
    assert stages["sentence complete"] == 300
    assert stages["synthesis start"] == 333
    assert stages["received"] == 1338
    assert stages["audible"] == 1400


def test_overhead_is_ttfa_minus_text_wait_minus_model_time():
    # 1338 ms to first audio = 300 ms of text + 1000 ms of model + 38 ms added by the pipeline
    assert overhead_ms(TIMELINE, 2_338_000) == pytest.approx(38.0)


def test_percentiles_interpolate_and_summary_counts():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert summary([1.0, 3.0])["n"] == 2


def test_starvation_counts_the_silence_a_player_would_hit():
    turn = HeardTurn("t1", sample_rate=1000)
    # 100 ms of audio arrives at t=0, the next 100 ms at t=150 ms: 50 ms of silence, one gap;
    # the third arrives early (buffered) and causes none.
    turn.frames = [(0, 0, 0, 100), (150_000, 0, 1, 100), (200_000, 0, 2, 100)]
    assert turn.starvation() == (50.0, 1)
