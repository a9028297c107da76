"""The web player's redirect allow-list, in Debian's headless chromium: the page the edge serves
follows a redirect (close 4307 after `redirect`) and keeps the edges a `ready` lists only when their
origin is the page's own or one the edge allows (VOICEBUS_EDGE_REDIRECT_ORIGINS, handed to the page
as ``<html data-edge-origins>``). A refused redirect says so in the status line and is not followed:
the player's token never reaches the other origin.

The page is the real one, served by a real edge app; its WebSockets are answered by Playwright
(`page.route_web_socket`), which plays the edges: the entry edge redirects, the others answer ready."""

from __future__ import annotations

import asyncio
import json

import pytest

from voicebus.players import protocol
from voicebus.players.auth import issue_token, player_url
from tests.players.edge_helpers import SECRET, edge_settings, running_edge
from tests.players.test_browser_e2e import CHROMIUM, CHROMIUM_ARGS, wait_in_page

pytestmark = [pytest.mark.browser]

ALLOWED = "ws://edge-b.test:8765/ws"  # an edge of another origin, allowed by the edge's settings
FOREIGN = "ws://evil.test:8765/ws"  # an origin nobody allowed


class FakeEdges:
    """Every WebSocket the page opens: the entry edge (the page's own /ws) answers the hello with
    `redirect` to `target` and closes with 4307; any other edge answers `ready` listing `listed`."""

    def __init__(self, entry: str, target: str, listed: list[str]) -> None:
        self.entry, self.target, self.listed = entry, target, listed
        self.hellos: list[tuple[str, dict]] = []  # (url, hello) of every hello an edge received

    async def route(self, ws) -> None:
        async def on_message(message) -> None:
            msg = json.loads(message)
            if msg.get("type") != "hello":
                return  # pings, reports
            self.hellos.append((ws.url, msg))
            session = msg["session"]
            if ws.url == self.entry:
                ws.send(json.dumps({"type": protocol.REDIRECT, "v": 1, "url": self.target, "session": session,
                                    "partition": 0}))
                await ws.close(code=protocol.CLOSE_REDIRECT, reason="redirect")
            else:
                ws.send(json.dumps({"type": "ready", "v": 1, "session": session, "client_id": "c-1",
                                    "server_time_us": 0, "queue_frames": 0, "edge": "edge-b", "edges": self.listed}))

        ws.on_message(on_message)


async def _play(settings, target: str, listed: list[str] = ()) -> tuple[dict, FakeEdges]:
    """Open the player the edge serves, press Start, let the entry edge redirect to `target`;
    returns what the page knows once it settled, and the fake edges."""
    from playwright.async_api import async_playwright

    async with running_edge(settings, with_kafka=False) as (app, client), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            edges = FakeEdges(str(client.make_url("/ws")).replace("http://", "ws://"), target, list(listed))
            await page.route_web_socket(lambda url: True, edges.route)
            await page.goto(player_url(str(client.make_url("/")), "S", issue_token(SECRET, "S", 300)))
            await page.click("#start")
            await wait_in_page(page, "window.voicebusPlayer.state === 'ready' || "
                                     "document.getElementById('status').textContent.includes('refused')")
            await asyncio.sleep(1.5)  # a reconnect the player should not make would happen within this
            seen = await page.evaluate("""() => ({
                state: window.voicebusPlayer.state,
                edge: window.voicebusPlayer.edge || null,
                edges: window.voicebusPlayer.edges,
                status: document.getElementById('status').textContent,
                attribute: document.documentElement.dataset.edgeOrigins,
            })""")
            assert not errors, errors
            return seen, edges
        finally:
            await browser.close()


async def test_a_redirect_to_a_foreign_origin_is_refused_and_not_followed():
    settings = edge_settings(edge_redirect_origins="http://edge-b.test:8765")
    seen, edges = await _play(settings, FOREIGN)
    assert seen["attribute"] == "http://edge-b.test:8765"  # the edge handed its list to the page
    assert "refused" in seen["status"] and FOREIGN in seen["status"], seen["status"]
    assert seen["state"] == "closed"
    assert seen["edges"]["refused"] == [{"url": FOREIGN, "why": "redirect"}]
    assert seen["edges"]["redirects"] == [] and seen["edges"]["connections"] == [edges.entry]
    assert [url for url, _ in edges.hellos] == [edges.entry]  # the token went to the page's edge only


async def test_a_redirect_to_an_allowed_origin_is_followed_and_ready_lists_only_allowed_edges():
    settings = edge_settings(edge_redirect_origins="http://edge-b.test:8765, https://edge-c.test")
    listed = [ALLOWED, "/edge-3/ws", FOREIGN, "wss://edge-c.test/ws", "ws://edge-c.test/ws"]
    seen, edges = await _play(settings, ALLOWED, listed)
    assert seen["attribute"] == "http://edge-b.test:8765,https://edge-c.test"
    assert seen["state"] == "ready" and seen["edge"] == "edge-b", seen
    assert seen["edges"]["connections"] == [edges.entry, ALLOWED]
    assert [url for url, _ in edges.hellos] == [edges.entry, ALLOWED]
    assert edges.hellos[0][1] == edges.hellos[1][1]  # the same hello, on the owner
    # of what the ready listed: the allowed origin, a path on the page's own origin and the allowed
    # https origin over wss are kept; the foreign origin and ws:// to an https-only origin are not
    own_edge_3 = edges.entry.replace("/ws", "/edge-3/ws")
    assert seen["edges"]["known"] == [ALLOWED, own_edge_3, "wss://edge-c.test/ws"]
    assert seen["edges"]["refused"] == [{"url": FOREIGN, "why": "ready"}, {"url": "ws://edge-c.test/ws", "why": "ready"}]


async def test_a_redirect_on_the_pages_own_origin_is_followed_and_other_origins_need_the_setting():
    """No VOICEBUS_EDGE_REDIRECT_ORIGINS: a path (edges behind one proxy) is followed; the edge
    that another deployment allowed is refused here."""
    settings = edge_settings()
    seen, edges = await _play(settings, "/edge-2/ws")
    assert seen["attribute"] == ""
    assert seen["state"] == "ready" and seen["edges"]["refused"] == []
    assert seen["edges"]["connections"] == [edges.entry, edges.entry.replace("/ws", "/edge-2/ws")]

    seen, edges = await _play(settings, ALLOWED)
    assert seen["state"] == "closed" and "refused" in seen["status"]
    assert [url for url, _ in edges.hellos] == [edges.entry]


async def test_edge_origins_are_compared_scheme_host_and_port():
    """edge-client.js's allow-list rule: ws/wss as http/https, default ports implied, host case-folded."""
    from playwright.async_api import async_playwright

    async with running_edge(edge_settings(), with_kafka=False) as (app, client), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(str(client.make_url("/")))
            got = await page.evaluate("""async () => {
                const m = await import('/web/edge-client.js');
                const allowed = m.parseOrigins(" https://Edge-2.example.com:443/ , http://edge-3:8765,not a url,/x");
                const page = "https://app.example.com/#session=S";
                const cases = ["wss://app.example.com/ws", "ws://app.example.com/ws", "wss://app.example.com:8443/ws",
                               "wss://edge-2.example.com/ws", "ws://edge-3:8765/ws", "ws://edge-3:8766/ws",
                               "wss://evil.example.com/ws", "", "/ws"];
                return { allowed, verdicts: cases.map((u) => [u, m.edgeAllowed(u, page, allowed)]) };
            }""")
        finally:
            await browser.close()
    assert got["allowed"] == ["https://edge-2.example.com", "http://edge-3:8765"]
    assert dict(got["verdicts"]) == {
        "wss://app.example.com/ws": True,  # the page's own origin
        "ws://app.example.com/ws": False,  # same host, another scheme: another origin
        "wss://app.example.com:8443/ws": False,  # another port
        "wss://edge-2.example.com/ws": True,
        "ws://edge-3:8765/ws": True,
        "ws://edge-3:8766/ws": False,
        "wss://evil.example.com/ws": False,
        "": False,
        "/ws": False,  # not absolute: the player resolves paths against its page before asking
    }
