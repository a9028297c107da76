"""The web player as an npm package, @voicebus/player (players/web/package.json): named and versioned
as voicebus, `npm pack` ships the module, its types, the worklet and the README (and none of the
edge's own pages), every module it ships imports only shipped files, and an app that installs the
tarball type-checks against its hand-written types (TypeScript from the package's devDependencies,
`make player-deps`; installed here when missing). npm works offline for all of it once TypeScript
is in npm's cache."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "players" / "web"
NPM = shutil.which("npm") or "npm"
SHIPPED = {"package.json", "README.md", "index.js", "index.d.ts", "edge-client.js", "protocol.js", "protocol.d.ts",
           "worklet.js", "examples/embed.html", "examples/example.ts"}


def npm(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([NPM, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"npm {' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done


def manifest() -> dict:
    return json.loads((PACKAGE / "package.json").read_text(encoding="utf-8"))


def pack(destination: Path) -> Path:
    """`npm pack` of players/web into `destination`: the tarball's path."""
    out = npm("pack", "--json", "--offline", "--ignore-scripts", "--pack-destination", str(destination), cwd=PACKAGE)
    [packed] = json.loads(out.stdout)
    return destination / packed["filename"]


def test_the_package_is_named_versioned_and_licensed_as_voicebus():
    pkg = manifest()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert pkg["name"] == "@voicebus/player" and pkg["version"] == version
    assert pkg["license"] == "Apache-2.0" and pkg["type"] == "module"
    assert pkg["exports"]["."] == {"types": "./index.d.ts", "default": "./index.js"}
    assert pkg["exports"]["./protocol"] == {"types": "./protocol.d.ts", "default": "./protocol.js"}
    assert not pkg.get("dependencies"), "the player runs without dependencies"
    assert set(pkg["devDependencies"]) == {"typescript"}  # only to check the types


def test_npm_pack_ships_the_module_its_types_the_worklet_and_the_readme():
    out = npm("pack", "--dry-run", "--json", "--offline", "--ignore-scripts", cwd=PACKAGE, timeout=30)
    [packed] = json.loads(out.stdout)
    files = {f["path"] for f in packed["files"]}
    # exactly these: the edge's own pages (index.html, player.js, console.*) are not the package's
    assert files == SHIPPED, files ^ SHIPPED
    assert packed["name"] == "@voicebus/player" and packed["filename"] == f"voicebus-player-{manifest()['version']}.tgz"
    # what the exports map names is shipped
    for target in [manifest()["main"], manifest()["types"], *(
            t for e in manifest()["exports"].values() for t in (e.values() if isinstance(e, dict) else [e]))]:
        assert target.removeprefix("./") in files, target


def test_the_shipped_modules_import_only_shipped_files():
    """Relative imports (and the worklet's URL) of every shipped module and type file resolve to a
    shipped file: the package works wherever it is installed, not only under the edge's /web/."""
    for name in sorted(n for n in SHIPPED if n.endswith((".js", ".d.ts"))):
        code = (PACKAGE / name).read_text(encoding="utf-8")
        targets = re.findall(r'(?:from|import)\s*\(?\s*"(\.[^"]+)"', code) + re.findall(r'new URL\("(\.[^"]+)"', code)
        for target in targets:
            resolved = (Path(name).parent / target).as_posix().removeprefix("./")
            assert resolved in SHIPPED, f"{name} imports {target}, which the package does not ship"
        assert "/web/" not in re.sub(r"//.*", "", code), f"{name} names the edge's /web/ path"


def typescript() -> Path:
    """The package's TypeScript (its devDependency), installed with `npm ci` when missing or
    another version than package.json names."""
    tsc = PACKAGE / "node_modules" / ".bin" / "tsc"
    installed = PACKAGE / "node_modules" / "typescript" / "package.json"
    wanted = manifest()["devDependencies"]["typescript"]
    if not tsc.exists() or json.loads(installed.read_text(encoding="utf-8"))["version"] != wanted:
        npm("ci", "--no-audit", "--no-fund", "--prefer-offline", cwd=PACKAGE, timeout=300)
    return tsc


def test_an_app_that_installs_the_tarball_type_checks_against_its_types(tmp_path):
    tsc = typescript()
    tarball = pack(tmp_path)
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text(json.dumps({"name": "app", "private": True, "type": "module"}))
    npm("install", "--offline", "--no-audit", "--no-fund", "--ignore-scripts", str(tarball), cwd=app)
    installed = app / "node_modules" / "@voicebus" / "player"
    assert (installed / "index.d.ts").is_file() and (installed / "worklet.js").is_file()
    # the example app, compiled strictly against what npm installed (the .d.ts files checked too);
    # its lines that must be type errors (@ts-expect-error) make sure the types are not `any`
    shutil.copy(PACKAGE / "examples" / "example.ts", app)
    shutil.copy(PACKAGE / "examples" / "tsconfig.json", app)
    done = subprocess.run([str(tsc), "-p", str(app)], cwd=app, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    # and a mistake in an app is caught: a misspelt option, a payload read as what it is not
    (app / "example.ts").write_text('import { createPlayer } from "@voicebus/player";\n'
                                    'createPlayer({ edgeURL: "wss://e/ws", session: "S", token: "T" })'
                                    '.on("turnend", (e) => e.stopped.toFixed());\n')
    done = subprocess.run([str(tsc), "-p", str(app)], cwd=app, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "edgeURL" in done.stdout and "toFixed" in done.stdout, done.stdout



def test_the_edge_pages_use_the_package_module():
    """The edge's player page (/) and the demo console are built on the package's module, the same
    file the edge serves under /web/: no copy of the player."""
    for html, script in [("index.html", "player.js"), ("console.html", "console.js")]:
        assert f'<script type="module" src="/web/{script}"></script>' in (PACKAGE / html).read_text(encoding="utf-8")
        code = (PACKAGE / script).read_text(encoding="utf-8")
        assert re.findall(r'^import \{[^}]*\bcreatePlayer\b[^}]*\} from "\./index\.js";$', code, re.M), script
        assert not re.findall(r'from "\./(?!index\.js")', code), f"{script} imports the player's parts directly"
        assert "new WebSocket" not in code and "audioWorklet" not in code, script


def test_the_types_declare_what_the_module_exports():
    """index.d.ts (by hand) and protocol.d.ts (generated) declare exactly the names index.js exports
    (imported in Node: the module touches no browser API until a player starts)."""
    script = f"const m = await import({json.dumps((PACKAGE / 'index.js').as_uri())}); console.log(JSON.stringify(Object.keys(m)));"
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    declared = set()
    for name in ("index.d.ts", "protocol.d.ts"):
        declared |= set(re.findall(r"^export declare (?:const|function|class) (\w+)", (PACKAGE / name).read_text(), re.M))
    assert set(json.loads(done.stdout)) == declared
