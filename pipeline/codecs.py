"""The wire format of every voicebus message (Avro, in one of two framings), and the typed errors
of bad input.

A message on the bus is framed one of two ways (`Settings.wire_format` chooses what a writer
produces; a reader always accepts both, byte 0 tells them apart, so a topic can migrate from one
to the other without a stop):

* ``single-object`` (the default, no registry needed), as the Avro specification defines it:

      C3 01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little-endian) | Avro binary body

* ``confluent``, what Kafka Connect, ksqlDB, Flink and the Confluent clients read:

      00 | schema id in the registry (4 bytes, big-endian) | Avro binary body

  The schema ids come from a Confluent-compatible schema registry (`voicebus.registry`, given to
  the codec; `codec_for(settings)` builds it from ``VOICEBUS_REGISTRY_URL``). A writer registers
  the current ``.avsc`` of a topic's message type under the subject ``<topic>-value``
  (TopicNameStrategy) with compatibility BACKWARD the first time it writes to that topic (or
  when `register` is called at start); a reader resolves an id it has not seen through the
  registry once and caches it.

Either way any Avro implementation can read it. The codec knows every current schema in `schemas/` and
every older writer schema in `schemas/history/`; it decodes a record written with any of them by
fingerprint and resolves it to the current reader schema (schema evolution: additive changes with
defaults). Every message is also checked against the rules Avro cannot express
(`voicebus.schemas.contract`) on both sides: encoding refuses to produce it, decoding to hand it on.
Errors are typed (`CodecError` and subclasses) and carry a short machine reason that
the dead-letter headers use.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.schema import SchemaParseException, fingerprint, to_parsing_canonical_form

from voicebus import schemas
from voicebus.ratelimit import TokenBucket
from voicebus.schemas import contract
from voicebus.schemas.messages import Message

if TYPE_CHECKING:
    from voicebus.registry import SchemaRegistry
    from voicebus.settings import Settings

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER_LEN = 1 + 4

SINGLE_OBJECT = "single-object"
CONFLUENT = "confluent"
WIRE_FORMATS = (SINGLE_OBJECT, CONFLUENT)
_MAX_MISSING_IDS = 1024  # ids the registry said it does not know, remembered so bad records don't hammer it
LOOKUP_RATE_PER_S, LOOKUP_BURST = 20.0, 100  # registry lookups of ids this codec has not seen


class CodecError(ValueError):
    """A record could not be encoded or decoded. `reason` is a short stable code."""

    reason = "codec-error"


class MalformedRecord(CodecError):
    reason = "malformed"


class UnknownFingerprint(CodecError):
    reason = "unknown-fingerprint"


class UnknownSchemaId(CodecError):
    """A Confluent-framed record names a schema id the registry does not know (or no registry
    is configured to ask)."""

    reason = "unknown-schema-id"


class RegistryUnavailable(CodecError):
    """The schema registry could not be asked (down, refused, timed out): the record itself may
    be fine, so the dead letter says so and it can be replayed once the registry is back."""

    reason = "registry-unavailable"


class InvalidText(CodecError):
    reason = "invalid-utf8"


class OversizedText(CodecError):
    reason = "oversized-text"


class WrongMessageType(CodecError):
    reason = "wrong-type"


class InvalidMessage(CodecError):
    """Avro accepts the record but it breaks the contract (`voicebus.schemas.contract`): a negative
    sequence number, a language the pipeline cannot speak, an id too long, ... Its `reason` is
    ``contract-violation``, or the reason of the contract's `Violation` when every problem of the
    record has that one (``invalid-voice``: a voice that is not a voice spec)."""

    reason = "contract-violation"


def schema_fingerprint(schema: Mapping[str, Any]) -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of `schema`'s parsing canonical form, little-endian."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


@dataclass(frozen=True)
class _Known:
    name: str  # short record name, e.g. "TextEvent"
    parsed: Any  # fastavro-parsed writer schema
    current: bool


@dataclass(frozen=True)
class Decoded:
    """A decoded record: its message type, its fields (resolved to the current schema) and
    whether it was written with an older schema."""

    type: str
    value: dict
    fingerprint: bytes
    older_writer: bool
    schema_id: int | None = None  # the registry id of a Confluent-framed record; None: single-object


class Codec:
    """Encodes and decodes voicebus messages; share one per process.

    Its schemas are fixed once built; with a `registry` it also keeps the schema ids it
    registered or resolved (caches only grow, and are safe to share between tasks).
    """

    def __init__(
        self,
        current: Mapping[str, Mapping[str, Any]] | None = None,
        history: Iterable[Mapping[str, Any]] | None = None,
        max_text_bytes: int = contract.LIMITS.max_text_bytes,
        *,
        framing: str = SINGLE_OBJECT,
        registry: "SchemaRegistry | None" = None,
        lookup_limit: "TokenBucket | None" = None,
    ) -> None:
        if framing not in WIRE_FORMATS:
            raise ValueError(f"wire format {framing!r} is not one of {', '.join(WIRE_FORMATS)}")
        if framing == CONFLUENT and registry is None:
            raise ValueError("the confluent wire format needs a schema registry")
        current = dict(current) if current is not None else {n: schemas.load(n) for n in schemas.CURRENT}
        history = list(history) if history is not None else schemas.load_history()
        self._max_text_bytes = max_text_bytes
        self.framing = framing
        self.registry = registry
        self._raw: dict[str, Mapping[str, Any]] = {}
        self._readers: dict[str, Any] = {}
        self._writer_fp: dict[str, bytes] = {}
        self._by_fp: dict[bytes, _Known] = {}
        self._by_id: dict[int, _Known] = {}
        self._id_fp: dict[int, bytes] = {}
        self._topic_ids: dict[tuple[str, str], int] = {}
        self._missing_ids: set[int] = set()
        self._prefetch_errors: dict[int, CodecError] = {}  # a prefetch's failure, for the decode that follows
        # Lookups of ids not known here, each a registry request: a flood of records naming made-up
        # ids is refused past this rate instead of turning into a flood of requests.
        self._lookups = lookup_limit or TokenBucket(LOOKUP_RATE_PER_S, LOOKUP_BURST)
        for name, raw in current.items():
            parsed = parse_schema(dict(raw), named_schemas={})
            fp = schema_fingerprint(raw)
            self._raw[name] = raw
            self._readers[name] = parsed
            self._writer_fp[name] = fp
            self._by_fp[fp] = _Known(name, parsed, True)
        for raw in history:
            name = raw["name"].rsplit(".", 1)[-1]
            fp = schema_fingerprint(raw)
            if fp not in self._by_fp:
                self._by_fp[fp] = _Known(name, parse_schema(dict(raw), named_schemas={}), False)

    @property
    def types(self) -> list[str]:
        return sorted(self._readers)

    def fingerprint_of(self, message_type: str) -> bytes:
        return self._writer_fp[message_type]

    def register(self, topic: str, message_type: str) -> int:
        """Register the current schema of `message_type` for `topic` (subject ``<topic>-value``,
        compatibility BACKWARD) and return its id; cached, so only the first call per topic
        asks the registry. Call it at start (off the event loop) for the topics a process
        writes; `encode` calls it on a topic's first record otherwise."""
        from voicebus.registry import RegistryError, subject_for

        key = (topic, message_type)
        schema_id = self._topic_ids.get(key)
        if schema_id is not None:
            return schema_id
        if message_type not in self._readers:
            raise WrongMessageType(f"no schema for message type {message_type!r}")
        if self.registry is None:
            raise UnknownSchemaId(f"no schema registry configured to register {message_type} for {topic}")
        try:
            schema_id = self.registry.register(subject_for(topic), self._raw[message_type])
        except RegistryError as exc:
            raise RegistryUnavailable(f"registering {message_type} as {subject_for(topic)}: {exc}") from exc
        self._by_id.setdefault(schema_id, self._by_fp[self._writer_fp[message_type]])
        self._id_fp.setdefault(schema_id, self._writer_fp[message_type])
        self._topic_ids[key] = schema_id
        return schema_id

    def encode(self, message_type: str, value: "Message | Mapping[str, Any]", topic: str | None = None) -> bytes:
        """`value` (a typed `Message` or a record dict) encoded with the current schema of
        `message_type`, framed as this codec's wire format says. The Confluent framing needs the
        `topic` (its subject names the schema id); single-object encoding ignores it."""
        if isinstance(value, Message):
            value = value.to_record()
        try:
            schema = self._readers[message_type]
        except KeyError:
            raise WrongMessageType(f"no schema for message type {message_type!r}") from None
        buf = io.BytesIO()
        if self.framing == CONFLUENT:
            if topic is None:
                raise WrongMessageType(f"confluent framing needs the topic {message_type} is written to")
            buf.write(CONFLUENT_MAGIC)
            buf.write(struct.pack(">I", self.register(topic, message_type)))
        else:
            buf.write(MAGIC)
            buf.write(self._writer_fp[message_type])
        try:
            schemaless_writer(buf, schema, dict(value))
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise MalformedRecord(f"cannot encode {message_type}: {exc}") from exc
        self._check(message_type, value)
        return buf.getvalue()

    def decode(self, data: bytes, expect: str | None = None) -> Decoded:
        """Decode one record in either framing (byte 0 says which); `expect` names the type the
        caller wants. The value is resolved to the current schema of its type."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedRecord(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        schema_id: int | None = None
        if len(data) >= HEADER_LEN and data[:2] == MAGIC:
            header_len = HEADER_LEN
            fp = data[2:HEADER_LEN]
            known = self._by_fp.get(fp)
            if known is None:
                raise UnknownFingerprint(f"unknown writer schema fingerprint {fp.hex()}")
        elif (schema_id := _confluent_schema_id(data)) is not None:
            header_len = CONFLUENT_HEADER_LEN
            known = self._known_by_id(schema_id)
            fp = self._id_fp[schema_id]
        else:
            raise MalformedRecord(
                f"neither Avro single-object encoding nor Confluent framing: {len(data)} bytes, "
                f"starts {data[:4].hex() or 'empty'}"
            )
        if expect is not None and known.name != expect:
            raise WrongMessageType(f"expected {expect}, got {known.name}")
        body = io.BytesIO(data[header_len:])
        try:
            value = schemaless_reader(
                body, known.parsed, None if known.current else self._readers[known.name]
            )
        except UnicodeDecodeError as exc:
            raise InvalidText(f"{known.name}: a string field is not valid UTF-8 ({exc.reason})") from exc
        except (EOFError, ValueError, TypeError, IndexError, KeyError, OverflowError, StopIteration,
                SchemaResolutionError) as exc:
            raise MalformedRecord(f"{known.name}: body does not match its schema: {exc!r}") from exc
        if body.tell() != len(data) - header_len:
            raise MalformedRecord(
                f"{known.name}: {len(data) - header_len - body.tell()} trailing bytes after the record"
            )
        self._check(known.name, value)
        return Decoded(known.name, value, fp, not known.current, schema_id)

    def unresolved_schema_id(self, data: Any) -> int | None:
        """The schema id of a Confluent-framed record whose writer schema this codec would have to
        fetch from the registry (a network call) to decode it; None when decoding needs none."""
        if self.registry is None or not isinstance(data, (bytes, bytearray, memoryview)):
            return None
        schema_id = _confluent_schema_id(bytes(data))
        if schema_id is None or schema_id in self._by_id or schema_id in self._missing_ids \
                or schema_id in self._prefetch_errors:
            return None
        return schema_id

    def prefetch(self, schema_id: int) -> None:
        """Resolve `schema_id` now, so that decoding a record that names it makes no network call:
        for a stage on an event loop, run it in a thread (`voicebus.shell.RecordPolicy` does).
        A failure is kept and raised by the next `decode` of that id, without asking again."""
        try:
            self._known_by_id(schema_id)
        except CodecError as exc:
            if len(self._prefetch_errors) >= _MAX_MISSING_IDS:
                self._prefetch_errors.pop(next(iter(self._prefetch_errors)))
            self._prefetch_errors[schema_id] = exc

    def _known_by_id(self, schema_id: int) -> _Known:
        """The writer schema registered as `schema_id`: from the cache, else from the registry
        (once). A schema we already know by fingerprint is reused as is; another one must be a
        record of one of our message types, and is resolved to its current schema on read."""
        from voicebus.registry import RegistryError, SchemaNotFound

        known = self._by_id.get(schema_id)
        if known is not None:
            return known
        failed = self._prefetch_errors.pop(schema_id, None)
        if failed is not None:
            raise failed
        if self.registry is None:
            raise UnknownSchemaId(
                f"Confluent-framed record with schema id {schema_id}, and no schema registry configured "
                "(VOICEBUS_REGISTRY_URL)"
            )
        if schema_id in self._missing_ids:
            raise UnknownSchemaId(f"the schema registry has no schema id {schema_id}")
        if not self.registry.knows(schema_id) and not self._lookups.take():
            raise UnknownSchemaId(f"schema id {schema_id} not looked up: lookups of unknown schema ids are "
                                  f"limited to {self._lookups.rate_per_s:g} per second")
        try:
            text = self.registry.schema_by_id(schema_id)
        except SchemaNotFound as exc:
            if len(self._missing_ids) < _MAX_MISSING_IDS:
                self._missing_ids.add(schema_id)
            raise UnknownSchemaId(f"the schema registry has no schema id {schema_id}") from exc
        except RegistryError as exc:
            raise RegistryUnavailable(f"resolving schema id {schema_id}: {exc}") from exc
        try:
            raw = json.loads(text)
            fp = schema_fingerprint(raw)
            known = self._by_fp.get(fp)
            if known is None:
                name = raw["name"].rsplit(".", 1)[-1] if isinstance(raw, dict) and raw.get("type") == "record" else None
                if name not in self._readers:
                    raise WrongMessageType(f"schema id {schema_id} is {raw.get('name') if isinstance(raw, dict) else raw!r}, "
                                           f"not one of {', '.join(self.types)}")
                known = _Known(name, parse_schema(dict(raw), named_schemas={}), False)
        except (ValueError, KeyError, TypeError, SchemaParseException) as exc:
            if isinstance(exc, CodecError):
                raise
            raise UnknownSchemaId(f"schema id {schema_id} is not an Avro schema we can read: {exc}") from exc
        self._by_id[schema_id] = known
        self._id_fp[schema_id] = fp
        return known

    def _check(self, message_type: str, value: Mapping[str, Any]) -> None:
        problems = contract.violations(message_type, value)
        if problems:
            error = InvalidMessage(f"{message_type}: " + "; ".join(problems))
            # a record whose only kind of problem has a reason of its own (a voice that is no
            # spec: invalid-voice) is dead-lettered with it; any other is a contract-violation
            reasons = {getattr(p, "reason", InvalidMessage.reason) for p in problems}
            if len(reasons) == 1:
                error.reason = reasons.pop()
            raise error
        text = value.get("text")
        if isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) > self._max_text_bytes:
            raise OversizedText(
                f"text field is {len(text.encode('utf-8', 'surrogatepass'))} bytes, limit {self._max_text_bytes}"
            )


def _confluent_schema_id(data: bytes) -> int | None:
    """The schema id of a Confluent-framed record (magic byte 0, a big-endian u32), else None."""
    if len(data) >= CONFLUENT_HEADER_LEN and data[:1] == CONFLUENT_MAGIC:
        return struct.unpack(">I", data[1:CONFLUENT_HEADER_LEN])[0]
    return None


def codec_for(settings: "Settings") -> Codec:
    """The codec a stage uses: the wire format and registry its settings name. A registry is
    attached whenever ``VOICEBUS_REGISTRY_URL`` is set (so a single-object writer still reads
    Confluent-framed records); the confluent format requires one. Nothing here touches the
    network."""
    from voicebus.registry import SchemaRegistry
    from voicebus.settings import SettingsError

    if settings.wire_format not in WIRE_FORMATS:
        raise SettingsError(f"VOICEBUS_WIRE_FORMAT={settings.wire_format!r}: one of {', '.join(WIRE_FORMATS)}")
    if settings.wire_format == CONFLUENT and not settings.registry_url:
        raise SettingsError("VOICEBUS_WIRE_FORMAT=confluent needs VOICEBUS_REGISTRY_URL (a Confluent-compatible "
                            "schema registry, e.g. the one `voicebus registry start` prints)")
    try:
        registry = SchemaRegistry(settings.registry_url, settings.registry_timeout_s, settings.registry_username,
                                  settings.registry_password, settings.registry_ssl_cafile) if settings.registry_url else None
    except ValueError as exc:
        raise SettingsError(f"VOICEBUS_REGISTRY_URL: {exc}") from None
    return Codec(max_text_bytes=settings.max_text_bytes, framing=settings.wire_format, registry=registry)


def deadletter_headers(error: CodecError | Exception, source_topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    """Kafka headers that say why a record went to the dead-letter topic."""
    reason = getattr(error, "reason", "unhandled")
    return [
        ("voicebus.error.reason", reason.encode()),
        ("voicebus.error.type", type(error).__name__.encode()),
        ("voicebus.error.message", str(error).encode("utf-8", "replace")[:1000]),
        ("voicebus.source.topic", source_topic.encode()),
        ("voicebus.source.partition", str(partition).encode()),
        ("voicebus.source.offset", str(offset).encode()),
    ]
