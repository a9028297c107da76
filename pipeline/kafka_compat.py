"""The one place voicebus touches aiokafka below its public API, and the check that what it
touches exists in the installed aiokafka (pinned ``aiokafka>=0.14,<0.15`` in pyproject.toml).

* `open_connection`: one connection to one broker with the bus's security (``aiokafka.conn.
  create_conn``), to say *why* a client could not bootstrap: aiokafka's bootstrap error names
  only the hosts, while the connection's own error says "invalid credentials with SASL
  mechanism SCRAM-SHA-512" or the TLS failure.
* `create_acls`: Kafka's CreateAcls request (aiokafka's protocol class, one ACL per request)
  sent through the admin client's ``_send_request``: aiokafka's admin client has no ACL method.

`check_aiokafka_internals` raises `AiokafkaInternalsChanged` naming what is missing; stages call
it through `voicebus.bus.diagnose_connection` before relying on it, and a test runs it.
"""

from __future__ import annotations

import inspect
from typing import Any


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

    create_conn = getattr(aiokafka.conn, "create_conn", None)
    if create_conn is None:
        raise AiokafkaInternalsChanged(f"aiokafka {aiokafka.__version__} has no aiokafka.conn.create_conn")
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
