"""The pure routing core (voicebus.players.router) without sockets."""

from dataclasses import replace

import pytest

from voicebus.players.router import SessionRouter, UnroutableChunk
from voicebus.players.tone import tone_turn
from voicebus.schemas.messages import ControlEvent


def test_an_idle_client_is_not_taken_for_a_stalled_one():
    # A player that waited longer than the stall timeout for its first audio (a slow model, a
    # long retrieval) made no progress because there was nothing to send: it must not be cut off.
    clock = FakeClock()
    router = SessionRouter(stall_timeout_s=10.0, clock=clock)
    channel = router.connect("s1")
    clock.now += 60
    for chunk in tone_turn("s1", "t1", sentences=1, chunks_per_sentence=3):
        router.route(chunk)
    assert channel.closed is None
    assert sum(f.is_audio for f in channel.outbox) == 3


async def test_the_outboxes_are_empty_only_when_every_client_s_is():
    router = SessionRouter(clock=FakeClock())
    assert router.outboxes_empty()  # nobody connected
    first, second = router.connect("s1"), router.connect("s2")
    for chunk in tone_turn("s1", "t1", sentences=1, chunks_per_sentence=2):
        router.route(chunk)
    assert not router.outboxes_empty() and first.outbox and not second.outbox
    while first.outbox:
        await first.next_frame()
    assert router.outboxes_empty()


def test_a_client_that_stops_reading_while_frames_wait_is_closed():
    clock = FakeClock()
    router = SessionRouter(stall_timeout_s=10.0, clock=clock)
    channel = router.connect("s1")
    chunks = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=3)
    router.route(chunks[0])
    clock.now += 9.9  # frames wait, nobody sends them: not yet a stall
    router.route(chunks[1])
    assert channel.closed is None
    clock.now += 0.2
    for chunk in chunks[2:]:
        router.route(chunk)
    assert channel.closed is not None and channel.closed.code == 4429


def test_a_chunk_that_is_not_whole_pcm16_samples_is_rejected_and_not_counted():
    router = SessionRouter()
    channel = router.connect("s1")
    odd = replace(tone_turn("s1", "t1", sentences=1, chunks_per_sentence=1)[0], pcm=b"\x01\x02\x03")
    with pytest.raises(UnroutableChunk, match="not whole PCM16LE samples"):
        router.route(odd)
    assert not channel.outbox
    # a rejected chunk says nothing about the pipeline's speed: no latency sample, no chunk counted
    assert router.metrics.registry.get_sample_value(
        "voicebus_stage_latency_seconds_count", {"stage": "bus_to_edge"}
    ) in (None, 0.0)
    assert router.metrics.registry.get_sample_value("voicebus_edge_chunks_total") == 0.0


class FakeClock:
    """Monotonic seconds the test moves by hand (the grace window, the stall rule, the cancel bucket)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def heard(channel) -> list[tuple[int, int]]:
    """(sentence, chunk) of every audio frame queued for `channel`, in order."""
    from voicebus.players import protocol

    return [(f.sentence, protocol.decode_audio(f.payload).chunk) for f in channel.outbox if f.is_audio]


def controls(channel, mtype: str) -> list[dict]:
    import json

    return [json.loads(f.payload) for f in channel.outbox if not f.is_audio and json.loads(f.payload)["type"] == mtype]


def test_a_chunk_with_a_negative_sequence_number_is_rejected_with_a_reason_not_a_struct_error():
    # The codec refuses it first; the router, fed directly, refuses it too (typed, dead-lettered).
    router = SessionRouter()
    router.connect("s1")
    bad = replace(tone_turn("s1", "t1", 1, 1)[0], sentence_seq=-1)
    with pytest.raises(UnroutableChunk, match="outside 0.."):
        router.route(bad)


def test_a_duplicate_chunk_is_forwarded_and_stored_once():
    router = SessionRouter()
    channel = router.connect("s1")
    chunks = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=2)
    for chunk in [chunks[0], chunks[0], chunks[1], chunks[1], chunks[0], chunks[2], chunks[3], chunks[3]]:
        router.route(chunk)
    assert heard(channel) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(controls(channel, "turn_end")) == 1
    assert len(router._sessions["s1"].turns["t1"].replay) == 4  # stored once too
    dropped = router.metrics.registry.get_sample_value
    assert dropped("voicebus_edge_dropped_frames_total", {"reason": "duplicate"}) == 3
    assert dropped("voicebus_edge_dropped_frames_total", {"reason": "after-turn-end"}) == 1


def test_a_sentence_re_spoken_from_its_start_contributes_only_its_missing_tail():
    # A worker spoke chunks 0-1 of sentence 1, died; its successor speaks sentence 1 again from
    # chunk 0: the listener must not hear the start of the sentence twice.
    router = SessionRouter()
    channel = router.connect("s1")
    first = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=4, freq_hz=300)
    again = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=4, freq_hz=300)
    for chunk in first[:6]:  # sentence 0 whole, sentence 1 chunks 0-1
        router.route(chunk)
    for chunk in again[4:]:  # sentence 1 again, from chunk 0
        router.route(chunk)
    assert heard(channel) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    # a whole sentence re-spoken after it was delivered adds nothing
    before = len(channel.outbox)
    router.route(replace(again[0], is_last_in_turn=False))
    assert len(channel.outbox) == before


def test_a_client_that_joins_mid_sentence_starts_at_the_next_sentence():
    router = SessionRouter()
    chunks = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=3)
    router.route(chunks[0])  # nobody listens yet
    channel = router.connect("s1")
    for chunk in chunks[1:]:
        router.route(chunk)
    assert heard(channel) == [(1, 0), (1, 1), (1, 2)]


def test_the_last_chunk_s_end_reason_reaches_the_player_in_turn_end():
    router = SessionRouter()
    channel = router.connect("s1")
    chunks = tone_turn("s1", "t1", sentences=2, chunks_per_sentence=1)
    router.route(chunks[0])
    # the worker could not speak the last sentence: it ends the turn with a reason and no audio
    router.route(replace(chunks[1], pcm=b"", end_reason="synthesis-failed"))
    assert controls(channel, "turn_end") == [{"type": "turn_end", "v": 1, "turn_id": "t1", "turn": 1,
                                              "reason": "synthesis-failed"}]
    late = router.connect("s1", resume={"turn_id": "t1", "sentence_seq": 0})  # a replay says it too
    assert controls(late, "turn_end")[0]["reason"] == "synthesis-failed"


def test_a_duplicate_last_chunk_still_ends_the_turn():
    # The first attempt's chunk 1 was not the last; the re-spoken sentence ends at chunk 1: the
    # turn must end although that chunk's audio is a duplicate.
    router = SessionRouter()
    channel = router.connect("s1")
    first = tone_turn("s1", "t1", sentences=1, chunks_per_sentence=3)
    for chunk in first[:2]:
        router.route(chunk)
    router.route(replace(first[1], is_last_chunk=True, is_last_in_turn=True))
    assert heard(channel) == [(0, 0), (0, 1)]
    assert len(controls(channel, "turn_end")) == 1


def test_chunks_of_sessions_nobody_listens_to_here_build_no_state():
    router = SessionRouter()
    for i in range(200):
        for chunk in tone_turn(f"s{i}", "t1", sentences=1, chunks_per_sentence=2):
            assert router.route(chunk) == 0
    assert router.replay_bytes == 0 and not router._sessions
    assert router.metrics.registry.get_sample_value("voicebus_edge_unserved_chunks_total") == 400


def test_a_session_is_kept_for_the_grace_window_after_its_last_client_left_then_dropped():
    clock = FakeClock()
    router = SessionRouter(grace_s=30.0, clock=clock)
    channel = router.connect("s1")
    chunks = tone_turn("s1", "t1", sentences=3, chunks_per_sentence=2)
    for chunk in chunks[:4]:
        router.route(chunk)
    router.disconnect(channel)
    for chunk in chunks[4:5]:  # still served: its replay grows while the player reconnects
        assert router.route(chunk) == 0
    clock.now += 29
    back = router.connect("s1", resume={"turn_id": "t1", "sentence_seq": 1})
    assert heard(back) == [(1, 0), (1, 1), (2, 0)]
    router.disconnect(back)
    clock.now += 31
    assert not router.served("s1") and router.replay_bytes == 0 and not router._replaying
    router.route(chunks[5])
    assert router.replay_bytes == 0
    late = router.connect("s1", resume={"turn_id": "t1", "sentence_seq": 1})
    assert heard(late) == []  # past the grace window nothing of the old turn is kept


def test_a_player_back_between_turns_gets_every_later_turn_even_one_that_ended_meanwhile():
    """bench chaos, kind ``edge``, 3 sessions: a player had heard turn t1 to its end; its edge died;
    turn t2 was spoken whole, and ended, while the player had no connection. Back with
    ``resume {t1, finished}`` it gets all of t2 (and not t1 again); without ``resume`` an ended turn
    is not sent (a new player does not hear old answers), which lost t2."""
    router = SessionRouter(grace_s=30.0)
    first = router.connect("s1")
    for chunk in tone_turn("s1", "t1", sentences=1, chunks_per_sentence=2):
        router.route(chunk)
    router.disconnect(first)
    for chunk in tone_turn("s1", "t2", sentences=2, chunks_per_sentence=1) + tone_turn("s1", "t3", 1, 2)[:1]:
        router.route(chunk)
    back = router.connect("s1", resume={"turn_id": "t1", "sentence_seq": 1, "finished": True})
    assert [m["turn_id"] for m in controls(back, "turn_start")] == ["t2", "t3"]
    assert [m["turn_id"] for m in controls(back, "turn_end")] == ["t2"]
    assert heard(back) == [(0, 0), (1, 0), (0, 0)]  # t2 whole, then t3 so far; nothing of t1
    router.disconnect(back)
    fresh = router.connect("s1")  # no resume: only the turn that has not ended
    assert [m["turn_id"] for m in controls(fresh, "turn_start")] == ["t3"]
    mid = router.connect("s1", resume={"turn_id": "t2", "sentence_seq": 1})  # was playing t2: its rest, then t3
    assert [m["turn_id"] for m in controls(mid, "turn_start")] == ["t2", "t3"] and heard(mid) == [(1, 0), (0, 0)]


def test_all_replay_buffers_together_stay_under_the_byte_limit():
    frame_bytes = 20 + 2 * 3600  # 150 ms of 24 kHz PCM16 and the header
    router = SessionRouter(replay_max_bytes=50 * frame_bytes, turns_per_session=4)
    channels = [router.connect(f"s{i}") for i in range(10)]
    peak = 0
    for i in range(10):
        for chunk in tone_turn(f"s{i}", "t1", sentences=4, chunks_per_sentence=5):
            router.route(chunk)
            peak = max(peak, router.replay_bytes)
    assert peak <= 50 * frame_bytes
    stored = sum(t.replay_bytes for s in router._sessions.values() for t in s.turns.values())
    assert stored == router.replay_bytes
    # the most recently active session kept its replay; the oldest ones gave theirs up first
    assert router._sessions["s9"].turns["t1"].replay and not router._sessions["s0"].turns["t1"].replay
    assert all(len(heard(c)) == 20 for c in channels)  # live delivery is not affected


def test_connections_past_the_per_session_and_per_edge_limits_are_refused():
    from voicebus.players.router import ConnectionRefused

    router = SessionRouter(max_clients=3, max_clients_per_session=2)
    a1, _a2 = router.connect("a"), router.connect("a")
    with pytest.raises(ConnectionRefused) as info:
        router.connect("a")
    assert info.value.code == "session-full" and info.value.close_code == 1013
    router.connect("b")
    with pytest.raises(ConnectionRefused) as info:
        router.connect("c")
    assert info.value.code == "edge-full"
    router.disconnect(a1)
    router.connect("c")  # a place became free


def test_the_cancel_bucket_allows_a_burst_then_its_rate():
    from voicebus.ratelimit import TokenBucket

    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2.0, burst=5, clock=clock)
    assert [bucket.take() for _ in range(7)] == [True] * 5 + [False] * 2
    clock.now += 1.0
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    clock.now += 3600
    assert sum(bucket.take() for _ in range(10)) == 5  # never more than the burst


YEAR_US = 365 * 24 * 3600 * 1_000_000


def whole_session_cancel(session_id: str, turn_ids=(), issued_at_us: int = 0, source: str = "agent") -> ControlEvent:
    from voicebus.clock import now_us

    return ControlEvent.cancel(session_id, None, turn_ids=turn_ids, reason="test", source=source,
                               issued_at_us=issued_at_us or now_us())


def test_a_whole_session_cancel_from_the_far_future_stops_the_turns_seen_and_mutes_nothing_later():
    from voicebus.clock import now_us

    router = SessionRouter()
    channel = router.connect("s1")
    router.route(tone_turn("s1", "t1", 2, 2)[0])
    router.apply_control(whole_session_cancel("s1", issued_at_us=now_us() + 10 * YEAR_US))
    assert [m["turn_id"] for m in controls(channel, "stop")] == ["t1"]
    assert router.route(tone_turn("s1", "t1", 2, 2)[1]) == 0  # the cancelled turn's later chunks
    channel.outbox.clear()
    for chunk in tone_turn("s1", "t2", 1, 2):  # the next turn plays
        assert router.route(chunk) == 1
    assert heard(channel) == [(0, 0), (0, 1)] and controls(channel, "turn_end")


def test_an_edge_clock_ahead_of_the_agent_s_does_not_cancel_a_new_turn():
    # A player's barge-in stamps the edge's clock; the next turn's first token carries the agent's,
    # an hour behind. Turns are cancelled by id, never by comparing those clocks.
    router = SessionRouter()
    channel = router.connect("s1")
    router.route(tone_turn("s1", "t1", 2, 2)[0])
    router.cancel("s1", None, router.known_turns("s1"), source="edge")
    assert [m["turn_id"] for m in controls(channel, "stop")] == ["t1"]
    channel.outbox.clear()
    for chunk in tone_turn("s1", "t2", 1, 2):
        from voicebus.clock import now_us

        assert router.route(replace(chunk, first_token_at_us=now_us() - 3600 * 1_000_000)) == 1
    assert heard(channel) == [(0, 0), (0, 1)]


def test_a_gate_resolution_stops_listed_turns_whose_audio_comes_later():
    router = SessionRouter()
    channel = router.connect("s1")
    router.route(tone_turn("s1", "t1", 1, 2)[0])
    router.apply_control(whole_session_cancel("s1"))  # the agent's: the edge had seen t1 only
    # the gate resolves it: it had t2 in flight too, whose audio had not reached the edge yet
    router.apply_control(whole_session_cancel("s1", turn_ids=["t1", "t2"], source="gate"))
    assert [m["turn_id"] for m in controls(channel, "stop")] == ["t1"]  # stopped once
    assert all(router.route(c) == 0 for c in tone_turn("s1", "t2", 1, 2))
    for chunk in tone_turn("s1", "t3", 1, 1):
        assert router.route(chunk) == 1


def test_cancels_with_made_up_turn_ids_do_not_grow_the_edge_s_memory():
    router = SessionRouter()
    router.connect("s1")
    for i in range(5000):
        router.cancel("s1", f"made-up-{i}", source="edge")
    assert len(router.cancels.cancelled_turns("s1")) <= 64
    assert len(router.cancels) == 1


def test_the_once_only_memory_of_a_turn_is_bounded_and_old_sentences_stay_done():
    from voicebus.players.router import TRACKED_SENTENCES

    router = SessionRouter()
    channel = router.connect("s1")
    chunk = tone_turn("s1", "t1", 1, 1, chunk_ms=10)[0]
    for s in range(TRACKED_SENTENCES + 100):
        router.route(replace(chunk, sentence_seq=s, is_last_in_turn=False))
    turn = router._sessions["s1"].turns["t1"]
    assert len(turn.forwarded) <= TRACKED_SENTENCES
    channel.outbox.clear()
    router.route(replace(chunk, sentence_seq=0, is_last_in_turn=False))  # forgotten, still done
    assert heard(channel) == []


def _restarting_worker_chunks(data, sentences: int, chunks: int) -> list[tuple[int, int]]:
    """(sentence, chunk) as workers that die and restart publish them: each attempt starts at a
    sentence at or before the one being spoken (from an older committed offset) and speaks from its
    chunk 0; the last attempt finishes the turn."""
    from hypothesis import strategies as st

    out: list[tuple[int, int]] = []
    at = 0
    for _ in range(data.draw(st.integers(0, 4), label="restarts")):
        start = data.draw(st.integers(0, at), label="restart from sentence")
        stop_sentence = data.draw(st.integers(start, sentences - 1), label="dies in sentence")
        stop_chunk = data.draw(st.integers(0, chunks - 1), label="after chunk")
        for s in range(start, stop_sentence + 1):
            last = stop_chunk if s == stop_sentence else chunks - 1
            out.extend((s, c) for c in range(last + 1))
            if data.draw(st.booleans(), label="producer retry"):
                out.append(out[-1])
        at = stop_sentence
    start = data.draw(st.integers(0, at), label="final attempt from")
    out.extend((s, c) for s in range(start, sentences) for c in range(chunks))
    return out


def test_any_history_of_worker_restarts_and_retries_is_heard_exactly_once_in_order():
    from hypothesis import given, settings as hsettings, strategies as st

    sentences, chunks = 3, 4
    template = {(c.sentence_seq, c.chunk_seq): c for c in tone_turn("s1", "t1", sentences, chunks, chunk_ms=5)}

    @hsettings(max_examples=150, deadline=None)
    @given(st.data())
    def check(data):
        router = SessionRouter(client_queue_frames=4096)
        channel = router.connect("s1")
        for key in _restarting_worker_chunks(data, sentences, chunks):
            router.route(template[key])
        assert heard(channel) == sorted(template)  # every chunk once, in order: nothing lost, nothing twice
        assert len(controls(channel, "turn_end")) == 1

    check()


def test_a_cancel_s_source_label_comes_from_a_closed_set():
    """A writer of the control topic chose `source`: 20,000 distinct values once added 20,000
    metric series. Unknown sources are counted as "other"."""
    from voicebus.players.metrics import EdgeMetrics
    from voicebus.players.router import SessionRouter

    metrics = EdgeMetrics()
    router = SessionRouter(metrics=metrics)
    for i in range(200):
        router.cancel("s", f"t{i}", source=f"attacker-{i}")
    router.cancel("s", "t-edge", source="edge")
    samples = {s.labels["source"]: s.value for m in metrics.registry.collect() if m.name == "voicebus_edge_cancels"
               for s in m.samples if s.name.endswith("_total")}
    assert samples == {"other": 200.0, "edge": 1.0}


def _order(channel) -> list[str]:
    """The outbox as the player gets it: ("audio", turn) or ("stop", turn), in order."""
    import json

    out = []
    for frame in channel.outbox:
        if frame.is_audio:
            out.append(("audio", frame.turn_id))
        else:
            message = json.loads(frame.payload)
            if message.get("type") == "stop":
                out.append(("stop", message["turn_id"]))
    return out


def floor_cut(session, cut, by):
    return ControlEvent.cancel(session, cut, reason="preempted", source="floor", issued_at_us=0, after_turn_id=by)


def test_a_preempted_turn_plays_on_until_its_preempter_s_first_audio_then_stops_ahead_of_it():
    clock = FakeClock()
    router = SessionRouter(clock=clock)
    channel = router.connect("s1")
    host = tone_turn("s1", "host", 3, 2)
    for chunk in host[:2]:
        router.route(chunk)
    assert router.apply_control(floor_cut("s1", "host", "expert")) == 0
    assert _order(channel) == [("audio", "host")] * 2  # nothing stopped yet: the host is still heard
    assert router.route(host[2]) == 0  # a chunk of the cut turn still on the bus: dropped, no stop
    assert ("stop", "host") not in _order(channel)
    router.route(tone_turn("s1", "expert", 1, 2)[0])
    assert _order(channel)[0] == ("stop", "host")  # the stop overtakes what was queued
    assert _order(channel)[-1] == ("audio", "expert")
    assert sum(1 for kind, turn in _order(channel) if kind == "stop") == 1


def test_a_preempted_turn_stops_anyway_when_its_preempter_is_not_heard_in_time():
    from voicebus.players.router import DEFERRED_STOP_S

    clock = FakeClock()
    router = SessionRouter(clock=clock)
    channel = router.connect("s1")
    router.route(tone_turn("s1", "host", 2, 2)[0])
    router.apply_control(floor_cut("s1", "host", "expert"))
    assert router.stop_overdue() == 0 and ("stop", "host") not in _order(channel)
    clock.now += DEFERRED_STOP_S + 0.1
    router.stop_overdue()
    assert ("stop", "host") in _order(channel)


def test_a_cut_whose_preempter_is_already_heard_or_cancelled_stops_at_once():
    router = SessionRouter(clock=FakeClock())
    channel = router.connect("s1")
    router.route(tone_turn("s1", "host", 2, 2)[0])
    router.route(tone_turn("s1", "expert", 2, 2)[0])
    router.apply_control(floor_cut("s1", "host", "expert"))
    assert ("stop", "host") in _order(channel)
    router.route(tone_turn("s1", "third", 2, 2)[0])
    router.apply_control(floor_cut("s1", "third", "fourth"))
    assert ("stop", "third") not in _order(channel)
    router.cancel("s1", "fourth")  # the preempter is cancelled before it is heard: the cut turn stops
    assert ("stop", "third") in _order(channel)


# --- fan-out: framed once, written at once ---------------------------------------------------
def _ws_messages(data: bytes) -> list[bytes | str]:
    """The messages of server WebSocket frames (unmasked, as `protocol.websocket_frame` writes)."""
    out: list[bytes | str] = []
    while data:
        opcode, n, at = data[0] & 0x0F, data[1] & 0x7F, 2
        if n == 126:
            n, at = int.from_bytes(data[2:4], "big"), 4
        elif n == 127:
            n, at = int.from_bytes(data[2:10], "big"), 10
        payload = data[at:at + n]
        out.append(payload if opcode == 2 else payload.decode())
        data = data[at + n:]
    return out


def _kinds(messages) -> list[str]:
    import json

    return ["audio" if isinstance(m, bytes) else json.loads(m)["type"] for m in messages]


def _wired_router(**options):
    from voicebus.players import protocol

    framed: list = []

    def wire(message):
        framed.append(message)
        return protocol.websocket_frame(message)

    router = SessionRouter(clock=FakeClock(), **options)
    router.wire = wire
    return router, framed


def test_a_chunk_is_framed_once_and_reaches_every_idle_player_in_one_write():
    router, framed = _wired_router(max_clients_per_session=50)
    writes: dict[str, list[bytes]] = {}
    channels = [router.connect("s1") for _ in range(50)]
    for channel in channels:
        channel.write_now = lambda data, cid=channel.client_id: writes.setdefault(cid, []).append(data) or True
    first, last = tone_turn("s1", "t1", sentences=1, chunks_per_sentence=2)
    router.route(first)
    # turn start, audio and timeline framed once for all 50 players, not once per player
    assert sorted(_kinds(framed)) == ["audio", "timeline", "turn_start"]
    for channel in channels:
        [data] = writes[channel.client_id]  # one write (one system call) per player for the chunk
        assert _kinds(_ws_messages(data)) == ["turn_start", "audio", "timeline"]
        assert not channel.outbox  # the sender task had nothing to do
    router.route(last)
    assert all(_kinds(_ws_messages(writes[c.client_id][1])) == ["audio", "turn_end"] for c in channels)
    registry = router.metrics.registry
    assert registry.get_sample_value("voicebus_edge_frames_sent_total") == 100
    assert registry.get_sample_value("voicebus_edge_overhead_seconds_count") == 100


def _busy_socket_player():
    """A wired router's player whose socket holds bytes until ``busy[0]`` is False; what
    `write_now` wrote, and a three-chunk turn for it."""
    router, _ = _wired_router()
    channel = router.connect("s1")
    busy = [True]
    written: list[bytes] = []
    channel.write_now = lambda data: not busy[0] and (written.append(data) or True)
    return router, channel, busy, written, tone_turn("s1", "t1", sentences=1, chunks_per_sentence=3)


def test_a_player_whose_socket_is_busy_gets_its_frames_queued_and_in_order():
    router, channel, busy, written, chunks = _busy_socket_player()
    router.route(chunks[0])  # the socket still holds bytes: the frames wait in the outbox
    busy[0] = False
    router.route(chunks[1])  # it takes bytes again, but older frames wait: this one queues behind them
    assert not written
    assert _kinds(f.payload for f in channel.outbox) == ["turn_start", "audio", "audio"]
    channel.outbox.clear()  # the sender sent them
    router.route(chunks[2])
    assert _kinds(_ws_messages(written[0])) == ["audio", "turn_end"]


async def test_a_frame_routed_while_the_sender_is_mid_send_waits_for_it():
    import asyncio

    router, channel, busy, written, chunks = _busy_socket_player()
    router.route(chunks[0])  # queued: turn_start, audio (with its timeline)
    socket_free = asyncio.Event()
    sent: list = []

    async def send_bytes(data):
        sent.append("audio")
        await socket_free.wait()  # a socket that drains slowly

    async def send_str(text):
        sent.append(_kinds([text])[0])

    sender = asyncio.create_task(channel.run_sender(send_bytes, send_str))
    while "audio" not in sent:
        await asyncio.sleep(0)
    busy[0] = False
    assert not channel.outbox  # the sender holds the first audio frame, nothing else waits
    router.route(chunks[1])  # must not overtake the frame being sent
    assert not written and len(channel.outbox) == 1
    socket_free.set()
    while channel.outbox:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    sender.cancel()
    assert sent == ["turn_start", "audio", "timeline", "audio"]


def test_frames_observed_together_count_as_each_observed_alone():
    from voicebus.players.metrics import EdgeMetrics

    one, many = EdgeMetrics(keep_overhead_samples=10), EdgeMetrics(keep_overhead_samples=10)
    for _ in range(7):
        one.observe_sent(0.003)
    many.observe_sent_many(0.003, 7)
    for name in ("voicebus_edge_frames_sent_total", "voicebus_edge_overhead_seconds_count",
                 "voicebus_edge_overhead_seconds_sum"):
        assert one.registry.get_sample_value(name) == pytest.approx(many.registry.get_sample_value(name))
    for le in ("0.001", "0.005", "+Inf"):
        labels = {"le": le}
        assert (one.registry.get_sample_value("voicebus_edge_overhead_seconds_bucket", labels)
                == many.registry.get_sample_value("voicebus_edge_overhead_seconds_bucket", labels))
    assert list(one.overhead_samples) == list(many.overhead_samples)
