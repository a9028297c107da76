"""Whether the bus accepts this process's credentials *now*, not only when a stage started.

A stage authenticates once per connection. When its user is deleted, its password changed or its
credentials expire while it runs, nothing happens until a connection is opened again: the broker
closes connections whose SASL session ran out (``connections.max.reauth.ms``; aiokafka does not
re-authenticate), a broker restarts, or the network drops. From then on every reconnection is
refused, and aiokafka retries it forever, logging one line per attempt and raising nothing to the
stage: records stop flowing while the stage looks alive.

`BusAccess` is where such a refusal becomes visible. Every connection aiokafka opens for a client
made by `voicebus.bus` reports here (`voicebus.kafka_compat.watch_connections`, installed by
`voicebus.bus.client_options`): a refused one marks its user refused, an accepted one clears it.
The first refusal is logged once, as an error that says who was refused, where and why (never a
secret), and the stages' ``/healthz`` answers 503 with it (`refusal_of`) until the broker accepts
the user again, which is logged too. Clients keep retrying meanwhile, so restoring the user heals
the stage without a restart, and an orchestrator that restarts unhealthy stages gets a stage that
fails at start saying why (`voicebus.bus.diagnose_connection`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from voicebus.clock import now_us

if TYPE_CHECKING:
    from voicebus.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Refusal:
    """A user the broker refuses: where, why (the broker's reason), since when, how many tries."""

    user: str
    where: str
    reason: str
    since_us: int
    attempts: int = 1


class BusAccess:
    """The users of this process the broker refuses now, keyed by SASL user name (``""`` for a
    mechanism without one, OAUTHBEARER). Connections report from any
    event loop of the process, so the map is guarded by a lock."""

    def __init__(self, clock_us: Callable[[], int] = now_us) -> None:
        self.clock_us = clock_us
        self._refused: dict[str, Refusal] = {}
        self._accepted: set[str] = set()  # users the broker accepted at least once
        self._latest: dict[str, float] = {}  # per user, when the attempt last counted began
        self._lock = threading.Lock()

    def note(self, user: str | None, where: str, refused: BaseException | None, began: float | None = None) -> None:
        """One connection attempt of `user` to `where`, begun at `began` (any monotonic clock, the
        same for every call): refused with `refused`, or accepted. An attempt that began before
        the last one counted ended late and says nothing newer (a handshake started before the
        user was restored may be refused after a later one was accepted), so it is ignored."""
        user = user or ""
        with self._lock:
            if began is not None:
                if began < self._latest.get(user, float("-inf")):
                    return
                self._latest[user] = began
            known = self._refused.get(user)
            if refused is None:
                self._accepted.add(user)
                if known is not None:
                    del self._refused[user]
                    log.warning("Kafka at %s accepts the credentials of %r again, after %d refused attempts",
                                where, user, known.attempts)
                return
            if known is not None:
                known.attempts += 1
                return
            reason = str(refused).split(":", 1)[-1].strip() or type(refused).__name__
            self._refused[user] = Refusal(user, where, reason, self.clock_us())
            was_accepted = user in self._accepted
        if was_accepted:
            log.error("Kafka at %s refused the credentials of %r, which it had accepted: %s. The user was "
                      "deleted, its password changed or its credentials expired while this process ran; its "
                      "clients keep retrying, and /healthz answers 503 until the broker accepts them again",
                      where, user, reason)
        else:
            log.error("Kafka at %s refused the credentials of %r: %s", where, user, reason)

    def refusal(self, user: str | None) -> Refusal | None:
        with self._lock:
            return self._refused.get(user or "")

    def refusal_of(self, settings: "Settings") -> dict[str, Any] | None:
        """What ``/healthz`` says of the user `settings` connect as: None while it is accepted."""
        if not settings.kafka_security_protocol.startswith("SASL_"):
            return None  # TLS or plaintext: no credentials a broker checks again on reconnection
        refusal = self.refusal(settings.kafka_sasl_username)
        return dataclasses.asdict(refusal) if refusal is not None else None


# One per process: aiokafka's connections are opened below any one client, so the report cannot
# be routed to the client (or stage) that asked; the user name is what ties the two together.
BUS_ACCESS = BusAccess()
