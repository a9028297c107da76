"""The package's shape: one import name, a one-way import graph, a light client side.

Everything installs under `voicebus`; the repository's folders map onto it (pyproject's
package-dir: pipeline/ is `voicebus`, agents/, players/ and schemas/ its subpackages). The import
graph is read from the source (every import statement, at the top of a module or inside a
function): it has no cycle, the runtime (agents' SDK, contract, bus, gate, synthesis) never
imports the edge (`voicebus.players`) or the operations around it (`voicebus.ops`: broker,
demo, benches), and the edge never imports the operations. The only module that names them all
is the command line's dispatcher, `voicebus.cli`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"pipeline": "voicebus", "agents": "voicebus.agents", "players": "voicebus.players",
           "schemas": "voicebus.schemas"}
FOREIGN_TOPS = set(FOLDERS)  # the folder names, which nothing may import as top-level packages
DISPATCHER = "voicebus.cli"
# The framework plugins are players as much as agents: each publishes a turn and hears it back
# through the Python listener (voicebus.players.listener).
PLUGINS = {"voicebus.agents.pipecat_tts", "voicebus.agents.livekit_tts"}


def module_name(path: Path) -> str:
    for folder, package in FOLDERS.items():
        if path.is_relative_to(ROOT / folder):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if p.name != "__main__.py"}


def imported_names(path: Path, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for imported in imported_names(path, package):
            while imported and imported not in modules:  # `from a.b import c`: c may be a name in a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_never_imports_the_edge_or_the_operations():
    graph = import_graph()
    wrong = {}
    for name, targets in graph.items():
        if name == DISPATCHER or name.startswith("voicebus.ops"):
            continue
        forbidden = (("voicebus.ops",) if name.startswith("voicebus.players") or name in PLUGINS
                     else ("voicebus.ops", "voicebus.players"))
        bad = sorted(t for t in targets if t.startswith(forbidden))
        if bad:
            wrong[name] = bad
    assert wrong == {}


def test_nothing_imports_the_folders_as_top_level_packages():
    """`import pipeline` would work from a checkout (the folder is on the path) and nowhere else."""
    wrong = []
    for folder in [*FOLDERS, "tests"]:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    tops = [(node.module or "").split(".")[0]]
                else:
                    continue
                wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for top in tops if top in FOREIGN_TOPS]
    assert wrong == []


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {package: folder for folder, package in FOLDERS.items()}
    folders = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert sorted(config["packages"]) == sorted(folders)


def test_the_agent_sdk_imports_no_server_library():
    """What `pip install voicebus` gives an agent: the SDK, the contract, the settings and the
    bus, with aiokafka and fastavro; no torch, no aiohttp, no metrics or tracing library."""
    heavy = ["torch", "kokoro", "misaki", "numpy", "aiohttp", "prometheus_client", "opentelemetry", "av",
             "matplotlib", "onnx"]
    code = ("import sys, voicebus.agents.sdk, voicebus.agents.replay, voicebus.agents.recorder, voicebus.cli; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["say", "--help"], ["settings"]])
def test_the_command_line_answers_without_a_role_s_libraries(argv):
    """The dispatcher and the client commands import nothing a role brings (checked by blocking
    those imports in the child)."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {'torch', 'aiohttp', 'prometheus_client', 'numpy', 'opentelemetry'}:\n"
            "            raise ImportError(f'{name} is not in the base install')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from voicebus.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr


MODULE_LINES = 520  # "about 500": a module longer than this says why at its top


def test_a_long_module_says_why_at_its_top():
    """A module of more than ~500 lines carries a ``Size:`` paragraph in its docstring: what
    keeps it whole. The rest are split by job."""
    unexplained = []
    for name, path in sorted(source_modules().items()):
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MODULE_LINES and "\nSize: " not in f"\n{doc}":
            unexplained.append(f"{name} ({lines} lines)")
    assert not unexplained, f"modules over {MODULE_LINES} lines without a Size: reason: {unexplained}"
