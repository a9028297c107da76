"""`voicebus settings`: every Settings field with its variable, default and meaning (from its docstring)."""

import json

from voicebus.cli import main
from voicebus.settings import ENV_PREFIX, Settings, field_docs


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
    assert by_name["partitions"] == {"field": "partitions", "variable": "VOICEBUS_PARTITIONS", "default": "24",
                                     "value": "3", "meaning": field_docs()["partitions"]}
    assert by_name["max_text_bytes"]["default"] == "16384" and "16384" in by_name["max_text_bytes"]["meaning"]
    assert by_name["edge_secret"]["value"] == "(set)" and "do-not-print-me" not in out
    assert all(r["variable"] == ENV_PREFIX + r["field"].upper() and r["meaning"] for r in rows)


def test_settings_table_names_every_variable(capsys):
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert ENV_PREFIX + name.upper() in out
