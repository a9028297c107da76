"""Sharded edges: which edge owns which session, and how a player finds the one that does.

The mechanism is the gate's (docs/gate.md, "Co-partitioning by number"): the control and audio
topics have the same partition count and every record is keyed by session id, so a session is on
the same partition number p in both. Edges form one consumer group (`Settings.edge_group_id`)
subscribed to the **control topic**; owning control partition p means owning every session on p,
and the edge then reads partition p of the audio topic with a group-less consumer (`assign`), as
the gate reads its text topics. The group consumer itself only holds the membership: its
partitions are paused, because every edge follows every control partition anyway
(`voicebus.shell.ControlFollower`: control is a few events per turn, and a session that moves to
an edge finds its cancels there already).

Players are sent to the owner through the **edge directory** (`Settings.edges_topic`): after
each rebalance an edge writes ``{edge_id, url, partitions}`` under its id (a tombstone when it
stops; keyed ``<group>/<edge id>``), always to partition 0, so the order of claims is the log's order. Every edge follows the
directory from its beginning; the owner of p is the edge of the **latest** record claiming p
(`EdgeDirectory`, pure). A dead edge's claim stands until its partitions' new owner writes its
own, one session timeout later.

The directory is **authenticated**: whoever may write the edges topic could otherwise name any
URL, and players would take their session token there. Each record (a tombstone too) carries an
HMAC-SHA256 of its key and value in the header ``voicebus.edge.sig``, keyed by the edge secret the
edges of a deployment already share (it signs the players' tokens). A record without a valid
signature is refused (`ForgedDirectoryRecord`), unless its URL's origin is one the operator
allowed (``VOICEBUS_EDGE_REDIRECT_ORIGINS``: edges that cannot share the secret).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

from pydantic import SecretStr

from voicebus.settings import Settings, reveal

SIGNATURE_HEADER = "voicebus.edge.sig"
_DOMAIN = b"voicebus edge directory v1"  # the edge secret signs tokens too: a key of its own here

DIRECTORY_PARTITION = 0  # every directory record goes here: one log, one order


def new_edge_id(settings: Settings) -> str:
    return settings.edge_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def public_url(settings: Settings) -> str:
    """Where players reach this edge's ``/ws`` (an absolute ws(s) URL or a path)."""
    return settings.edge_public_url or f"ws://{settings.edge_host}:{settings.edge_port}/ws"


@dataclass(frozen=True)
class Claim:
    """One edge's directory record: the partitions it owned as of the record at `offset`."""

    edge_id: str
    url: str
    partitions: frozenset[int]
    offset: int


class DirectoryRecordError(ValueError):
    """A directory record that is not ``{"edge_id", "url", "partitions": [int]}``."""

    reason = "bad-directory-record"


class ForgedDirectoryRecord(DirectoryRecordError):
    """A directory record without a valid signature (and not of an allowed origin)."""

    reason = "forged-directory-record"


def directory_signature(secret: str | SecretStr, key: bytes, value: bytes | None) -> bytes:
    """The signature of one directory record (a tombstone: `value` None)."""
    signing_key = hmac.new(reveal(secret).encode("utf-8"), _DOMAIN, hashlib.sha256).digest()
    body = len(key).to_bytes(4, "big") + key + (b"\x00" if value is None else b"\x01" + value)
    return hmac.new(signing_key, body, hashlib.sha256).hexdigest().encode("ascii")


def directory_headers(secret: str | SecretStr, key: bytes, value: bytes | None) -> list[tuple[str, bytes]]:
    return [(SIGNATURE_HEADER, directory_signature(secret, key, value))]


def redirect_origins(settings: Settings) -> list[str]:
    """``VOICEBUS_EDGE_REDIRECT_ORIGINS`` as a list."""
    return [o.strip() for o in settings.edge_redirect_origins.split(",") if o.strip()]


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of an absolute URL (ws/wss as http/https); "" for a path."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return ""
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{scheme}://{parts.netloc.lower()}"


def directory_record(group: str, edge_id: str, url: str, partitions: set[int] | frozenset[int]) -> tuple[bytes, bytes]:
    """The directory record of one edge of `group`: (key, value). The key is ``<group>/<edge_id>``,
    so edges of other groups (another audio topic, e.g. the demo's second lane) can share the topic."""
    value = {"edge_id": edge_id, "url": url, "partitions": sorted(partitions)}
    return directory_key(group, edge_id), json.dumps(value, separators=(",", ":")).encode("utf-8")


def directory_key(group: str, edge_id: str) -> bytes:
    return f"{group}/{edge_id}".encode("utf-8")


class EdgeDirectory:
    """The edges of one group and the partitions they own, from the directory records in log order (pure)."""

    def __init__(self, group: str, secret: str | SecretStr | None = None,
                 allowed_origins: Iterable[str] = ()) -> None:
        self.prefix = f"{group}/"
        self.claims: dict[str, Claim] = {}
        # None: records are not checked (a directory read by a tool, or tests of the ownership rule)
        self.secret = secret
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins if o)

    def apply(self, key: bytes | None, value: bytes | None, offset: int,
              headers: Iterable[tuple[str, bytes]] = ()) -> None:
        """One directory record; a tombstone (None) removes its edge; another group's is ignored.
        Raises `DirectoryRecordError` (`ForgedDirectoryRecord` for a bad or missing signature)."""
        if key is None:
            raise DirectoryRecordError("a directory record without a key")
        name = key.decode("utf-8", "replace")
        if not name.startswith(self.prefix):
            return
        edge_id = name[len(self.prefix):]
        signed = self._signed(key, value, headers)
        if value is None:
            if not signed:
                raise ForgedDirectoryRecord(f"an unsigned tombstone for edge {edge_id!r}")
            self.claims.pop(edge_id, None)
            return
        try:
            body = json.loads(value)
            url, partitions = body["url"], frozenset(int(p) for p in body["partitions"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DirectoryRecordError(f"directory record of {edge_id!r}: {exc!r}") from None
        if not isinstance(url, str) or not url:
            raise DirectoryRecordError(f"directory record of {edge_id!r} has no url")
        if not signed and origin_of(url) not in self.allowed_origins:
            raise ForgedDirectoryRecord(f"directory record of {edge_id!r} naming {url!r} is not signed with the "
                                        f"edges' secret and its origin is not allowed")
        self.claims[edge_id] = Claim(edge_id, url, partitions, offset)

    def _signed(self, key: bytes, value: bytes | None, headers: Iterable[tuple[str, bytes]]) -> bool:
        if self.secret is None:
            return True
        expected = directory_signature(self.secret, key, value)
        return any(k == SIGNATURE_HEADER and hmac.compare_digest(v or b"", expected) for k, v in headers)

    def owner(self, partition: int) -> Claim | None:
        """The edge of the latest record that claims `partition`, or None."""
        best: Claim | None = None
        for claim in self.claims.values():
            if partition in claim.partitions and (best is None or claim.offset > best.offset):
                best = claim
        return best

    def urls(self) -> list[str]:
        """The public URL of every edge that owns a partition now (the latest claim of it), the
        latest record first. An edge killed without its tombstone drops out once its partitions
        are claimed by others; its record stays (one per edge id: give each deployment slot a
        stable ``VOICEBUS_EDGE_ID`` so a restart overwrites it)."""
        owners = {claim.edge_id for p in {p for c in self.claims.values() for p in c.partitions}
                  if (claim := self.owner(p)) is not None}
        return [c.url for c in sorted(self.claims.values(), key=lambda c: -c.offset) if c.edge_id in owners]
