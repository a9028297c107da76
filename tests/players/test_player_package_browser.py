"""The npm package in an app's page, in Debian's headless chromium: the tarball `npm pack` writes,
unpacked into a site's node_modules as `npm install` puts it, served by that site (another origin
than the edge's), and its example page (examples/embed.html: an import map and `createPlayer`)
plays a session from the edge: turn start, words, captions, audible, the turn's end with how far
it was rendered, and a barge-in (`cancel()`) that stops the next turn."""

from __future__ import annotations

import contextlib
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from voicebus.players.auth import issue_token
from voicebus.players.edge import ROUTER_KEY
from voicebus.players.tone import tone_turn
from voicebus.schemas.messages import AudioChunk, WordTiming
from tests.players.edge_helpers import SECRET, edge_settings, running_edge
from tests.players.test_browser_e2e import CHROMIUM, CHROMIUM_ARGS, wait_in_page
from tests.players.test_player_package import pack

pytestmark = [pytest.mark.browser]

CHUNK_SAMPLES = 3600  # 150 ms at 24 kHz
WORDS = ["one", "two", "three", "four"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A site whose node_modules holds the packed package, as in an app that installed the tarball."""
    root = tmp_path_factory.mktemp("site")
    target = root / "node_modules" / "@voicebus" / "player"
    target.mkdir(parents=True)
    with tarfile.open(pack(root)) as tar:
        for member in tar.getmembers():
            member.name = member.name.removeprefix("package/")
        tar.extractall(target, filter="data")
    return root


@contextlib.asynccontextmanager
async def serving(root: Path):
    app = web.Application()
    app.router.add_static("/", root)
    server = TestServer(app)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def worded_turn(session: str, turn_id: str, sentences: int, chunks: int) -> list[AudioChunk]:
    """A tone turn whose sentences each say WORDS, one word per chunk."""
    out = tone_turn(session, turn_id, sentences=sentences, chunks_per_sentence=chunks)
    for i, chunk in enumerate(out):
        c = chunk.chunk_seq
        if c < len(WORDS):
            out[i] = replace(chunk, words=(WordTiming(text=WORDS[c], start=c * CHUNK_SAMPLES,
                                                      end=(c + 1) * CHUNK_SAMPLES - 600),))
    return out


async def test_the_packed_example_page_plays_a_session_from_another_origin_and_barges_in(site):
    from playwright.async_api import async_playwright

    async with running_edge(edge_settings(), with_kafka=False) as (app, client), serving(site) as server, \
            async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            edge = str(client.make_url("/ws")).replace("http://", "ws://")
            url = (str(server.make_url("/node_modules/@voicebus/player/examples/embed.html"))
                   + f"#edge={edge}&session=S&token={issue_token(SECRET, 'S', 300)}")
            assert url.split("/")[2] != edge.split("/")[2]  # the page's origin is not the edge's
            await page.goto(url)
            await page.click("#play")
            await wait_in_page(page, "window.voicebusEmbed.some(e => e.type === 'ready')")

            router = app[ROUTER_KEY]
            for chunk in worded_turn("S", "turn-1", sentences=2, chunks=4):
                router.route(chunk)
            end = await wait_in_page(page, "window.voicebusEmbed.find(e => e.type === 'turnend')")
            assert end == {"type": "turnend", "turnId": "turn-1", "stopped": False,
                           "rendered": {"sentenceSeq": 1, "samples": 4 * CHUNK_SAMPLES}}, end
            events = await page.evaluate("window.voicebusEmbed")
            kinds = [e["type"] for e in events]
            assert kinds[:3] == ["ready", "turnstart", "words"] and kinds.index("audible") < kinds.index("turnend"), kinds
            words = [e for e in events if e["type"] == "words"]
            assert [(e["sentenceSeq"], e["words"]) for e in words] == [(0, 1), (0, 2), (0, 3), (0, 4),
                                                                       (1, 1), (1, 2), (1, 3), (1, 4)]
            assert await page.text_content("#caption b") in WORDS  # a caption was shown, its word marked

            # barge in on a long turn once it is audible: stopped here, reported, cancelled at the edge
            for chunk in worded_turn("S", "turn-2", sentences=3, chunks=10):
                router.route(chunk)
            await wait_in_page(page, "window.voicebusEmbed.some(e => e.type === 'audible' && e.turnId === 'turn-2')")
            await page.click("#bargein")
            stop = await wait_in_page(
                page, "window.voicebusEmbed.find(e => e.type === 'turnend' && e.turnId === 'turn-2')")
            assert stop["stopped"] and stop["rendered"]["samples"] > 0, stop
            events = await page.evaluate("window.voicebusEmbed")
            assert {"type": "cancel", "turnId": "turn-2"} in events
            assert not [e for e in events if e["type"] == "error"] and not errors, (events, errors)
        finally:
            await browser.close()
