"""Avro single-object encoding of every voicebus message, and the typed errors of bad input.

A message on the bus is, as the Avro specification defines single-object encoding:

    C3 01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little-endian) | Avro binary body

so any Avro implementation can read it. The codec knows every current schema in `schemas/` and
every older writer schema in `schemas/history/`; it decodes a record written with any of them by
fingerprint and resolves it to the current reader schema (schema evolution: additive changes with
defaults). Every message is also checked against the rules Avro cannot express
(`schemas.contract`) on both sides: encoding refuses to produce it, decoding to hand it on.
Errors are typed (`CodecError` and subclasses) and carry a short machine reason that
the dead-letter headers use.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

import schemas
from schemas import contract

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8


class CodecError(ValueError):
    """A record could not be encoded or decoded. `reason` is a short stable code."""

    reason = "codec-error"


class MalformedRecord(CodecError):
    reason = "malformed"


class UnknownFingerprint(CodecError):
    reason = "unknown-fingerprint"


class InvalidText(CodecError):
    reason = "invalid-utf8"


class OversizedText(CodecError):
    reason = "oversized-text"


class WrongMessageType(CodecError):
    reason = "wrong-type"


class InvalidMessage(CodecError):
    """Avro accepts the record but it breaks the contract (`schemas.contract`): a negative
    sequence number, a language the pipeline cannot speak, an id too long, ..."""

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


class Codec:
    """Encodes and decodes voicebus messages. Immutable once built; share one per process."""

    def __init__(
        self,
        current: Mapping[str, Mapping[str, Any]] | None = None,
        history: Iterable[Mapping[str, Any]] | None = None,
        max_text_bytes: int = contract.LIMITS.max_text_bytes,
    ) -> None:
        current = dict(current) if current is not None else {n: schemas.load(n) for n in schemas.CURRENT}
        history = list(history) if history is not None else schemas.load_history()
        self._max_text_bytes = max_text_bytes
        self._readers: dict[str, Any] = {}
        self._writer_fp: dict[str, bytes] = {}
        self._by_fp: dict[bytes, _Known] = {}
        for name, raw in current.items():
            parsed = parse_schema(dict(raw), named_schemas={})
            fp = schema_fingerprint(raw)
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

    def encode(self, message_type: str, value: Mapping[str, Any]) -> bytes:
        """Single-object encoding of `value` with the current schema of `message_type`."""
        try:
            schema = self._readers[message_type]
        except KeyError:
            raise WrongMessageType(f"no schema for message type {message_type!r}") from None
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(self._writer_fp[message_type])
        try:
            schemaless_writer(buf, schema, dict(value))
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise MalformedRecord(f"cannot encode {message_type}: {exc}") from exc
        self._check(message_type, value)
        return buf.getvalue()

    def decode(self, data: bytes, expect: str | None = None) -> Decoded:
        """Decode one single-object-encoded record; `expect` names the type the caller wants."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedRecord(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise MalformedRecord(
                f"not Avro single-object encoding: {len(data)} bytes, starts {data[:4].hex() or 'empty'}"
            )
        fp = data[2:HEADER_LEN]
        known = self._by_fp.get(fp)
        if known is None:
            raise UnknownFingerprint(f"unknown writer schema fingerprint {fp.hex()}")
        if expect is not None and known.name != expect:
            raise WrongMessageType(f"expected {expect}, got {known.name}")
        body = io.BytesIO(data[HEADER_LEN:])
        try:
            value = schemaless_reader(
                body, known.parsed, None if known.current else self._readers[known.name]
            )
        except UnicodeDecodeError as exc:
            raise InvalidText(f"{known.name}: a string field is not valid UTF-8 ({exc.reason})") from exc
        except (EOFError, ValueError, TypeError, IndexError, KeyError, OverflowError, StopIteration) as exc:
            raise MalformedRecord(f"{known.name}: body does not match its schema: {exc!r}") from exc
        if body.tell() != len(data) - HEADER_LEN:
            raise MalformedRecord(
                f"{known.name}: {len(data) - HEADER_LEN - body.tell()} trailing bytes after the record"
            )
        self._check(known.name, value)
        return Decoded(known.name, value, fp, not known.current)

    def _check(self, message_type: str, value: Mapping[str, Any]) -> None:
        problems = contract.violations(message_type, value)
        if problems:
            raise InvalidMessage(f"{message_type}: " + "; ".join(problems))
        text = value.get("text")
        if isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) > self._max_text_bytes:
            raise OversizedText(
                f"text field is {len(text.encode('utf-8', 'surrogatepass'))} bytes, limit {self._max_text_bytes}"
            )


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
