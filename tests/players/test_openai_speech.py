"""The OpenAI-compatible speech endpoint: requests, auth and errors (pure and on an edge without the bus)."""

from __future__ import annotations

import pytest

from voicebus.players.openai_speech import (OPENAI_VOICES, ApiError, SpeechRequest, key_allowed, owned_session_id,
                                            parse_keys, resolve_voice)
from voicebus.settings import Settings
from voicebus.topics import partition_of
from tests.players.edge_helpers import edge_settings, running_edge

S = Settings()


def parse(**body):
    return SpeechRequest.parse({"model": "tts-1", "input": "Hello there.", "voice": "alloy", **body}, S)


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400
    return caught.value


def test_a_request_resolves_voice_language_speed_and_format():
    request = parse(response_format="wav", speed=1.25)
    assert (request.voice, request.language, request.speed, request.response_format) == ("af_alloy", "a", 1.25, "wav")
    assert parse().response_format == "mp3"  # OpenAI's default
    assert parse(voice="ef_dora").language == "e"
    mix = parse(voice="bm_george:0.3 + bf_emma:0.7")
    assert (mix.voice, mix.language) == ("bf_emma:0.7+bm_george:0.3", "b")  # canonical; its main voice's language
    assert parse(voice="af_heart", language="pt").language == "p"  # an explicit language wins
    assert parse(voice="my_voice").language == "a"  # a deployment's own voice pack: the default language
    assert resolve_voice("Nova") == "af_nova" and set(OPENAI_VOICES) >= {"alloy", "echo", "fable", "onyx", "nova", "shimmer"}


@pytest.mark.parametrize("body, param", [
    ({"model": "whisper-1"}, "model"),
    ({"input": ""}, "input"),
    ({"input": "x" * 5000}, "input"),
    ({"input": 3}, "input"),
    ({"voice": "a b c"}, "voice"),
    ({"voice": "af_heart:x"}, "voice"),
    ({"voice": "af_heart:0"}, "voice"),  # the SDK would refuse these: a 400 here, never a 500
    ({"voice": "af_heart+af_heart"}, "voice"),
    ({"voice": "kf_minji"}, "voice"),  # a Kokoro-style name of a language Kokoro v1.0 lacks (k)
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 5}, "speed"),
    ({"speed": True}, "speed"),
    ({"language": "xx"}, "language"),
    ({"stream_format": "chunks"}, "stream_format"),
])
def test_a_bad_request_names_its_parameter(body, param):
    assert refused(**body).param == param


def test_a_missing_field_is_a_400_naming_it():
    with pytest.raises(ApiError) as caught:
        SpeechRequest.parse({"model": "tts-1", "voice": "alloy"}, S)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "input", "missing_required_parameter")


def test_keys_are_bearer_keys_and_without_any_only_loopback_may_speak():
    keys = parse_keys("k1, k2\nk3")
    assert keys == {"k1", "k2", "k3"}
    assert key_allowed("Bearer k2", keys, loopback_peer=False)
    assert not key_allowed("Bearer k4", keys, loopback_peer=True)
    assert not key_allowed("k1", keys, loopback_peer=True)
    assert not key_allowed(None, keys, loopback_peer=True)
    assert key_allowed(None, frozenset(), loopback_peer=True)
    assert not key_allowed("Bearer anything", frozenset(), loopback_peer=False)


def test_a_new_session_lands_on_a_partition_this_edge_owns():
    for owned in ({0}, {3, 5}):
        for _ in range(20):
            assert partition_of(owned_session_id(owned, 6), 6) in owned
    with pytest.raises(ApiError) as caught:
        owned_session_id(set(), 6)
    assert caught.value.status == 503


async def test_the_edge_answers_in_openai_s_shape():
    async with running_edge(edge_settings(api_keys="sekret"), with_kafka=False) as (_, client):
        unauthorized = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})
        assert unauthorized.status == 401
        error = (await unauthorized.json())["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        auth = {"Authorization": "Bearer sekret"}
        models = await (await client.get("/v1/models", headers=auth)).json()
        assert {m["id"] for m in models["data"]} >= {"tts-1", "tts-1-hd", "kokoro"}
        voices = await (await client.get("/v1/audio/voices", headers=auth)).json()
        assert "af_heart" in voices["voices"] and voices["openai"]["alloy"] == "af_alloy"
        bad = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy",
                                                          "speed": 9}, headers=auth)
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "speed"
        not_json = await client.post("/v1/audio/speech", data=b"{", headers=auth)
        assert not_json.status == 400 and (await not_json.json())["error"]["code"] == "invalid_json"
        no_bus = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"},
                                   headers=auth)
        assert no_bus.status == 503 and (await no_bus.json())["error"]["type"] == "server_error"


async def test_without_keys_a_loopback_client_may_speak_and_the_endpoint_can_be_turned_off():
    async with running_edge(edge_settings(), with_kafka=False) as (_, client):
        assert (await client.get("/v1/models")).status == 200  # the test client is on loopback
    async with running_edge(edge_settings(speech_api=False), with_kafka=False) as (_, client):
        assert (await client.get("/v1/models")).status == 404
