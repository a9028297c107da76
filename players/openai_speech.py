"""The OpenAI-compatible speech endpoint of the edge: ``POST /v1/audio/speech`` over the bus.

Clients written for OpenAI's speech API (the official ``openai`` Python and TypeScript clients,
Open WebUI, agents) speak to voicebus unchanged: base URL ``http://<edge>/v1``. A request is a
one-shot turn: this module publishes its ``input`` as the TextEvents of a new turn (agent
`Settings.speech_api_agent_id`, through the agents SDK's `Publisher`, so the turn is traced like
any other) in a new session whose partition this edge owns, and streams the session's audio back
as the workers synthesize it, sentence by sentence, in the format asked for
(`voicebus.players.audio_formats`), with chunked transfer. The gate, the workers, cancellation,
metrics and traces are those of every other turn. A client that goes away before the end
cancels the turn on the control topic (the workers drop the sentences not yet spoken).

Routes: ``POST /v1/audio/speech``, ``GET /v1/models``, ``GET /v1/audio/voices``. Auth: a bearer
key from `Settings.api_keys`; with none configured, loopback clients only. Errors are OpenAI's
shape: ``{"error": {"message", "type", "param", "code"}}``. docs/openai.md is the reference.

Pure parts: `SpeechRequest.parse` (validation, voice and language resolution) and
`key_allowed`; the rest is the aiohttp shell.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

from aiohttp import web
from prometheus_client import Counter, Histogram

from voicebus.settings import ENV_PREFIX, Settings, reveal
from voicebus.players.access import is_loopback_host
from voicebus.players.audio_formats import FORMATS, StreamEncoder
from voicebus.players.keys import LINK_KEY, METRICS_KEY, ROUTER_KEY, SETTINGS_KEY
from voicebus.players.channel import ClientClosed
from voicebus.players.tap import SessionTap, TapAudio, TapTurnEnd
from voicebus.schemas.contract import (KOKORO_CODES, KOKORO_VOICES, LANGUAGES, LIMITS, InvalidVoice, UnknownLanguage,
                                       kokoro_code, parse_voice)

log = logging.getLogger(__name__)

# The model names clients send. voicebus has one model (Kokoro-82M); OpenAI's names are accepted so
# that code written for OpenAI runs unchanged.
MODELS = ("kokoro", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# OpenAI's voice names -> the Kokoro-82M voice of the same character (Kokoro names several of its
# voices after OpenAI's: af_alloy, af_nova, am_echo, am_onyx, bm_fable).
OPENAI_VOICES: Mapping[str, str] = {
    "alloy": "af_alloy", "ash": "am_adam", "ballad": "bm_george", "coral": "af_heart", "echo": "am_echo",
    "fable": "bm_fable", "nova": "af_nova", "onyx": "am_onyx", "sage": "af_sarah", "shimmer": "af_bella",
    "verse": "am_michael",
}
STREAM_FORMATS = ("audio", "sse")
MAX_BODY_BYTES = 256 * 1024
SAMPLE_RATE = 24_000
DISCONNECT_POLL_S = 0.05  # how soon a client that went away is noticed while no audio flows
_KOKORO_NAME = re.compile(r"^[a-z][fm]_[a-z0-9]+$")  # <language><gender>_<name>, as Kokoro names its voices

SESSION_HEADER = "X-Voicebus-Session"
TURN_HEADER = "X-Voicebus-Turn"

DOOR_KEY = web.AppKey("speech_door", object)  # the endpoint's `_Door`
SPEECH_METRICS_KEY = web.AppKey("speech_metrics", object)


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response(body, status=self.status, headers=headers)


# --- the request (pure) ------------------------------------------------------------------------


def resolve_voice(voice: str) -> str:
    """The voice spec a TextEvent carries for a request's ``voice``: an OpenAI name maps to its
    Kokoro voice; a Kokoro voice or a mix (``af_heart:0.7+af_bella:0.3``) is kept, in its
    canonical spelling (`voicebus.schemas.contract.parse_voice`). `ApiError` (param ``voice``)
    for anything else."""
    name = voice.strip()
    if name.lower() in OPENAI_VOICES:
        return OPENAI_VOICES[name.lower()]
    try:
        return parse_voice(name).canonical
    except InvalidVoice as exc:
        raise ApiError(400, f"voice {voice!r}: {exc}. A voice is an OpenAI voice ({', '.join(OPENAI_VOICES)}), "
                            f"a Kokoro voice (af_heart) or a mix (af_heart:0.7+af_bella:0.3); GET /v1/audio/voices "
                            f"lists them", param="voice", code="invalid_voice") from None


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    voice: str  # the spec the TextEvent carries
    language: str  # Kokoro code
    response_format: str
    speed: float
    model: str
    stream_format: str = "audio"

    @classmethod
    def parse(cls, body: Any, settings: Settings) -> "SpeechRequest":
        """Validate a request body (decoded JSON); `ApiError` 400 naming the parameter."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")

        def string(name: str, default: str | None = None) -> str:
            value = body.get(name, default)
            if not isinstance(value, str):
                raise ApiError(400, f"'{name}' is required and must be a string" if value is None
                               else f"'{name}' must be a string", param=name,
                               code="missing_required_parameter" if value is None else "invalid_type")
            return value

        model = string("model")
        if model not in MODELS:
            raise ApiError(400, f"model {model!r} is not served here; models: {', '.join(MODELS)}", param="model",
                           code="model_not_found")
        text = string("input")
        if not text.strip():
            raise ApiError(400, "'input' is empty", param="input", code="empty_input")
        if len(text) > settings.speech_api_max_input_chars:
            raise ApiError(400, f"'input' is {len(text)} characters, at most {settings.speech_api_max_input_chars}",
                           param="input", code="string_above_max_length")
        if len(text.encode("utf-8")) > LIMITS.max_text_bytes:
            raise ApiError(400, f"'input' is more than {LIMITS.max_text_bytes} bytes of UTF-8", param="input",
                           code="string_above_max_length")
        voice = resolve_voice(string("voice"))
        fmt = string("response_format", "mp3")
        if fmt not in FORMATS:
            raise ApiError(400, f"response_format {fmt!r}: one of {', '.join(FORMATS)}", param="response_format")
        stream_format = string("stream_format", "audio")
        if stream_format not in STREAM_FORMATS:
            raise ApiError(400, f"stream_format {stream_format!r}: one of {', '.join(STREAM_FORMATS)}",
                           param="stream_format")
        speed = body.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) \
                or not LIMITS.min_speed <= speed <= LIMITS.max_speed:
            raise ApiError(400, f"speed {speed!r} must be a number from {LIMITS.min_speed} to {LIMITS.max_speed}",
                           param="speed")
        language = cls._language(body.get("language", body.get("lang_code")), voice, settings)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        return cls(text, voice, language, fmt, float(speed), model, stream_format)

    @staticmethod
    def _language(asked: Any, voice: str, settings: Settings) -> str:
        """The request's ``language`` (voicebus's extension, ``lang_code`` as Kokoro-FastAPI
        names it) when given; else the language of the (first) voice, read from its name as
        Kokoro names voices (``a``: American English, ``e``: Spanish, ...); else the default."""
        if asked is not None:
            if not isinstance(asked, str):
                raise ApiError(400, "'language' must be a string", param="language")
            try:
                return kokoro_code(asked)
            except UnknownLanguage as exc:
                raise ApiError(400, str(exc), param="language", code="unsupported_language") from None
        first = parse_voice(voice).names[0]  # a mix: its heaviest voice (the canonical spelling's first)
        if not _KOKORO_NAME.match(first):
            return kokoro_code(settings.default_language)  # a voice pack of the deployment's own naming
        if first[0] not in KOKORO_CODES:
            raise ApiError(400, f"voice {first!r} speaks a language voicebus does not speak; it speaks "
                                f"{', '.join(sorted(k for k in LANGUAGES if len(k) == 2))}", param="voice",
                           code="unsupported_language")
        return first[0]


def parse_keys(secret: str) -> frozenset[str]:
    """The keys in `Settings.api_keys` (comma- or newline-separated, as in a keys file)."""
    return frozenset(k.strip() for k in re.split(r"[,\n]", secret) if k.strip())


def key_allowed(authorization: str | None, keys: frozenset[str], loopback_peer: bool) -> bool:
    """Whether a request may speak: a ``Bearer`` key among `keys` (compared in constant time);
    with no keys configured, a loopback client only."""
    if not keys:
        return loopback_peer
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    given = given.strip()
    return any(hmac.compare_digest(given.encode(), key.encode()) for key in keys)


def owned_session_id(owned: set[int] | frozenset[int], partitions: int, prefix: str = "speech-") -> str:
    """A new session id whose partition is one of `owned`: its audio comes to this edge."""
    from voicebus.topics import partition_of

    if not owned:
        raise ApiError(503, "this edge owns no partition of the audio topic right now (more edges than partitions, "
                            "or a rebalance): try again, or another edge", type_="server_error", code="no_partition")
    while True:  # each try hits an owned partition with probability |owned| / partitions
        session_id = prefix + secrets.token_hex(8)
        if partition_of(session_id, partitions) in owned:
            return session_id


# --- the aiohttp shell -------------------------------------------------------------------------


class SpeechMetrics:
    def __init__(self, registry: Any) -> None:
        self.requests = Counter("voicebus_speech_requests_total", "Speech API requests, by answer",
                                ["format", "status"], registry=registry)
        self.first_byte = Histogram("voicebus_speech_first_audio_seconds",
                                    "Speech API: request received to its first audio bytes sent", registry=registry,
                                    buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0))
        self.disconnects = Counter("voicebus_speech_disconnects_total",
                                   "Speech API clients that went away before their audio ended", registry=registry)


def setup(app: web.Application) -> None:
    """Add the endpoint's routes and its publisher (started after the edge's Kafka link) to the edge app."""
    app[DOOR_KEY] = _Door()
    app[SPEECH_METRICS_KEY] = SpeechMetrics(app[METRICS_KEY].registry)
    app.cleanup_ctx.append(_publisher_ctx)
    app.router.add_post("/v1/audio/speech", _speech)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/audio/voices", _voices)


class _Door:
    """The endpoint's publisher once started, or why there is none (told to every request)."""

    def __init__(self) -> None:
        self.publisher: Any = None
        self.unavailable = "this edge is not connected to the bus"


def publisher_settings(settings: Settings) -> Settings:
    """The settings the endpoint publishes with: on a SASL bus, as its own agent user
    (`Settings.speech_api_kafka_username`) when one is set; else the edge's."""
    if settings.kafka_security_protocol.startswith("SASL_") and settings.speech_api_kafka_username:
        return settings.replace(kafka_sasl_username=settings.speech_api_kafka_username,
                                kafka_sasl_password=settings.speech_api_kafka_password)
    return settings


async def _publisher_ctx(app: web.Application) -> AsyncIterator[None]:
    from aiokafka.errors import KafkaError

    from voicebus.agents.sdk import Publisher
    from voicebus.bus import TopicCreationError

    door = app[DOOR_KEY]
    if app[LINK_KEY] is None:  # an edge without the bus (tests): nothing to publish to
        yield
        return
    settings = app[SETTINGS_KEY]
    publisher = Publisher(publisher_settings(settings), settings.speech_api_agent_id)
    try:
        await publisher.start()  # its text topic exists and the gate knows it before the first request
    except (KafkaError, TopicCreationError) as exc:
        # The edge serves its players either way: only this endpoint is off, and says why.
        await publisher.stop()
        door.unavailable = (f"the speech endpoint cannot publish as agent {settings.speech_api_agent_id!r} "
                            f"({type(exc).__name__}: {exc})")
        if settings.kafka_security_protocol.startswith("SASL_") and not settings.speech_api_kafka_username:
            door.unavailable += (f"; on a secured bus it publishes as an agent user of its own: set "
                                 f"{ENV_PREFIX}SPEECH_API_KAFKA_USERNAME and _PASSWORD (docs/openai.md)")
        log.error("%s", door.unavailable)
        yield
        return
    door.publisher = publisher
    try:
        yield
    finally:
        door.publisher = None
        await publisher.stop()


def _authorize(request: web.Request) -> None:
    settings = request.app[SETTINGS_KEY]
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    loopback = is_loopback_host(str(peer[0])) if isinstance(peer, (tuple, list)) and peer else False
    keys = parse_keys(reveal(settings.api_keys))
    if not key_allowed(request.headers.get("Authorization"), keys, loopback):
        if not keys:
            raise ApiError(401, f"no API keys are configured ({ENV_PREFIX}API_KEYS): this endpoint answers loopback "
                                f"clients only", code="invalid_api_key")
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def _answers_errors(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            _authorize(request)
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    return wrapped


@_answers_errors
async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "voicebus"} for m in MODELS]})


@_answers_errors
async def _voices(request: web.Request) -> web.Response:
    spoken = sorted(name for name, voice in KOKORO_VOICES.items() if voice.spoken)
    return web.json_response({"voices": spoken, "openai": dict(OPENAI_VOICES)})


async def _read_body(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = await request.content.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}", code="invalid_json") from None


@_answers_errors
async def _speech(request: web.Request) -> web.StreamResponse:
    from voicebus.agents.sdk import new_turn_id

    app = request.app
    settings, metrics = app[SETTINGS_KEY], app[SPEECH_METRICS_KEY]
    received = time.monotonic()
    body = await _read_body(request)
    try:
        speech = SpeechRequest.parse(body, settings)
    except ApiError:
        metrics.requests.labels("-", "400").inc()
        raise
    link, door = app[LINK_KEY], app[DOOR_KEY]
    publisher = door.publisher
    if link is None or publisher is None:
        raise ApiError(503, door.unavailable, type_="server_error", code="no_bus")
    session_id = owned_session_id(link.owned, link.partitions)
    turn_id = new_turn_id()
    stream = _Stream(request, speech, metrics, received, session_id, turn_id)
    async with SessionTap(app[ROUTER_KEY], session_id) as tap:
        turn = publisher.turn(session_id, turn_id, voice=speech.voice, language=speech.language, speed=speech.speed)
        await turn.token(speech.input)
        await turn.end()
        log.info("speech: turn %s of session %s: %d characters, voice %s, %s", turn_id, session_id,
                 len(speech.input), speech.voice, speech.response_format)
        finished = False
        try:
            finished = await stream.run(tap, turn_id, settings.speech_api_timeout_s)
        finally:
            if not finished:  # the client went away, a timeout, an error: nothing more of it is wanted
                with contextlib.suppress(Exception):
                    await publisher.cancel(session_id, turn_id, reason=stream.why or "client-gone",
                                           source="openai-speech")
    # a client that went away before any audio is answered nothing it will read
    return stream.response if stream.response is not None else web.Response(status=499)


class _Stream:
    """One response: prepared with the first audio (so a failure before it is still an error
    status), then written as the tap yields the turn's audio."""

    def __init__(self, request: web.Request, speech: SpeechRequest, metrics: SpeechMetrics, received: float,
                 session_id: str, turn_id: str) -> None:
        self.request, self.speech, self.metrics, self.received = request, speech, metrics, received
        self.session_id, self.turn_id = session_id, turn_id
        self.encoder = StreamEncoder(speech.response_format, SAMPLE_RATE)
        self.response: web.StreamResponse | None = None
        self.why = ""

    @property
    def gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def _prepare(self) -> None:
        if self.response is not None:
            return
        sse = self.speech.stream_format == "sse"
        content_type = "text/event-stream" if sse else FORMATS[self.speech.response_format].content_type
        # the session and turn name the request on the bus (its TurnHeard, its trace, a cancel)
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": content_type, "Cache-Control": "no-cache",
            SESSION_HEADER: self.session_id, TURN_HEADER: self.turn_id})
        self.response.enable_chunked_encoding()
        await self.response.prepare(self.request)

    async def _write(self, data: bytes, first: bool = False) -> None:
        if not data:
            return
        await self._prepare()
        if first:
            self.metrics.first_byte.observe(time.monotonic() - self.received)
        if self.speech.stream_format == "sse":
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
            data = f"data: {json.dumps(event)}\n\n".encode()
        await self.response.write(data)

    async def run(self, tap: SessionTap, turn_id: str, timeout_s: float) -> bool:
        """Stream the turn; True once its end was written, False when the client went away."""
        fmt = self.speech.response_format
        sent_audio = False
        try:
            while True:
                if self.gone:
                    self.why = "client-gone"
                    self.metrics.disconnects.inc()
                    return False
                waited = time.monotonic() - self.received
                if not sent_audio and waited > timeout_s:
                    self.why = "timeout"
                    self.metrics.requests.labels(fmt, "504").inc()
                    raise ApiError(504, f"no audio after {timeout_s:g} s: are the gate and a worker running?",
                                   type_="server_error", code="timeout")
                try:
                    batch = await asyncio.wait_for(tap.next(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                except ClientClosed:  # the edge closed this client (shutting down, too slow)
                    self.why = "edge-closed"
                    return False
                for event in batch:
                    if await self._handle(event, turn_id, sent_audio):
                        return True
                    sent_audio = sent_audio or isinstance(event, TapAudio) and event.turn_id == turn_id
        except ConnectionError:  # a write to a client that went away
            self.why = "client-gone"
            self.metrics.disconnects.inc()
            return False
        finally:
            self.encoder.close()

    async def _handle(self, event: object, turn_id: str, sent_audio: bool) -> bool:
        """Write what `event` adds to the response; True once the turn's end is written."""
        if isinstance(event, TapAudio) and event.turn_id == turn_id and event.pcm:
            await self._write(self.encoder.feed(event.pcm), first=not sent_audio)
        elif isinstance(event, TapTurnEnd) and event.turn_id == turn_id:
            await self._write(self.encoder.finish())
            await self._prepare()
            if self.speech.stream_format == "sse":
                await self.response.write(b'data: {"type": "speech.audio.done"}\n\n')
            await self.response.write_eof()
            self.metrics.requests.labels(self.speech.response_format, "200").inc()
            return True
        return False
