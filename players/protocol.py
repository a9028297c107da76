"""The edge <-> player wire protocol (version 1): frame layouts, message types, close codes and
their typed parse errors. Pure: no I/O. `docs/protocol.md` is the human-readable copy.

Two kinds of WebSocket frames:

* binary frames carry audio: a fixed 20-byte little-endian header followed by the chunk's audio
  as the bus carries it: PCM16LE samples, or Opus packets each behind a 2-byte length (the
  header's ``encoding`` byte says which);
* text frames carry control messages: one JSON object with a ``type`` field and the protocol
  version ``v``.

The binary header names the turn by a small per-connection number (``turn``), announced together
with the turn's id in the ``turn_start`` control message, so audio frames stay fixed-size.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from voicebus.schemas.contract import (
    LIMITS,
    AudioEncoding,
    MalformedOpusPayload,
    PlaybackKind,
    check_opus_packets,
    is_valid_id,
)

PROTOCOL_VERSION = 1

# --- binary audio frames ---------------------------------------------------------------------
FRAME_AUDIO = 0x01
ENCODING_PCM16LE = 0x01
ENCODING_OPUS = 0x02  # whole Opus packets, each a u16 little-endian length then the packet
ENCODINGS = {AudioEncoding.PCM16LE: ENCODING_PCM16LE, AudioEncoding.OPUS: ENCODING_OPUS}

FLAG_LAST_IN_SENTENCE = 0x01
FLAG_LAST_IN_TURN = 0x02
FLAG_FIRST_IN_SENTENCE = 0x04

# type u8 | version u8 | flags u8 | encoding u8 | turn u32 | sentence u32 | chunk u32 | sample_rate u32
AUDIO_HEADER = struct.Struct("<BBBBIIII")
AUDIO_HEADER_LEN = AUDIO_HEADER.size  # 20
MAX_AUDIO_FRAME_BYTES = 1024 * 1024

# --- JSON control messages -------------------------------------------------------------------
# server -> client
READY = "ready"
TURN_START = "turn_start"
TURN_END = "turn_end"
STOP = "stop"
TIMELINE = "timeline"
WORDS = "words"
SKIP = "skip"
PONG = "pong"
ERROR = "error"
REDIRECT = "redirect"
RECONNECT = "reconnect"
# client -> server
HELLO = "hello"
CANCEL = "cancel"
PING = "ping"
REPORT = "report"

CLIENT_MESSAGE_TYPES = frozenset({HELLO, CANCEL, PING, REPORT})
SERVER_MESSAGE_TYPES = frozenset({READY, TURN_START, TURN_END, STOP, TIMELINE, WORDS, SKIP, PONG, ERROR, REDIRECT, RECONNECT})
REPORT_KINDS = frozenset(PlaybackKind)
MAX_TEXT_FRAME_BYTES = 16 * 1024  # a longer client text frame (UTF-8 bytes) is refused: 4400 malformed-frame
# The WebSocket layer's limit on one message from a client: above it the edge closes with 1009
# (message too big) without parsing it.
MAX_WS_MESSAGE_BYTES = 4 * MAX_TEXT_FRAME_BYTES

# --- close codes (4000-4999 are the application's range) -------------------------------------
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the edge shuts down
CLOSE_PROTOCOL_ERROR = 4400  # malformed frame, unknown type, hello missing or repeated
CLOSE_MESSAGE_TOO_BIG = 1009  # a client message over MAX_WS_MESSAGE_BYTES (closed by the WebSocket layer)
CLOSE_UNAUTHORIZED = 4401  # token missing, forged, expired or for another session
CLOSE_FORBIDDEN_ORIGIN = 4403  # a browser page of an origin the edge does not allow
CLOSE_HELLO_TIMEOUT = 4408  # no hello within the deadline
CLOSE_UNSUPPORTED_VERSION = 4426  # the client speaks another protocol version
CLOSE_TOO_SLOW = 4429  # the client could not keep up (see the slow-client policy)
CLOSE_TRY_AGAIN_LATER = 1013  # connection limit reached (edge-full, session-full), or no edge owns the session now (no-owner)
CLOSE_SERVICE_RESTART = 1012  # the session moved to another edge (a rebalance): reconnect, with resume
CLOSE_REDIRECT = 4307  # this edge does not own the session: the redirect message names the one that does


class ProtocolError(ValueError):
    """A frame could not be parsed. `code` is the error code sent to the client and `close_code`
    the WebSocket close code the edge closes with."""

    code = "protocol-error"
    close_code = CLOSE_PROTOCOL_ERROR


class MalformedFrame(ProtocolError):
    code = "malformed-frame"


class UnknownMessageType(ProtocolError):
    code = "unknown-message-type"


class UnsupportedVersion(ProtocolError):
    code = "unsupported-version"
    close_code = CLOSE_UNSUPPORTED_VERSION


class OriginNotAllowed(ProtocolError):
    code = "origin-not-allowed"
    close_code = CLOSE_FORBIDDEN_ORIGIN


class OutOfRange(MalformedFrame):
    """A number in a client message is negative, too large for its Avro field, or not finite."""

    code = "out-of-range"


@dataclass(frozen=True)
class AudioFrame:
    turn: int
    sentence: int
    chunk: int
    sample_rate: int
    pcm: bytes
    flags: int = 0
    encoding: int = ENCODING_PCM16LE
    version: int = PROTOCOL_VERSION

    @property
    def last_in_sentence(self) -> bool:
        return bool(self.flags & FLAG_LAST_IN_SENTENCE)

    @property
    def last_in_turn(self) -> bool:
        return bool(self.flags & FLAG_LAST_IN_TURN)


def check_payload(encoding: int, payload: bytes) -> None:
    """`MalformedFrame` unless `payload` is what the header's `encoding` byte says."""
    if encoding == ENCODING_PCM16LE:
        if len(payload) % 2:
            raise MalformedFrame(f"PCM16 payload has an odd length ({len(payload)} bytes): not whole PCM16LE samples")
    elif encoding == ENCODING_OPUS:
        try:
            check_opus_packets(payload)
        except MalformedOpusPayload as exc:
            raise MalformedFrame(f"Opus payload: {exc}") from None
    else:
        raise MalformedFrame(f"unknown audio encoding 0x{encoding:02x}")


def encode_audio(frame: AudioFrame, checked: bool = False) -> bytes:
    """The binary frame of ``frame``; its payload checked (`check_payload`) unless the caller
    did (``checked``: the edge checks each chunk once, before it builds the frame)."""
    if not checked:
        check_payload(frame.encoding, frame.pcm)
    header = AUDIO_HEADER.pack(
        FRAME_AUDIO, frame.version, frame.flags, frame.encoding, frame.turn, frame.sentence, frame.chunk, frame.sample_rate
    )
    return header + frame.pcm


def decode_audio(data: bytes) -> AudioFrame:
    if len(data) < AUDIO_HEADER_LEN:
        raise MalformedFrame(f"binary frame of {len(data)} bytes is shorter than the {AUDIO_HEADER_LEN}-byte header")
    if len(data) > MAX_AUDIO_FRAME_BYTES:
        raise MalformedFrame(f"binary frame of {len(data)} bytes exceeds {MAX_AUDIO_FRAME_BYTES}")
    ftype, version, flags, encoding, turn, sentence, chunk, rate = AUDIO_HEADER.unpack_from(data)
    if ftype != FRAME_AUDIO:
        raise UnknownMessageType(f"unknown binary frame type 0x{ftype:02x}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"binary frame version {version}, this edge speaks {PROTOCOL_VERSION}")
    pcm = bytes(data[AUDIO_HEADER_LEN:])
    check_payload(encoding, pcm)
    return AudioFrame(turn, sentence, chunk, rate, pcm, flags, encoding, version)


def encode_control(message_type: str, **fields: Any) -> str:
    """A JSON control message (server -> client or client -> server)."""
    return json.dumps({"type": message_type, "v": PROTOCOL_VERSION, **fields}, separators=(",", ":"))


def websocket_frame(message: bytes | str) -> bytes:
    """`message` as a server puts it on the socket: one final, unmasked, uncompressed WebSocket
    frame (RFC 6455), binary for bytes, text (UTF-8) for str. The edge frames a fan-out's message
    once and writes the same bytes to every player's socket."""
    opcode, data = (0x2, message) if isinstance(message, bytes) else (0x1, message.encode("utf-8"))
    n = len(data)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return head + data


# Ids in client frames end up in bus events: the contract's rule (voicebus.schemas.contract.is_valid_id).
ID_RULE = f"1-{LIMITS.max_id_chars} characters, no control characters"

# Required fields (name -> accepted types) of each client message.
_CLIENT_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    HELLO: {"session": (str,), "token": (str,)},
    CANCEL: {},
    PING: {"t0": (int, float)},
    REPORT: {"kind": (str,), "turn_id": (str,)},
}


def parse_client_message(text: str) -> dict[str, Any]:
    """Parse and validate one client text frame; raises a `ProtocolError` subclass."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_FRAME_BYTES:
        raise MalformedFrame(f"text frame of {size} bytes exceeds {MAX_TEXT_FRAME_BYTES}")
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MalformedFrame(f"text frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedFrame(f"a control message is a JSON object, got {type(message).__name__}")
    mtype = message.get("type")
    if mtype not in CLIENT_MESSAGE_TYPES:
        raise UnknownMessageType(f"unknown message type {mtype!r}; expected one of {sorted(CLIENT_MESSAGE_TYPES)}")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"message version {version!r}, this edge speaks {PROTOCOL_VERSION}")
    for name, kinds in _CLIENT_FIELDS[mtype].items():
        value = message.get(name)
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise MalformedFrame(f"{mtype}: field {name!r} is missing or not {'/'.join(k.__name__ for k in kinds)}")
    if mtype == REPORT and message["kind"] not in REPORT_KINDS:
        raise MalformedFrame(f"report: unknown kind {message['kind']!r}; expected one of {sorted(REPORT_KINDS)}")
    if mtype == CANCEL and message.get("turn_id") is not None and not is_valid_id(message["turn_id"]):
        raise MalformedFrame(f"cancel: turn_id must be absent or an id ({ID_RULE})")
    if mtype == REPORT and not is_valid_id(message["turn_id"]):
        raise MalformedFrame(f"report: turn_id must be an id ({ID_RULE})")
    if mtype == PING and not math.isfinite(message["t0"]):
        raise OutOfRange("ping: t0 must be a finite number")  # it is echoed: NaN/Infinity are not JSON
    for name, limit in _INTEGER_FIELDS.items():
        if name not in message:
            continue
        value = message[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise MalformedFrame(f"{mtype}: field {name!r} must be an integer")
        if not 0 <= value < limit:
            raise OutOfRange(f"{mtype}: field {name!r} is {value}, outside [0, {limit})")
    resume = message.get("resume")
    if mtype == HELLO and resume is not None:
        if not (isinstance(resume, dict) and is_valid_id(resume.get("turn_id"))
                and isinstance(resume.get("sentence_seq"), int) and not isinstance(resume["sentence_seq"], bool)
                and isinstance(resume.get("finished", False), bool)):
            raise MalformedFrame(f"hello: resume must be {{turn_id: id ({ID_RULE}), sentence_seq: integer, "
                                 "finished: optional boolean}")
        if not 0 <= resume["sentence_seq"] <= LIMITS.max_seq:
            raise OutOfRange(f"hello: resume.sentence_seq is {resume['sentence_seq']}, outside [0, {LIMITS.max_seq}]")
    return message


# Integer fields of client messages and their bounds (they end up in Avro int/long fields).
# rendered_*: how far a player rendered a turn (its heard report, voicebus.players.heard).
_INTEGER_FIELDS = {"audible_at_us": 2**63, "sentence_seq": LIMITS.max_seq + 1,
                   "rendered_sentence_seq": LIMITS.max_seq + 1, "rendered_samples": LIMITS.max_seq + 1}


# --- the same constants for the JavaScript players -------------------------------------------------

JS_MODULE = Path(__file__).parent / "web" / "protocol.js"
TS_DECLARATIONS = JS_MODULE.with_suffix(".d.ts")  # its types, for the npm package (players/web/package.json)
_GENERATED = ("// Generated from players/protocol.py by `python -m voicebus.players.protocol --write-js`: do not\n"
              "// edit. The player protocol's constants (docs/protocol.md), the same on both sides.\n")


def _constants() -> list[tuple[str, Any, str]]:
    """(name, value, comment) of every constant both files declare, in order; a dict value is a
    frozen object of its keys."""
    messages = {name: value for name, value in globals().items()
                if isinstance(value, str) and value in SERVER_MESSAGE_TYPES | CLIENT_MESSAGE_TYPES and name.isupper()}
    closes = {name.removeprefix("CLOSE_"): value for name, value in globals().items()
              if name.startswith("CLOSE_") and isinstance(value, int)}
    return [
        ("PROTOCOL_VERSION", PROTOCOL_VERSION, ""),
        ("FRAME_AUDIO", FRAME_AUDIO, ""),
        ("HEADER_BYTES", AUDIO_HEADER_LEN, "<BBBBIIII: type, version, flags, encoding, turn, sentence, chunk, sample rate"),
        ("FLAG_LAST_IN_SENTENCE", FLAG_LAST_IN_SENTENCE, ""),
        ("FLAG_LAST_IN_TURN", FLAG_LAST_IN_TURN, ""),
        ("FLAG_FIRST_IN_SENTENCE", FLAG_FIRST_IN_SENTENCE, ""),
        ("ENCODING_PCM16LE", ENCODING_PCM16LE, ""),
        ("ENCODING_OPUS", ENCODING_OPUS, ""),
        ("MAX_TEXT_FRAME_BYTES", MAX_TEXT_FRAME_BYTES, ""),
        ("MSG", dict(sorted(messages.items())), "message types (the JSON text frames' `type`)"),
        ("CLOSE", dict(sorted(closes.items(), key=lambda kv: kv[1])), "close codes"),
        ("REPORT_KIND", {k.value: k.value for k in PlaybackKind}, "a report's `kind` (the PlaybackReport schema's enum)"),
    ]


def javascript_module() -> str:
    """``players/web/protocol.js``: the protocol's constants for the browser players, generated
    from this module (``python -m voicebus.players.protocol --write-js``; a test checks that the
    file in the tree is what this returns), so the two sides cannot drift apart."""
    lines = [_GENERATED]
    for name, value, comment in _constants():
        if isinstance(value, dict):
            body = "".join(f"  {k}: {json.dumps(v)},\n" for k, v in value.items())
            lines.append(f"// {comment}\nexport const {name} = Object.freeze({{\n{body}}});")
        else:
            lines.append(f"export const {name} = {json.dumps(value)};" + (f" // {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


def typescript_declarations() -> str:
    """``players/web/protocol.d.ts``: the types of ``protocol.js`` (each constant its literal
    value), for the npm package's TypeScript users; generated and checked with it."""
    lines = [_GENERATED]
    for name, value, comment in _constants():
        if isinstance(value, dict):
            body = "".join(f"  readonly {k}: {json.dumps(v)};\n" for k, v in value.items())
            lines.append(f"/** {comment} */\nexport declare const {name}: {{\n{body}}};")
        else:
            lines.append((f"/** {comment} */\n" if comment else "") + f"export declare const {name}: {json.dumps(value)};")
    lines += [
        "/** a control message's `type` */",
        "export type MessageType = (typeof MSG)[keyof typeof MSG];",
        "/** a close code the edge sends */",
        "export type CloseCode = (typeof CLOSE)[keyof typeof CLOSE];",
        "/** a playback report's `kind` */",
        "export type ReportKind = (typeof REPORT_KIND)[keyof typeof REPORT_KIND];",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m voicebus.players.protocol")
    parser.add_argument("--write-js", action="store_true",
                        help=f"write {JS_MODULE.name} and {TS_DECLARATIONS.name} beside the web player")
    args = parser.parse_args(argv)
    if args.write_js:
        JS_MODULE.write_text(javascript_module(), encoding="utf-8")
        TS_DECLARATIONS.write_text(typescript_declarations(), encoding="utf-8")
    else:
        print(javascript_module(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
