"""The browser players take the protocol's constants from players/web/protocol.js, generated from
players/protocol.py: the file in the tree is what the generator writes, and the pages use it."""

from __future__ import annotations

import re

from voicebus.players import protocol


def test_protocol_js_is_what_the_python_side_generates():
    assert protocol.JS_MODULE.read_text(encoding="utf-8") == protocol.javascript_module(), (
        "players/web/protocol.js is stale: run `python -m voicebus.players.protocol --write-js`")


def test_the_pages_name_message_types_and_close_codes_only_through_it():
    web = protocol.JS_MODULE.parent
    for page in ("player.js", "console.js"):
        code = (web / page).read_text(encoding="utf-8")
        assert not re.findall(r'case "(?:%s)"' % "|".join(sorted(protocol.SERVER_MESSAGE_TYPES)), code), page
        assert not re.findall(r'send\("(?:%s)"' % "|".join(sorted(protocol.CLIENT_MESSAGE_TYPES)), code), page
        assert not re.findall(r"e\.code === 4\d\d\d|e\.code === 101[23]", code), page
