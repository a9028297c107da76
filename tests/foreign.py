"""Bytes as a producer that does not use voicebus's codec would write them: valid Avro single-object
encoding of any value the schema accepts, without the contract's checks (`voicebus.schemas.contract`).
Tests use it to put on the bus what our own producers refuse to write."""

from __future__ import annotations

import io
from typing import Any, Mapping

from fastavro import parse_schema, schemaless_writer

from voicebus import schemas
from voicebus.codecs import MAGIC, schema_fingerprint


def foreign_encode(message_type: str, value: Mapping[str, Any]) -> bytes:
    raw = schemas.load(message_type)
    buf = io.BytesIO()
    buf.write(MAGIC + schema_fingerprint(raw))
    schemaless_writer(buf, parse_schema(raw), dict(value))
    return buf.getvalue()
