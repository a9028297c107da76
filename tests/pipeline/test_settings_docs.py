"""The settings reference in docs/settings.md ("Every setting") is generated from the code: each
field's group and the first sentence of its docstring (`voicebus.settings_cli.reference_markdown`)."""

from __future__ import annotations

from pathlib import Path

from voicebus.cli import main
from voicebus.settings import DEFAULT_EDGE_SECRET, SETTING_GROUPS, Settings
from voicebus.settings_cli import (DOCS_PAGE, REGENERATE, first_sentence, reference_markdown, with_reference,
                                   write_docs)

ROOT = Path(__file__).resolve().parents[2]


def test_docs_settings_md_is_generated_from_the_fields():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert with_reference(page) == page, (
        f"docs/settings.md is stale (a field, its group or its docstring changed): run `{REGENERATE}`")


def test_the_page_written_is_this_checkout_s():
    assert DOCS_PAGE == ROOT / "docs" / "settings.md"


def test_the_reference_heads_each_group_and_lists_each_field_once_with_its_first_sentence():
    text = reference_markdown()
    for group in SETTING_GROUPS.values():
        page = f" ([{group.doc.partition('#')[0]}]({group.doc}))" if group.doc else ""
        assert f"\n**{group.title}**{page}\n\n| variable | default | meaning |\n|---|---|---|\n" in text
    for name in Settings.model_fields:
        assert text.count(f"| `VOICEBUS_{name.upper()}` |") == 1, name
    assert ("| `VOICEBUS_GATE_MODE` | `incremental` | `incremental`: each sentence goes to synthesis as soon as it "
            "is released (the point of voicebus); `buffered`: ") in text
    assert ("[protocol.md, \"The floor: several agents in one session\"]"
            "(protocol.md#the-floor-several-agents-in-one-session)") in text
    assert r"`voicebus kafka fetch\|start`" in text  # a pipe in a cell is escaped


def test_the_reference_is_the_same_on_every_machine_and_shows_no_secret(monkeypatch, tmp_path):
    before = reference_markdown()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("VOICEBUS_EDGE_SECRET", "not-in-the-docs")
    assert reference_markdown() == before
    assert "| `VOICEBUS_CACHE_DIR` | `$XDG_CACHE_HOME/voicebus` |" in before and str(tmp_path) not in before
    assert "| `VOICEBUS_EDGE_SECRET` | (public default) |" in before and DEFAULT_EDGE_SECRET not in before
    assert "| `VOICEBUS_API_KEYS` | – |" in before


def test_first_sentence_ends_at_a_full_stop_outside_code_parentheses_and_abbreviations():
    assert first_sentence("One (a. b). Two.") == "One (a. b)."
    assert first_sentence("Ends at ``.``, then e.g. here. Not this.") == "Ends at ``.``, then e.g. here."
    assert first_sentence("``x.y`` and `a. b` stay. Next.") == "``x.y`` and `a. b` stay."
    assert first_sentence("No full stop") == "No full stop"


def test_write_docs_rewrites_only_the_every_setting_section(tmp_path, capsys):
    page = tmp_path / "settings.md"
    head, tail = "# Settings\n\nIntro.\n", "## Limits\n\nBounds, kept as they are.\n"
    page.write_text(f"{head}\n## Every setting\n\nold, hand-written\n\n{tail}")
    assert main(["settings", "--write-docs", str(page)]) == 0
    assert capsys.readouterr().out == f"{page}: rewritten\n"
    text = page.read_text()
    assert text == f"{head}\n## Every setting\n\n{reference_markdown()}\n{tail}"
    assert not write_docs(page) and page.read_text() == text


def test_markdown_prints_the_reference(capsys):
    assert main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    assert main(["settings", "--markdown", "--role", "gate"]) == 0
    out = capsys.readouterr().out
    assert "`VOICEBUS_GATE_MODE`" in out and "`VOICEBUS_DEVICE`" not in out
