"""Signed session tokens: who may listen to which session, until when.

A token is ``<payload>.<signature>``, both base64url without padding; the payload is compact JSON
``{"s": session_id, "exp": epoch_seconds}`` and the signature is HMAC-SHA256 of the payload bytes
with the edge secret (`Settings.edge_secret`). An empty secret is refused (`MissingSecret`): it
would make every token forgeable. Pure: the clock is a parameter.

The player page gets its token in the URL *fragment* (`player_url`: ``/#session=S&token=T``):
browsers never send a fragment to a server, so the token stays out of access logs, proxies and
``Referer`` headers; the page reads it from ``location.hash`` and sends it in the WebSocket hello.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time

from pydantic import SecretStr

from voicebus.settings import reveal


class MissingSecret(ValueError):
    """The edge secret is empty: no token may be minted or checked with it."""


class TokenError(ValueError):
    """A token was rejected; `reason` is a short stable code sent to the client."""

    reason = "invalid-token"


class MalformedToken(TokenError):
    reason = "malformed-token"


class BadSignature(TokenError):
    reason = "bad-signature"


class ExpiredToken(TokenError):
    reason = "expired-token"


class WrongSession(TokenError):
    reason = "wrong-session"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: str | SecretStr, payload: bytes) -> bytes:
    secret = reveal(secret)
    if not secret:
        raise MissingSecret("the edge secret (VOICEBUS_EDGE_SECRET) is empty: tokens cannot be minted or checked")
    return hmac.new(secret.encode("utf-8"), payload, hashlib.sha256).digest()


def issue_token(secret: str | SecretStr, session_id: str, ttl_s: int, now_s: float | None = None) -> str:
    """A token that lets its holder listen to `session_id` for `ttl_s` seconds."""
    now_s = time.time() if now_s is None else now_s
    payload = json.dumps({"s": session_id, "exp": int(now_s + ttl_s)}, separators=(",", ":")).encode("utf-8")
    return f"{_b64(payload)}.{_b64(_sign(secret, payload))}"


def verify_token(secret: str | SecretStr, token: str, session_id: str, now_s: float | None = None) -> None:
    """Raise a `TokenError` unless `token` is signed with `secret`, unexpired and for `session_id`
    (`MissingSecret` for an empty `secret`, before looking at the token)."""
    now_s = time.time() if now_s is None else now_s
    if not secret:
        raise MissingSecret("the edge secret (VOICEBUS_EDGE_SECRET) is empty: tokens cannot be checked")
    if not isinstance(token, str) or token.count(".") != 1:
        raise MalformedToken("a token is <payload>.<signature>")
    payload_text, signature_text = token.split(".")
    try:
        payload, signature = _unb64(payload_text), _unb64(signature_text)
    except (binascii.Error, ValueError):
        raise MalformedToken("token parts are not base64url") from None
    # Check the signature before looking inside: an unsigned payload is never parsed.
    if not hmac.compare_digest(signature, _sign(secret, payload)):
        raise BadSignature("token signature does not match")
    try:
        claims = json.loads(payload)
        token_session, expires = claims["s"], claims["exp"]
    except (ValueError, KeyError, TypeError):
        raise MalformedToken("token payload is not {s, exp}") from None
    if not isinstance(expires, int) or now_s >= expires:
        raise ExpiredToken("token expired")
    if token_session != session_id:
        raise WrongSession("token is for another session")


def player_url(edge_url: str, session_id: str, token: str) -> str:
    """The web player's URL for `session_id`: session and token in the fragment (never sent to a server)."""
    from urllib.parse import urlencode

    return f"{edge_url.rstrip('/')}/#{urlencode({'session': session_id, 'token': token})}"
