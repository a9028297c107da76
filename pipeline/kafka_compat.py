"""The one place voicebus touches aiokafka below its public API, and the check that what it
touches exists in the installed aiokafka (pinned ``aiokafka>=0.14,<0.15`` in pyproject.toml).

* `open_connection`: one connection to one broker with the bus's security (``aiokafka.conn.
  create_conn``), to say *why* a client could not bootstrap: aiokafka's bootstrap error names
  only the hosts, while the connection's own error says "invalid credentials with SASL
  mechanism SCRAM-SHA-512" or the TLS failure.
* `watch_connections`: every connection an aiokafka client opens (``aiokafka.client.create_conn``,
  the name its client calls) reports to an observer whether the broker accepted its SASL
  credentials: aiokafka retries a refused reconnection forever and tells its caller nothing
  (`voicebus.credentials`).
* `stop_fetches_quietly`: ``Fetcher.close`` (what ``AIOKafkaConsumer.stop`` awaits) cancels the
  fetches still pending and awaits each without catching its cancellation, so a consumer stopped
  while a fetch waits out its retry backoff (a broker away, or refusing this user) raises
  ``CancelledError`` out of ``stop()`` and never closes its client (aio-libs/aiokafka#983 names
  those lines). The patched close ends the remaining fetches and lets ``stop()`` finish; a stop
  that is itself being cancelled still raises.
* `create_acls`: Kafka's CreateAcls request (aiokafka's protocol class, one ACL per request)
  sent through the admin client's ``_send_request``: aiokafka's admin client has no ACL method.

`check_aiokafka_internals` raises `AiokafkaInternalsChanged` naming what is missing; stages call
it through `voicebus.bus.diagnose_connection` before relying on it, and a test runs it.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable


class AiokafkaInternalsChanged(RuntimeError):
    """The installed aiokafka lacks an internal voicebus relies on (a version outside the pin)."""


CREATE_CONN_PARAMETERS = ("security_protocol", "ssl_context", "sasl_mechanism", "sasl_plain_username",
                          "sasl_plain_password", "request_timeout_ms")


def check_aiokafka_internals() -> None:
    import aiokafka
    import aiokafka.conn
    import aiokafka.protocol.admin
    from aiokafka.admin import AIOKafkaAdminClient

    for owner, name in ((aiokafka.protocol.admin, "CreateAclsRequest"), (AIOKafkaAdminClient, "_send_request")):
        if not hasattr(owner, name):
            raise AiokafkaInternalsChanged(f"aiokafka {aiokafka.__version__} has no {owner.__name__}.{name}")

    import aiokafka.client

    create_conn = getattr(aiokafka.conn, "create_conn", None)
    if create_conn is None or not hasattr(aiokafka.client, "create_conn"):
        raise AiokafkaInternalsChanged(f"aiokafka {aiokafka.__version__} has no aiokafka.conn.create_conn "
                                       "or its client no longer calls it by that name")
    from aiokafka.consumer.fetcher import Fetcher

    if not callable(getattr(Fetcher, "close", None)) or "_pending_tasks" not in inspect.getsource(Fetcher.close):
        raise AiokafkaInternalsChanged(f"aiokafka {aiokafka.__version__}: Fetcher.close no longer awaits _pending_tasks")
    missing = [p for p in CREATE_CONN_PARAMETERS if p not in inspect.signature(create_conn).parameters]
    if missing:
        raise AiokafkaInternalsChanged(f"aiokafka {aiokafka.__version__}: create_conn lacks {', '.join(missing)}")


async def open_connection(options: dict[str, Any], host: str, port: int, timeout_s: float) -> Any:
    """A connection to `host`:`port` with a client's `options` (`voicebus.bus.client_options`:
    its security protocol, TLS context and SASL credentials); the caller closes it."""
    from aiokafka.conn import create_conn

    check_aiokafka_internals()
    keys = ("security_protocol", "ssl_context", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")
    return await create_conn(host, port, request_timeout_ms=int(timeout_s * 1000),
                             **{k: options[k] for k in keys if k in options})


def watch_connections(observer: Callable[[str | None, str, BaseException | None, float], None],
                      clock: Callable[[], float] = time.monotonic) -> None:
    """From now on, every connection an aiokafka client of this process opens calls
    ``observer(sasl user, "host:port", refusal, began)``: the `SaslAuthenticationFailed` that
    refused it, or None once it is open, and when (`clock`) the attempt began. Other failures (a
    broker down, TLS) are not the credentials' and are not reported. Installed once per process;
    later calls change nothing."""
    import aiokafka.client
    from aiokafka.errors import SaslAuthenticationFailed

    original = aiokafka.client.create_conn
    if getattr(original, "_voicebus_watched", False):
        return
    check_aiokafka_internals()

    async def create_conn(host: str, port: int, **kwargs: Any) -> Any:
        user, where, began = kwargs.get("sasl_plain_username"), f"{host}:{port}", clock()
        try:
            connection = await original(host, port, **kwargs)
        except SaslAuthenticationFailed as exc:
            observer(user, where, exc, began)
            raise
        if kwargs.get("security_protocol", "PLAINTEXT").startswith("SASL_"):
            observer(user, where, None, began)
        return connection

    create_conn._voicebus_watched = True  # type: ignore[attr-defined]
    aiokafka.client.create_conn = create_conn


def stop_fetches_quietly() -> None:
    """Patch aiokafka's ``Fetcher.close`` once per process (see the module's docstring)."""
    import asyncio

    from aiokafka.consumer.fetcher import Fetcher

    original = Fetcher.close
    if getattr(original, "_voicebus_patched", False):
        return
    check_aiokafka_internals()

    async def close(self: Any) -> None:
        try:
            await original(self)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if cancelling is not None and cancelling():
                raise  # the stop itself is being cancelled
            # a pending fetch re-raised its own cancellation: end the ones the loop did not reach
            pending = [t for t in self._pending_tasks if not t.done()]
            for fetch in pending:
                fetch.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    close._voicebus_patched = True  # type: ignore[attr-defined]
    Fetcher.close = close


async def create_acls(admin: Any, creations: list[tuple[int, str, int, str, str, int, int]]) -> list[tuple[int, str | None]]:
    """Send CreateAcls (resource type, resource name, pattern type, principal, host, operation,
    permission per creation) to the cluster; each creation's (error code, message)."""
    from aiokafka.protocol.admin import CreateAclsRequest

    check_aiokafka_internals()
    results = []
    for creation in creations:
        response = await admin._send_request(CreateAclsRequest(*creation))
        results += [(code, message) for code, message in response.creation_responses]
    return results
