"""The rest of the wire contract: what the `.avsc` files beside this module cannot say.

Avro says a field is an ``int`` or a ``string``; it cannot say that a sequence number is never
negative, which languages the pipeline can speak, or how long an id may be. This module says it,
once, for every stage: the codec (`voicebus.codecs.Codec`) checks every message against it when it
encodes (so a producer such as the agents SDK refuses what the pipeline cannot speak, at the
source, with a clear error) and when it decodes (so a consumer never hands a handler a record that
breaks it: the record policy in `voicebus.shell` dead-letters it with the violation's reason).

What is here:

- the enums of the schemas (`TextEventKind`, `ControlAction`, `AudioEncoding`, `PlaybackKind`),
  built from the `.avsc` symbols, so code compares ``event["kind"] == TextEventKind.TOKEN``
  (a ``str`` enum: equal to the decoded string) and never a bare literal;
- `LANGUAGES`: the language codes an agent may write, each mapped to the Kokoro code the engine
  speaks, and `SEGMENTER_LANGUAGE`: the sentence rules used for each Kokoro code. Only languages
  that both the gate can segment and the engine can phonemize are listed: a language one stage
  accepts and the next cannot speak is how a turn used to wedge;
- limits (`Limits`): text bytes, id lengths, sequence ranges, sample rates, audio bytes per chunk;
- `violations(message_type, value)`: the checks (the codec raises `InvalidMessage` with them);
- the framing of Opus audio (`pack_opus_packets`, `split_opus_packets`): an OPUS AudioChunk's
  ``pcm`` holds whole packets, each a 2-byte little-endian length then the packet, the same bytes
  on the bus and in the edge's audio frames (docs/protocol.md).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping

from voicebus import schemas

# --- enums, from the schemas ---------------------------------------------------------------------


def _symbols(message_type: str, field_name: str) -> list[str]:
    for f in schemas.load(message_type)["fields"]:
        if f["name"] == field_name:
            return list(f["type"]["symbols"])
    raise KeyError(f"{message_type} has no enum field {field_name!r}")


class SchemaEnum(str, enum.Enum):
    """A schema enum: each member is its Avro symbol, equal to it and printed as it."""

    __str__ = str.__str__
    __format__ = str.__format__


def _enum(name: str, message_type: str, field_name: str) -> type[SchemaEnum]:
    symbols = _symbols(message_type, field_name)
    return SchemaEnum(name, [(s, s) for s in symbols], module=__name__)  # type: ignore[return-value]


TextEventKind = _enum("TextEventKind", "TextEvent", "kind")
ControlAction = _enum("ControlAction", "ControlEvent", "action")
AudioEncoding = _enum("AudioEncoding", "AudioChunk", "encoding")
PlaybackKind = _enum("PlaybackKind", "PlaybackReport", "kind")
FloorEventKind = _enum("FloorEventKind", "FloorEvent", "event")

EVIDENCE_KINDS = frozenset({TextEventKind.EVIDENCE_PENDING, TextEventKind.EVIDENCE_READY,
                            TextEventKind.EVIDENCE_FAILED})

# --- languages -----------------------------------------------------------------------------------

# Language as an agent writes it (ISO code, or Kokoro's own one-letter code) -> Kokoro code.
LANGUAGES: Mapping[str, str] = {
    "en": "a", "en-us": "a", "en_us": "a", "a": "a",
    "en-gb": "b", "en_gb": "b", "b": "b",
    "es": "e", "e": "e",
    "pt": "p", "pt-br": "p", "pt_br": "p", "p": "p",
}
# Kokoro code -> the sentence rules the segmenter applies (it has rules for en, es and pt).
SEGMENTER_LANGUAGE: Mapping[str, str] = {"a": "en", "b": "en", "e": "es", "p": "pt"}
# A voice of each language, for an event that names none when the configured default is of another.
DEFAULT_VOICES: Mapping[str, str] = {"a": "af_heart", "b": "bf_emma", "e": "ef_dora", "p": "pf_dora"}
KOKORO_CODES = frozenset(LANGUAGES.values())
assert KOKORO_CODES == frozenset(SEGMENTER_LANGUAGE) == frozenset(DEFAULT_VOICES), "one entry per spoken language"


class UnknownLanguage(ValueError):
    """A language code the pipeline cannot speak (see `LANGUAGES`)."""

    reason = "unknown-language"


def kokoro_code(language: str | None, default: str = "en") -> str:
    """The Kokoro code for ``language`` (``None`` or empty: ``default``); `UnknownLanguage` else."""
    code = (language or default or "").strip().lower()
    try:
        return LANGUAGES[code]
    except KeyError:
        raise UnknownLanguage(
            f"language {code!r} cannot be spoken; known: {', '.join(sorted(LANGUAGES))}") from None


# --- limits --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The hard limits of every message. One instance, `LIMITS`; docs/protocol.md lists them."""

    max_text_bytes: int = 16 * 1024
    """A text field (token, sentence) longer than this in UTF-8 is refused as oversized."""
    max_id_chars: int = 128
    """session_id, turn_id, claim_id, client_id: at most this many characters, no control chars."""
    max_agent_id_chars: int = 200
    """agent_id: Kafka's legal topic characters, as the agent's text topic is named after it."""
    max_label_chars: int = 1000
    """Free text meant for people (reason, source, detail, voice name)."""
    max_seq: int = 2**31 - 1
    """sentence_seq and chunk_seq are 0 .. max_seq (Avro int is signed; negatives are refused)."""
    sample_rates: frozenset[int] = frozenset({8000, 16000, 22050, 24000, 32000, 44100, 48000})
    max_chunk_audio_bytes: int = 256 * 1024
    """One AudioChunk's audio: ~5.4 s of 24 kHz PCM16, far above the 150 ms chunks workers send."""
    min_speed: float = 0.25
    max_speed: float = 4.0
    max_priority: int = 1000
    """A TextEvent's floor ``priority`` is -max_priority .. max_priority."""
    max_turn_ids: int = 64
    """A ControlEvent cancels at most this many listed turns (``turn_ids``), each a valid id: a
    cancel cannot grow a stage's state (two cancels of 600 KB of ids once made the gate's state
    record too large to write)."""


LIMITS = Limits()

# The values a metric label may take from a ControlEvent's free-text ``source``: what voicebus's
# own producers write. Any other value is counted as "other", so a writer of the control topic
# cannot add a metric series per value (20,000 distinct sources once made 20,000 series).
CANCEL_SOURCES = frozenset({"agent", "edge", "gate", "floor", "console", "openai-adapter", "user", "cli", "bus"})

# --- the floor (docs/protocol.md, "The floor") ---------------------------------------------------

FLOOR_QUEUE = "queue"  # a turn that finds the floor taken waits until the turn speaking ends
FLOOR_PREEMPT = "preempt"  # a turn that finds the floor taken cuts the turn speaking
FLOOR_POLICIES = (FLOOR_QUEUE, FLOOR_PREEMPT)
FLOOR_CANCEL_SOURCE = "floor"  # the source of the cancel the gate publishes for a preempted turn


def metric_label(value: object, allowed: frozenset[str]) -> str:
    """`value` when it is one of `allowed`, else ``other``: a label from a closed set."""
    return value if isinstance(value, str) and value in allowed else "other"

# --- Opus packet framing -------------------------------------------------------------------------

OPUS_LENGTH_BYTES = 2
MAX_OPUS_PACKET_BYTES = 1275  # RFC 6716 3.4: a frame is at most 1275 bytes
OPUS_SAMPLE_RATES = frozenset({8000, 16000, 24000, 48000})  # Opus rates (12 kHz too) that LIMITS.sample_rates allows


class MalformedOpusPayload(ValueError):
    """Bytes that are not a sequence of length-prefixed Opus packets."""


def pack_opus_packets(packets: "list[bytes] | tuple[bytes, ...]") -> bytes:
    """Whole Opus packets as one payload: each a 2-byte little-endian length, then the packet."""
    out = bytearray()
    for packet in packets:
        if not 0 < len(packet) <= MAX_OPUS_PACKET_BYTES:
            raise MalformedOpusPayload(f"an Opus packet of {len(packet)} bytes (1..{MAX_OPUS_PACKET_BYTES})")
        out += len(packet).to_bytes(OPUS_LENGTH_BYTES, "little")
        out += packet
    return bytes(out)


def split_opus_packets(payload: "bytes | bytearray | memoryview") -> list[bytes]:
    """The packets of a payload `pack_opus_packets` made; `MalformedOpusPayload` when a length
    is zero, too large or runs past the end."""
    data = memoryview(payload)
    packets: list[bytes] = []
    at = 0
    while at < len(data):
        if at + OPUS_LENGTH_BYTES > len(data):
            raise MalformedOpusPayload(f"{len(data) - at} stray byte(s) at offset {at} of an Opus payload")
        size = int.from_bytes(data[at:at + OPUS_LENGTH_BYTES], "little")
        at += OPUS_LENGTH_BYTES
        if not 0 < size <= MAX_OPUS_PACKET_BYTES or at + size > len(data):
            raise MalformedOpusPayload(f"Opus packet length {size} at offset {at - OPUS_LENGTH_BYTES} "
                                       f"(1..{MAX_OPUS_PACKET_BYTES}, {len(data) - at} bytes left)")
        packets.append(bytes(data[at:at + size]))
        at += size
    return packets


_ID = re.compile(r"[^\x00-\x1f\x7f]+")


def is_valid_id(value: Any, limits: "Limits | None" = None) -> bool:
    """A session, turn, claim or client id: a non-empty string of at most ``max_id_chars``
    characters without control characters."""
    limit = (limits or LIMITS).max_id_chars
    return isinstance(value, str) and 0 < len(value) <= limit and bool(_ID.fullmatch(value))
_AGENT_ID = re.compile(r"[A-Za-z0-9._-]+")

# --- the checks ----------------------------------------------------------------------------------


def violations(message_type: str, value: Mapping[str, Any], limits: Limits = LIMITS) -> list[str]:
    """Every rule `value` breaks (empty when it is fine). Pure; fields Avro checks are not redone,
    and the text size is the codec's own check (`OversizedText`, with its setting)."""
    problems: list[str] = []

    def ident(name: str, *, optional: bool = False) -> None:
        v = value.get(name)
        if v is None and optional:
            return
        if not is_valid_id(v, limits):
            problems.append(f"{name} must be 1-{limits.max_id_chars} characters without control characters")

    def non_negative(name: str, top: int) -> None:
        v = value.get(name)
        if isinstance(v, int) and not 0 <= v <= top:
            problems.append(f"{name} {v} is outside 0..{top}")

    def label(name: str) -> None:
        v = value.get(name)
        if isinstance(v, str) and len(v) > limits.max_label_chars:
            problems.append(f"{name} is longer than {limits.max_label_chars} characters")

    def language(name: str = "language", *, optional: bool = False) -> None:
        v = value.get(name)
        if v is None and optional:
            return
        if not isinstance(v, str) or v.strip().lower() not in LANGUAGES:
            problems.append(f"{name} {v!r} cannot be spoken (known: {', '.join(sorted(LANGUAGES))})")

    def agent() -> None:
        v = value.get("agent_id")
        if not isinstance(v, str) or len(v) > limits.max_agent_id_chars or not _AGENT_ID.fullmatch(v):
            problems.append(f"agent_id must match [A-Za-z0-9._-]{{1,{limits.max_agent_id_chars}}}")

    if "session_id" in value:
        ident("session_id")
    if message_type == "TextEvent":
        ident("turn_id")
        agent()
        non_negative("seq", 2**63 - 1)
        non_negative("produced_at_us", 2**63 - 1)
        ident("claim_id", optional=True)
        language(optional=True)
        label("voice")
        floor = value.get("floor")
        if floor is not None and floor not in FLOOR_POLICIES:
            problems.append(f"floor {floor!r} is not one of {', '.join(FLOOR_POLICIES)} (or null)")
        priority = value.get("priority")
        if isinstance(priority, int) and not -limits.max_priority <= priority <= limits.max_priority:
            problems.append(f"priority {priority} is outside -{limits.max_priority}..{limits.max_priority}")
    elif message_type == "ControlEvent":
        ident("turn_id", optional=True)
        ident("after_turn_id", optional=True)
        non_negative("issued_at_us", 2**63 - 1)
        label("reason")
        label("source")
        turn_ids = value.get("turn_ids") or ()
        if len(turn_ids) > limits.max_turn_ids:
            problems.append(f"turn_ids lists {len(turn_ids)} turns, at most {limits.max_turn_ids}")
        elif not all(is_valid_id(t, limits) for t in turn_ids):
            problems.append(f"each of turn_ids must be 1-{limits.max_id_chars} characters without control characters")
    elif message_type == "SynthesisRequest":
        ident("turn_id")
        agent()
        non_negative("sentence_seq", limits.max_seq)
        language()
        label("voice")
        speed = value.get("speed")
        if isinstance(speed, (int, float)) and not limits.min_speed <= speed <= limits.max_speed:
            problems.append(f"speed {speed} is outside {limits.min_speed}..{limits.max_speed}")
    elif message_type == "AudioChunk":
        ident("turn_id")
        non_negative("sentence_seq", limits.max_seq)
        non_negative("chunk_seq", limits.max_seq)
        rate = value.get("sample_rate")
        if isinstance(rate, int) and rate not in limits.sample_rates:
            problems.append(f"sample_rate {rate} is not one of {sorted(limits.sample_rates)}")
        audio = value.get("pcm")
        if isinstance(audio, (bytes, bytearray)):
            if len(audio) > limits.max_chunk_audio_bytes:
                problems.append(f"audio is {len(audio)} bytes, limit {limits.max_chunk_audio_bytes}")
            encoding = value.get("encoding", AudioEncoding.PCM16LE)
            if encoding == AudioEncoding.PCM16LE and len(audio) % 2:
                problems.append(f"{len(audio)} bytes of PCM16LE is not whole samples")
            elif encoding == AudioEncoding.OPUS:
                if isinstance(rate, int) and rate not in OPUS_SAMPLE_RATES:
                    problems.append(f"sample_rate {rate} is not an Opus rate {sorted(OPUS_SAMPLE_RATES)}")
                try:
                    split_opus_packets(audio)
                except MalformedOpusPayload as exc:
                    problems.append(str(exc))
        label("worker_id")
        label("end_reason")
        for word in value.get("words") or ():
            start, end, text = word.get("start"), word.get("end"), word.get("text")
            if isinstance(text, str) and len(text) > limits.max_label_chars:
                problems.append(f"word text is longer than {limits.max_label_chars} characters")
            if isinstance(start, int) and isinstance(end, int) and not 0 <= start <= end:
                problems.append(f"word {text!r} spans samples {start}..{end}: start must be 0 <= start <= end")
    elif message_type == "PlaybackReport":
        ident("turn_id")
        ident("client_id")
        seq = value.get("sentence_seq")
        if isinstance(seq, int) and not -1 <= seq <= limits.max_seq:
            problems.append(f"sentence_seq {seq} is outside -1..{limits.max_seq}")
        label("detail")
    elif message_type == "TurnHeard":
        ident("turn_id")
        non_negative("sentence_seq", limits.max_seq)
        non_negative("rendered_samples", limits.max_seq)
        label("client_id")
        if len(value.get("heard_text") or "") > limits.max_text_bytes:
            problems.append(f"heard_text is longer than {limits.max_text_bytes} characters")
    elif message_type == "FloorEvent":
        ident("turn_id")
        agent()
        non_negative("waited_us", 2**63 - 1)
        label("reason")
    return problems

