"""The one settings object of voicebus.

`Settings` is frozen and is built once per process by `Settings.from_env()`; this module is the
only place that reads the environment (prefix ``VOICEBUS_``). Every other module takes a
`Settings` (or the few values it needs) as an argument, so tests build their own with
`Settings(...)` or `settings.replace(...)` instead of patching the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from schemas.contract import LIMITS

ENV_PREFIX = "VOICEBUS_"


class SettingsError(ValueError):
    """A ``VOICEBUS_*`` variable could not be parsed into its field's type."""


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "voicebus"


@dataclass(frozen=True)
class Settings:
    # --- bus -------------------------------------------------------------------------------
    bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers (``VOICEBUS_BOOTSTRAP``)."""
    partitions: int = 6
    replication_factor: int = 1
    text_topic_prefix: str = "voicebus.text."
    """Agents publish to ``<prefix><agent_id>``; the gate subscribes to the prefix by pattern."""
    control_topic: str = "voicebus.control"
    synthesis_topic: str = "voicebus.synthesis"
    audio_topic: str = "voicebus.audio"
    playback_topic: str = "voicebus.playback"
    deadletter_topic: str = "voicebus.deadletter"
    gate_changelog_topic: str = "voicebus-gate-gate_sessions-changelog"
    max_text_bytes: int = LIMITS.max_text_bytes
    """A text field longer than this (UTF-8 bytes) is rejected as oversized and dead-lettered."""
    max_message_bytes: int = 1024 * 1024
    fetch_max_wait_ms: int = 100
    """How long the broker may park an idle consumer's fetch. It adds no latency (a parked fetch
    returns as soon as a record is appended) but each expiry is a round trip: 5 ms made every idle
    consumer cost the broker and the client CPU that the model needs (docs/benchmarks.md)."""

    show_library_warnings: bool = False
    """Show the known torch/kokoro warnings that the CLI hides (pipeline/cli.py)."""

    # --- wire format and schema registry (docs/kafka.md) -----------------------------------
    wire_format: str = "single-object"
    """What writers produce: ``single-object`` (Avro single-object encoding, no registry) or
    ``confluent`` (byte 0, a 4-byte schema id, the body: what Kafka Connect, ksqlDB and the
    Confluent clients read; needs ``registry_url``). Readers accept both either way."""
    registry_url: str = ""
    """A Confluent-compatible schema registry API, e.g.
    ``http://127.0.0.1:8081/apis/ccompat/v7`` (Apicurio; `voicebus registry start` prints it).
    Empty: none; a Confluent-framed record then dead-letters as ``unknown-schema-id``."""
    registry_timeout_s: float = 5.0
    """How long one registry request may take (registering a schema, resolving an id)."""

    # --- local broker (voicebus kafka start|status|stop) -----------------------------------
    cache_dir: Path = field(default_factory=_default_cache_dir)
    kafka_version: str = "4.4.0"
    kafka_port: int = 9092
    kafka_controller_port: int = 9093

    # --- local schema registry (voicebus registry fetch|start|status|stop) -----------------
    registry_version: str = "3.3.3"
    """Apicurio Registry version fetched from Maven Central (needs a Java 21+ runtime)."""
    registry_port: int = 8081

    # --- gate ----------------------------------------------------------------------------------
    gate_app_id: str = "voicebus-gate"
    gate_mode: str = "incremental"
    """``incremental``: each sentence goes to synthesis as soon as it is released (the point of
    voicebus). ``buffered``: the gate waits for the end of the turn and sends the whole answer
    as one request (the hand-off voicebus replaces; kept for the TTFA benchmark's comparison)."""
    default_language: str = "en"
    default_voice: str = "af_heart"
    default_speed: float = 1.0
    first_clause_min_words: int = 8
    """Release a long first sentence early at a clause boundary once it has this many words
    (0 disables it). 8 was chosen by measurement: docs/segmentation.md."""
    hold_timeout_s: float = 10.0
    hold_timeout_policy: str = "release"
    """What happens to text held behind a pending evidence mark when the hold times out:
    ``release`` or ``drop``."""

    # --- synthesis -----------------------------------------------------------------------------
    weights_path: Path | None = None
    """An explicit local Kokoro weights directory (config.json, kokoro-v1_0.pth, voices/)."""
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda``."""
    weights_hub: str = "auto"
    """Hugging Face hub use: ``auto`` (cache, then the hub when it answers a quick check),
    ``cache`` (cache only) or ``off`` (straight to the offline pack)."""
    worker_max_in_flight: int = 8
    chunk_ms: int = 150
    opening_clause_min_words: int = 3
    """A turn's first sentence is synthesized in two pieces when its first clause has at least
    this many words, so the turn's first audio needs only that clause (0 disables it)."""
    max_lead_silence_ms: int = 20
    max_trail_silence_ms: int = 250
    """Silence kept before and after the sound of each synthesized piece. Kokoro pads each
    forward pass with ~270 ms before and ~600 ms after; the lead delays the turn's first audible
    sample and the sum is the pause between sentences. 20 + 250 ms: docs/synthesis.md."""
    worker_cancel_lookback_s: float = 300.0
    """A starting worker applies the cancels of this many seconds back before fetching requests."""
    worker_session_timeout_ms: int = 10_000
    """Consumer-group session timeout: how soon a dead worker's partitions move to another."""

    # --- edge ----------------------------------------------------------------------------------
    edge_host: str = "127.0.0.1"
    edge_port: int = 8765
    edge_secret: str = "voicebus-dev-secret-change-me"
    token_ttl_s: int = 3600
    client_queue_frames: int = 256

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build settings from ``VOICEBUS_<FIELD>`` variables, then apply ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw)
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """These settings as ``VOICEBUS_*`` variables, for a child process (gate or worker
        subprocess) that must see exactly the same configuration."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            env[ENV_PREFIX + f.name.upper()] = "" if value is None else str(value)
        return env

    @property
    def kafka_dir(self) -> Path:
        return self.cache_dir / "kafka"

    @property
    def registry_dir(self) -> Path:
        return self.cache_dir / "registry"

    @property
    def weights_cache_dir(self) -> Path:
        return self.cache_dir / "weights"


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw.strip().lower() in {"1", "true", "yes", "on"}
        if kind.startswith("Path"):
            return Path(raw).expanduser() if raw else None
        return raw
    except ValueError as exc:
        raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: not a valid {kind}") from exc
