"""The synthesis worker's pure core (no Kafka): scheduling order, bounds, cancel, dedupe, offsets,
and chunk building over the real kokoro code (tiny random-weight engine)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from voicebus.codecs import Codec
from voicebus.schemas.messages import ControlEvent, SynthesisRequest
from voicebus.synthesis.chunks import ChunkAssembler, chunk_duration_ms
from voicebus.synthesis.scheduler import (
    OffsetTracker,
    Outcome,
    SchedulerFull,
    SynthesisJob,
    SynthesisScheduler,
    synthesis_args,
)

CHUNK_MS = 150
SAMPLE_RATE = 24000


def request(session="s1", turn="t1", seq=0, text="Hello there.", last=False, first_token_at_us=1_000):
    return SynthesisRequest(
        session_id=session, turn_id=turn, agent_id="a", sentence_seq=seq, text=text,
        language="a", voice="af_heart", speed=1.0, is_last_in_turn=last,
        first_token_at_us=first_token_at_us, text_complete_at_us=2_000, released_at_us=3_000,
    )


def cancel(session="s1", turn="t1", issued_at_us=5_000, turn_ids=()):
    return ControlEvent.cancel(session, turn, reason="barge-in", source="test", issued_at_us=issued_at_us,
                               turn_ids=turn_ids)


class Recorder:
    def __init__(self):
        self.settled: list[tuple[tuple, Outcome]] = []

    def __call__(self, job: SynthesisJob, outcome: Outcome) -> None:
        self.settled.append(((job.key.session_id, job.key.turn_id, job.key.sentence_seq), outcome))


@pytest.fixture(scope="module")
def engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny(seed=0)


# --- scheduling ---------------------------------------------------------------------------------

def test_one_job_per_session_in_order_and_round_robin_across_sessions():
    sched = SynthesisScheduler(max_in_flight=8)
    for seq in range(3):
        sched.submit(request("A", seq=seq))
    sched.submit(request("B", seq=0))
    a0 = sched.next_job()
    assert a0.key.session_id == "A" and a0.key.sentence_seq == 0
    b0 = sched.next_job()  # A is busy: B's first sentence does not wait behind A's turn
    assert b0.key.session_id == "B"
    assert sched.next_job() is None  # both sessions busy
    sched.finish(a0)
    a1 = sched.next_job()
    assert a1.key.sentence_seq == 1
    sched.finish(b0)
    sched.finish(a1)
    assert sched.next_job().key.sentence_seq == 2


def test_bounded_in_flight_counts_queued_and_running():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=2, on_settled=rec)
    sched.submit(request(seq=0))
    sched.submit(request(seq=1))
    assert sched.free_slots == 0
    with pytest.raises(SchedulerFull):
        sched.submit(request(seq=2))
    job = sched.next_job()
    assert (sched.queue_depth, sched.in_flight, sched.free_slots) == (1, 2, 0)
    sched.submit(request(seq=0))  # a duplicate takes no slot even when full
    assert rec.settled == [(("s1", "t1", 0), Outcome.DUPLICATE)]
    sched.finish(job)
    assert sched.free_slots == 1
    sched.submit(request(seq=2))
    assert sched.in_flight == 2


def test_cancel_purges_queued_and_stops_running_but_not_other_turns_or_sessions():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=8, on_settled=rec)
    for seq in range(4):
        sched.submit(request("s1", "t1", seq))
    sched.submit(request("s1", "t2", 0))
    sched.submit(request("s2", "t1", 0))
    running = sched.next_job()
    purged, stopped = sched.apply_control(cancel("s1", "t1"))
    assert [j.key.sentence_seq for j in purged] == [1, 2, 3]
    assert stopped == [running] and running.should_stop()
    assert sched.finish(running) is Outcome.STOPPED
    left = [sched.next_job(), sched.next_job()]
    assert sorted((j.key.session_id, j.key.turn_id) for j in left) == [("s1", "t2"), ("s2", "t1")]
    assert [o for k, o in rec.settled] == [Outcome.CANCELLED] * 3 + [Outcome.STOPPED]
    # a late copy of a cancelled turn's request is skipped without synthesis
    sched.submit(request("s1", "t1", 9))
    assert rec.settled[-1] == (("s1", "t1", 9), Outcome.CANCELLED)


def test_session_wide_cancel_covers_the_turns_seen_so_far_and_the_gate_resolution_the_rest():
    sched = SynthesisScheduler(max_in_flight=8)
    sched.submit(request("s1", "old", 0, first_token_at_us=1_000))
    # a far-future timestamp compares with no clock (it used to mute every later turn)
    purged, _ = sched.apply_control(cancel("s1", None, issued_at_us=2**62))
    assert [j.key.turn_id for j in purged] == ["old"]
    sched.submit(request("s1", "new", 0, first_token_at_us=9_000))
    assert sched.next_job().key.turn_id == "new"
    # the gate's resolution names a turn this worker had not seen yet: its requests are skipped
    sched.apply_control(ControlEvent.cancel("s1", None, source="gate", turn_ids=["late"], issued_at_us=5_000))
    late = sched.submit(request("s1", "late", 0))
    assert sched.is_cancelled(late)


def test_dedupe_of_completed_and_of_queued_requests():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=4, on_settled=rec)
    sched.submit(request(seq=0))
    sched.submit(request(seq=0))  # already queued
    job = sched.next_job()
    sched.finish(job)
    sched.submit(request(seq=0))  # re-delivered after a rebalance: already spoken
    assert [o for _, o in rec.settled] == [Outcome.DUPLICATE, Outcome.SPOKEN, Outcome.DUPLICATE]
    assert sched.next_job() is None


def test_dropped_requests_are_not_remembered_so_a_redelivery_is_spoken():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=4, on_settled=rec)
    sched.submit(request(seq=0), origin=("p0", 10))
    sched.submit(request("s2", seq=0), origin=("p1", 11))
    dropped = sched.drop_queued(lambda j: j.origin[0] == "p0")
    assert [j.key.session_id for j in dropped] == ["s1"]
    sched.submit(request(seq=0), origin=("p0", 10))
    assert rec.settled == [(("s1", "t1", 0), Outcome.DROPPED)]
    assert sched.in_flight == 2


def test_offset_tracker_commits_only_contiguous_settled_offsets():
    t = OffsetTracker()
    for off in (5, 6, 7):
        t.track("p", off)
    assert t.settle("p", 6) is None  # 5 still pending: committing 7 would lose it on a crash
    assert t.unsettled("p") == 2
    assert t.settle("p", 5) == 7
    assert t.settle("p", 7) == 8
    t.track("p", 8)
    t.forget(["p"])
    assert t.settle("p", 8) is None


class StepClock:
    """Epoch µs that move only when the test says (the pure core's clock, passed in)."""

    def __init__(self, now_us: int = 1_000_000) -> None:
        self.now_us = now_us

    def __call__(self) -> int:
        return self.now_us


def test_the_scheduler_stamps_jobs_with_the_clock_it_is_given():
    clock = StepClock(50_000)
    sched = SynthesisScheduler(max_in_flight=2, clock_us=clock)
    job = sched.submit(request())
    clock.now_us = 80_000
    assert sched.next_job() is job
    assert (job.received_at_us, job.started_at_us) == (50_000, 80_000)


def test_the_assembler_stamps_chunks_and_measures_the_real_time_factor_on_its_clock():
    clock = StepClock(1_000_000)
    assembler = ChunkAssembler(SynthesisJob(request(last=True), received_at_us=1), chunk_ms=CHUNK_MS,
                               sample_rate=SAMPLE_RATE, clock_us=clock)
    assert assembler.realtime_factor is None  # no audio yet
    second = SAMPLE_RATE * 2  # bytes of one second of PCM16
    clock.now_us += 500_000
    out = assembler.feed(b"\x01\x00" * (second // 2))  # 1 s of audio, ready 0.5 s after the start
    assert assembler.realtime_factor == pytest.approx(0.5)
    clock.now_us += 1_500_000
    out += assembler.feed(b"\x01\x00" * (second // 2))  # 2 s of audio in 2 s: as fast as it plays
    clock.now_us += 9_000_000  # publishing the last chunks is not synthesis
    out += assembler.finish()
    assert assembler.realtime_factor == pytest.approx(1.0)
    assert {c.synthesis_started_at_us for c in out} == {1_000_000}
    assert out[0].audio_ready_at_us == 1_500_000 and out[-1].audio_ready_at_us == 12_000_000


def test_the_real_time_watch_warns_once_when_the_worker_falls_behind_and_again_after_it_recovered():
    from voicebus.synthesis.metrics import RealTimeWatch

    watch = RealTimeWatch(window=4, min_sentences=3)
    assert [watch.observe(f) for f in (1.6, 1.4)] == [None, None]  # too few sentences to say
    assert watch.observe(1.2) == pytest.approx(1.4)  # median of three over 1: the warning
    assert [watch.observe(f) for f in (2.0, 1.1)] == [None, None]  # still behind: said once
    assert [watch.observe(f) for f in (0.3, 0.4, 0.3)] == [None, None, None]  # back under 1
    assert watch.slow is False
    assert [watch.observe(f) for f in (1.5, 1.7, 1.9)] == [None, None, pytest.approx(1.6)]


# --- chunks over the real kokoro code -------------------------------------------------------------

def build_chunks(engine, job, chunk_ms=CHUNK_MS):
    assembler = ChunkAssembler(job, chunk_ms=chunk_ms, sample_rate=engine.sample_rate, worker_id="w1")
    chunks = []
    raw = b""
    for pcm in engine.stream(chunk_ms=chunk_ms, should_stop=job.should_stop, **synthesis_args(job)):
        raw += pcm
        chunks += assembler.feed(pcm)
    chunks += assembler.finish()
    return chunks, raw


def test_chunks_are_timed_ordered_flagged_and_valid_audio_chunks(engine):
    job = SynthesisJob(request(text="Hello there, how are you today?", last=True), received_at_us=2_500)
    chunks, raw = build_chunks(engine, job)
    assert len(chunks) >= 3
    assert b"".join(c.pcm for c in chunks) == raw  # nothing lost or reordered
    assert [c.chunk_seq for c in chunks] == list(range(len(chunks)))
    assert [c.is_last_chunk for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c.is_last_in_turn for c in chunks] == [False] * (len(chunks) - 1) + [True]
    for c in chunks[:-1]:
        assert chunk_duration_ms(c) == pytest.approx(CHUNK_MS)
    assert 0 < chunk_duration_ms(chunks[-1]) < CHUNK_MS * 1.25
    first = chunks[0]
    assert (first.first_token_at_us, first.text_complete_at_us, first.released_at_us) == (1_000, 2_000, 3_000)
    assert first.request_received_at_us == 2_500
    assert first.request_received_at_us <= first.synthesis_started_at_us <= first.audio_ready_at_us
    assert all(a.audio_ready_at_us <= b.audio_ready_at_us for a, b in zip(chunks, chunks[1:]))
    codec = Codec()
    for c in chunks:  # the wire contract accepts them
        assert codec.decode(codec.encode("AudioChunk", c)).value["chunk_seq"] == c.chunk_seq


def test_where_the_engine_pauses_to_decode_more_nothing_made_so_far_is_held_back():
    """A window's end (``pause``): the held chunk and the whole remainder go out then, not after
    the next window is decoded (held, a player had one chunk to play meanwhile: bench ttfa's
    silence after a turn's first chunk); the last chunk still closes the sentence."""
    job = SynthesisJob(request(last=True), received_at_us=10)
    assembler = ChunkAssembler(job, chunk_ms=CHUNK_MS, sample_rate=SAMPLE_RATE)
    chunk_bytes = SAMPLE_RATE * CHUNK_MS // 1000 * 2
    window = b"\x01\x00" * (chunk_bytes + chunk_bytes // 2 // 2)  # two chunks and a half, in two feeds
    out = assembler.feed(window[:chunk_bytes]) + assembler.feed(window[chunk_bytes:], pause=True)
    assert [len(c.pcm) for c in out] == [chunk_bytes, chunk_bytes, chunk_bytes // 2]  # all of it, now
    assert not any(c.is_last_chunk for c in out)
    tiny = assembler.feed(b"\x01\x00" * 10, pause=True)  # under a quarter chunk: kept for what follows
    assert tiny == []
    rest = assembler.feed(b"\x02\x00" * (chunk_bytes // 2)) + assembler.finish()
    assert [(len(c.pcm), c.is_last_chunk) for c in rest] == [(chunk_bytes + 20, True)]
    assert [c.chunk_seq for c in out + rest] == list(range(4))
    # Opus: what goes out before the end is whole 20 ms frames, the rest waits for the next window
    from voicebus.schemas.contract import split_opus_packets

    opus = opus_assembler(SynthesisJob(request(last=True), received_at_us=10))
    early = opus.feed(b"\x01\x00" * (8 * 480 + 3 * 480 + 100), pause=True)  # a chunk, 3 frames and a bit
    assert [len(split_opus_packets(c.pcm)) for c in early] == [8, 3]
    closing = opus.feed(b"\x01\x00" * 380) + opus.finish()  # the bit and the rest: one more frame
    assert [(len(split_opus_packets(c.pcm)), c.is_last_chunk) for c in closing] == [(1 + 1, True)]


def test_end_of_turn_marker_yields_one_empty_last_chunk_without_synthesis():
    job = SynthesisJob(request(text="", seq=4, last=True), received_at_us=1)
    assert job.is_end_marker
    chunks = ChunkAssembler(job, chunk_ms=CHUNK_MS, sample_rate=SAMPLE_RATE).finish()
    assert len(chunks) == 1
    assert chunks[0].pcm == b"" and chunks[0].is_last_chunk and chunks[0].is_last_in_turn
    assert chunks[0].sentence_seq == 4 and chunks[0].chunk_seq == 0


def test_a_failed_sentence_sends_what_it_has_then_an_empty_last_chunk_with_its_reason():
    job = SynthesisJob(request(last=True), received_at_us=10)
    assembler = ChunkAssembler(job, chunk_ms=CHUNK_MS, sample_rate=SAMPLE_RATE)
    chunk_bytes = SAMPLE_RATE * CHUNK_MS // 1000 * 2
    out = assembler.feed(b"\x01\x00" * (chunk_bytes // 2 * 2 + 10))  # two chunks and a bit: one held back
    out += assembler.finish(end_reason="no-voices")
    assert [c.chunk_seq for c in out] == [0, 1, 2]
    assert [len(c.pcm) for c in out] == [chunk_bytes, chunk_bytes + 20, 0]
    assert [(c.is_last_chunk, c.is_last_in_turn, c.end_reason) for c in out] == [
        (False, False, ""), (False, False, ""), (True, True, "no-voices")]
    codec = Codec()
    assert all(codec.decode(codec.encode("AudioChunk", c)).value["end_reason"] == c.end_reason for c in out)
    # nothing made yet: the closing chunk alone, and a sentence inside the turn does not end the turn
    inner = ChunkAssembler(SynthesisJob(request(last=False), received_at_us=10), chunk_ms=CHUNK_MS,
                           sample_rate=SAMPLE_RATE).finish(end_reason="engine-error")
    assert [(c.pcm, c.is_last_chunk, c.is_last_in_turn, c.end_reason) for c in inner] == [
        (b"", True, False, "engine-error")]


def opus_assembler(job, chunk_ms=CHUNK_MS):
    from voicebus.audio_codec import AudioFormat
    from voicebus.schemas.contract import AudioEncoding

    return ChunkAssembler(job, chunk_ms=chunk_ms, sample_rate=SAMPLE_RATE, audio=AudioFormat(AudioEncoding.OPUS))


def test_opus_chunks_are_whole_packets_of_whole_frames_and_decode_to_the_sentence():
    import numpy as np

    from voicebus.audio_codec import OpusDecoder
    from voicebus.players.tone import tone_pcm
    from voicebus.schemas.contract import AudioEncoding, split_opus_packets

    job = SynthesisJob(request(last=True), received_at_us=10)
    assembler = opus_assembler(job)
    assert assembler.chunk_bytes == 160 * 24 * 2  # 150 ms rounded to whole 20 ms frames
    pcm = tone_pcm(0.98)  # 6 chunks and 20 ms: the last takes the rest (as PCM does)
    chunks = assembler.feed(pcm[:20_000]) + assembler.feed(pcm[20_000:]) + assembler.finish()
    assert [c.chunk_seq for c in chunks] == list(range(6))
    assert [c.is_last_chunk for c in chunks] == [False] * 5 + [True]
    assert all(c.encoding == AudioEncoding.OPUS for c in chunks)
    # each chunk's packets stand alone: one per 20 ms frame (the last also holds the encoder's flush)
    assert [len(split_opus_packets(c.pcm)) for c in chunks[:-1]] == [8] * 5
    assert len(split_opus_packets(chunks[-1].pcm)) == 9 + 1
    decoder = OpusDecoder(SAMPLE_RATE)
    decoded = np.frombuffer(b"".join(decoder.decode(c.pcm) for c in chunks) + decoder.flush(), "<i2")
    assert 23_520 <= len(decoded) <= 23_520 + 2 * 480
    assert 0.25 < np.abs(decoded).max() / 32767 < 0.35  # the 0.3 tone
    assert sum(len(c.pcm) for c in chunks) * 10 < len(pcm)  # over 10x smaller than PCM16
    codec = Codec()
    for c in chunks:  # the wire contract accepts them
        assert codec.decode(codec.encode("AudioChunk", c)).value["pcm"] == c.pcm


def test_an_opus_sentence_that_fails_flushes_its_audio_before_the_empty_closing_chunk():
    from voicebus.schemas.contract import split_opus_packets

    job = SynthesisJob(request(last=True), received_at_us=10)
    assembler = opus_assembler(job)
    out = assembler.feed(b"\x01\x00" * (assembler.chunk_bytes + 10))  # two chunks and a bit: one held back
    out += assembler.finish(end_reason="no-voices")
    assert [(c.chunk_seq, c.is_last_chunk, c.end_reason) for c in out] == [
        (0, False, ""), (1, False, ""), (2, True, "no-voices")]
    assert len(split_opus_packets(out[1].pcm)) > 8 and out[2].pcm == b""  # the flush rides with the audio
    # an end-of-turn marker opens no encoder and carries no packet
    marker = opus_assembler(SynthesisJob(request(text="", seq=4, last=True), received_at_us=1)).finish()
    assert [(c.pcm, c.is_last_in_turn) for c in marker] == [(b"", True)]


def test_what_the_engine_cannot_speak_is_named_by_reason():
    from voicebus.codecs import InvalidMessage
    from voicebus.schemas.contract import UnknownLanguage
    from voicebus.synthesis.engine import EngineError, NoVoices
    from voicebus.synthesis.worker import speak_failure_reason

    assert speak_failure_reason(UnknownLanguage("x")) == "unknown-language"
    assert speak_failure_reason(NoVoices("x")) == "no-voices"
    assert speak_failure_reason(InvalidMessage("x")) == "contract-violation"
    assert speak_failure_reason(ValueError("speed")) == "invalid-request"
    assert speak_failure_reason(EngineError("x")) == "engine-error"
    assert speak_failure_reason(RuntimeError("a torch error")) == "engine-error"


def test_cancel_stops_real_synthesis_in_flight_before_its_next_chunk(engine):
    """The engine runs in a thread (as in the worker); a cancel applied on the other thread stops
    it before its next chunk."""
    sched = SynthesisScheduler(max_in_flight=2)
    text = "One two three four five six seven eight, nine ten eleven."  # two pieces (8 words, then 3)
    sched.submit(request(text=text))
    job = sched.next_job()
    full_chunks = sum(1 for _ in engine.stream(chunk_ms=CHUNK_MS, **synthesis_args(job)))
    got: list[bytes] = []
    first = threading.Event()
    after_cancel: list[bytes] = []
    cancelled = threading.Event()

    def synthesize():
        for pcm in engine.stream(chunk_ms=CHUNK_MS, should_stop=job.should_stop, **synthesis_args(job)):
            (after_cancel if cancelled.is_set() else got).append(pcm)
            first.set()

    thread = threading.Thread(target=synthesize)
    thread.start()
    assert first.wait(60)
    sched.apply_control(cancel())
    cancelled.set()
    thread.join(60)
    assert not thread.is_alive()
    # at most the one chunk whose check had passed when the cancel landed; the worker's own
    # pre-publish check (on the loop that applies cancels) drops that one too
    assert len(after_cancel) <= 1
    assert 0 < len(got) < full_chunks
    assert sched.finish(job) is Outcome.STOPPED


def test_only_a_turns_first_sentence_asks_for_an_early_first_clause():
    from voicebus.synthesis.scheduler import SynthesisJob

    def args_for(seq):
        job = SynthesisJob(request("s", "t", seq, "Hi, there you are."), received_at_us=0)
        return synthesis_args(job, opening_clause_min_words=3)

    assert args_for(0)["first_clause_min_words"] == 3
    assert args_for(1)["first_clause_min_words"] == 0


# --- speculative release: tentative requests (docs/worker.md) ----------------------------------------


def tentative(seq=0, text="Hello there.", **kw):
    return replace(request(seq=seq, text=text, **kw), tentative=True)


def confirm(seq=0, last=False):
    return request(seq=seq, text="", last=last)  # empty and not tentative: a confirmation


def test_a_confirmed_tentative_job_publishes_held_chunks_with_the_turn_end_of_its_confirmation():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=1, on_settled=rec)
    sched.submit(tentative(), origin=("p", 0))
    job = sched.next_job()
    assert job.unconfirmed
    sched.park(job)  # synthesized before the confirmation came: no slot taken, session blocked
    assert sched.free_slots == 1 and sched.next_job() is None
    sched.submit(request(seq=1, text="Next."))  # cannot overtake it
    assert sched.next_job() is None
    sched.submit(confirm(last=True), origin=("p", 1))
    again = sched.next_job()
    assert again is job and not job.unconfirmed and job.request.is_last_in_turn and job.request.text == "Hello there."
    sched.finish(job)
    assert sched.next_job().key.sentence_seq == 1
    assert [o for _, o in rec.settled] == [Outcome.SETTLEMENT, Outcome.SPOKEN]


@pytest.mark.parametrize("where", ["queued", "running", "parked"])
def test_a_withdrawn_tentative_job_is_dropped_and_its_seq_spoken_by_the_replacement(where):
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=2, on_settled=rec)
    sched.submit(tentative(text="Go to example."))
    job = None
    if where != "queued":
        job = sched.next_job()
        if where == "parked":
            sched.park(job)
    sched.submit(tentative(text=""))  # withdrawn
    if where == "running":
        assert job.stop_requested and job.stop_reason is Outcome.RETRACTED
        assert sched.finish(job) is Outcome.RETRACTED
    assert sorted(o.value for _, o in rec.settled) == ["retracted", "settlement"]
    sched.submit(request(text="Go to example.com now!"))  # the same key: not a duplicate
    replacement = sched.next_job()
    assert replacement.request.text == "Go to example.com now!" and not replacement.unconfirmed


def test_a_final_request_with_other_text_replaces_a_running_tentative_one_in_order():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=2, on_settled=rec)
    sched.submit(tentative(text='He said "stop.'))
    job = sched.next_job()
    sched.submit(request(text='He said "stop."'))
    assert job.stop_reason is Outcome.RETRACTED
    assert sched.next_job() is None  # the session's running job must end first
    sched.finish(job)
    assert sched.next_job().request.text == 'He said "stop."'


def test_a_cancel_drops_a_parked_tentative_job():
    rec = Recorder()
    sched = SynthesisScheduler(max_in_flight=2, on_settled=rec)
    sched.submit(tentative())
    sched.park(sched.next_job())
    purged, _ = sched.apply_control(cancel())
    assert len(purged) == 1 and rec.settled[-1][1] is Outcome.CANCELLED and sched.parked == []


async def test_a_slot_freed_between_the_fetch_loops_look_and_its_wait_still_wakes_it():
    """The worker's fetch and synthesis loops as they interleave when a job ends right as the fetch
    loop goes back to sleep: the fetch loop has seen no free slot and begun its wait (a task not yet
    run), the synthesis loop ends the job, finds nothing to do and sleeps too. One event that both
    loops cleared lost the fetch loop's wakeup there: both slept, the partitions paused, until the
    next control event came."""
    sched = SynthesisScheduler(max_in_flight=1)
    sched.submit(request(seq=0))
    job = sched.next_job()
    assert sched.free_slots == 0
    fetch_wait = asyncio.create_task(sched.changes.wait(sched.changes.generation, timeout_s=2.0))
    sched.finish(job, Outcome.STOPPED)
    assert sched.next_job() is None
    synthesis_wait = asyncio.create_task(sched.changes.wait(sched.changes.generation, timeout_s=2.0))
    assert await fetch_wait, "the fetch loop slept through the slot that freed"
    assert sched.free_slots == 1 and not synthesis_wait.done()
    sched.submit(request(seq=1))
    assert await synthesis_wait


@pytest.mark.parametrize("change", ["submit", "cancelled at next_job", "finish", "park", "cancel", "drop"])
def test_every_change_that_frees_a_slot_or_readies_a_job_advances_the_changes(change):
    sched = SynthesisScheduler(max_in_flight=3)
    sched.submit(request(seq=0))
    sched.submit(tentative(session="s2"))
    running = [sched.next_job(), sched.next_job()] if change in ("finish", "park") else []
    before = sched.changes.generation
    if change == "submit":
        sched.submit(request(session="s3"))
    elif change == "cancelled at next_job":
        sched.cancels.apply(cancel())  # not through apply_control: next_job meets it queued
        sched.next_job()
    elif change == "finish":
        sched.finish(running[0])
    elif change == "park":
        sched.park(running[1])
    elif change == "cancel":
        sched.apply_control(cancel())
    elif change == "drop":
        sched.drop_queued(lambda job: True)
    assert sched.changes.generation > before


def test_the_worker_encodes_as_the_settings_say_and_refuses_an_unknown_encoding():
    from types import SimpleNamespace

    from voicebus.settings import Settings, SettingsError
    from voicebus.synthesis.worker import SynthesisWorker
    from voicebus.schemas.contract import AudioEncoding

    engine = SimpleNamespace(sample_rate=SAMPLE_RATE)  # read at construction; nothing is synthesized
    assert SynthesisWorker(Settings(), engine).audio.encoding == AudioEncoding.PCM16LE
    assert SynthesisWorker(Settings(audio_encoding="opus"), engine).audio.encoding == AudioEncoding.OPUS
    with pytest.raises(SettingsError, match="VOICEBUS_AUDIO_ENCODING: Input should be 'pcm16' or 'opus'"):
        SynthesisWorker(Settings(audio_encoding="flac"), engine)
