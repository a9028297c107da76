"""The heard core: what a listener heard of a turn from the word timings and the players' reports."""

from __future__ import annotations

from dataclasses import replace

from voicebus.players.heard import HeardTracker, Rendered
from voicebus.players.router import SessionRouter
from voicebus.players.tone import tone_turn
from voicebus.schemas.messages import WordTiming

# two sentences of three words, 1000 samples a word
S0 = [WordTiming(text=t, start=1000 * i, end=1000 * i + 900) for i, t in enumerate(["Hello", "there,", "friend."])]
S1 = [WordTiming(text=t, start=1000 * i, end=1000 * i + 900) for i, t in enumerate(["How", "are", "you?"])]


def tracker(**kw) -> HeardTracker:
    t = HeardTracker(**kw)
    t.add_words("s", "t", 0, S0[:2])
    t.add_words("s", "t", 0, S0[2:])
    t.add_words("s", "t", 1, S1)
    t.add_words("s", "t", 1, S1[:1])  # a duplicate chunk adds nothing
    return t


def test_a_stop_mid_second_sentence_hears_the_first_and_the_words_started_before_it():
    heard = tracker().report("s", "t", Rendered("c1", 1, 1500, True, 7), ["c1"], now_us=10)
    assert heard.heard_text == "Hello there, friend. How are"  # "are" was in progress: heard
    assert heard.unheard_words == ("you?",) and heard.interrupted
    assert (heard.sentence_seq, heard.rendered_samples, heard.client_id) == (1, 1500, "c1")
    assert (heard.stopped_at_us, heard.published_at_us, heard.reports) == (7, 10, 1)


def test_the_turn_started_when_the_first_player_heard_it():
    t = tracker()
    t.audible("s", "t", 900)
    t.audible("s", "t", 500)  # another player (or a later sentence's report, out of order)
    t.audible("s", "t", 0)  # no time given: ignored
    heard = t.report("s", "t", Rendered("c1", 1, 3000, False, 7), ["c1"], now_us=10)
    assert heard.started_at_us == 500
    assert tracker().report("s", "t", Rendered("c1", 1, 3000, False, 7), ["c1"], now_us=10).started_at_us == 0


def test_a_word_whose_start_was_not_rendered_is_not_heard():
    heard = tracker().report("s", "t", Rendered("c1", 1, 1000, True, 7), ["c1"], now_us=10)
    assert heard.heard_text == "Hello there, friend. How"
    nothing = tracker().report("s", "t", Rendered("c1", 0, 0, True, 7), ["c1"], now_us=10)
    assert nothing.heard_text == "" and len(nothing.unheard_words) == 6


def test_played_to_the_end_is_not_interrupted():
    heard = tracker().report("s", "t", Rendered("c1", 1, 3000, False, 7), ["c1"], now_us=10)
    assert heard.heard_text == "Hello there, friend. How are you?" and not heard.interrupted
    assert heard.unheard_words == ()


def test_with_several_players_the_furthest_report_counts_once_all_reported():
    t = tracker()
    assert t.report("s", "t", Rendered("c1", 0, 2500, True, 5), ["c1", "c2"], now_us=10) is None
    heard = t.report("s", "t", Rendered("c2", 1, 500, True, 6), ["c1", "c2"], now_us=20)
    assert heard.client_id == "c2" and heard.heard_text == "Hello there, friend. How" and heard.reports == 2
    assert t.report("s", "t", Rendered("c1", 1, 3000, False, 9), ["c1", "c2"], now_us=30) is None  # published once


def test_a_player_that_never_reports_holds_the_turn_up_only_for_the_wait():
    t = tracker(wait_us=1000)
    assert t.report("s", "t", Rendered("c1", 0, 1500, True, 5), ["c1", "gone"], now_us=10) is None
    assert t.next_deadline_us() == 1010
    assert t.due(1009) == []
    [heard] = t.due(1010)
    assert heard.heard_text == "Hello there," and heard.reports == 1
    assert t.due(5000) == [] and t.next_deadline_us() is None


def test_state_is_bounded():
    t = HeardTracker(max_turns=3)
    for i in range(10):
        t.add_words("s", f"t{i}", 0, S0)
        t.report("s", f"t{i}", Rendered("c", 0, 0, True, 1), ["c"], now_us=1)
    assert len(t._turns) <= 3 and len(t._published) <= 3


def test_the_router_sends_a_chunks_words_before_its_audio_and_keeps_them_for_the_report():
    router = SessionRouter()
    channel = router.connect("s")
    chunks = tone_turn("s", "t", sentences=2, chunks_per_sentence=2)
    chunks[0] = replace(chunks[0], words=tuple(S0))
    chunks[2] = replace(chunks[2], words=tuple(S1))
    for chunk in chunks:
        router.route(chunk)
    kinds = [("audio" if f.is_audio else f.payload.split('"type":"')[1].split('"')[0]) for f in channel.outbox]
    assert kinds == ["turn_start", "words", "audio", "audio", "words", "audio", "audio", "turn_end"]
    assert router.players_of_turn("s", "t") == [channel.client_id]
    assert router.heard.words_of("s", "t") == {0: S0, 1: S1}
    # a player that joins now (replay) gets the words with the audio
    late = router.connect("s", resume={"turn_id": "t", "sentence_seq": 1})
    assert sum(1 for f in late.outbox if not f.is_audio and '"type":"words"' in f.payload) == 1
