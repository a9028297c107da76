"""The telephony door on the real broker: a turn published on the audio topic plays into a Twilio
Media Stream, the call's mark echoes become a TurnHeard on the heard topic, and a cancel on the
control topic clears the call mid-turn and is reported as what was heard before it."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from voicebus.bus import make_producer, publish
from voicebus.clock import now_us
from voicebus.codecs import Codec
from voicebus.players import telephony
from voicebus.players.edge import ROUTER_KEY, make_app
from tests.players.edge_helpers import SECRET
from tests.players.test_edge_kafka import read_topic
from tests.players.test_telephony import FakeTwilio, served, worded_turn
from tests.waiting import eventually

pytestmark = pytest.mark.kafka


async def test_a_call_hears_a_turn_from_the_bus_and_a_cancel_on_the_bus_clears_it(make_settings):
    settings = make_settings(edge_secret=SECRET, speech_api=False)
    app = make_app(settings)
    telephony.setup(app)  # a no-op where make_app has mounted it already
    async with TestClient(TestServer(app)) as client:
        router = app[ROUTER_KEY]
        call = await FakeTwilio.dial(client, "phone-1")
        await served(router, "phone-1")
        whole, words = worded_turn("phone-1", "t1", sentences=2, chunks=2)
        cut, _ = worded_turn("phone-1", "t2", sentences=3, chunks=3)
        producer, codec = make_producer(settings), Codec()
        await producer.start()
        try:
            for chunk in whole + cut[:6]:  # t2: its first two sentences, then the cancel
                await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
            [heard] = await read_topic(settings, settings.heard_topic, "TurnHeard", lambda v: v)
            assert heard["session_id"] == "phone-1" and heard["turn_id"] == "t1"
            assert heard["heard_text"] == " ".join(text for _, text in words) and not heard["interrupted"]
            await eventually(lambda: call.played_s() >= 0.6 + 0.3, timeout_s=10, what="t2 playing")
            await publish(producer, codec, settings.control_topic, "ControlEvent", {
                "session_id": "phone-1", "turn_id": "t2", "action": "CANCEL", "reason": "barge-in",
                "source": "agent", "issued_at_us": now_us(), "turn_ids": []})
            await eventually(lambda: call.events("clear"), timeout_s=10, what="the cancel cleared the call")
        finally:
            await producer.stop()
        cleared_at = next(i for i, (_, m) in enumerate(call.received) if m["event"] == "clear")
        both = await read_topic(settings, settings.heard_topic, "TurnHeard", lambda v: len(v) >= 2)
        stopped = next(h for h in both if h["turn_id"] == "t2")
        assert stopped["interrupted"] and stopped["heard_text"].startswith("w0.0") and stopped["unheard_words"]
        reports = await read_topic(settings, settings.playback_topic, "PlaybackReport", lambda v: len(v) >= 4)
        assert [(r["turn_id"], r["kind"]) for r in reports] == [
            ("t1", "AUDIBLE_START"), ("t1", "PLAYBACK_END"), ("t2", "AUDIBLE_START"), ("t2", "STOPPED")]
        assert {r["detail"] for r in reports} == {"twilio"}
        assert call.payloads(since=cleared_at + 1) == []  # nothing of t2 after the clear
        await call.close()
