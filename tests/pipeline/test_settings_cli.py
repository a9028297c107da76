"""`voicebus settings`: every Settings field with its variable, default and meaning (from its docstring),
by group; ``--role`` keeps one role's."""

import json
import re

import pytest

from voicebus.cli import main
from voicebus.settings import ENV_PREFIX, SETTING_GROUPS, Settings, field_docs, fields_of, group_of

TITLES = [group.title for group in SETTING_GROUPS.values()]


def test_every_settings_field_has_a_docstring():
    missing = [name for name, doc in field_docs().items() if not doc]
    assert missing == [], f"add a docstring under these fields in pipeline/settings.py: {missing}"


def test_settings_json_lists_every_field_with_its_variable_default_value_and_meaning(capsys, monkeypatch):
    monkeypatch.setenv("VOICEBUS_PARTITIONS", "3")
    monkeypatch.setenv("VOICEBUS_EDGE_SECRET", "do-not-print-me")
    assert main(["settings", "--json", "-"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out)
    assert [r["field"] for r in rows] == list(Settings.model_fields)
    by_name = {r["field"]: r for r in rows}
    assert by_name["partitions"] == {"field": "partitions", "group": "bus", "variable": "VOICEBUS_PARTITIONS",
                                     "default": "24", "value": "3", "meaning": field_docs()["partitions"]}
    assert by_name["max_text_bytes"]["default"] == "16384" and "16384" in by_name["max_text_bytes"]["meaning"]
    assert by_name["edge_secret"]["value"] == "(set)" and "do-not-print-me" not in out
    assert all(r["variable"] == ENV_PREFIX + r["field"].upper() and r["meaning"] for r in rows)


def test_settings_table_names_every_variable(capsys):
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert ENV_PREFIX + name.upper() in out


def test_the_table_shows_each_group_as_a_headed_section(capsys):
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    headings = [line.strip() for line in out.splitlines() if line.strip() in TITLES]
    assert headings == TITLES
    assert out.index("VOICEBUS_BOOTSTRAP") < out.index("\nGate ") < out.index("VOICEBUS_GATE_MODE")


@pytest.mark.parametrize("role", ["gate", "worker", "edge", "agent", "speech-api"])
def test_a_role_lists_only_the_settings_its_process_reads(capsys, role):
    assert main(["settings", "--role", role, "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["field"] for r in rows] == list(fields_of(role))
    assert all(r["group"] == group_of(r["field"]) for r in rows)
    assert main(["settings", "--role", role]) == 0
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        shown = re.search(rf"\b{ENV_PREFIX}{name.upper()}\b", out) is not None
        assert shown == (name in fields_of(role)), name


def test_a_role_s_table_heads_the_fields_of_other_groups_it_reads_with_their_group(capsys):
    assert main(["settings", "--role", "worker"]) == 0
    out = capsys.readouterr().out
    assert "read by the worker role" in out
    headings = [line.strip() for line in out.splitlines() if line.strip() in TITLES]
    assert headings == ["Bus and topics", "Security, wire format, registry", "Tracing", "Local tools", "Gate",
                        "Synthesis worker", "Edge"]
    assert out.index("\nGate ") < out.index("VOICEBUS_DEFAULT_VOICE") < out.index("\nSynthesis worker ")
