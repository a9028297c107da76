"""Who may reach an edge: loopback names, and the ``Origin`` and ``Host`` policies of its doors.

Pure functions of the request's headers and the settings, shared by the WebSocket player path
(`voicebus.players.edge`) and the other doors (`voicebus.players.openai_speech`,
`voicebus.players.telephony`), so each door admits exactly what the others do.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pydantic import SecretStr

from voicebus.settings import DEFAULT_EDGE_SECRET, reveal


def is_loopback_host(host: str) -> bool:
    """Whether a listen address or host name only reaches this machine (``localhost``, 127.0.0.0/8,
    ``::1``). Empty, ``0.0.0.0``, ``::`` and other names are not."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host: str | None, allowed: str) -> bool:
    """The Origin policy of ``/ws`` (pure): no Origin header (not a browser) passes; the edge's own
    origin (Origin's host:port equals the request's Host) passes; ``*`` in `allowed` passes all;
    otherwise an origin must be listed in `allowed` (comma-separated), or, when `allowed` is empty,
    be a loopback origin (``http://localhost:3000``)."""
    if origin is None:
        return True
    wanted = {o.strip().rstrip("/").lower() for o in allowed.split(",") if o.strip()}
    origin = origin.strip().rstrip("/").lower()
    if "*" in wanted or origin in wanted:
        return True
    try:
        parts = urlsplit(origin)
        netloc, hostname = parts.netloc, parts.hostname or ""
    except ValueError:
        return False
    if host and netloc and netloc == host.lower():
        return True
    return not wanted and parts.scheme in ("http", "https") and is_loopback_host(hostname)


def host_allowed(host: str | None, secret: str | SecretStr) -> bool:
    """With the public default secret (a loopback-only edge) the request's ``Host`` must be a
    loopback name too (``localhost``, ``127.0.0.1``, ``[::1]``), which shuts out DNS rebinding;
    with a real secret any Host passes (a proxy may forward a public name)."""
    if reveal(secret) != DEFAULT_EDGE_SECRET:
        return True
    try:
        hostname = urlsplit(f"//{host or ''}").hostname or ""
    except ValueError:
        return False
    return is_loopback_host(hostname)
