"""The headless listener as a player: what it keeps around a barge-in (no edge, no Kafka)."""

from __future__ import annotations

from voicebus.players.listener import HeardTurn
from voicebus.players.protocol import AudioFrame


def _frame(sentence: int, chunk: int, samples: int = 480) -> AudioFrame:
    return AudioFrame(turn=1, sentence=sentence, chunk=chunk, sample_rate=24000, pcm=b"\x01\x00" * samples)


def test_frames_before_a_cancel_are_kept_and_played():
    turn = HeardTurn("t1")
    assert turn.add_frame(100, _frame(0, 0)) and turn.add_frame(200, _frame(0, 1, 240))
    assert [f[:3] for f in turn.frames] == [(100, 0, 0), (200, 0, 1)]
    assert len(turn.pcm) == 2 * 720 and turn.duration_s == 720 / 24000
    assert turn.last_audio_at_us == 200 and not turn.discarded


def test_frames_in_flight_after_the_cancel_are_discarded_not_counted_against_the_edge():
    turn = HeardTurn("t1")
    turn.add_frame(100, _frame(0, 0))
    turn.cancelled_at_us = 150
    assert not turn.add_frame(160, _frame(0, 1))
    assert len(turn.frames) == 1 and len(turn.pcm) == 2 * 480
    assert turn.discarded == [(160, 0, 1, 480)] and turn.frames_after_stop == 0
    assert turn.last_audio_at_us == 160


def test_frames_after_the_edges_stop_are_counted():
    turn = HeardTurn("t1")
    turn.add_frame(100, _frame(0, 0))
    turn.stopped = turn.ended = True  # the edge's "stop", without a cancel from this player
    assert not turn.add_frame(300, _frame(1, 0))
    assert turn.frames_after_stop == 1 and len(turn.frames) == 1


def test_turn_end_s_reason_is_kept():
    from voicebus.players.listener import Listener

    listener = Listener("http://127.0.0.1:1", "s1", "secret")
    listener._on_control({"type": "turn_start", "v": 1, "turn_id": "t1", "turn": 1, "sample_rate": 24000}, 0)
    listener._on_control({"type": "turn_end", "v": 1, "turn_id": "t1", "turn": 1, "reason": "sentence-failed"}, 1)
    assert listener.turns["t1"].ended and listener.turns["t1"].end_reason == "sentence-failed"


async def test_a_listener_the_edge_refuses_leaves_no_open_session_behind():
    """`async with` a listener whose start fails (the edge refuses its token): the HTTP session
    and socket it opened are closed on the way out, not left to the garbage collector."""
    import pytest

    from voicebus.players.listener import Listener
    from tests.players.edge_helpers import edge_settings, running_edge

    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        listener = Listener(str(client.make_url("/")), "s1", "not-the-edge-secret")
        with pytest.raises(ConnectionError, match="refused"):
            async with listener:
                pytest.fail("a refused listener must not get in")
        assert listener._http.closed and listener._ws.closed
