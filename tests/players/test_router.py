"""The pure routing core (players.router) without sockets."""

import time

import pytest

from players.router import SessionRouter, UnroutableChunk
from players.tone import tone_turn


def test_an_idle_client_is_not_taken_for_a_stalled_one():
    # A player that waited longer than the stall timeout for its first audio (a slow model, a
    # long retrieval) made no progress because there was nothing to send: it must not be cut off.
    router = SessionRouter(stall_timeout_s=0.05)
    channel = router.connect("s1")
    time.sleep(0.1)
    for chunk in tone_turn("s1", "t1", sentences=1, chunks_per_sentence=3):
        router.route(chunk)
    assert channel.closed is None
    assert sum(f.is_audio for f in channel.outbox) == 3


def test_a_client_that_stops_reading_while_frames_wait_is_closed():
    router = SessionRouter(stall_timeout_s=0.05)
    channel = router.connect("s1")
    chunks = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=3)
    router.route(chunks[0])
    time.sleep(0.1)  # frames wait, nobody sends them
    for chunk in chunks[1:]:
        router.route(chunk)
    assert channel.closed is not None and channel.closed.code == 4429


def test_a_chunk_that_is_not_whole_pcm16_samples_is_rejected_and_not_counted():
    router = SessionRouter()
    channel = router.connect("s1")
    odd = {**tone_turn("s1", "t1", sentences=1, chunks_per_sentence=1)[0], "pcm": b"\x01\x02\x03"}
    with pytest.raises(UnroutableChunk, match="not whole PCM16LE samples"):
        router.route(odd)
    assert not channel.outbox
    # a rejected chunk says nothing about the pipeline's speed: no latency sample, no chunk counted
    assert router.metrics.registry.get_sample_value(
        "voicebus_stage_latency_seconds_count", {"stage": "bus_to_edge"}
    ) in (None, 0.0)
    assert router.metrics.registry.get_sample_value("voicebus_edge_chunks_total") == 0.0
