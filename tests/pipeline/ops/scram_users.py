"""Deleting and restoring a SCRAM user on a running cluster, as an operator would with
``kafka-configs --alter --delete-config SCRAM-SHA-512 --entity-type users``: Kafka's
AlterUserScramCredentials request (API key 51, version 0) sent through aiokafka's admin client.
The project fetches no Kafka command-line tools, and aiokafka's admin client has no such method."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import CompactArray, CompactBytes, CompactString, Int8, Int16, Int32, Schema, TaggedFields

SCRAM_SHA_512 = 2  # ScramMechanism.SCRAM_SHA_512
ITERATIONS = 4096  # the fewest the broker accepts


class AlterUserScramCredentialsResponse_v0(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(("throttle_time_ms", Int32),
                    ("results", CompactArray(("user", CompactString("utf-8")), ("error_code", Int16),
                                             ("error_message", CompactString("utf-8")), ("tags", TaggedFields))),
                    ("tags", TaggedFields))


class AlterUserScramCredentialsRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = AlterUserScramCredentialsResponse_v0
    SCHEMA = Schema(("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8),
                                               ("tags", TaggedFields))),
                    ("upsertions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8),
                                                ("iterations", Int32), ("salt", CompactBytes),
                                                ("salted_password", CompactBytes), ("tags", TaggedFields))),
                    ("tags", TaggedFields))


class AlterUserScramCredentialsRequest(Request[AlterUserScramCredentialsRequest_v0]):
    API_KEY = 51

    def __init__(self, deletions: list[tuple[Any, ...]], upsertions: list[tuple[Any, ...]]) -> None:
        self._deletions, self._upsertions = deletions, upsertions

    def build(self, request_struct_class: type[AlterUserScramCredentialsRequest_v0]) -> AlterUserScramCredentialsRequest_v0:
        return request_struct_class(self._deletions, self._upsertions, {})


RESOURCE_NOT_FOUND = 91  # deleting a user already deleted (by an attempt whose answer was lost)


async def _alter(admin: Any, request: AlterUserScramCredentialsRequest) -> None:
    """Send `request`; a connection the broker closed under it (its SASL session ended: the admin
    client does not re-authenticate either) is opened again and the request sent again."""
    from aiokafka.errors import KafkaConnectionError, NodeNotReadyError

    for attempt in range(5):
        try:
            response = await admin._send_request(request)
            break
        except (KafkaConnectionError, NodeNotReadyError):
            if attempt == 4:
                raise
            await asyncio.sleep(0.2)
    failed = [(user, code, message) for user, code, message, _tags in response.results
              if code and not (code == RESOURCE_NOT_FOUND and attempt)]
    assert not failed, f"AlterUserScramCredentials refused: {failed}"


async def delete_user(admin: Any, user: str) -> None:
    await _alter(admin, AlterUserScramCredentialsRequest([(user, SCRAM_SHA_512, {})], []))


async def set_password(admin: Any, user: str, password: str) -> None:
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, ITERATIONS)
    await _alter(admin, AlterUserScramCredentialsRequest([], [(user, SCRAM_SHA_512, ITERATIONS, salt, salted, {})]))
