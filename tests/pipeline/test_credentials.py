"""`BusAccess`: a refused user is reported once, counted per retry, and cleared when accepted."""

from __future__ import annotations

import logging

from aiokafka.errors import SaslAuthenticationFailed
from pydantic import SecretStr

from voicebus.credentials import BusAccess
from voicebus.settings import Settings

REFUSED = SaslAuthenticationFailed("Authentication failed during authentication due to invalid credentials "
                                   "with SASL mechanism SCRAM-SHA-512")


def sasl(user: str) -> Settings:
    return Settings.from_env({}).replace(kafka_security_protocol="SASL_SSL", kafka_sasl_username=user,
                                         kafka_sasl_password=SecretStr("pw"))


def test_a_user_refused_after_being_accepted_is_reported_once_until_accepted_again(caplog):
    caplog.set_level(logging.INFO, logger="voicebus.credentials")
    access = BusAccess(clock_us=lambda: 42)
    access.note("worker", "b:9093", None)
    assert access.refusal_of(sasl("worker")) is None
    for _ in range(5):
        access.note("worker", "b:9093", REFUSED)
    assert access.refusal_of(sasl("worker")) == {
        "user": "worker", "where": "b:9093", "since_us": 42, "attempts": 5,
        "reason": "Authentication failed during authentication due to invalid credentials with SASL mechanism "
                  "SCRAM-SHA-512"}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "which it had accepted" in errors[0].getMessage()
    assert access.refusal_of(sasl("gate")) is None  # another user of the process is not refused
    access.note("worker", "b:9093", None)
    assert access.refusal_of(sasl("worker")) is None
    assert "accepts the credentials of 'worker' again, after 5 refused attempts" in caplog.text


def test_a_user_refused_from_the_start_is_reported_without_blaming_a_change(caplog):
    access = BusAccess()
    access.note("agent", "b:9093", REFUSED)
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "refused the credentials of 'agent'" in error and "which it had accepted" not in error


def test_a_client_without_sasl_has_no_refused_user():
    access = BusAccess()
    access.note(None, "b:9093", REFUSED)
    assert access.refusal_of(Settings.from_env({})) is None  # PLAINTEXT: no user to refuse
    assert access.refusal(None) is not None


def test_an_attempt_that_began_before_the_last_one_counted_is_ignored():
    """Seen on a broker: the user restored, one connection accepted, then a handshake begun
    before the restore was refused; the stage flapped back to 503."""
    access = BusAccess()
    access.note("worker", "b:9093", None, began=1.0)
    access.note("worker", "b:9093", REFUSED, began=2.0)  # the user deleted
    access.note("worker", "b:9093", None, began=4.0)  # restored
    access.note("worker", "b:9093", REFUSED, began=3.0)  # begun before the restore, ended after it
    assert access.refusal("worker") is None
    access.note("worker", "b:9093", REFUSED, began=5.0)
    assert access.refusal("worker").attempts == 1
