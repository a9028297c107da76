"""The browser players take the protocol's constants from players/web/protocol.js, generated from
players/protocol.py, and their types from protocol.d.ts, generated with it: the files in the tree
are what the generator writes, and the player module and the pages use them."""

from __future__ import annotations

import re

from voicebus.players import protocol


def test_protocol_js_is_what_the_python_side_generates():
    assert protocol.JS_MODULE.read_text(encoding="utf-8") == protocol.javascript_module(), (
        "players/web/protocol.js is stale: run `python -m voicebus.players.protocol --write-js`")


def test_protocol_d_ts_is_what_the_python_side_generates():
    assert protocol.TS_DECLARATIONS.read_text(encoding="utf-8") == protocol.typescript_declarations(), (
        "players/web/protocol.d.ts is stale: run `python -m voicebus.players.protocol --write-js`")


def test_the_declarations_declare_what_the_module_exports():
    js = protocol.javascript_module()
    ts = protocol.typescript_declarations()
    exported = re.findall(r"^export const (\w+) = ", js, re.M)
    assert exported and exported == re.findall(r"^export declare const (\w+): ", ts, re.M)
    for name, value in [("PROTOCOL_VERSION", protocol.PROTOCOL_VERSION), ("HEADER_BYTES", protocol.AUDIO_HEADER_LEN)]:
        assert f"export declare const {name}: {value};" in ts
    assert f'readonly REDIRECT: {protocol.CLOSE_REDIRECT};' in ts and 'readonly TURN_END: "turn_end";' in ts


def test_the_player_and_the_pages_name_message_types_and_close_codes_only_through_it():
    web = protocol.JS_MODULE.parent
    for page in ("index.js", "player.js", "console.js"):
        code = (web / page).read_text(encoding="utf-8")
        assert not re.findall(r'case "(?:%s)"' % "|".join(sorted(protocol.SERVER_MESSAGE_TYPES)), code), page
        assert not re.findall(r'send\("(?:%s)"' % "|".join(sorted(protocol.CLIENT_MESSAGE_TYPES)), code), page
        assert not re.findall(r"e\.code === 4\d\d\d|e\.code === 101[23]", code), page
