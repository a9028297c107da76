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


def test_every_field_is_in_exactly_one_group_in_declaration_order():
    from voicebus.settings import SETTING_GROUPS, group_of

    listed = [name for group in SETTING_GROUPS.values() for name in group.fields]
    assert listed == list(Settings.model_fields)  # once each, and the class's sections are the groups
    assert group_of("partitions") == "bus" and group_of("edge_host") == "edge" and group_of("api_keys") == "speech-api"


@pytest.mark.parametrize("change, named", [
    (lambda fields: fields[1:], "in no group ['bootstrap']"),
    (lambda fields: (*fields, "gate_mode"), "in more than one group ['gate_mode']"),
    (lambda fields: (*fields, "no_such_field"), "no field ['no_such_field']"),
])
def test_a_field_in_no_group_or_in_two_is_an_error_at_import(monkeypatch, change, named):
    import dataclasses

    from voicebus import settings as module

    bus = module.SETTING_GROUPS["bus"]
    monkeypatch.setitem(module.SETTING_GROUPS, "bus", dataclasses.replace(bus, fields=change(bus.fields)))
    with pytest.raises(RuntimeError) as caught:
        module._check_groups()
    assert named in str(caught.value)


def test_a_role_reads_the_shared_groups_its_own_and_the_few_others_it_uses():
    from voicebus.settings import ROLES, SETTING_GROUPS, SHARED_GROUPS, fields_of, group_of

    shared = {name for key in SHARED_GROUPS for name in SETTING_GROUPS[key].fields}
    for role, spec in ROLES.items():
        fields = fields_of(role)
        assert list(fields) == [name for name in Settings.model_fields if name in fields]  # declaration order
        assert shared <= set(fields)
        assert {group_of(name) for name in fields} - {*SHARED_GROUPS, *spec.groups} == {group_of(n) for n in spec.also}
    gate, worker = set(fields_of("gate")), set(fields_of("worker"))
    assert {"gate_mode", "floor_policy", "edge_host"} <= gate and not {"weights_path", "edge_port"} & gate
    assert {"weights_path", "device", "default_voice", "cache_dir"} <= worker and "gate_mode" not in worker
    assert {"speech_api", "api_keys"} <= set(fields_of("edge"))  # the edge serves the speech endpoint
    with pytest.raises(ValueError, match="no role"):
        fields_of("broker")
