"""The heard report on the real broker: word timings from the audio topic reach the player before
their audio, the players' heard reports become one TurnHeard on the heard topic (the furthest
player counts; one that never reports holds it up only for the wait)."""

import json
from dataclasses import replace

import pytest

from voicebus.bus import make_producer, publish
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.players.tone import tone_turn
from voicebus.schemas.messages import AudioChunk, WordTiming
from tests.players.edge_helpers import SECRET, audio, collect, connect, of_type, running_edge, turn_ended
from tests.players.test_edge_kafka import read_topic

pytestmark = pytest.mark.kafka

S0 = tuple(WordTiming(text=t, start=1200 * i, end=1200 * i + 1000) for i, t in enumerate(["Your", "order", "shipped."]))
S1 = tuple(WordTiming(text=t, start=1200 * i, end=1200 * i + 1000) for i, t in enumerate(["It", "arrives", "Monday."]))


def worded_turn(session: str, turn: str) -> list[AudioChunk]:
    chunks = tone_turn(session, turn, sentences=2, chunks_per_sentence=2)  # 3600 samples a chunk
    return [replace(chunk, words=words) for chunk, words in zip(chunks, (S0[:2], S0[2:], S1[:2], S1[2:]))]


def heard_report(turn_id: str, kind: str, sentence: int, samples: int) -> str:
    return json.dumps({"type": "report", "v": 1, "kind": kind, "turn_id": turn_id, "audible_at_us": now_us(),
                       "rendered_sentence_seq": sentence, "rendered_samples": samples})


async def test_words_reach_the_player_and_the_furthest_players_report_is_published(make_settings):
    settings = make_settings(edge_secret=SECRET, edge_heard_wait_ms=60_000)
    async with running_edge(settings) as (app, client):
        near, ready_near = await connect(client, "S")
        far, ready_far = await connect(client, "S")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            for chunk in worded_turn("S", "t1"):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        finally:
            await producer.stop()
        messages = await collect(near, turn_ended)
        await collect(far, turn_ended)
        words = of_type(messages, "words")
        assert [w["text"] for m in words for w in m["words"]] == ["Your", "order", "shipped.", "It", "arrives", "Monday."]
        first_audio = next(i for i, m in enumerate(messages) if m in audio(messages))
        assert messages.index(words[0]) < first_audio  # a word is known before its audio plays

        # the near player stopped in the first sentence, the far one in the second, inside "arrives"
        sent_at = now_us()
        await near.send_str(heard_report("t1", "STOPPED", 0, 1300))
        await far.send_str(heard_report("t1", "STOPPED", 1, 1300))
        [heard] = await read_topic(settings, settings.heard_topic, "TurnHeard", lambda v: v)
        assert heard["session_id"] == "S" and heard["turn_id"] == "t1"
        assert heard["heard_text"] == "Your order shipped. It arrives"
        assert heard["unheard_words"] == ["Monday."] and heard["interrupted"]
        assert heard["client_id"] == ready_far["client_id"] and heard["reports"] == 2
        # published on the second (last) player's report, not after the wait
        assert heard["published_at_us"] - sent_at < 5_000_000
        playback = await read_topic(settings, settings.playback_topic, "PlaybackReport", lambda v: len(v) >= 2)
        assert {r["kind"] for r in playback} == {"STOPPED"}


async def test_a_player_that_never_reports_holds_the_turn_up_only_for_the_wait(make_settings):
    settings = make_settings(edge_secret=SECRET, edge_heard_wait_ms=300)
    async with running_edge(settings) as (app, client):
        done, _ = await connect(client, "S")
        await connect(client, "S")  # a second player that never reports
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            for chunk in worded_turn("S", "t2"):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
        finally:
            await producer.stop()
        await collect(done, turn_ended)
        reported_at = now_us()
        await done.send_str(heard_report("t2", "PLAYBACK_END", 1, 7200))
        [heard] = await read_topic(settings, settings.heard_topic, "TurnHeard", lambda v: v)
        assert heard["heard_text"] == "Your order shipped. It arrives Monday." and not heard["interrupted"]
        assert heard["reports"] == 1 and heard["published_at_us"] - reported_at >= 300_000


async def test_a_turn_cut_by_the_floor_stops_at_its_preempter_s_audio_and_reports_what_was_heard(make_settings):
    """The gate's cut of a preempted turn (source floor, after_turn_id the preempter): the player
    keeps the old turn until the preempter's first audio, gets its stop just ahead of that audio,
    and its STOPPED report becomes a TurnHeard that says what was heard before the cut."""
    settings = make_settings(edge_secret=SECRET, edge_heard_wait_ms=60_000)
    async with running_edge(settings) as (app, client):
        player, _ = await connect(client, "S")
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            old = worded_turn("S", "old")
            for chunk in old[:2]:  # the first sentence of the old turn
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            first = await collect(player, lambda got: len(audio(got)) >= 2)
            await publish(producer, codec, settings.control_topic, "ControlEvent", {
                "session_id": "S", "turn_id": "old", "action": "CANCEL", "reason": "preempted by a newer turn",
                "source": "floor", "issued_at_us": now_us(), "turn_ids": [], "after_turn_id": "new"})
            # no stop yet: the old turn is still what the listener hears
            with pytest.raises(TimeoutError):
                await collect(player, lambda got: of_type(got, "stop"), timeout=1.0)
            for chunk in tone_turn("S", "new", sentences=1, chunks_per_sentence=1):
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            after = await collect(player, lambda got: audio(got))
        finally:
            await producer.stop()
        [stop] = of_type(after, "stop")
        assert stop["turn_id"] == "old" and after.index(stop) < after.index(audio(after)[0])
        assert audio(first) and len(audio(first)) == 2
        await player.send_str(heard_report("old", "STOPPED", 0, 1300))
        [heard] = await read_topic(settings, settings.heard_topic, "TurnHeard", lambda v: v)
    assert heard["turn_id"] == "old" and heard["interrupted"]
    assert heard["heard_text"] == "Your order" and heard["unheard_words"] == ["shipped."]
