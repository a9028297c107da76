"""The one settings object of voicebus.

`Settings` is frozen and is built once per process by `Settings.from_env()`; this module is the
only place that reads the environment (prefix ``VOICEBUS_``). Every other module takes a
`Settings` (or the few values it needs) as an argument, so tests build their own with
`Settings(...)` or `settings.replace(...)` instead of patching the environment.

pydantic validates every value wherever it comes from (the environment, a constructor, a
`replace`): types, the allowed values of each choice (`VOICEBUS_GATE_MODE=foo` is an error that
names the variable and the allowed values), bounds; ``VOICEBUS_TRACING=ture`` is an error, not
"off". A ``VOICEBUS_*`` variable that names no field is warned about with the closest field's
variable. Secrets are `SecretStr`: never shown by ``repr``, `voicebus settings` or an error.
Each field's docstring is its documentation (`field_docs`, `voicebus settings`).

Every field is in one group (`SETTING_GROUPS`: bus, security, tracing, local tools, and one per
role), declared once in a table that is checked at import to name each field exactly once; the
class declares them in that order, one section per group. `fields_of(role)` gives what one kind
of process reads (`ROLES`: the shared groups, its own, and a few fields of others). The reference
in docs/settings.md is generated from the groups and the docstrings (`voicebus.settings_cli`).

Size: about 710 lines, most of them the field declarations with their documentation (the
settings reference is generated from them), then the groups that sort them per role.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from voicebus.schemas.contract import LANGUAGES, LIMITS

ENV_PREFIX = "VOICEBUS_"
DEFAULT_EDGE_SECRET = "voicebus-dev-secret-change-me"
OPUS_FRAME_MS = (10, 20, 40, 60)  # the packet durations Opus allows  # public: the edge refuses it off loopback


log = logging.getLogger(__name__)


class SettingsError(ValueError):
    """A setting has a value its field does not allow (the message names the variable)."""


def reveal(secret: "str | SecretStr") -> str:
    """A secret's value, where it is used (signing, a client's credentials) and nowhere else."""
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "voicebus"


Language = Literal[tuple(LANGUAGES)]  # type: ignore[valid-type]  # the contract's languages


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
    # secret field -> the file it was read from (``VOICEBUS_<FIELD>_FILE``): a child process is
    # given the file, never the value
    _secret_files: dict[str, str] = PrivateAttr(default_factory=dict)

    # Each section is one group of `SETTING_GROUPS` (below), in the same order.

    # --- bus -------------------------------------------------------------------------------
    bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (the command line's ``--bootstrap``
    overrides it)."""
    partitions: int = Field(24, ge=1)
    """Partitions of each topic voicebus creates; topics that exist keep their count, and text
    topics must match it (a session stays in one partition: its key). Edges, gate workers and
    synthesis workers each scale up to this many; 24 shares evenly among 1, 2, 3, 4, 6, 8 and 12
    (docs/edge.md, "Capacity"). A deployment created with another count sets that count here, or
    grows its topics while drained (``voicebus topics grow``, docs/kafka.md, "Adding partitions")."""
    replication_factor: int = Field(0, ge=0)
    """Replicas of each topic voicebus creates; 0 (default): min(3, brokers the cluster reports
    when the topic is created) (docs/kafka.md, "Durability: replication, acks, retention"). So 1
    on the demo's single broker and 3 on a 3-broker cluster (`voicebus.topics.durability`; the
    cluster is asked because a bootstrap list often names only some of its brokers)."""
    min_insync_replicas: int = Field(0, ge=0)
    """``min.insync.replicas`` of each topic voicebus creates: how many replicas must have a
    record before an acks=all produce succeeds; 0 (default): replication - 1 when replication
    >= 2, else 1."""
    text_topic_prefix: str = "voicebus.text."
    """Agents publish to ``<prefix><agent_id>``; the gate subscribes to the prefix by pattern."""
    agents_topic: str = "voicebus.agents"
    """The registry of agent text topics (compacted, key agent id): the SDK writes a record when
    it creates or first uses its topic; every gate worker follows it and starts reading the new
    topic within milliseconds (docs/gate.md)."""
    control_topic: str = "voicebus.control"
    """Cancels (barge-in) for every stage, keyed by session."""
    synthesis_topic: str = "voicebus.synthesis"
    """Sentences released by the gate, read by the synthesis workers (one group)."""
    audio_topic: str = "voicebus.audio"
    """Audio chunks from the workers. Edges share it by partition: each reads only the partitions
    it owns (docs/edge.md, "Sharded edges")."""
    playback_topic: str = "voicebus.playback"
    """Playback reports from the players (audible start, end, underruns), published by the edge."""
    heard_topic: str = "voicebus.heard"
    """What the listener heard of each turn (TurnHeard), published by the edge for the agents."""
    floor_topic: str = "voicebus.floor"
    """What happened to each turn on its session's floor (FloorEvent: granted, queued, cut, ...),
    published by the gate for the agents."""
    deadletter_topic: str = "voicebus.deadletter"
    """Records a stage could not handle, unchanged, with the reason in ``voicebus.error.*`` headers."""
    edges_topic: str = "voicebus.edges"
    """The edge directory (compacted, keyed by edge id): each edge's public URL and the partitions it
    owns, written and read on partition 0 only so the latest claim of a partition is the last one."""
    gate_changelog_topic: str = "voicebus-gate-gate_sessions-changelog"
    """The gate's changelog (compacted): each session's state, keyed by session, and the positions
    of the text partitions the gate has applied."""
    max_text_bytes: int = LIMITS.max_text_bytes
    """A text field longer than this many UTF-8 bytes (16384) is rejected as oversized: the SDK
    refuses to publish it and a consumer dead-letters a record carrying one."""
    deadletter_attempts: int = Field(3, ge=1)
    """How many times a stage tries to write one dead letter before it skips the record (counted in
    ``voicebus_records_skipped_total``): a dead-letter topic that is missing or unwritable must not
    stop a stage for every other session."""
    deadletter_timeout_s: float = Field(5.0, gt=0)
    """How long one try of a dead-letter write may take."""
    max_message_bytes: int = 1024 * 1024
    """The largest Kafka record voicebus produces or fetches per partition (bytes)."""
    fetch_max_wait_ms: int = 100
    """How long the broker may park an idle consumer's fetch. It adds no latency (a parked fetch
    returns as soon as a record is appended) but each expiry is a round trip: 5 ms made every idle
    consumer cost the broker and the client CPU that the model needs (docs/benchmarks.md)."""

    # --- security: the bus (docs/kafka.md, "A secured cluster"), the same for every client ------
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every Kafka client (producers, consumers, admin; every stage, the CLI and the SDK)
    connects: ``PLAINTEXT``, ``SSL`` (TLS, optionally with a client certificate), ``SASL_PLAINTEXT``
    or ``SASL_SSL`` (a managed cluster: MSK, Confluent Cloud, Aiven, Strimzi)."""
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    """The SASL mechanism of ``SASL_*`` protocols: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``."""
    kafka_sasl_username: str = ""
    """The SASL user name of this process's principal."""
    kafka_sasl_password: SecretStr = SecretStr("")
    """The SASL password (or ``VOICEBUS_KAFKA_SASL_PASSWORD_FILE``: a file holding it, e.g. a
    mounted secret). Never printed, logged or put in an error message."""
    kafka_ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed the brokers' certificates (``SSL``, ``SASL_SSL``); empty:
    the system's trust store."""
    kafka_ssl_certfile: Path | None = None
    """PEM client certificate for mutual TLS (with ``kafka_ssl_keyfile``)."""
    kafka_ssl_keyfile: Path | None = None
    """PEM private key of ``kafka_ssl_certfile``."""
    kafka_ssl_key_password: SecretStr = SecretStr("")
    """The password of an encrypted ``kafka_ssl_keyfile`` (or ``VOICEBUS_KAFKA_SSL_KEY_PASSWORD_FILE``)."""

    # --- security: wire format and schema registry (docs/kafka.md) -------------------------
    wire_format: Literal["single-object", "confluent"] = "single-object"
    """What writers produce: ``single-object`` (Avro single-object encoding, no registry) or
    ``confluent`` (byte 0, a 4-byte schema id, the body: what Kafka Connect, ksqlDB and the
    Confluent clients read; needs ``registry_url``). Readers accept both either way."""
    registry_url: str = ""
    """A Confluent-compatible schema registry API, e.g.
    ``http://127.0.0.1:8081/apis/ccompat/v7`` (Apicurio; `voicebus registry start` prints it).
    Empty: none; a Confluent-framed record then dead-letters as ``unknown-schema-id``."""
    registry_timeout_s: float = 5.0
    """How long one registry request may take (registering a schema, resolving an id)."""
    registry_username: str = ""
    """HTTP basic-auth user of the schema registry (empty: no authentication)."""
    registry_password: SecretStr = SecretStr("")
    """HTTP basic-auth password of the schema registry (or ``VOICEBUS_REGISTRY_PASSWORD_FILE``)."""
    registry_ssl_cafile: Path | None = None
    """PEM file of the CA(s) of an ``https://`` registry (empty: the system's trust store)."""

    # --- tracing (pipeline/tracing.py, docs/tracing.md) ------------------------------------
    tracing: bool = False
    """One OpenTelemetry trace per turn (W3C trace context in Kafka headers, a span per stage),
    exported over OTLP. Off (default): no span is made, no header written or read."""
    otlp_endpoint: str = ""
    """Where spans go when ``tracing`` is on, e.g. ``http://127.0.0.1:4318/v1/traces``
    (http/protobuf) or ``http://127.0.0.1:4317`` (grpc). Empty: the exporter's default (and the
    standard ``OTEL_EXPORTER_OTLP_*`` variables)."""
    otlp_protocol: Literal["http/protobuf", "grpc", "none"] = "http/protobuf"
    """The OTLP transport: ``http/protobuf`` or ``grpc``; ``none`` makes and propagates the spans
    but exports nothing (tracing's own cost, e.g. `voicebus bench ttfa --tracing`)."""
    otlp_service_name: str = "voicebus"
    """The ``service.name`` resource attribute of the exported spans (the stage is a span
    attribute, ``voicebus.stage`` on the instrumentation scope)."""

    # --- local tools: the local broker (voicebus kafka start|status|stop) ------------------
    cache_dir: Path = Field(default_factory=_default_cache_dir,
                            json_schema_extra={"shown_default": "$XDG_CACHE_HOME/voicebus"})
    """Kafka jars, local broker data and Kokoro weights (default ``$XDG_CACHE_HOME/voicebus``)."""
    kafka_version: str = "4.4.0"
    """The Apache Kafka version `voicebus kafka fetch|start` runs (jars from Maven Central)."""
    kafka_port: int = Field(9092, ge=0, le=65535)
    """The local broker's client port (`voicebus kafka start --port`); every other command connects
    to ``bootstrap``, which does not follow this port: set ``VOICEBUS_BOOTSTRAP`` to match."""
    kafka_controller_port: int = Field(9093, ge=0, le=65535)
    """The local broker's KRaft controller port (`voicebus kafka start --controller-port`)."""

    # --- local tools: the local schema registry (voicebus registry fetch|start|status|stop) --
    registry_version: str = "3.3.3"
    """Apicurio Registry version fetched from Maven Central (needs a Java 21+ runtime)."""
    registry_port: int = Field(8081, ge=0, le=65535)
    """Loopback port of the local registry's API (its management port is picked free at start)."""

    # --- local tools: the command line --------------------------------------------------------
    show_library_warnings: bool = False
    """Show the known torch/kokoro warnings that the CLI hides (pipeline/cli.py)."""

    # --- gate ----------------------------------------------------------------------------------
    gate_app_id: str = "voicebus-gate"
    """The gate's app id: its consumer group and the prefix of its changelog topic."""
    gate_mode: Literal["incremental", "buffered"] = "incremental"
    """``incremental``: each sentence goes to synthesis as soon as it is released (the point of
    voicebus); ``buffered``: the gate waits for the end of the turn and sends the whole answer
    as one request (the hand-off voicebus replaces; kept for the TTFA benchmark's comparison)."""
    default_language: Language = "en"
    """Language of a turn that names none: one the engine speaks (``en``, ``es``, ``pt``, ``fr``,
    ``it``, ``hi``, ``ja``, ``zh``; `voicebus.schemas.contract.LANGUAGES`)."""
    default_voice: str = "af_heart"
    """Kokoro voice of a turn that names none."""
    default_speed: float = Field(1.0, gt=0)
    """Speech speed of a turn that names none (1.0 = the voice's own pace)."""
    speculative_release: bool = True
    """Speculative release (docs/gate.md): a sentence end that is almost certain (``.``, ``?``,
    ``!`` after a word that is no known abbreviation, number or initial) goes to synthesis at
    once, marked tentative, instead of waiting for the next token; the next token confirms or
    retracts it, and the worker publishes nothing of it until it is confirmed. On by default
    (a retracted sentence costs one synthesis and is never heard); docs/gate.md has the measured
    saving and retraction rate. Off: every sentence waits for the token after its end."""
    first_clause_min_words: int = 8
    """Release a long first sentence early at a clause boundary once it has this many words
    (0 disables it). 8 was chosen by measurement: docs/gate.md."""
    hold_timeout_s: float = 10.0
    """How long text waits behind a pending evidence mark before ``hold_timeout_policy`` applies."""
    hold_timeout_policy: Literal["release", "drop"] = "release"
    """What happens to text held behind a pending evidence mark when the hold times out:
    ``release`` or ``drop``."""
    floor_policy: Literal["queue", "preempt"] = "queue"
    """How a session's turns share its floor (docs/protocol.md, "The floor: several agents in one
    session"): ``queue``: one turn
    speaks at a time, in the order the turns started, a later turn waiting until the earlier one
    ends or is cancelled; ``preempt``: a new turn cuts the one speaking. A turn may override it
    (its first event's ``floor``), and a turn of higher ``priority`` always preempts."""
    floor_max_waiting_turns: int = Field(4, ge=1, le=64)
    """How many turns of one session may wait for the floor; a turn beyond it is refused (ended
    at once, nothing spoken, with a warning in the gate's log and its floor event)."""
    topic_discovery_interval_s: float = 2.0
    """How often a gate worker lists the broker's topics for text topics matching the prefix that
    were never registered (producers other than the SDK)."""
    gate_max_buffer_chars: int = 2048
    """A turn's segmenter releases what it holds once its buffer reaches this many characters (cut
    at a word boundary): run-on text and unclosed code fences cannot grow the state."""
    gate_max_session_state_bytes: int = 256 * 1024
    """The most one session's gate state may take (JSON bytes); past it the session's oldest
    live turns are ended early. Below ``max_message_bytes``: the state is one changelog record."""
    gate_max_sessions: int = Field(100_000, ge=1)
    """The most sessions one gate worker holds in memory; past it a new session takes the place of
    the least recently active idle session, or is refused (``gate-full``) when none is idle. An idle
    session (nothing buffered, held or waiting) is forgotten, as on idle expiry; a refused session's
    events are each dead-lettered as ``gate-full`` and counted in
    ``voicebus_gate_sessions_refused_total``: nothing of it is spoken, and every session the gate
    holds goes on."""
    gate_session_idle_s: float = 3600.0
    """A session with no event for this long is expired by the gate: its open turns are ended
    and its state is deleted (a tombstone on the changelog)."""

    # --- synthesis -----------------------------------------------------------------------------
    weights_path: Path | None = None
    """An explicit local Kokoro weights directory (config.json, kokoro-v1_0.pth, voices/)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """The torch device of the synthesis: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``
    or ``cuda:N``."""
    weights_hub: Literal["auto", "cache", "off"] = "auto"
    """Hugging Face hub use: ``auto`` (cache, then the hub when it answers a quick check),
    ``cache`` (cache only) or ``off`` (straight to the offline pack)."""
    worker_max_in_flight: int = 8
    """Requests a synthesis worker holds at once (queued + running); beyond it its partitions pause."""
    chunk_ms: int = Field(150, gt=0)
    """Duration of each AudioChunk the worker publishes (ms)."""
    audio_encoding: Literal["pcm16", "opus"] = "pcm16"
    """The audio on the bus and to the players (pipeline/audio_codec.py): ``pcm16`` (raw 16-bit
    samples, 48 KB/s per speaking session at 24 kHz) or ``opus`` (Opus packets, ``opus_bitrate``
    and ``opus_frame_ms``; chunks are whole packets, so ``chunk_ms`` is rounded to whole frames).
    Players must decode what the workers write: the web player does both (WebCodecs for Opus)."""
    opus_bitrate: int = 24_000
    """Opus target bitrate (bits/s, constrained VBR) when ``audio_encoding`` is ``opus``."""
    opus_frame_ms: int = 20
    """Duration of one Opus packet (ms): 10, 20, 40 or 60."""
    opening_clause_min_words: int = 3
    """A turn's first sentence is synthesized in two pieces when its first clause has at least
    this many words, so the turn's first audio needs only that clause (0 disables it)."""
    max_lead_silence_ms: int = 20
    """Silence kept before the sound of each synthesized piece (ms); see ``max_trail_silence_ms``."""
    max_trail_silence_ms: int = 250
    """Silence kept after the sound of each synthesized piece (ms). Kokoro pads each
    forward pass with ~270 ms before and ~600 ms after; the lead delays the turn's first audible
    sample and the sum is the pause between sentences. 20 + 250 ms: docs/worker.md."""
    windowed_decoding: bool = True
    """Decode each piece in growing windows of frames and publish each window's audio as soon as
    it is decoded; sentences are then cut only where they must be (no pause mid-phrase). Its
    quality gates hold (Whisper tiny.en WER the same as the whole decode's, seams no worse than
    the audio around them: docs/worker.md); False: one window per piece, sentences cut after
    their 8th word for early audio (the engine's older behaviour)."""
    shorten_inner_pauses: bool = True
    """Shorten every silence Kokoro predicts inside a phrase (no punctuation in it) to 75 ms of
    silent frames before decoding (`kokoro_frames.shorten_inner_silence`); a pause the text
    punctuates is kept whole. The offline pack's voice pauses 310-400 ms in the middle of some
    phrases ("before nine | to confirm"); False: Kokoro's own pauses (docs/worker.md,
    "Mid-phrase pauses")."""
    synthesis_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype of the decoder (~90 % of a forward pass) and of the PL-BERT that reads the
    phonemes (`kokoro_frames.Bfloat16Bert`): ``auto`` (bfloat16 on a CPU
    that multiplies it in hardware: AMX or AVX-512 BF16; else float32), ``float32`` or ``bfloat16``.
    bfloat16 made the generator 3.6-4x faster with AMX, the whole synthesis 1.4-1.7x with AVX-512
    BF16 (a Zen 5 EPYC), and Whisper hears the same words (docs/worker.md, "The generator,
    folded"); float32 is kokoro's arithmetic (the audio within 1e-5), on a CPU with the decoder's
    wide convolutions through short DFTs and its 3-tap ones of many channels through F(4, 3)
    (`tiled_conv`: fewer multiplications, the same audio within float32's rounding; docs/worker.md,
    "Wide convolutions through short DFTs") and PL-BERT prepacked (`kokoro_frames.PrepackedBert`)."""
    synthesis_threads: int = Field(1, ge=1)
    """torch intra-op threads of a worker that loads the real model. 1 (the default) on a node
    whose cores are shared with brokers and other stages: there 2 threads made a forward pass 3-4x
    slower. On a worker with cores of its own use their number: 2 threads were 1.6-1.7x faster
    than 1 on a quiet 2-core machine (docs/benchmarks.md, "bench synth"). At least 1."""
    worker_cancel_lookback_s: float = 300.0
    """A starting worker applies the cancels of this many seconds back before fetching requests."""
    worker_session_timeout_ms: int = 10_000
    """Consumer-group session timeout: how soon a dead worker's partitions move to another."""
    worker_publish_backoff_s: float = 0.1
    """A worker's failed send (audio chunk, dead letter) or commit is retried after this long,
    doubling up to ``worker_publish_max_backoff_s``; the request stays uncommitted meanwhile."""
    worker_speak_attempts: int = Field(3, ge=1)
    """How many times a worker synthesizes a sentence whose synthesis failed with an error that is
    not about its text (out of memory, a device error) before any of its audio was made; then it is
    failed, with the reason in its last chunk's ``end_reason``. An error about the text itself (an
    unknown language, no voice) fails it at once."""
    worker_publish_max_backoff_s: float = 5.0
    """The longest wait between two tries of a worker's failed send or commit."""

    # --- edge ----------------------------------------------------------------------------------
    edge_host: str = "127.0.0.1"
    """The edge's listen address (and that of a gate's or worker's ``--metrics-port``); anything
    but a loopback address needs a real ``edge_secret``: the edge refuses to start there with the
    default or an empty one (docs/edge.md)."""
    edge_port: int = Field(8765, ge=0, le=65535)
    """The edge's listen port (web player, ``/ws``, ``/healthz``)."""
    edge_secret: SecretStr = SecretStr(DEFAULT_EDGE_SECRET)
    """The HMAC key of player tokens and of the edge directory's records. The default is public:
    fine on loopback only. Empty is refused."""
    token_ttl_s: int = 3600
    """How long a token from `voicebus token` stays valid (seconds)."""
    client_queue_frames: int = 256
    """Audio frames queued per player connection before the oldest queued sentence is skipped."""
    edge_metrics_port: int = Field(0, ge=0, le=65535)
    """Where the edge serves ``/metrics``: 0, on the player port to loopback clients only (others
    get 403); a port, there, on ``edge_metrics_host``, and not on the player port."""
    edge_metrics_host: str = "127.0.0.1"
    """The listen address of the metrics port (used when ``edge_metrics_port`` is set)."""
    edge_allowed_origins: str = ""
    """Comma-separated browser origins (``https://app.example.com``) allowed to open ``/ws``;
    empty: the edge's own origin and loopback origins only; ``*``: any. A request without an
    ``Origin`` header (not a browser) is not checked. Refused: close 4403 ``origin-not-allowed``."""

    # --- edge: hard limits (docs/edge.md, "Bounds") -------------------------------------------
    edge_max_clients: int = 1000
    """Player connections one edge serves at once; one more is refused with close 1013 ``edge-full``."""
    edge_max_clients_per_session: int = 8
    """Player connections of one session on one edge; one more is refused with close 1013 ``session-full``."""
    edge_replay_max_bytes: int = 64 * 1024 * 1024
    """All replay buffers of one edge together (bytes of encoded frames, 67108864 = 64 MiB, about 23
    minutes of 24 kHz PCM16); past it the oldest sentences of the least recently active sessions go."""
    edge_session_grace_s: float = 30.0
    """How long an edge keeps a session's turns and replay after its last player left, for a
    reconnect with ``resume``; after that, and for sessions none of its players listen to, it keeps nothing."""
    edge_cancel_rate_per_s: float = 2.0
    """Cancels one player connection may send per second, sustained (token bucket refill rate)."""
    edge_cancel_burst: int = 5
    """Cancels one player connection may send at once (token bucket size); beyond the rate an
    extra cancel is refused with the error ``rate-limited`` (the connection stays up)."""
    edge_message_rate_per_s: float = Field(20.0, gt=0)
    """Reports and pings one player connection may send per second, sustained (token bucket); a
    player sends a few per sentence and a ping every few seconds. Beyond it a message is refused
    with the error ``rate-limited`` (the connection stays up)."""
    edge_message_burst: int = Field(50, ge=1)
    """Reports and pings one player connection may send at once (token bucket size)."""
    edge_heard_wait_ms: int = 500
    """After a session's first heard report of a turn (playback end or stop, with how far it
    rendered), how long the edge waits for its other players before it publishes TurnHeard
    from the furthest report; with every player reported it publishes at once."""
    edge_cancel_lookback_s: float = 60.0
    """A starting edge applies the cancels of this many seconds back before it serves audio."""

    # --- edge: sharding (docs/edge.md, "Sharded edges") -------------------------------------------
    edge_group_id: str = ""
    """The consumer group of the edges that share one audio topic (they own its partitions, and
    so its sessions, between them); empty: ``voicebus-edge.<audio_topic>``."""
    edge_id: str = ""
    """This edge's name in the edge directory; empty: ``<host name>-<pid>-<random>``, new each start."""
    edge_public_url: str = ""
    """Where players reach this edge's ``/ws``, as redirects name it: an absolute ``ws://`` or
    ``wss://`` URL, or a path (``/edge-1/ws``) the player resolves against its page's origin (an
    edge behind a proxy); empty: ``ws://<edge_host>:<edge_port>/ws``."""
    edge_redirect_origins: str = ""
    """Comma-separated origins (``https://edge-3.example.com``) of the edges a player may be sent
    to besides its page's own origin; an edge-directory record naming one of them is believed even
    without the shared ``edge_secret`` signature. A player follows a redirect, or an edge its edge
    listed, only to its page's own origin or to one of these (so a deployment whose edges have
    their own host names lists them all here). Empty (default): players stay on their page's
    origin, and only signed directory records are believed."""
    edge_session_timeout_ms: int = 10_000
    """Consumer-group session timeout of the edges: how soon a dead edge's sessions move to the
    others (the broker's minimum is 6000 by default)."""
    edge_resume_lookback_s: float = 120.0
    """A player that resumes on an edge holding nothing of its session (the session moved here) is
    served from the audio of this many seconds back, re-read from the session's partition."""
    edge_owner_wait_s: float = 5.0
    """A hello for a session whose partition no edge owns right now (a rebalance) waits this long
    for an owner, then is refused with close 1013 ``no-owner``."""

    # --- agents --------------------------------------------------------------------------------
    sse_max_line_bytes: int = 1024 * 1024
    """The longest Server-Sent Events line (and event) the OpenAI adapter buffers: 1048576 bytes.
    A chat-completion chunk is a few hundred bytes; a longer line breaks the stream (the turn ends)."""

    # --- agents: the demo console (players/console.py, docs/edge.md) ----------------------------
    console_token_ms: float = 30.0
    """The console streams typed text as LLM-like tokens, one every this many milliseconds."""
    console_max_text_chars: int = 2000
    """The longest text the console accepts to speak (longer is refused with 413)."""
    console_max_sessions: int = 64
    """Console sessions kept at once (one per opened page); the oldest idle one is forgotten beyond."""

    # --- the OpenAI-compatible speech endpoint (players/openai_speech.py, docs/openai.md) ---------
    speech_api: bool = True
    """Serve ``/v1/audio/speech``, ``/v1/models`` and ``/v1/audio/voices`` on the edge. Each request
    is a one-shot turn of agent ``speech_api_agent_id`` through the gate and the workers."""
    api_keys: SecretStr = SecretStr("")
    """Bearer keys of the speech endpoint, comma-separated (or ``VOICEBUS_API_KEYS_FILE``: a file of
    them, one per line or comma-separated); empty: the endpoint answers loopback clients only (the
    demo), and 401 to any other. A request without one of them gets 401."""
    speech_api_agent_id: str = "openai-speech"
    """The agent id (and so the text topic) the speech endpoint's turns are published as."""
    speech_api_kafka_username: str = ""
    """On a SASL bus: the user the speech endpoint publishes its turns as, an agent principal of
    its own (`voicebus topics --create` grants ``User:<it>`` that agent's rights), since the edge's
    own user may not write text. Empty: the edge's user, which a bus with voicebus's ACLs refuses
    (the endpoint then answers 503 saying so); on a bus without SASL it is not used."""
    speech_api_kafka_password: SecretStr = SecretStr("")
    """The password of ``speech_api_kafka_username`` (or ``VOICEBUS_SPEECH_API_KAFKA_PASSWORD_FILE``)."""
    speech_api_max_input_chars: int = Field(4096, ge=1, le=16_384)
    """The longest ``input`` the speech endpoint accepts (OpenAI's limit is 4096 characters)."""
    speech_api_timeout_s: float = Field(60.0, gt=0)
    """A speech request whose first audio has not arrived after this long is cancelled (504)."""

    @field_validator("default_voice")
    @classmethod
    def _voice_spec(cls, value: str) -> str:
        # checked here: a gate whose default is no voice spec would write requests the contract refuses
        from voicebus.schemas.contract import InvalidVoice, parse_voice

        try:
            parse_voice(value)
        except InvalidVoice as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("opus_frame_ms")
    @classmethod
    def _opus_frame(cls, value: int) -> int:
        if value not in OPUS_FRAME_MS:
            raise ValueError(f"Input should be {', '.join(map(str, OPUS_FRAME_MS[:-1]))} or {OPUS_FRAME_MS[-1]}")
        return value

    @field_validator("weights_path", "kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile",
                     "registry_ssl_cafile", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("cache_dir", "weights_path", "kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile",
                     "registry_ssl_cafile", mode="after")
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build settings from ``VOICEBUS_<FIELD>`` variables, then apply ``overrides``; a
        `SettingsError` names each variable whose value its field does not allow."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        secrets = _secret_fields()
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in cls.model_fields:
                values[name] = raw
            elif name.endswith("_file") and name.removesuffix("_file") in secrets:
                continue  # read below, after the plain variable (which wins)
            else:
                log.warning("%s is not a voicebus setting (ignored)%s", key, _closest_hint(name))
        files: dict[str, str] = {}
        for name in secrets:
            path = environ.get(f"{ENV_PREFIX}{name.upper()}_FILE")
            if path and name not in values and name not in overrides:
                values[name] = _read_secret_file(f"{ENV_PREFIX}{name.upper()}_FILE", path)
                files[name] = path
        values.update(overrides)
        settings = cls(**values)
        settings._secret_files.update(files)
        return settings

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_explain(exc)) from None

    def replace(self, **changes: Any) -> "Settings":
        """A copy with `changes`, validated like any other settings."""
        current = {name: getattr(self, name) for name in type(self).model_fields}
        changed = type(self)(**{**current, **changes})
        changed._secret_files.update({k: v for k, v in self._secret_files.items() if k not in changes})
        return changed

    def to_env(self) -> dict[str, str]:
        """These settings as ``VOICEBUS_*`` variables, for a child process (gate or worker
        subprocess) that must see exactly the same configuration. A secret read from a file is
        passed as its ``_FILE`` variable: its value is in no child's environment."""
        env: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in self._secret_files:
                env[f"{ENV_PREFIX}{name.upper()}_FILE"] = self._secret_files[name]
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            env[ENV_PREFIX + name.upper()] = "" if value is None else str(value)
        return env

    @property
    def edge_url(self) -> str:
        """The edge's base URL on the address it listens on (``/ws``, ``/healthz`` below it); what
        players elsewhere are told is `edge_public_url`."""
        return f"http://{self.edge_host}:{self.edge_port}"

    @property
    def kafka_dir(self) -> Path:
        return self.cache_dir / "kafka"

    @property
    def registry_dir(self) -> Path:
        return self.cache_dir / "registry"

    @property
    def weights_cache_dir(self) -> Path:
        return self.cache_dir / "weights"


def field_docs() -> dict[str, str]:
    """Each field's docstring (pydantic keeps it as the field's description), whitespace folded;
    ``""`` for a field without one."""
    return {name: " ".join((f.description or "").split()) for name, f in Settings.model_fields.items()}


@dataclass(frozen=True)
class SettingGroup:
    """The settings of one role, or of one concern (the bus, security, tracing, local tools), as
    the reference shows them."""

    title: str
    doc: str  # the page of docs/ that explains them (with an anchor where it helps), "" for none
    fields: tuple[str, ...]  # in declaration order


# Every field in exactly one group (checked below, at import); the groups and their fields are in
# the order the class declares them (the settings tests check it), one section of the class per group.
SETTING_GROUPS: dict[str, SettingGroup] = {
    "bus": SettingGroup("Bus and topics", "", (
        "bootstrap", "partitions", "replication_factor", "min_insync_replicas", "text_topic_prefix",
        "agents_topic", "control_topic", "synthesis_topic", "audio_topic", "playback_topic", "heard_topic",
        "floor_topic", "deadletter_topic", "edges_topic", "gate_changelog_topic", "max_text_bytes",
        "deadletter_attempts", "deadletter_timeout_s", "max_message_bytes", "fetch_max_wait_ms")),
    "security": SettingGroup("Security, wire format, registry", "kafka.md#a-secured-cluster", (
        "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password",
        "kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile", "kafka_ssl_key_password", "wire_format",
        "registry_url", "registry_timeout_s", "registry_username", "registry_password", "registry_ssl_cafile")),
    "tracing": SettingGroup("Tracing", "tracing.md", (
        "tracing", "otlp_endpoint", "otlp_protocol", "otlp_service_name")),
    "local-tools": SettingGroup("Local tools", "", (
        "cache_dir", "kafka_version", "kafka_port", "kafka_controller_port", "registry_version",
        "registry_port", "show_library_warnings")),
    "gate": SettingGroup("Gate", "gate.md", (
        "gate_app_id", "gate_mode", "default_language", "default_voice", "default_speed", "speculative_release",
        "first_clause_min_words", "hold_timeout_s", "hold_timeout_policy", "floor_policy",
        "floor_max_waiting_turns", "topic_discovery_interval_s", "gate_max_buffer_chars",
        "gate_max_session_state_bytes", "gate_max_sessions", "gate_session_idle_s")),
    "synthesis": SettingGroup("Synthesis worker", "worker.md", (
        "weights_path", "device", "weights_hub", "worker_max_in_flight", "chunk_ms", "audio_encoding",
        "opus_bitrate", "opus_frame_ms", "opening_clause_min_words", "max_lead_silence_ms",
        "max_trail_silence_ms", "windowed_decoding", "shorten_inner_pauses", "synthesis_precision",
        "synthesis_threads", "worker_cancel_lookback_s", "worker_session_timeout_ms",
        "worker_publish_backoff_s", "worker_speak_attempts", "worker_publish_max_backoff_s")),
    "edge": SettingGroup("Edge", "edge.md", (
        "edge_host", "edge_port", "edge_secret", "token_ttl_s", "client_queue_frames", "edge_metrics_port",
        "edge_metrics_host", "edge_allowed_origins", "edge_max_clients", "edge_max_clients_per_session",
        "edge_replay_max_bytes", "edge_session_grace_s", "edge_cancel_rate_per_s", "edge_cancel_burst",
        "edge_message_rate_per_s", "edge_message_burst", "edge_heard_wait_ms", "edge_cancel_lookback_s",
        "edge_group_id", "edge_id", "edge_public_url", "edge_redirect_origins", "edge_session_timeout_ms",
        "edge_resume_lookback_s", "edge_owner_wait_s")),
    "agents": SettingGroup("Agents and demo", "", (
        "sse_max_line_bytes", "console_token_ms", "console_max_text_chars", "console_max_sessions")),
    "speech-api": SettingGroup("The OpenAI-compatible speech endpoint", "openai.md", (
        "speech_api", "api_keys", "speech_api_agent_id", "speech_api_kafka_username",
        "speech_api_kafka_password", "speech_api_max_input_chars", "speech_api_timeout_s")),
}
SHARED_GROUPS = ("bus", "security", "tracing")  # read by every role's process


@dataclass(frozen=True)
class Role:
    """What one kind of process reads: the shared groups, its own groups, and a few fields of
    other groups (``also``)."""

    groups: tuple[str, ...]
    also: tuple[str, ...] = ()


ROLES: dict[str, Role] = {  # `voicebus settings --role`
    # the gate's and the worker's ``--metrics-port`` listens on ``edge_host``
    "gate": Role(("gate",), also=("edge_host",)),
    # the worker warms up with the default voice and finds its weights under ``cache_dir``
    "worker": Role(("synthesis",), also=("cache_dir", "show_library_warnings", "default_language",
                                         "default_voice", "edge_host")),
    # the edge serves the speech endpoint, which names voices of the default language
    "edge": Role(("edge", "speech-api"), also=("default_language",)),
    # the framework adapters (Pipecat, LiveKit) listen through the edge with a token they sign
    "agent": Role(("agents",), also=("edge_host", "edge_port", "edge_secret")),
    "speech-api": Role(("speech-api",), also=("default_language",)),
}


def group_of(name: str) -> str:
    """The group of field `name`."""
    return _GROUP_OF[name]


def fields_of(role: str) -> tuple[str, ...]:
    """The fields `role`'s process reads (a key of `ROLES`), in declaration order: the shared
    groups' (bus, security, tracing), its own groups' and its ``also``."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is no role: {', '.join(ROLES)}")
    groups = {*SHARED_GROUPS, *ROLES[role].groups}
    wanted = {name for name in Settings.model_fields if _GROUP_OF[name] in groups} | set(ROLES[role].also)
    return tuple(name for name in Settings.model_fields if name in wanted)


def _check_groups() -> dict[str, str]:
    """Field -> group, once every field is in exactly one group and every role names real ones."""
    group_of: dict[str, str] = {}
    twice = []
    for key, group in SETTING_GROUPS.items():
        for name in group.fields:
            if name in group_of:
                twice.append(name)
            group_of[name] = key
    unknown = sorted(set(group_of) - set(Settings.model_fields))
    ungrouped = [name for name in Settings.model_fields if name not in group_of]
    if twice or unknown or ungrouped:
        raise RuntimeError(f"SETTING_GROUPS must name every Settings field once: in more than one group {twice}, "
                           f"no field {unknown}, in no group {ungrouped}")
    for role in ROLES.values():
        if not set(role.groups) <= SETTING_GROUPS.keys() or not set(role.also) <= group_of.keys():
            raise RuntimeError(f"a role names an unknown group or field: {role}")
    return group_of


_GROUP_OF = _check_groups()


def _secret_fields() -> list[str]:
    """The fields that hold secrets; each may also be given as ``VOICEBUS_<FIELD>_FILE``."""
    return [name for name, f in Settings.model_fields.items() if f.annotation is SecretStr]


def _read_secret_file(variable: str, path: str) -> str:
    """A secret mounted as a file (one line; the trailing newline is not part of it)."""
    try:
        return Path(path).expanduser().read_text().rstrip("\r\n")
    except OSError as exc:
        raise SettingsError(f"{variable}: cannot read {path}: {exc.strerror}") from None


def _closest_hint(name: str) -> str:
    close = difflib.get_close_matches(name, list(Settings.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""


def _explain(exc: ValidationError) -> str:
    """One line per wrong value, naming its variable and what it must be; a secret's value is never
    repeated (pydantic's own message would quote the input)."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        name = str(error["loc"][0]) if error["loc"] else "?"
        variable = ENV_PREFIX + name.upper()
        if error["type"] == "extra_forbidden":
            lines.append(f"{name} is not a setting{_closest_hint(name)}")
            continue
        lines.append(f"{variable}: {error['msg']}")
    return "; ".join(lines)
