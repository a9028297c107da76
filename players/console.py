"""The demo console: a page on the edge where a person hears buffered vs streamed hand-off.

`install_console(app, console)` adds the console's routes to an edge app built by
`voicebus.players.edge.make_app` (the demo does it through `PipelineStack(edge_setup=...)`); nothing
else in the edge changes. The console plays the part of an agent: it publishes TextEvents with
the agents SDK, per page session, onto one of two *lanes* (`voicebus.ops.runtime.buffered_lane`):
``incremental`` (the gate releases each sentence as soon as it is certain) or ``buffered`` (a
second gate app in ``gate_mode=buffered``: the whole answer at the end of the turn, on its own
synthesis topic). Both lanes publish to the one audio and control topic, so the audio comes back
to the page through the ordinary player protocol (``/ws``) and a barge-in reaches both.

Routes (``docs/edge.md``, "Demo console"):

* ``GET /console``: the page (``players/web/console.html``); its key is in the URL fragment.
* ``POST /console/api/session``: a new session id and its player token, the shipped
  conversations and the languages.
* ``POST /console/api/play`` ``{session, mode, conversation | text + language}``: publish one
  answer (a shipped conversation at its recorded timing, or the text as LLM-like tokens).
* ``POST /console/api/stop`` ``{session}``: the agent stops talking (after a barge-in).

A page that goes away mid-answer (closed, reloaded) leaves no listener for its session: once the
session has had a player and has none for `ABANDON_AFTER_S`, the console stops its agent and
publishes a whole-session cancel, so the workers do not go on synthesizing for nobody (on a
small CPU a few abandoned answers would otherwise delay every later one by minutes).

Every ``/console/api`` request must come from a loopback address and carry the console key
(``X-Voicebus-Console-Key``): the key is minted per demo run and printed in the console URL.
A custom header also means a page of another origin cannot send these requests (CORS preflight,
which the console never answers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from aiohttp import web

from voicebus.agents.conversation_file import Conversation, ConversationEvent, ControlLine, TextLine
from voicebus.settings import Settings
from voicebus.players.edge import ROUTER_KEY, is_loopback_host as is_loopback
from voicebus.schemas.contract import DEFAULT_VOICES, LANGUAGES, TextEventKind, kokoro_code

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
KEY_HEADER = "X-Voicebus-Console-Key"
MODES = ("incremental", "buffered")
AGENT_ID = "assistant"
ABANDON_AFTER_S = 3.0  # a reload reconnects well within this
OPEN_TURN_MAX_S = 300.0  # a played turn the edge never saw end counts as work going on for at most this
REAP_EVERY_S = 1.0


class ConsoleError(ValueError):
    """A console request that cannot be served; `status` is the HTTP status it is answered with."""

    status = 400


class UnknownConversation(ConsoleError):
    status = 404


class TextTooLong(ConsoleError):
    status = 413


class PlayRunning(ConsoleError):
    status = 409


def console_key() -> str:
    """A fresh console key: 12 URL-safe characters (72 random bits)."""
    return secrets.token_urlsafe(9)


def console_url(host: str, port: int, key: str) -> str:
    """The console's URL. The console answers loopback clients only, so a wildcard listen address
    is written as 127.0.0.1 (the URL stays short: it is printed on a line of its own)."""
    if host in ("", "0.0.0.0", "::") or not is_loopback(host):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/console#k={key}"


# --- pure core: what one play publishes ---------------------------------------------------------

def play_turn_id(recorded_session: str, turn_id: str, play: int, several_sessions: bool) -> str:
    """A turn id unique to this play (the gate applies a turn's seq numbers once: replaying a
    recorded turn id in the same session would be ignored as a duplicate)."""
    base = f"{recorded_session}.{turn_id}" if several_sessions else turn_id
    return f"{base}.p{play}"


def conversation_play(conversation: Conversation, session_id: str, play: int) -> list[ConversationEvent]:
    """A shipped conversation's events, moved into `session_id` with turn ids of this play."""
    several = len(conversation.sessions()) > 1
    out: list[ConversationEvent] = []
    for event in conversation.events:
        turn = None if event.turn_id is None else play_turn_id(event.session_id, event.turn_id, play, several)
        out.append(dataclasses.replace(event, session_id=session_id, turn_id=turn))
    return out


def text_play(text: str, language: str, session_id: str, play: int, token_ms: float) -> list[ConversationEvent]:
    """Typed text as one turn of LLM-like tokens, one every `token_ms`, then END_OF_TURN."""
    from voicebus.agents.tokens import split_like_llm

    voice = DEFAULT_VOICES[kokoro_code(language)]
    turn_id = f"typed.p{play}"
    pieces = split_like_llm(text)
    lines: list[ConversationEvent] = [
        TextLine(token_ms * (i + 1), AGENT_ID, session_id, turn_id, TextEventKind.TOKEN, piece, None, language, voice)
        for i, piece in enumerate(pieces)
    ]
    lines.append(TextLine(token_ms * (len(pieces) + 1), AGENT_ID, session_id, turn_id, TextEventKind.END_OF_TURN,
                          "", None, language, voice))
    return lines


def turns_of(events: Sequence[ConversationEvent]) -> list[dict[str, Any]]:
    """What the page shows of each turn: its id, the text its speaking agent streams (with each
    token's offset in ms, so the page can reveal the text as it is published) and whether a
    recorded barge-in cancels it."""
    turns: dict[str, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, TextLine) and e.kind == TextEventKind.TOKEN:
            turn = turns.setdefault(e.turn_id, {"turn_id": e.turn_id, "text": "", "tokens": [], "cancelled_at_ms": None})
            turn["text"] += e.text
            turn["tokens"].append([round(e.t_ms, 1), e.text])
        elif isinstance(e, ControlLine):
            for turn in turns.values():
                if e.turn_id in (None, turn["turn_id"]) and turn["cancelled_at_ms"] is None:
                    turn["cancelled_at_ms"] = round(e.t_ms, 1)
    return list(turns.values())


# --- the shell ------------------------------------------------------------------------------------

@dataclass
class _Session:
    session_id: str
    plays: int = 0
    task: asyncio.Task | None = None
    last_used: float = field(default_factory=time.monotonic)
    had_player: bool = False
    open_turns: set[str] = field(default_factory=set)  # the last play's turns
    played_at: float = 0.0
    alone_since: float | None = None  # when its last player left, while it had work going on


class Console:
    """The console's state: its key, the lanes it publishes to (mode -> settings, bootstrap
    resolved), the shipped conversations, the page sessions and their running plays. Owns one
    `voicebus.agents.sdk.Publisher` per lane between `start()` and `stop()` (the app's cleanup_ctx)."""

    def __init__(self, key: str, lanes: dict[str, Settings], conversations: dict[str, Conversation],
                 edge_settings: Settings) -> None:
        missing = set(MODES) - set(lanes)
        if missing:
            raise ValueError(f"the console needs a lane per mode; missing {sorted(missing)}")
        self.key = key
        self.lanes = lanes
        self.conversations = conversations
        self.settings = edge_settings
        self.publishers: dict[str, Any] = {}
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.failures: list[str] = []  # plays that failed (shown in the log and to the page)
        self.router: Any = None  # the edge's SessionRouter (set by install_console)
        self.abandoned: list[str] = []  # sessions cancelled because their page went away
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        from voicebus.agents.sdk import Publisher

        agents = sorted({e.agent_id for c in self.conversations.values() for e in c.events
                         if isinstance(e, TextLine)} | {AGENT_ID})
        for mode in MODES:
            publisher = Publisher(self.lanes[mode], agent_id=AGENT_ID)
            await publisher.start()
            self.publishers[mode] = publisher
            for agent in agents:  # topics ready before anyone presses play
                await publisher.ensure_agent_topic(agent)
        if self.router is not None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="console-reaper")

    async def _reap_forever(self) -> None:
        from aiokafka.errors import KafkaError

        while True:
            await asyncio.sleep(REAP_EVERY_S)
            for session_id in self.abandoned_sessions(time.monotonic()):
                try:
                    await self.cancel_session(session_id, "console page closed")
                except KafkaError as exc:
                    log.error("could not cancel the abandoned console session %s: %s", session_id, exc)

    def abandoned_sessions(self, now: float) -> list[str]:
        """Sessions whose page went away while they had work going on (a play publishing, or a
        turn the edge has not seen end), for `ABANDON_AFTER_S`. Each is returned once."""
        out = []
        for session in self.sessions.values():
            if self.router.clients_of(session.session_id):
                session.had_player, session.alone_since = True, None
                continue
            busy = (session.task is not None and not session.task.done()) or self._open_turns(session, now)
            if not (session.had_player and busy):
                session.alone_since = None
                continue
            if session.alone_since is None:
                session.alone_since = now
            elif now - session.alone_since >= ABANDON_AFTER_S:
                session.had_player, session.alone_since = False, None
                out.append(session.session_id)
        return out

    def _open_turns(self, session: _Session, now: float) -> bool:
        """Whether a turn of the session's last play may still be worked on: the edge has not seen
        it end (or not seen it at all yet: the gate or a worker may still be on it)."""
        if not session.open_turns or now - session.played_at > OPEN_TURN_MAX_S:
            return False
        sid = session.session_id
        active = set(self.router.active_turns(sid))
        return any(t in active or self.router.turn_started_at(sid, t) is None for t in session.open_turns)

    async def cancel_session(self, session_id: str, reason: str) -> None:
        """Stop the session's agent and cancel every turn of it everywhere (a whole-session cancel)."""
        session = self.sessions[session_id]
        if session.task is not None and not session.task.done():
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)
        await self.publishers[MODES[0]].cancel(session_id, None, reason=reason, source="console")
        self.abandoned.append(session_id)
        del self.abandoned[:-100]
        log.info("console session %s: %s; its turns are cancelled", session_id, reason)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        for session in self.sessions.values():
            if session.task is not None:
                session.task.cancel()
        tasks = [s.task for s in self.sessions.values() if s.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for publisher in self.publishers.values():
            await publisher.stop()
        self.publishers.clear()

    def new_session(self) -> dict[str, Any]:
        from voicebus.players.auth import issue_token

        session_id = "console-" + secrets.token_hex(5)
        self.sessions[session_id] = _Session(session_id)
        while len(self.sessions) > self.settings.console_max_sessions:
            oldest = next((s for s in self.sessions.values() if s.task is None or s.task.done()), None)
            if oldest is None:
                break
            del self.sessions[oldest.session_id]
        return {
            "session": session_id,
            "token": issue_token(self.settings.edge_secret, session_id, self.settings.token_ttl_s),
            "modes": list(MODES),
            "languages": sorted(LANGUAGES),
            "conversations": [
                {"name": name, "title": c.title, "description": c.description,
                 "turns": [{k: t[k] for k in ("turn_id", "text")} for t in turns_of(c.events)]}
                for name, c in self.conversations.items()
            ],
        }

    def _session(self, body: dict) -> _Session:
        session = self.sessions.get(str(body.get("session", "")))
        if session is None:
            raise ConsoleError("unknown session: ask /console/api/session for one (reload the page)")
        session.last_used = time.monotonic()
        self.sessions.move_to_end(session.session_id)
        return session

    def play(self, body: dict) -> dict[str, Any]:
        session = self._session(body)
        mode = body.get("mode")
        if mode not in MODES:
            raise ConsoleError(f"mode must be one of {MODES}, got {mode!r}")
        if session.task is not None and not session.task.done():
            raise PlayRunning("an answer is still being published in this session: wait or barge in")
        session.plays += 1
        if body.get("conversation"):
            conversation = self.conversations.get(str(body["conversation"]))
            if conversation is None:
                raise UnknownConversation(f"no shipped conversation {body['conversation']!r}")
            events = conversation_play(conversation, session.session_id, session.plays)
        else:
            text, language = str(body.get("text") or "").strip(), str(body.get("language") or "en")
            if not text:
                raise ConsoleError("nothing to say: pick a conversation or type a text")
            if len(text) > self.settings.console_max_text_chars:
                raise TextTooLong(f"the text has {len(text)} characters; the console speaks at most "
                                  f"{self.settings.console_max_text_chars} (VOICEBUS_CONSOLE_MAX_TEXT_CHARS)")
            if language not in LANGUAGES:
                raise ConsoleError(f"language {language!r} cannot be spoken; known: {sorted(LANGUAGES)}")
            events = text_play(text, language, session.session_id, session.plays, self.settings.console_token_ms)
        from voicebus.agents.replay import ReplayError, plan_replay
        from voicebus.agents.sdk import AgentError

        try:
            plan_replay(events, keep_session_ids=True)  # every record checked against the contract now
        except (AgentError, ReplayError) as exc:
            raise ConsoleError(f"cannot publish this answer: {exc}") from None
        session.task = asyncio.create_task(self._publish(mode, events), name=f"console-play-{session.session_id}")
        turns = turns_of(events)
        session.open_turns, session.played_at = {t["turn_id"] for t in turns}, time.monotonic()
        return {"session": session.session_id, "mode": mode, "play": session.plays, "turns": turns}

    async def _publish(self, mode: str, events: list[ConversationEvent]) -> None:
        from aiokafka.errors import KafkaError

        from voicebus.agents.replay import replay

        try:
            await replay(self.lanes[mode], events, publisher=self.publishers[mode], keep_session_ids=True)
        except KafkaError as exc:
            message = f"console play on the {mode} lane failed: {exc}"
            log.error(message)
            self.failures.append(message)

    async def stop_play(self, body: dict) -> dict[str, Any]:
        """The agent stops talking (the page barged in): no more of its tokens are published."""
        session = self._session(body)
        running = session.task is not None and not session.task.done()
        if running:
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)
        return {"session": session.session_id, "stopped": running}


CONSOLE_KEY = web.AppKey("console", Console)


def install_console(app: web.Application, console: Console) -> None:
    """Add the console's routes to an edge app (before it starts) and tie the console's Kafka
    publishers to the app's lifetime."""
    app[CONSOLE_KEY] = console
    console.router = app[ROUTER_KEY]
    app.cleanup_ctx.append(_console_ctx)
    app.router.add_get("/console", _page)
    app.router.add_post("/console/api/session", _api(lambda c, body: c.new_session()))
    app.router.add_post("/console/api/play", _api(lambda c, body: c.play(body)))
    app.router.add_post("/console/api/stop", _api(lambda c, body: c.stop_play(body)))


async def _console_ctx(app: web.Application) -> AsyncIterator[None]:
    console = app[CONSOLE_KEY]
    try:
        await console.start()
    except BaseException:
        await console.stop()
        raise
    yield
    await console.stop()


async def _page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(WEB_DIR / "console.html", headers={"Cache-Control": "no-store"})


def _api(handler):
    async def endpoint(request: web.Request) -> web.Response:
        console = request.app[CONSOLE_KEY]
        if not is_loopback(request.remote or ""):
            log.warning("refused %s from %s: the console answers loopback clients only", request.path, request.remote)
            return web.json_response({"error": "the console answers loopback clients only"}, status=403)
        if not secrets.compare_digest(request.headers.get(KEY_HEADER, ""), console.key):
            return web.json_response({"error": "wrong or missing console key: open the URL the demo printed"},
                                     status=403)
        try:
            body = await request.json() if request.can_read_body else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        try:
            result = handler(console, body)
            if asyncio.iscoroutine(result):
                result = await result
        except ConsoleError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return web.json_response(result)

    return endpoint
