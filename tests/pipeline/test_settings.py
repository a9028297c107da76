"""`Settings`: every value validated wherever it comes from, errors that name the variable,
unknown variables warned about, secrets never shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import SecretStr

from voicebus.settings import DEFAULT_EDGE_SECRET, Settings, SettingsError, reveal


def test_values_are_parsed_from_the_environment():
    s = Settings.from_env({"VOICEBUS_PARTITIONS": "3", "VOICEBUS_TRACING": "true", "VOICEBUS_WEIGHTS_PATH": "",
                           "VOICEBUS_CACHE_DIR": "~/vb", "VOICEBUS_DEFAULT_SPEED": "1.5"})
    assert (s.partitions, s.tracing, s.weights_path, s.default_speed) == (3, True, None, 1.5)
    assert s.cache_dir == Path("~/vb").expanduser()


@pytest.mark.parametrize("variable, raw, allowed", [
    ("VOICEBUS_GATE_MODE", "foo", "'incremental' or 'buffered'"),
    ("VOICEBUS_TRACING", "ture", "valid boolean"),
    ("VOICEBUS_PARTITIONS", "0", "greater than or equal to 1"),
    ("VOICEBUS_WIRE_FORMAT", "json", "'single-object' or 'confluent'"),
    ("VOICEBUS_AUDIO_ENCODING", "mp3", "'pcm16' or 'opus'"),
    ("VOICEBUS_DEFAULT_LANGUAGE", "xx", "'en'"),
    ("VOICEBUS_OPUS_FRAME_MS", "25", "10, 20, 40 or 60"),
    ("VOICEBUS_DEVICE", "tpu", "auto|cpu|cuda"),
    ("VOICEBUS_DEFAULT_VOICE", "af_heart:0+af_bella", "weight"),  # the gate would write refused requests
])
def test_a_value_its_field_does_not_allow_is_an_error_naming_the_variable(variable, raw, allowed):
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({variable: raw})
    assert str(caught.value).startswith(f"{variable}: ") and allowed in str(caught.value)


def test_constructors_and_replace_validate_too():
    with pytest.raises(SettingsError, match="VOICEBUS_GATE_MODE"):
        Settings().replace(gate_mode="sometimes")
    with pytest.raises(Exception):
        Settings(gate_mode="sometimes")
    with pytest.raises(SettingsError, match="partiton is not a setting; did you mean VOICEBUS_PARTITIONS"):
        Settings().replace(partiton=3)


def test_settings_are_frozen():
    with pytest.raises(Exception):
        Settings().partitions = 3  # type: ignore[misc]


def test_an_unknown_variable_is_warned_about_with_the_closest_name(caplog):
    with caplog.at_level(logging.WARNING, logger="voicebus.settings"):
        Settings.from_env({"VOICEBUS_PARTITON": "3", "VOICEBUS_NOTHING_LIKE_IT": "1", "OTHER": "x"})
    messages = [r.getMessage() for r in caplog.records]
    assert any("VOICEBUS_PARTITON is not a voicebus setting" in m and "did you mean VOICEBUS_PARTITIONS?" in m
               for m in messages)
    assert any(m.startswith("VOICEBUS_NOTHING_LIKE_IT is not a voicebus setting (ignored)") for m in messages)
    assert not any("OTHER" in m for m in messages)


def test_a_secret_is_never_shown_but_reaches_a_child_process():
    s = Settings.from_env({"VOICEBUS_EDGE_SECRET": "do-not-print-me"})
    assert isinstance(s.edge_secret, SecretStr) and reveal(s.edge_secret) == "do-not-print-me"
    assert "do-not-print-me" not in repr(s) and "do-not-print-me" not in str(s)
    assert s.to_env()["VOICEBUS_EDGE_SECRET"] == "do-not-print-me"
    assert Settings.from_env(s.to_env()) == s
    assert reveal(Settings().edge_secret) == DEFAULT_EDGE_SECRET


def test_an_error_never_repeats_a_secret():
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({"VOICEBUS_EDGE_SECRET": "s3cret-value", "VOICEBUS_GATE_MODE": "foo"})
    assert "s3cret-value" not in str(caught.value)


def test_to_env_round_trips_every_field():
    s = Settings(partitions=3, weights_path=Path("/models/k"), gate_mode="buffered", tracing=True)
    assert Settings.from_env(s.to_env()) == s


def test_the_choices_are_the_stages_own():
    from typing import get_args

    from voicebus.gate.core import GATE_MODES
    from voicebus.gate.evidence import HOLD_TIMEOUT_POLICIES
    from voicebus.schemas.contract import LANGUAGES

    fields = Settings.model_fields
    assert get_args(fields["gate_mode"].annotation) == GATE_MODES
    assert get_args(fields["hold_timeout_policy"].annotation) == HOLD_TIMEOUT_POLICIES
    assert set(get_args(fields["default_language"].annotation)) == set(LANGUAGES)


def test_a_secret_from_a_file_reaches_a_child_as_the_file_never_the_value(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("from-the-file\n")
    s = Settings.from_env({"VOICEBUS_KAFKA_SASL_PASSWORD_FILE": str(secret), "VOICEBUS_EDGE_SECRET": "plain"})
    assert reveal(s.kafka_sasl_password) == "from-the-file"
    env = s.replace(partitions=2).to_env()
    assert env["VOICEBUS_KAFKA_SASL_PASSWORD_FILE"] == str(secret) and "VOICEBUS_KAFKA_SASL_PASSWORD" not in env
    assert "from-the-file" not in "".join(env.values())
    assert reveal(Settings.from_env(env).kafka_sasl_password) == "from-the-file"
    assert env["VOICEBUS_EDGE_SECRET"] == "plain"  # given as a value: the child needs it as one
    changed = s.replace(kafka_sasl_password=SecretStr("new"))
    assert changed.to_env()["VOICEBUS_KAFKA_SASL_PASSWORD"] == "new"


def test_a_plain_secret_variable_wins_over_its_file(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("from-the-file")
    s = Settings.from_env({"VOICEBUS_KAFKA_SASL_PASSWORD_FILE": str(secret), "VOICEBUS_KAFKA_SASL_PASSWORD": "plain"})
    assert reveal(s.kafka_sasl_password) == "plain"
    with pytest.raises(SettingsError, match="VOICEBUS_REGISTRY_PASSWORD_FILE: cannot read"):
        Settings.from_env({"VOICEBUS_REGISTRY_PASSWORD_FILE": str(tmp_path / "missing")})
