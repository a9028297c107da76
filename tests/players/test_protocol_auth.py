"""The wire protocol's frame layouts and parse errors, and the signed session tokens."""

import json

import pytest

from voicebus.players import auth, protocol


def test_audio_frame_round_trip_and_fixed_header():
    frame = protocol.AudioFrame(turn=3, sentence=7, chunk=2, sample_rate=24000, pcm=b"\x01\x00\xff\x7f",
                                flags=protocol.FLAG_LAST_IN_SENTENCE | protocol.FLAG_LAST_IN_TURN)
    data = protocol.encode_audio(frame)
    assert len(data) == protocol.AUDIO_HEADER_LEN + 4 == 24
    assert data[0] == protocol.FRAME_AUDIO and data[1] == protocol.PROTOCOL_VERSION
    decoded = protocol.decode_audio(data)
    assert decoded == frame and decoded.last_in_turn and decoded.last_in_sentence


@pytest.mark.parametrize("data, error", [
    (b"\x01\x01", protocol.MalformedFrame),
    (b"\x09" + bytes(19), protocol.UnknownMessageType),
    (bytes([1, 2]) + bytes(18), protocol.UnsupportedVersion),
    (bytes([1, 1, 0, 1]) + bytes(16) + b"\x00", protocol.MalformedFrame),  # odd PCM16 length
    (bytes([1, 1, 0, 9]) + bytes(16), protocol.MalformedFrame),  # unknown encoding
])
def test_bad_audio_frames_raise_typed_errors(data, error):
    with pytest.raises(error):
        protocol.decode_audio(data)


@pytest.mark.parametrize("text, error", [
    ("not json", protocol.MalformedFrame),
    ("[1, 2]", protocol.MalformedFrame),
    ('{"type": "dance", "v": 1}', protocol.UnknownMessageType),
    ('{"type": "ping", "v": 2, "t0": 1}', protocol.UnsupportedVersion),
    ('{"type": "hello", "v": 1, "session": "s"}', protocol.MalformedFrame),
    ('{"type": "report", "v": 1, "kind": "LOUD", "turn_id": "t"}', protocol.MalformedFrame),
    ('{"type": "report", "v": 1, "kind": "AUDIBLE_START", "turn_id": "t", "audible_at_us": "soon"}', protocol.MalformedFrame),
    ('{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "audible_at_us": 1180591620717411303424}',
     protocol.MalformedFrame),  # beyond an Avro long
    ('{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "sentence_seq": -1}', protocol.MalformedFrame),
    ('{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": 3}}', protocol.MalformedFrame),
])
def test_bad_client_messages_raise_typed_errors(text, error):
    with pytest.raises(error) as info:
        protocol.parse_client_message(text)
    assert info.value.close_code in (protocol.CLOSE_PROTOCOL_ERROR, protocol.CLOSE_UNSUPPORTED_VERSION)


@pytest.mark.parametrize("text", [
    '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "t", "sentence_seq": -1}}',
    '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "t", "sentence_seq": 2147483648}}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "sentence_seq": -1}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "sentence_seq": 2147483648}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "audible_at_us": -5}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "audible_at_us": 9223372036854775808}',
    '{"type": "ping", "v": 1, "t0": NaN}',
    '{"type": "ping", "v": 1, "t0": Infinity}',
])
def test_negative_or_oversized_numbers_are_refused_as_out_of_range(text):
    with pytest.raises(protocol.OutOfRange) as info:
        protocol.parse_client_message(text)
    assert info.value.code == "out-of-range" and info.value.close_code == protocol.CLOSE_PROTOCOL_ERROR


@pytest.mark.parametrize("text", [
    '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "t", "sentence_seq": true}}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "t", "sentence_seq": 1.5}',
    '{"type": "cancel", "v": 1, "turn_id": "' + "x" * 129 + '"}',
    '{"type": "cancel", "v": 1, "turn_id": ""}',
    '{"type": "report", "v": 1, "kind": "UNDERRUN", "turn_id": "a\\u0000b"}',
    '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "' + "x" * 129 + '", "sentence_seq": 0}}',
    '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "t", "sentence_seq": 0, "finished": 1}}',
])
def test_mistyped_numbers_and_bad_turn_ids_are_malformed_frames(text):
    with pytest.raises(protocol.MalformedFrame) as info:
        protocol.parse_client_message(text)
    assert info.value.code == "malformed-frame" and info.value.close_code == protocol.CLOSE_PROTOCOL_ERROR


def test_control_messages_carry_type_and_version():
    message = json.loads(protocol.encode_control(protocol.STOP, turn_id="t1"))
    assert message == {"type": "stop", "v": 1, "turn_id": "t1"}
    hello = protocol.parse_client_message(json.dumps({"type": "hello", "v": 1, "session": "s", "token": "x"}))
    assert hello["session"] == "s"


def test_token_accepts_its_session_until_expiry():
    token = auth.issue_token("secret", "s1", ttl_s=60, now_s=1000)
    auth.verify_token("secret", token, "s1", now_s=1059)
    with pytest.raises(auth.ExpiredToken):
        auth.verify_token("secret", token, "s1", now_s=1060)


def test_token_for_another_session_is_rejected():
    token = auth.issue_token("secret", "s1", ttl_s=60)
    with pytest.raises(auth.WrongSession):
        auth.verify_token("secret", token, "s2")


def test_token_signed_with_another_secret_or_tampered_is_rejected():
    token = auth.issue_token("other", "s1", ttl_s=60)
    with pytest.raises(auth.BadSignature):
        auth.verify_token("secret", token, "s1")
    payload, sig = auth.issue_token("secret", "s1", ttl_s=60).split(".")
    forged = auth._b64(json.dumps({"s": "s2", "exp": 2**40}).encode())
    with pytest.raises(auth.BadSignature):
        auth.verify_token("secret", f"{forged}.{sig}", "s2")


@pytest.mark.parametrize("token", ["", "abc", "a.b.c", "!!.??"])
def test_malformed_tokens_are_rejected(token):
    with pytest.raises(auth.TokenError):
        auth.verify_token("secret", token, "s1")


# --- fuzz: a client frame is refused, or what the edge makes of it is within the contract -------

from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st  # noqa: E402

from voicebus.schemas import contract  # noqa: E402

_FIELD = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(), st.text(max_size=200),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_FRAME = st.fixed_dictionaries(
    {"type": st.sampled_from(sorted(protocol.CLIENT_MESSAGE_TYPES) + ["nope"]), "v": st.sampled_from([1, 2, "1"])},
    optional={"turn_id": _FIELD, "kind": st.sampled_from(sorted(protocol.REPORT_KINDS) + ["X"]) | _FIELD,
              "sentence_seq": _FIELD, "audible_at_us": _FIELD, "session": _FIELD, "token": _FIELD,
              "t0": _FIELD, "resume": st.one_of(_FIELD, st.fixed_dictionaries({"turn_id": _FIELD, "sentence_seq": _FIELD})),
              "reason": _FIELD, "detail": _FIELD})


@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_FRAME.map(json.dumps), st.text(max_size=50)))
@example(json.dumps({"type": "report", "v": 1, "kind": "STOPPED", "turn_id": "a\nb"}))
@example(json.dumps({"type": "cancel", "v": 1, "turn_id": "x" * 129}))
@example(json.dumps({"type": "hello", "v": 1, "session": "s", "token": "t", "resume": {"turn_id": "", "sentence_seq": 0}}))
@example(json.dumps({"type": "cancel", "v": 1, "resume": {}}))
@example(json.dumps({"type": "ping", "v": 1, "turn_id": False, "t0": 0}))
def test_any_client_text_frame_is_refused_or_yields_ids_the_contract_accepts(text):
    """Fuzz: the edge turns a client's cancel and report into bus events; an id the
    contract refuses (control characters, over 128 characters) used to pass the frame check and
    fail only when the edge encoded the event."""
    try:
        message = protocol.parse_client_message(text)
    except protocol.ProtocolError as exc:
        assert str(exc)
        return
    if message["type"] in (protocol.CANCEL, protocol.REPORT) and message.get("turn_id") is not None:
        # the ids the edge puts into a ControlEvent or a PlaybackReport (a ping's stray fields go nowhere)
        assert not contract.violations("ControlEvent", {"session_id": "s", "turn_id": message["turn_id"]}), message
    resume = message.get("resume") if message["type"] == protocol.HELLO else None
    if resume is not None:
        assert not contract.violations("ControlEvent", {"session_id": "s", "turn_id": resume["turn_id"]})


def test_a_resume_may_say_its_turn_was_heard_to_the_end():
    message = protocol.parse_client_message(
        '{"type": "hello", "v": 1, "session": "s", "token": "x", "resume": {"turn_id": "t", "sentence_seq": 2, "finished": true}}')
    assert message["resume"] == {"turn_id": "t", "sentence_seq": 2, "finished": True}


@pytest.mark.parametrize("message", ["{}", "é" * 100, b"\x01" * 125, b"\x02" * 126, b"\x03" * 70_000])
async def test_a_frame_built_once_for_every_player_is_the_frame_aiohttp_would_send(message):
    from unittest import mock

    from aiohttp import WSMsgType
    from aiohttp._websocket.writer import WebSocketWriter

    transport = mock.Mock(is_closing=lambda: False)
    writer = WebSocketWriter(mock.Mock(_paused=False), transport, use_mask=False, compress=0)
    await writer.send_frame(message.encode() if isinstance(message, str) else message,
                            WSMsgType.TEXT if isinstance(message, str) else WSMsgType.BINARY)
    sent = b"".join(bytes(call.args[0]) for call in transport.write.call_args_list)
    assert protocol.websocket_frame(message) == sent
