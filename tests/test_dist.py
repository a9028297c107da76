"""The built distribution, installed the way a user installs it: into fresh virtual environments.

The base wheel installs beside the OpenAI Agents SDK (whose import name is `agents`: voicebus's
is `voicebus.agents`) and brings no torch; ``[all]`` brings every role. uv installs them (from
its cache, filled by the project's own set-up: seconds, not minutes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UV = str(Path(sys.executable).parent / "uv")


def run(*cmd: str, cwd: Path | str = "/", check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(UV, "build", "-q", "--out-dir", str(out), str(ROOT))
    return out


def wheel(dist: Path) -> Path:
    [path] = dist.glob("voicebus-*.whl")
    return path


def fresh_env(tmp_path: Path, *requirements: str) -> Path:
    env = tmp_path / "env"
    run(UV, "venv", "-q", "--python", sys.executable, str(env))
    run(UV, "pip", "install", "-q", "--python", str(env / "bin" / "python"), *requirements)
    return env


def test_the_sdist_and_wheel_carry_the_package_data(dist):
    import zipfile

    assert len(list(dist.glob("voicebus-*.tar.gz"))) == 1
    names = set(zipfile.ZipFile(wheel(dist)).namelist())
    for expected in ["voicebus/schemas/text_event.avsc", "voicebus/schemas/history/text_event_v0.avsc",
                     "voicebus/agents/conversations/support.jsonl", "voicebus/players/web/player.js",
                     "voicebus/ops/maven/kafka/pom.xml", "voicebus/ops/maven/registry/pom.xml",
                     "voicebus/ops/bench/data/pysbd-golden-rules.json", "voicebus/ops/bench/data/languages.json"]:
        assert expected in names
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"voicebus"}


def test_the_base_wheel_installs_beside_openai_agents_without_torch(dist, tmp_path):
    env = fresh_env(tmp_path, str(wheel(dist)), "openai-agents")
    python, voicebus = str(env / "bin" / "python"), str(env / "bin" / "voicebus")
    version = run(voicebus, "--version").stdout.strip()
    assert version.startswith("voicebus ") and version != "voicebus 0+unknown"
    both = run(python, "-c", "import agents, voicebus.agents.sdk; print(agents.__file__); print(voicebus.agents.sdk.__file__)")
    openai_agents, sdk = both.stdout.split()
    assert "/site-packages/agents/" in openai_agents and "/site-packages/voicebus/agents/" in sdk
    shown = run(UV, "pip", "show", "--python", python, "torch", check=False)
    assert shown.returncode != 0 and "not found" in shown.stderr.lower()
    assert run(voicebus, "say", "--help").stdout.startswith("usage: voicebus say")


def test_the_all_extra_gives_the_whole_command_line(dist, tmp_path):
    env = fresh_env(tmp_path, f"{wheel(dist)}[all]")
    python, voicebus = str(env / "bin" / "python"), str(env / "bin" / "voicebus")
    run(python, "-c", "import voicebus.gate.app, voicebus.synthesis.engine, voicebus.players.edge, voicebus.ops.bench.ttfa")
    for command in ["gate", "worker", "edge", "synth", "demo", "kafka", "bench"]:
        assert run(voicebus, command, "--help").stdout.startswith(f"usage: voicebus {command}")
    assert run(python, "-c", "from voicebus.ops.broker import POM_PATH; print(POM_PATH.is_file())").stdout.strip() == "True"
    # package data found by package name, not from a checkout's folders
    shipped = "from voicebus.agents.corpus import corpus_path; print(corpus_path('support').is_file())"
    assert run(python, "-c", shipped).stdout.strip() == "True"
