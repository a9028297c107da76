"""The demo console's core and API (players/console.py), the demo's console URL line
(pipeline/ops/demo_console.py) and the buffered lane (pipeline/ops/runtime.py). The API tests run the
edge app with the console installed against the real broker and read what it published back from
Kafka; the browser test (test_console_browser.py) drives the whole thing."""

from __future__ import annotations

import asyncio
import io
import os
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from voicebus.agents.conversation_file import load
from voicebus.agents.corpus import corpus_path
from voicebus.ops.demo_console import print_url
from voicebus.ops.runtime import buffered_lane
from voicebus.topics import text_topic, text_topic_pattern
from voicebus.players.auth import verify_token
from voicebus.players.console import (
    ABANDON_AFTER_S, KEY_HEADER, Console, conversation_play, console_url, install_console, text_play, turns_of,
)
from voicebus.players.edge import make_app
from voicebus.players.router import SessionRouter
from tests.players.edge_helpers import connect
from tests.players.test_edge_kafka import read_topic
from tests.waiting import eventually

SECRET = "console-secret"


# --- pure -------------------------------------------------------------------------------------------

def test_console_url_is_short_loopback_and_alone_on_its_line_at_80_columns():
    for host in ("127.0.0.1", "0.0.0.0", "", "::", "localhost", "192.168.1.20"):
        url = console_url(host, 65535, "A" * 12)
        assert len(url) <= 80 and " " not in url, url
        assert url.startswith(("http://127.0.0.1:65535/", "http://localhost:65535/")), url  # the console is loopback-only
    out = io.StringIO()
    url = console_url("127.0.0.1", 8765, "k3y_-AbC0123")
    print_url(url, out)
    lines = out.getvalue().splitlines()
    assert url in lines and lines[lines.index(url) - 1] == "" and lines[lines.index(url) + 1] == ""
    assert all(len(line) <= 80 for line in lines), lines


def test_the_demo_serves_the_console_to_a_terminal_and_runs_the_batch_elsewhere(tmp_path):
    from voicebus.cli import build_parser
    from voicebus.ops.demo import demo_mode

    assert build_parser().parse_args(["demo"]).mode is None
    assert build_parser().parse_args(["demo", "--batch"]).mode == "batch"
    assert build_parser().parse_args(["demo", "--console"]).mode == "console"
    with open(tmp_path / "stdin", "w+") as not_a_terminal:
        assert demo_mode(None, not_a_terminal) == "batch"
        assert demo_mode("console", not_a_terminal) == "console"
    assert demo_mode(None, None) == "batch"  # no stdin at all (a daemon)
    leader, follower = os.openpty()  # a pseudo-terminal: what a person's shell gives `make demo`
    try:
        with os.fdopen(follower) as terminal:
            assert demo_mode(None, terminal) == "console" and demo_mode("batch", terminal) == "batch"
    finally:
        os.close(leader)


def test_a_play_moves_a_conversation_into_the_session_with_turn_ids_of_its_own():
    conversation = load(corpus_path("interrupted"))
    first, second = conversation_play(conversation, "console-1", 1), conversation_play(conversation, "console-1", 2)
    assert {e.session_id for e in first} == {"console-1"}
    assert {e.turn_id for e in first} == {"t1.p1", "t2.p1"} and {e.turn_id for e in second} == {"t1.p2", "t2.p2"}
    assert [e.t_ms for e in first] == [e.t_ms for e in conversation.events]  # the recorded timing
    turns = turns_of(first)
    assert [t["turn_id"] for t in turns] == ["t1.p1", "t2.p1"]
    assert turns[0]["cancelled_at_ms"] is not None and turns[1]["cancelled_at_ms"] is None  # the recorded barge-in
    assert turns[0]["text"] == "".join(t for _, t in turns[0]["tokens"])


def test_typed_text_streams_as_tokens_then_ends_the_turn():
    events = text_play("Hola. ¿Qué tal?", "es", "console-2", 3, token_ms=30)
    assert "".join(e.text for e in events) == "Hola. ¿Qué tal?"
    assert events[-1].kind == "END_OF_TURN" and {e.turn_id for e in events} == {"typed.p3"}
    assert {e.voice for e in events} == {"ef_dora"} and {e.language for e in events} == {"es"}
    assert [e.t_ms for e in events] == sorted(e.t_ms for e in events) and events[1].t_ms - events[0].t_ms == 30


def test_the_buffered_lane_has_its_own_topics_and_gate_the_incremental_gate_never_reads(make_settings):
    settings = make_settings()
    lane = buffered_lane(settings)
    assert lane.gate_mode == "buffered" and settings.gate_mode == "incremental"
    assert lane.synthesis_topic != settings.synthesis_topic and lane.gate_app_id != settings.gate_app_id
    assert lane.gate_changelog_topic != settings.gate_changelog_topic
    assert (lane.control_topic, lane.audio_topic, lane.playback_topic) == \
        (settings.control_topic, settings.audio_topic, settings.playback_topic)  # one edge, one barge-in
    assert not re.match(text_topic_pattern(settings), text_topic(lane, "assistant"))
    assert not re.match(text_topic_pattern(lane), text_topic(settings, "assistant"))


async def test_a_session_whose_page_went_away_mid_answer_is_reported_once():
    console = Console("key", {"incremental": None, "buffered": None}, {}, _settings())
    console.router = router = SessionRouter()
    session = console.new_session()["session"]
    task = console.sessions[session].task = asyncio.create_task(asyncio.sleep(60))
    try:
        channel = router.connect(session)
        assert console.abandoned_sessions(0.0) == []  # its page listens
        router.disconnect(channel)
        assert console.abandoned_sessions(1.0) == []  # a reload reconnects within the grace time
        assert console.abandoned_sessions(1.0 + ABANDON_AFTER_S / 2) == []
        assert console.abandoned_sessions(1.0 + ABANDON_AFTER_S) == [session]
        assert console.abandoned_sessions(2.0 + ABANDON_AFTER_S) == []  # once
        other = console.new_session()["session"]  # a session that never had a page is not reaped
        console.sessions[other].task = task
        assert console.abandoned_sessions(100.0) == [] and console.abandoned_sessions(200.0) == []
    finally:
        task.cancel()


def _settings(**overrides):
    from voicebus.settings import Settings

    return Settings(edge_secret=SECRET, **overrides)


# --- the API, on the real broker --------------------------------------------------------------------

class ConsoleEdge:
    def __init__(self, settings) -> None:
        self.settings = settings
        self.lanes = {"incremental": settings, "buffered": buffered_lane(settings)}
        conversations = {name: load(corpus_path(name)) for name in ("support", "interrupted")}
        self.app = make_app(settings)
        self.console = Console("the-key", self.lanes, conversations, settings)
        install_console(self.app, self.console)

    async def __aenter__(self):
        self.client = TestClient(TestServer(self.app))
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self.client.__aexit__(*exc)

    async def post(self, path: str, body: dict | None = None, key: str | None = "the-key"):
        headers = {KEY_HEADER: key} if key is not None else {}
        response = await self.client.post(f"/console/api/{path}", json=body or {}, headers=headers)
        return response.status, await response.json()


@pytest.mark.kafka
async def test_console_api_publishes_each_mode_on_its_lane_and_refuses_what_it_cannot_serve(make_settings):
    settings = make_settings(edge_secret=SECRET, console_max_text_chars=50)
    async with ConsoleEdge(settings) as edge:
        assert (await edge.client.get("/console")).status == 200  # the page itself needs no key
        assert (await edge.post("session", key=None))[0] == 403
        assert (await edge.post("session", key="wrong"))[0] == 403
        status, session = await edge.post("session")
        assert status == 200 and session["modes"] == ["incremental", "buffered"]
        sid = session["session"]
        verify_token(SECRET, session["token"], sid)  # a player token for exactly this session
        assert {c["name"] for c in session["conversations"]} == {"support", "interrupted"}

        status, played = await edge.post("play", {"session": sid, "mode": "buffered", "conversation": "support"})
        assert status == 200 and [t["turn_id"] for t in played["turns"]] == ["t1.p1"]
        assert (await edge.post("play", {"session": sid, "mode": "incremental", "conversation": "support"}))[0] == 409
        events = await read_topic(settings, text_topic(edge.lanes["buffered"], "assistant"), "TextEvent",
                                  lambda v: any(e["kind"] == "END_OF_TURN" for e in v), timeout=30)
        assert {(e["session_id"], e["turn_id"]) for e in events} == {(sid, "t1.p1")}
        assert "".join(e["text"] for e in events) == played["turns"][0]["text"]
        await eventually(lambda: edge.console.sessions[sid].task.done(), timeout_s=10, what="the play published")

        status, typed = await edge.post("play", {"session": sid, "mode": "incremental", "text": "Hi. Bye.", "language": "en"})
        assert status == 200 and typed["turns"][0]["turn_id"] == "typed.p2"
        events = await read_topic(settings, text_topic(settings, "assistant"), "TextEvent",
                                  lambda v: any(e["kind"] == "END_OF_TURN" for e in v), timeout=30)
        assert "".join(e["text"] for e in events) == "Hi. Bye." and {e["turn_id"] for e in events} == {"typed.p2"}

        assert (await edge.post("play", {"session": sid, "mode": "incremental", "text": "x" * 51}))[0] == 413
        assert (await edge.post("play", {"session": sid, "mode": "incremental", "text": "Hi.", "language": "xx"}))[0] == 400
        assert (await edge.post("play", {"session": sid, "mode": "fast", "conversation": "support"}))[0] == 400
        assert (await edge.post("play", {"session": sid, "mode": "buffered", "conversation": "nope"}))[0] == 404
        assert (await edge.post("play", {"session": "someone-else", "mode": "buffered", "conversation": "support"}))[0] == 400

        # stop: the agent stops talking mid-answer (what the page does after a barge-in)
        await eventually(lambda: edge.console.sessions[sid].task.done(), timeout_s=10, what="the typed play published")
        status, _ = await edge.post("play", {"session": sid, "mode": "incremental", "conversation": "support"})
        assert status == 200
        status, stopped = await edge.post("stop", {"session": sid})
        assert status == 200 and stopped["stopped"] is True
        assert (await edge.post("stop", {"session": sid}))[1]["stopped"] is False


@pytest.mark.kafka
async def test_a_page_that_goes_away_mid_answer_has_its_session_cancelled(make_settings):
    settings = make_settings(edge_secret=SECRET)
    async with ConsoleEdge(settings) as edge:
        _, session = await edge.post("session")
        sid = session["session"]
        ws, ready = await connect(edge.client, sid, token=session["token"])
        assert ready["type"] == "ready"
        await eventually(lambda: edge.console.sessions[sid].had_player,
                         timeout_s=5, what="the console saw the page's player")
        status, played = await edge.post("play", {"session": sid, "mode": "incremental", "conversation": "support"})
        assert status == 200
        await ws.close()  # the page is closed while its agent is still talking
        control = await read_topic(settings, settings.control_topic, "ControlEvent",
                                   lambda v: any(c["session_id"] == sid for c in v), timeout=ABANDON_AFTER_S + 15)
        cancel = next(c for c in control if c["session_id"] == sid)
        assert cancel["action"] == "CANCEL" and cancel["turn_id"] is None and cancel["source"] == "console"
        assert edge.console.sessions[sid].task.done() and edge.console.abandoned == [sid]
