"""A client of a Confluent-compatible schema registry, for the codec's Confluent framing.

This module owns the HTTP conversation with the registry and nothing else: registering a schema
under a subject (and setting that subject's compatibility rule), and fetching a schema by its
id. It speaks the Confluent Schema Registry REST API, which Apicurio Registry serves under
``/apis/ccompat/v7`` (`voicebus registry start` runs one) and Confluent's own registry serves at
its root. `Codec` takes one of these as an argument (`voicebus.codecs.codec_for` builds it from
`Settings.registry_url`); nothing here runs at import, and a codec without a registry never
touches the network.

Calls are synchronous (the standard library's urllib) because the codec is: a schema id is
fetched once per process and then cached, so a consumer pays one registry round trip per
writer schema it meets, not per record. Stages never make them on their event loop: they
register their writer schemas at start, and `voicebus.shell.RecordPolicy` resolves an unknown
schema id in a thread (`Codec.prefetch`) before it decodes the record.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping

from pydantic import SecretStr

from voicebus.settings import reveal

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
COMPATIBILITY = "BACKWARD"
"""The rule voicebus follows (docs/kafka.md): a new schema only adds fields with defaults, so a
reader with the new schema reads every record written with the previous one."""


def subject_for(topic: str) -> str:
    """TopicNameStrategy, the Confluent clients' default: the value schema of `topic` is
    registered under ``<topic>-value``."""
    return f"{topic}-value"


class RegistryError(RuntimeError):
    """The registry refused a request or could not be reached. `status` is the HTTP status
    (None when no answer came), `error_code` the registry's own code (e.g. 40403, 409)."""

    def __init__(self, message: str, status: int | None = None, error_code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code


class SchemaNotFound(RegistryError):
    """The registry answered that no schema has this id (Confluent error 40403)."""


class IncompatibleSchema(RegistryError):
    """The registry refused a new version: it breaks the subject's compatibility rule (409)."""


class SchemaRegistry:
    """A Confluent-compatible registry at `url` (e.g. ``http://127.0.0.1:8081/apis/ccompat/v7``).

    Thread-safe; schemas fetched by id are cached for the life of the object (an id's schema
    never changes in a registry).
    """

    def __init__(self, url: str, timeout_s: float = 5.0, username: str = "", password: "str | SecretStr" = "",
                 cafile: "str | Path | None" = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"schema registry url {_without_userinfo(url)!r} is not http(s)://...")
        if parts.username is not None:  # user:password@ in the URL: used, then never shown again
            username = username or urllib.parse.unquote(parts.username)
            password = reveal(password) or urllib.parse.unquote(parts.password or "")
        self.url = _without_userinfo(url).rstrip("/")
        self.timeout_s = timeout_s
        secret = reveal(password)
        self._authorization = ("Basic " + base64.b64encode(f"{username}:{secret}".encode()).decode()
                               if username else None)
        self._ssl = ssl.create_default_context(cafile=str(cafile)) if cafile else None
        self._by_id: dict[int, str] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SchemaRegistry({self.url!r})"

    # --- the API calls the codec needs -----------------------------------------------------------

    def register(self, subject: str, schema: Mapping[str, Any] | str, compatibility: str | None = COMPATIBILITY) -> int:
        """Register `schema` (Avro) under `subject` and return its id; registering the same
        schema again returns the same id. When `compatibility` is given, the subject's rule is
        set to it first, so the registry refuses a later incompatible version
        (`IncompatibleSchema`)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        quoted = urllib.parse.quote(subject, safe="")
        if compatibility:
            self._request("PUT", f"/config/{quoted}", {"compatibility": compatibility})
        answer = self._request("POST", f"/subjects/{quoted}/versions", {"schema": text, "schemaType": "AVRO"})
        schema_id = int(answer["id"])
        with self._lock:
            self._by_id[schema_id] = text
        return schema_id

    def knows(self, schema_id: int) -> bool:
        """The schema of `schema_id` is cached here (no request needed)."""
        with self._lock:
            return schema_id in self._by_id

    def schema_by_id(self, schema_id: int) -> str:
        """The schema text registered with `schema_id` (cached); `SchemaNotFound` if none."""
        with self._lock:
            cached = self._by_id.get(schema_id)
        if cached is not None:
            return cached
        answer = self._request("GET", f"/schemas/ids/{int(schema_id)}")
        schema_type = answer.get("schemaType", "AVRO")
        if schema_type != "AVRO":
            raise RegistryError(f"schema {schema_id} is {schema_type}, not AVRO")
        text = answer["schema"]
        with self._lock:
            self._by_id[schema_id] = text
        return text

    def compatibility(self, subject: str) -> str | None:
        """The subject's compatibility rule, or None when the subject has none of its own."""
        try:
            answer = self._request("GET", f"/config/{urllib.parse.quote(subject, safe='')}")
        except SchemaNotFound:
            return None
        except RegistryError as exc:
            if exc.status == 404:
                return None
            raise
        return answer.get("compatibilityLevel") or answer.get("compatibility")

    def subjects(self) -> list[str]:
        return list(self._request("GET", "/subjects"))

    # --- HTTP ------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": CONTENT_TYPE + ", application/json", **({"Content-Type": CONTENT_TYPE} if data else {})}
        if self._authorization:
            headers["Authorization"] = self._authorization
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._ssl) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            raise _error_from(method, path, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RegistryError(f"schema registry at {self.url} unreachable ({method} {path}): {reason}") from exc
        try:
            return json.loads(payload) if payload else {}
        except ValueError as exc:
            raise RegistryError(f"{method} {path}: the registry answered something not JSON: {payload[:200]!r}") from exc


def _without_userinfo(url: str) -> str:
    """`url` without ``user:password@``: what error messages and ``repr`` may show."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _error_from(method: str, path: str, exc: urllib.error.HTTPError) -> RegistryError:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        body = {}
    code = body.get("error_code") if isinstance(body, dict) else None
    message = f"{method} {path}: HTTP {exc.code}: {(body.get('message') if isinstance(body, dict) else None) or exc.reason}"
    if code == 40403 or (exc.code == 404 and "/schemas/ids/" in path):
        return SchemaNotFound(message, exc.code, code)
    if exc.code == 409:
        return IncompatibleSchema(message, exc.code, code)
    return RegistryError(message, exc.code, code)
