"""The schema registry client's credentials: sent as HTTP basic auth, taken from the settings
(or from ``user:password@`` in the URL), and never shown in ``repr`` or an error message.

The server here is a loopback HTTP server that checks the ``Authorization`` header the way a
registry behind basic auth does (401 without it); the registry's API itself is tested against
the real Apicurio in test_registry.py."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import SecretStr

from voicebus.codecs import codec_for
from voicebus.registry import RegistryError, SchemaRegistry
from voicebus.settings import Settings

USER, PASSWORD = "gate", "registry-pass-1234"


@contextlib.contextmanager
def json_server(answer):
    """A loopback HTTP server whose GET answers ``answer(path, headers) -> (status, JSON body)``;
    yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            status, value = answer(self.path, self.headers)
            body = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def registry_url():
    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    def answer(path, headers):
        if headers.get("Authorization") != expected:
            return 401, {"error_code": 40101, "message": "Unauthorized"}
        return 200, ["voicebus.text.a-value"]

    with json_server(answer) as url:
        yield url + "/apis/ccompat/v7"


def test_the_settings_credentials_are_sent_as_basic_auth(registry_url):
    settings = Settings(registry_url=registry_url, registry_username=USER, registry_password=SecretStr(PASSWORD))
    registry = codec_for(settings).registry
    assert registry.subjects() == ["voicebus.text.a-value"]
    assert PASSWORD not in repr(registry)


def test_credentials_in_the_url_are_used_and_never_shown(registry_url):
    with_userinfo = registry_url.replace("http://", f"http://{USER}:{PASSWORD}@")
    registry = SchemaRegistry(with_userinfo)
    assert registry.subjects() == ["voicebus.text.a-value"]
    assert PASSWORD not in repr(registry) and registry.url == registry_url


def test_a_wrong_password_is_a_clear_error_without_the_password(registry_url):
    wrong = "not-the-password-5678"
    with pytest.raises(RegistryError) as caught:
        SchemaRegistry(registry_url, username=USER, password=wrong).subjects()
    assert "HTTP 401" in str(caught.value) and wrong not in str(caught.value)
    unreachable = f"http://{USER}:{wrong}@127.0.0.1:1/apis/ccompat/v7"  # nothing listens on port 1
    with pytest.raises(RegistryError) as caught:
        SchemaRegistry(unreachable, timeout_s=2).subjects()
    assert "unreachable" in str(caught.value) and wrong not in str(caught.value)


# --- a flood of unknown schema ids ----------------------------------------------------------------


def test_a_flood_of_unknown_schema_ids_is_looked_up_at_a_bounded_rate():
    """Records naming made-up schema ids each cost a registry request (blocking the stage while
    it waits); past the codec's lookup rate they are refused without one, and an id the registry
    said it does not know is never asked again."""
    import struct

    from voicebus.codecs import Codec, UnknownSchemaId
    from voicebus.ratelimit import TokenBucket

    asked: list[str] = []

    def answer(path, headers):
        asked.append(path)
        return 404, {"error_code": 40403, "message": "Schema not found"}

    with json_server(answer) as url:
        now = [0.0]
        codec = Codec(registry=SchemaRegistry(url),
                      lookup_limit=TokenBucket(1.0, 3, clock=lambda: now[0]))
        reasons = []
        for schema_id in [7, 7, *range(100, 200)]:
            with pytest.raises(UnknownSchemaId) as caught:
                codec.decode(b"\x00" + struct.pack(">I", schema_id) + b"\x02")
            reasons.append(str(caught.value))
        assert len(asked) == 3 and asked[0].endswith("/schemas/ids/7")  # 7 once, then 2 more: the burst
        assert sum("per second" in r for r in reasons) == 98  # 102..199: the burst was spent on 7, 100, 101
        now[0] += 2.0  # two tokens later
        for schema_id in (300, 301, 302):
            with pytest.raises(UnknownSchemaId):
                codec.decode(b"\x00" + struct.pack(">I", schema_id) + b"\x02")
        assert len(asked) == 5
