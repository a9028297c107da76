"""Closed by default: the edge refuses a public or empty secret beyond loopback, serves /metrics to
loopback only (or on its own port), refuses browser pages of other origins, and tells every refusal."""

from __future__ import annotations

import json
import socket

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from voicebus.cli import main
from voicebus.settings import DEFAULT_EDGE_SECRET, Settings
from voicebus.players import protocol
from voicebus.players.auth import MissingSecret, issue_token, verify_token
from voicebus.players.edge import InsecureEdgeConfig, host_allowed, make_app, origin_allowed
from voicebus.ops.daemon import free_port
from tests.players.edge_helpers import SECRET, collect, connect, edge_settings, of_type, running_edge


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.2", "", "edge.example.com"])
def test_the_default_secret_is_refused_beyond_loopback(host):
    with pytest.raises(InsecureEdgeConfig, match="VOICEBUS_EDGE_SECRET"):
        make_app(Settings(edge_host=host), with_kafka=False)
    make_app(Settings(edge_host=host, edge_secret="a-real-secret"), with_kafka=False)  # a real one is fine


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_the_default_secret_is_fine_on_loopback(host):
    make_app(Settings(edge_host=host, edge_secret=DEFAULT_EDGE_SECRET), with_kafka=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_empty_secret_is_refused_everywhere(host):
    with pytest.raises(InsecureEdgeConfig, match="empty"):
        make_app(Settings(edge_host=host, edge_secret=""), with_kafka=False)
    with pytest.raises(MissingSecret):
        issue_token("", "s1", 60)
    with pytest.raises(MissingSecret):
        verify_token("", issue_token("x", "s1", 60), "s1")


def test_the_edge_command_refuses_to_start_open_and_says_why(monkeypatch, capsys):
    monkeypatch.delenv("VOICEBUS_EDGE_SECRET", raising=False)
    assert main(["edge", "--host", "0.0.0.0", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on '0.0.0.0' with the default VOICEBUS_EDGE_SECRET" in err
    monkeypatch.setenv("VOICEBUS_EDGE_SECRET", "")
    assert main(["token", "--session", "s1"]) == 2
    assert "VOICEBUS_EDGE_SECRET is empty" in capsys.readouterr().err
    monkeypatch.delenv("VOICEBUS_EDGE_SECRET")
    monkeypatch.setenv("VOICEBUS_EDGE_HOST", "0.0.0.0")
    assert main(["demo", "--tiny"]) == 2  # before loading a model or starting anything
    assert "with the default VOICEBUS_EDGE_SECRET" in capsys.readouterr().out


async def test_the_pipeline_stack_refuses_an_exposed_edge_before_starting_anything():
    from voicebus.ops.runtime import PipelineStack

    stack = PipelineStack(Settings(edge_host="0.0.0.0", bootstrap="192.0.2.1:9"), None)
    with pytest.raises(InsecureEdgeConfig):
        await stack.start()  # not BrokerError: the bus is never tried
    await stack.stop()


def _non_loopback_address() -> str:
    """This machine's address on its default route (the UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        address = s.getsockname()[0]
    assert not address.startswith("127."), f"no non-loopback IPv4 address here ({address})"
    return address


async def _serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def test_metrics_on_the_player_port_answer_loopback_clients_only():
    port = free_port()
    runner = await _serve(make_app(Settings(edge_host="0.0.0.0", edge_port=port, edge_secret=SECRET), with_kafka=False),
                          "0.0.0.0", port)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200 and "voicebus_edge" in await r.text()
            async with http.get(f"http://{_non_loopback_address()}:{port}/metrics") as r:
                assert r.status == 403 and "loopback clients only" in await r.text()
            async with http.get(f"http://{_non_loopback_address()}:{port}/healthz") as r:
                assert r.status == 200  # the rest of the edge is served as before
    finally:
        await runner.cleanup()


async def test_metrics_on_their_own_port_leave_the_player_port():
    port, metrics_port = free_port(), free_port()
    settings = Settings(edge_port=port, edge_secret=SECRET, edge_metrics_port=metrics_port)
    runner = await _serve(make_app(settings, with_kafka=False), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                assert r.status == 200 and "voicebus_edge" in await r.text()
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 404
    finally:
        await runner.cleanup()
    with pytest.raises(ConnectionError):  # stopped with the edge
        socket.create_connection(("127.0.0.1", metrics_port), timeout=1).close()


@pytest.mark.parametrize("origin, allowed, ok", [
    (None, "", True),  # not a browser
    ("SAME", "", True),  # the edge's own page
    ("http://localhost:3000", "", True),
    ("http://127.0.0.1:5173", "", True),
    ("https://evil.example", "", False),
    ("null", "", False),
    ("https://app.example", "https://app.example, https://other.example", True),
    ("https://app.example/", "https://APP.example", True),
    ("http://localhost:3000", "https://app.example", False),  # a list replaces the loopback default
    ("SAME", "https://app.example", True),
    ("https://evil.example", "*", True),
])
def test_origin_policy(origin, allowed, ok):
    host = "edge.example:8765"
    assert origin_allowed(f"http://{host}" if origin == "SAME" else origin, host, allowed) is ok


async def test_a_page_of_another_origin_is_closed_with_4403_and_a_clear_error():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        ws = await client.ws_connect("/ws", headers={"Origin": "https://evil.example"})
        got = await collect(ws, lambda m: False)
        [error] = of_type(got, "error")
        assert error["code"] == "origin-not-allowed" and "evil.example" in error["message"]
        assert ws.close_code == protocol.CLOSE_FORBIDDEN_ORIGIN == 4403
        own = f"http://{client.server.host}:{client.server.port}"
        ws = await client.ws_connect("/ws", headers={"Origin": own})
        await ws.send_str(json.dumps({"type": "hello", "v": 1, "session": "s1", "token": issue_token(SECRET, "s1", 60)}))
        assert json.loads((await ws.receive(timeout=5)).data)["type"] == "ready"
        await ws.close()


@pytest.mark.parametrize("host, secret, ok", [
    ("127.0.0.1:8765", DEFAULT_EDGE_SECRET, True),
    ("localhost:8765", DEFAULT_EDGE_SECRET, True),
    ("[::1]:8765", DEFAULT_EDGE_SECRET, True),
    ("evil.example:8765", DEFAULT_EDGE_SECRET, False),  # DNS rebinding onto a loopback edge
    ("192.0.2.2:8765", DEFAULT_EDGE_SECRET, False),
    (None, DEFAULT_EDGE_SECRET, False),
    ("edge.example.com", "a-real-secret", True),  # behind a proxy: any name
])
def test_host_policy(host, secret, ok):
    assert host_allowed(host, secret) is ok


async def test_a_rebound_host_name_is_refused_by_an_edge_with_the_default_secret():
    async with running_edge(Settings(), with_kafka=False) as (app, client):  # loopback, default secret
        port = client.server.port
        ws = await client.ws_connect("/ws", headers={"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"})
        got = await collect(ws, lambda m: False)
        assert of_type(got, "error")[0]["code"] == "origin-not-allowed" and ws.close_code == 4403
        ws = await client.ws_connect("/ws", headers={"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"})
        token = issue_token(DEFAULT_EDGE_SECRET, "s1", 60)
        await ws.send_str(json.dumps({"type": "hello", "v": 1, "session": "s1", "token": token}))
        assert json.loads((await ws.receive(timeout=5)).data)["type"] == "ready"
        await ws.close()


async def test_frame_size_limits_close_with_4400_or_1009_as_documented():
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        # 6000 euro signs: 6000 characters but 18000 UTF-8 bytes, over the 16384-byte text limit
        ws, _ = await connect(client, "s1")
        await ws.send_str(json.dumps({"type": "ping", "v": 1, "t0": 1, "pad": "€" * 6000}, ensure_ascii=False))
        got = await collect(ws, lambda m: False)
        assert of_type(got, "error")[0]["code"] == "malformed-frame" and ws.close_code == 4400
        # over MAX_WS_MESSAGE_BYTES the WebSocket layer closes with 1009 before anything is parsed
        ws, _ = await connect(client, "s1")
        await ws.send_str("x" * (protocol.MAX_WS_MESSAGE_BYTES + 1))
        got = await collect(ws, lambda m: False)
        assert got[-1].type == WSMsgType.CLOSE and ws.close_code == protocol.CLOSE_MESSAGE_TOO_BIG == 1009


HELLO_S1 = json.dumps({"type": "hello", "v": 1, "session": "s1", "token": issue_token(SECRET, "s1", 3600)})


@pytest.mark.parametrize("frame, code, close_code", [
    ("[]", "malformed-frame", 4400),
    ('{"v":1}', "unknown-message-type", 4400),
    ('{"type":7,"v":1}', "unknown-message-type", 4400),
    ('{"type":"ping","t0":1}', "unsupported-version", 4426),
    ('{"type":"ping","v":1,"t0":true}', "malformed-frame", 4400),
    ('{"type":"report","v":1,"kind":"LOUD","turn_id":"t"}', "malformed-frame", 4400),
    ('{"type":"cancel","v":1,"turn_id":5}', "malformed-frame", 4400),
    ('{"type":"cancel","v":1,"turn_id":""}', "malformed-frame", 4400),
    ('{"type":"report","v":1,"kind":"STOPPED","turn_id":"%s"}' % ("t" * 129), "malformed-frame", 4400),
    ('{"type":"report","v":1,"kind":"AUDIBLE_START","turn_id":"t","sentence_seq":-1}', "out-of-range", 4400),
    ('{"type":"report","v":1,"kind":"AUDIBLE_START","turn_id":"t","audible_at_us":-5}', "out-of-range", 4400),
    ('{"type":"report","v":1,"kind":"AUDIBLE_START","turn_id":"t","sentence_seq":"1"}', "malformed-frame", 4400),
    ('{"type":"ping","v":1,"t0":NaN}', "out-of-range", 4400),
    (HELLO_S1, "malformed-frame", 4400),  # a second hello
    (b"\x01" * 24, "malformed-frame", 4400),  # a binary frame after hello
])
async def test_each_documented_4400_cause_gets_its_documented_reason(frame, code, close_code):
    """The tables of docs/protocol.md, *Errors and close codes*, frame by frame."""
    async with running_edge(edge_settings(), with_kafka=False) as (app, client):
        ws, _ = await connect(client, "s1")
        await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
        got = await collect(ws, lambda m: False)
        assert of_type(got, "error")[0]["code"] == code and ws.close_code == close_code
