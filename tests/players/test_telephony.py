"""The edge's telephony door (`voicebus.players.telephony`) against a Twilio Media Streams client
written from Twilio's documented messages (`FakeTwilio`): it says ``connected`` and ``start``,
plays the ``media`` it gets at a call's pace (20 ms a frame, one after another), echoes each
``mark`` once the audio before it has played, and on ``clear`` drops what it had not played and
returns its pending marks at once, as Twilio does. The edge runs without Kafka and is fed through
its router; a `FakeLink` stands in for its Kafka link (ownership, what it publishes)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from dataclasses import replace

import av
import numpy as np
import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer

from voicebus.clock import now_us
from voicebus.players import telephony
from voicebus.players.auth import issue_token
from voicebus.players.edge import LINK_KEY, ROUTER_KEY, make_app
from voicebus.players.router import SessionRouter
from voicebus.players.tap import SessionTap
from voicebus.players.tone import tone_turn
from voicebus.schemas.messages import AudioChunk, Message, PlaybackReport, TurnHeard, WordTiming
from tests.players.edge_helpers import SECRET, edge_settings
from tests.waiting import eventually

CHUNK = 3600  # samples of a 150 ms tone_turn chunk at 24 kHz


class FakeTwilio:
    """Twilio's side of one bidirectional Media Stream (``<Connect><Stream>``)."""

    stream_key = "streamSid"  # where the edge's messages name the stream

    def __init__(self, ws, stream_sid: str, echo: bool) -> None:
        self.ws, self.stream_sid, self.echo = ws, stream_sid, echo
        self.received: list[tuple[float, dict]] = []  # (arrival, loop clock), message
        self.frames = 0
        self.play_end = 0.0  # when the call will have played every frame it got
        self.pending: list[tuple[float, str]] = []  # marks: (when their audio has played, name)
        self.echoed: list[tuple[int, str]] = []  # (epoch µs, name)
        self.cleared: list[tuple[float, float]] = []  # (when, seconds of audio played by then)
        self.close_code: int | None = None
        self._seq = 1
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def dial(cls, client, session: str, token: str | None = None, params: dict | None = None,
                   echo: bool = True) -> "FakeTwilio":
        ws = await client.ws_connect(telephony.TWILIO_PATH)
        stream_sid = "MZ" + "0" * 30 + session[-2:]
        custom = {"session": session, "token": token or issue_token(SECRET, session, 60)} if params is None else params
        await ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send_str(json.dumps({
            "event": "start", "sequenceNumber": "1", "streamSid": stream_sid,
            "start": {"accountSid": "AC" + "1" * 32, "streamSid": stream_sid, "callSid": "CA" + "2" * 32,
                      "tracks": ["inbound"], "customParameters": custom,
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
        return cls(ws, stream_sid, echo)

    def events(self, event: str | None = None) -> list[dict]:
        return [m for _, m in self.received if event is None or m["event"] == event]

    def payloads(self, since: int = 0) -> list[bytes]:
        return [base64.b64decode(m["media"]["payload"]) for _, m in self.received[since:] if m["event"] == "media"]

    def played_s(self) -> float:
        now = asyncio.get_running_loop().time()
        return self.frames * 0.020 - max(0.0, self.play_end - now)

    async def _send(self, message: dict) -> None:
        self._seq += 1
        await self.ws.send_str(json.dumps({**message, "sequenceNumber": str(self._seq), "streamSid": self.stream_sid}))

    def _named(self, message: dict) -> bool:
        return message["streamSid"] == self.stream_sid

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            while self.pending and self.pending[0][0] <= now:
                _, name = self.pending.pop(0)
                if self.echo:
                    self.echoed.append((now_us(), name))
                    await self._send({"event": "mark", "mark": {"name": name}})
            wait = self.pending[0][0] - now if self.pending else None
            try:
                msg = await self.ws.receive(timeout=wait)
            except asyncio.TimeoutError:
                continue
            if msg.type != WSMsgType.TEXT:
                self.close_code = self.ws.close_code
                return
            now, message = loop.time(), json.loads(msg.data)
            self.received.append((now, message))
            assert self._named(message), message
            if message["event"] == "media":
                self.frames += 1
                self.play_end = max(self.play_end, now) + 0.020
            elif message["event"] == "mark":
                self.pending.append((max(self.play_end, now), message["mark"]["name"]))
            elif message["event"] == "clear":
                self.cleared.append((now, self.played_s()))
                self.play_end = now
                self.pending = [(now, name) for _, name in self.pending]  # returned at once, unplayed

    async def hang_up(self) -> None:
        await self._send({"event": "stop", "stop": {"accountSid": "AC" + "1" * 32, "callSid": "CA" + "2" * 32}})
        await asyncio.wait_for(self._task, 5)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        await self.ws.close()


class FakeTelnyx(FakeTwilio):
    """Telnyx's side of a bidirectional media stream (``stream_bidirectional_mode: rtp``, codec
    PCMU): ``stream_id`` beside the start object, snake_case fields; the session and token in the
    stream URL's query; the edge's messages name no stream."""

    @classmethod
    async def dial(cls, client, session: str, token: str | None = None, params: dict | None = None,
                   echo: bool = True) -> "FakeTelnyx":
        query = {"session": session, "token": token or issue_token(SECRET, session, 60)} if params is None else params
        ws = await client.ws_connect(telephony.TELNYX_PATH, params=query)
        stream_id = "32de0dea-53cb-4b21-89a4-9e1819c0" + session[-4:]
        await ws.send_str(json.dumps({"event": "connected", "version": "1.0.0"}))
        await ws.send_str(json.dumps({
            "event": "start", "sequence_number": "1", "stream_id": stream_id,
            "start": {"user_id": "u1", "call_control_id": "v3:abc", "client_state": None,
                      "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}))
        return cls(ws, stream_id, echo)

    async def _send(self, message: dict) -> None:
        self._seq += 1
        await self.ws.send_str(json.dumps({**message, "sequence_number": str(self._seq), "stream_id": self.stream_sid}))

    def _named(self, message: dict) -> bool:
        return "streamSid" not in message and "stream_id" not in message


class FakeLink:
    """The edge's Kafka link as the door uses it: who owns a session, what gets published."""

    def __init__(self, owner: str | None = None) -> None:
        self.owner = owner
        self.published: list[tuple[str, str, Message | dict]] = []
        self.heard: list[TurnHeard] = []

    async def owner_url(self, session_id: str) -> str | None:
        return self.owner

    async def publish(self, topic: str, message_type: str, value: Message | dict, headers=None) -> None:
        self.published.append((topic, message_type, value))

    async def publish_heard(self, heard: TurnHeard) -> None:
        self.heard.append(heard)

    def reports(self, turn_id: str | None = None) -> list[PlaybackReport]:
        return [v for _, kind, v in self.published
                if kind == "PlaybackReport" and (turn_id is None or v.turn_id == turn_id)]


@contextlib.asynccontextmanager
async def telephony_edge(link: FakeLink | None = None, start_timeout_s: float | None = None, **kwargs):
    app = make_app(edge_settings(speech_api=False), with_kafka=False, **kwargs)  # the door alone
    telephony.setup(app)  # a no-op where make_app has mounted it already
    if start_timeout_s is not None:
        app[telephony.START_TIMEOUT_KEY] = start_timeout_s
    app[LINK_KEY] = link
    async with TestClient(TestServer(app)) as client:
        yield app, client


def worded_turn(session: str, turn: str, sentences: int, chunks: int) -> tuple[list[AudioChunk], list[tuple[int, str]]]:
    """A tone turn with one word starting in each chunk; and the words as (absolute sample, text)."""
    turn_chunks = tone_turn(session, turn, sentences=sentences, chunks_per_sentence=chunks)
    words = []
    for i, c in enumerate(turn_chunks):
        text, start = f"w{c.sentence_seq}.{c.chunk_seq}", c.chunk_seq * CHUNK + 100
        turn_chunks[i] = replace(c, words=(WordTiming(text=text, start=start, end=start + 2000),))
        words.append((c.sentence_seq * chunks * CHUNK + start, text))
    return turn_chunks, words


def mulaw_decode(data: bytes) -> np.ndarray:
    codec = av.CodecContext.create("pcm_mulaw", "r")
    codec.sample_rate, codec.layout = 8000, "mono"
    return np.concatenate([f.to_ndarray().reshape(-1) for f in codec.decode(av.Packet(data))]).astype(np.float64)


async def served(router: SessionRouter, session: str) -> None:
    await eventually(lambda: router.clients_of(session), timeout_s=5, what=f"the call joined session {session}")


@pytest.mark.usefixtures("settled_heap")
async def test_a_turn_reaches_the_call_as_20_ms_mulaw_frames_at_real_time_pace():
    async with telephony_edge(FakeLink()) as (app, client):
        router = app[ROUTER_KEY]
        call = await FakeTwilio.dial(client, "pace-1")
        await served(router, "pace-1")
        chunks = tone_turn("pace-1", "t1", sentences=2, chunks_per_sentence=4, freq_hz=440)  # 1.2 s, all at once
        for chunk in chunks:
            router.route(chunk)
        ends = await eventually(lambda: [m for m in call.events("mark") if m["mark"]["name"].startswith("t1:")
                                         and call.received[-1][1] is m and call.frames >= 60],
                                timeout_s=10, what="the turn's last frame and its mark")
        payloads = call.payloads()
        assert ends and all(len(p) == telephony.FRAME_BYTES for p in payloads)
        assert len(payloads) == 60  # 1.2 s of 8 kHz μ-law: 9600 bytes, 60 frames of 20 ms
        # Real time: frame k arrives no earlier than k × 20 ms after the first, less the lead.
        assert telephony.LEAD_S <= 0.2  # a small lead: what a clear purges, and all a lost clear leaves playing
        arrivals = [t for t, m in call.received if m["event"] == "media"]
        early = [k for k, t in enumerate(arrivals) if t - arrivals[0] < k * 0.020 - telephony.LEAD_S - 0.010]
        assert early == [], f"frames sent ahead of the call's playout by more than the lead: {early[:5]}"
        assert 59 * 0.020 - telephony.LEAD_S - 0.010 <= arrivals[-1] - arrivals[0] < 59 * 0.020 + 0.6
        # The μ-law is the tone: decoded, it matches the source taken down to 8 kHz independently.
        decoded = mulaw_decode(b"".join(payloads))
        source = np.frombuffer(b"".join(c.pcm for c in chunks), "<i2").astype(np.float64).reshape(-1, 3).mean(axis=1)
        assert len(decoded) == len(source)
        best = max(np.corrcoef(decoded[40 + lag:len(source) - 40 + lag], source[40:-40])[0, 1] for lag in range(-8, 9))
        assert best > 0.97
        assert 0.85 < np.sqrt(np.mean(decoded ** 2) / np.mean(source ** 2)) < 1.15
        # Marks ride between the frames: the first after the first frame, one after each chunk's frames.
        kinds = [m["event"] for _, m in call.received]
        assert kinds[0] == "media" and kinds[1] == "mark"
        assert kinds.count("mark") >= 1 + len(chunks)
        await eventually(lambda: [r for r in app[LINK_KEY].reports("t1") if r.kind == "PLAYBACK_END"], timeout_s=5,
                         what="the turn reported played to its end")
        await call.close()


async def test_mark_echoes_make_the_turn_heard_and_a_call_that_never_echoes_heard_nothing():
    link = FakeLink()
    async with telephony_edge(link) as (app, client):
        router = app[ROUTER_KEY]
        listening = await FakeTwilio.dial(client, "heard-1")
        deaf = await FakeTwilio.dial(client, "heard-2", echo=False)  # a peer that never confirms playback
        await served(router, "heard-1")
        await served(router, "heard-2")
        words = {}
        for session in ("heard-1", "heard-2"):
            chunks, words[session] = worded_turn(session, "t1", sentences=2, chunks=2)
            for chunk in chunks:
                router.route(chunk)
        [heard] = await eventually(lambda: [h for h in link.heard if h.session_id == "heard-1"], timeout_s=10,
                                   what="TurnHeard of the call that played the turn")
        assert heard.heard_text == " ".join(text for _, text in words["heard-1"])
        assert not heard.interrupted and heard.unheard_words == ()
        assert heard.turn_id == "t1" and heard.client_id == router.clients_of("heard-1")[0].client_id
        last_echo_us = listening.echoed[-1][0]
        assert heard.published_at_us >= last_echo_us  # on the last mark's echo: the audio had played
        kinds = [r.kind for r in link.reports("t1") if r.session_id == "heard-1"]
        assert kinds == ["AUDIBLE_START", "PLAYBACK_END"]
        started = next(r for r in link.reports("t1") if r.kind == "AUDIBLE_START")
        assert started.audible_at_us <= listening.echoed[0][0] and started.detail == "twilio"

        # The deaf call got every frame and mark, but nothing says it played: it heard nothing.
        await eventually(lambda: deaf.frames >= 30 and deaf.received[-1][1]["event"] == "mark", timeout_s=10,
                         what="the deaf call's frames and last mark")
        assert not [h for h in link.heard if h.session_id == "heard-2"]
        await deaf.hang_up()  # Twilio's stop: the call ends cleanly
        assert deaf.close_code == 1000
        [nothing] = await eventually(lambda: [h for h in link.heard if h.session_id == "heard-2"], timeout_s=5,
                                     what="TurnHeard of the call that hung up")
        assert nothing.heard_text == "" and nothing.interrupted
        assert nothing.unheard_words == tuple(text for _, text in words["heard-2"])
        await eventually(lambda: not router.clients_of("heard-2"), timeout_s=5, what="the hung-up call left")
        await listening.close()


@pytest.mark.usefixtures("settled_heap")
async def test_a_cancel_mid_turn_clears_the_call_and_no_frame_of_that_turn_follows():
    link = FakeLink()
    async with telephony_edge(link) as (app, client):
        router = app[ROUTER_KEY]
        call = await FakeTwilio.dial(client, "barge-1")
        await served(router, "barge-1")
        chunks, words = worded_turn("barge-1", "t1", sentences=3, chunks=3)  # 1.35 s
        for chunk in chunks:
            router.route(chunk)
        await eventually(lambda: call.played_s() >= 0.5, timeout_s=10, what="half a second of the turn played")
        router.cancel("barge-1", "t1", source="bus")  # what a cancel from the control topic does
        await eventually(lambda: call.events("clear"), timeout_s=5, what="clear")
        cleared_at = next(i for i, (_, m) in enumerate(call.received) if m["event"] == "clear")
        played_s = call.cleared[0][1]
        assert 0.5 <= played_s < 1.0
        # The next turn plays whole; every frame after the clear is its own.
        after, _ = worded_turn("barge-1", "t2", sentences=1, chunks=2)
        for chunk in after:
            router.route(chunk)
        await eventually(lambda: [h for h in link.heard if h.turn_id == "t2"], timeout_s=10,
                         what="the next turn heard to its end")
        assert len(call.payloads(since=cleared_at + 1)) == 2 * CHUNK // 3 // telephony.FRAME_BYTES  # 15: t2's only
        marks_after = [m["mark"]["name"] for _, m in call.received[cleared_at + 1:] if m["event"] == "mark"]
        assert marks_after and all(name.startswith("t2:") for name in marks_after)

        # What was heard of t1 is what the call played before the clear (to a chunk's precision),
        # not the marks Twilio returned when it dropped the rest.
        [heard] = [h for h in link.heard if h.turn_id == "t1"]
        assert heard.interrupted and heard.unheard_words
        position = heard.sentence_seq * 3 * CHUNK + heard.rendered_samples
        # (its marks come after each chunk, 150 ms; an echo may be on the wire when the clear goes)
        assert played_s * 24000 - CHUNK - 2400 <= position <= played_s * 24000 + 480
        assert heard.heard_text == " ".join(text for start, text in words if start < position)
        assert [r.kind for r in link.reports("t1")] == ["AUDIBLE_START", "STOPPED"]
        await call.close()


@pytest.mark.parametrize("params, reason", [
    # tokens made at collection: valid for long enough that only the fault under test refuses them
    ({"session": "s1", "token": issue_token("not-the-secret", "s1", 86_400)}, "bad-signature"),
    ({"session": "s1", "token": issue_token(SECRET, "someone-else", 86_400)}, "wrong-session"),
    ({"session": "s1"}, "malformed-token"),
])
async def test_a_bad_token_closes_the_stream_4401_and_sends_nothing(params, reason):
    async with telephony_edge(FakeLink()) as (app, client):
        router = app[ROUTER_KEY]
        call = await FakeTwilio.dial(client, "s1", params=params)
        await asyncio.wait_for(call._task, 5)
        assert call.close_code == 4401 and call.ws.close_code == 4401
        assert call.received == []
        for chunk in tone_turn("s1", "t1", 1, 2):
            assert router.route(chunk) == 0  # nobody listens
        assert router.n_clients == 0 and router.awaiting_hello == 0
        assert app[ROUTER_KEY].metrics.telephony_calls.labels("twilio", reason)._value.get() == 1


async def test_a_stream_without_start_in_time_is_closed():
    async with telephony_edge(FakeLink(), start_timeout_s=0.3) as (app, client):
        ws = await client.ws_connect(telephony.TWILIO_PATH)
        await ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        msg = await ws.receive(timeout=5)
        assert msg.type == WSMsgType.CLOSE and ws.close_code == 4408
        assert app[ROUTER_KEY].awaiting_hello == 0


async def test_an_edge_that_does_not_own_the_session_refuses_the_call_and_says_which_does(caplog):
    async with telephony_edge(FakeLink(owner="ws://edge-2:8765/ws")) as (app, client):
        call = await FakeTwilio.dial(client, "elsewhere")
        await asyncio.wait_for(call._task, 5)
        assert call.close_code == telephony.CLOSE_NOT_OWNER and call.received == []
        assert app[ROUTER_KEY].n_clients == 0
        assert "ws://edge-2:8765/ws" in caplog.text


async def test_a_tap_read_at_its_own_pace_is_not_closed_as_too_slow():
    """The router's stall rule closes a client that made no progress for 10 s while frames wait;
    a tap taking frames one by one (the call's real-time pace) makes progress."""
    clock = [0.0]
    router = SessionRouter(stall_timeout_s=10.0, clock=lambda: clock[0])
    async with SessionTap(router, "slow") as tap:
        chunks = tone_turn("slow", "t1", sentences=1, chunks_per_sentence=20)
        for chunk in chunks[:10]:
            router.route(chunk)
        for chunk in chunks[10:]:
            clock[0] += 6.0  # a frame every 6 s: slow, but never 10 s without one
            await tap.next()
            router.route(chunk)
        assert tap.channel.closed is None


async def test_a_telnyx_call_hears_the_turn_and_its_marks_say_what_was_heard():
    """Telnyx frames the same protocol its own way (docs/telephony.md): the same frames, marks and
    reports; a wrong token in the stream URL is refused as on Twilio's path."""
    link = FakeLink()
    async with telephony_edge(link) as (app, client):
        router = app[ROUTER_KEY]
        call = await FakeTelnyx.dial(client, "tx-01")
        await served(router, "tx-01")
        chunks, words = worded_turn("tx-01", "t1", sentences=1, chunks=3)
        for chunk in chunks:
            router.route(chunk)
        await eventually(lambda: [r for r in link.reports("t1") if r.kind == "PLAYBACK_END"], timeout_s=10,
                         what="the Telnyx call's end of playback")
        assert len(call.payloads()) == 23 and all(len(p) == telephony.FRAME_BYTES for p in call.payloads()[:-1])
        [heard] = [h for h in link.heard if h.turn_id == "t1"]
        assert heard.heard_text == " ".join(text for _, text in words) and not heard.interrupted
        assert [r.detail for r in link.reports("t1")] == ["telnyx", "telnyx"]
        await call.close()
        refused = await FakeTelnyx.dial(client, "tx-02", token=issue_token("not-the-secret", "tx-02", 86_400))
        await asyncio.wait_for(refused._task, 5)
        assert refused.close_code == 4401 and refused.received == []
