"""The README's Python quickstart runs as written, and the docs hold together.

* The code block right after ``<!-- quickstart -->`` in README.md is run as a user runs it: a fresh
  Python process, configured only through ``VOICEBUS_*`` variables (the test session's broker and
  this test's own topics, `Settings.to_env`). What it prints and what arrived on the bus are
  checked.
* The block after ``<!-- quickstart-listener -->`` needs a gate, a worker and an edge running; it
  is compiled and every name it imports is checked to exist.
* Every relative link of README.md, CHANGELOG.md and docs/*.md names a file that exists, and an
  anchor (``#section``) names a heading of that file; docs/settings.md names every setting.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from voicebus.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]


def marked_block(text: str, marker: str) -> str:
    """The fenced ```python block that follows ``<!-- marker -->`` (blank lines between allowed)."""
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*\n```python\n(.*?)\n```", text, re.S)
    assert found, f"README.md has no ```python block right after <!-- {marker} -->"
    return found.group(1) + "\n"


def child_env(settings: Settings) -> dict[str, str]:
    """The environment a user's shell would give the quickstart: no VOICEBUS_* but these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOICEBUS_")}
    env.update(settings.to_env())
    return env


@pytest.mark.kafka
async def test_the_quickstart_publishes_its_turn_as_written(make_settings, tmp_path):
    from voicebus.bus import read_to_end
    from voicebus.codecs import codec_for
    from voicebus.topics import text_topic

    settings = make_settings()
    script = tmp_path / "quickstart.py"
    script.write_text(marked_block(README.read_text(), "quickstart"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(settings),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the quickstart failed:\n{done.stdout}\n{done.stderr}"
    printed = re.search(r"^published turn (\S+) of session (\S+)$", done.stdout, re.M)
    assert printed, f"the quickstart printed: {done.stdout!r}"
    turn_id, session_id = printed.groups()

    codec = codec_for(settings)
    records = await read_to_end(settings, [text_topic(settings, "assistant")])
    events = [codec.decode(r.value, expect="TextEvent").value for r in records]
    assert events, "nothing arrived on the assistant's text topic"
    assert {(e["session_id"], e["turn_id"], e["agent_id"]) for e in events} == {(session_id, turn_id, "assistant")}
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert [e["kind"] for e in events][-1] == "END_OF_TURN"
    assert "".join(e["text"] for e in events if e["kind"] == "TOKEN") == "Hello from voicebus. Your order has shipped."
    assert {e["language"] for e in events} == {"en"}
    # registered for the gate, which finds the agent's topic through the agent registry
    registry = await read_to_end(settings, [settings.agents_topic])
    assert any(r.key == b"assistant" for r in registry)


@pytest.mark.kafka
async def test_the_two_agent_example_runs_as_written(make_settings, tmp_path):
    """docs/agents.md's two agents in one session, against a real gate: the expert's turn queues
    behind the host's and is granted when the host's turn ends."""
    from voicebus.gate.app import READY_LINE
    from voicebus.gate.cli import start_gate_subprocess

    settings = make_settings(first_clause_min_words=0)
    gate = start_gate_subprocess(settings, stderr=subprocess.STDOUT)
    try:
        seen: list[str] = []
        ready = threading.Event()

        def pump() -> None:  # drains the gate's output (a full pipe would block it)
            for line in gate.stdout:
                seen.append(line)
                if line.startswith(READY_LINE):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        assert await asyncio.to_thread(ready.wait, 90), f"the gate did not start: {''.join(seen[-20:])}"
        script = tmp_path / "two_agents.py"
        script.write_text(marked_block((ROOT / "docs" / "agents.md").read_text(), "two-agents"))
        done = await asyncio.to_thread(subprocess.run, [sys.executable, str(script)], cwd=tmp_path,
                                       env=child_env(settings), capture_output=True, text=True, timeout=300)
    finally:
        gate.terminate()
        await asyncio.to_thread(gate.wait, 60)
    assert done.returncode == 0, f"the example failed:\n{done.stdout}\n{done.stderr}"
    printed = re.search(r"was QUEUED, then GRANTED after (\d+\.\d) s", done.stdout)
    assert printed and float(printed.group(1)) >= 0.1, done.stdout  # it waited for the host (~0.5 s)


def test_the_listener_quickstart_compiles_and_imports_what_exists():
    code = marked_block(README.read_text(), "quickstart-listener")
    tree = ast.parse(code, "README.md quickstart-listener")
    compile(tree, "README.md quickstart-listener", "exec")
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert ("voicebus.players.listener", "Listener") in imported
    for module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
    from voicebus.players.listener import HeardTurn, Listener

    for attribute in ("wait_turn_end", "start", "stop"):
        assert hasattr(Listener, attribute)
    assert hasattr(HeardTurn, "duration_s") and hasattr(HeardTurn, "write_wav")
    settings = Settings()
    assert settings.edge_url.startswith("http://") and settings.edge_secret.get_secret_value()


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if fenced or not heading:
            continue
        slug = github_slug(heading.group(1))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_names_a_page_and_a_section_that_exist(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    for link in links(page):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)} links to {link}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.relative_to(ROOT)} links to {link}: no such section"


def test_the_settings_page_names_every_setting():
    text = (ROOT / "docs" / "settings.md").read_text()
    missing = [f"VOICEBUS_{name.upper()}" for name in Settings.model_fields
               if f"`VOICEBUS_{name.upper()}`" not in text]
    assert not missing, f"docs/settings.md does not list {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_speak_of_the_software_not_of_its_work_log(page):
    labels = re.findall(r"(?i)\b(?:stop [0-9]+|issues? #?[0-9]+)", page.read_text())
    assert not labels, f"{page.relative_to(ROOT)} names work items instead of dates or sections: {labels}"
