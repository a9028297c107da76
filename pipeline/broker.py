"""A local Apache Kafka broker run by the project itself, without Docker.

This module owns `voicebus kafka fetch|start|status|stop` and the `LocalKafka` class behind them:

* `fetch_jars` resolves the broker's classpath (the official jars from Maven Central) once with the
  machine's Maven, from `tools/kafka/pom.xml`, into ``<kafka_dir>/jars/<version>/``.
* `LocalKafka` writes a KRaft ``server.properties`` (one node, combined broker + controller,
  loopback only), formats its storage with `kafka.tools.StorageTool format --standalone` (what
  ``bin/kafka-storage.sh`` runs), and starts `kafka.Kafka` (what ``bin/kafka-server-start.sh``
  runs) in its own process group. `start()` returns once the broker answers a Kafka ApiVersions
  request; `stop()` sends SIGTERM, then SIGKILL, and leaves no process. A pid file in the data dir
  lets another process (the CLI's ``status``/``stop``) find the broker.
* `ensure_local_kafka(settings)` is for the demo and the benchmarks: it uses a broker already
  answering at ``settings.bootstrap`` or starts a throwaway one and stops it on exit.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from pipeline.settings import Settings

POM_PATH = Path(__file__).resolve().parent.parent / "tools" / "kafka" / "pom.xml"
SERVER_MAIN = "kafka.Kafka"  # bin/kafka-server-start.sh
STORAGE_TOOL = "kafka.tools.StorageTool"  # bin/kafka-storage.sh
_COMPLETE_MARK = ".complete"
DEFAULT_JVM_OPTIONS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20")
# For a broker that should start fast on a busy machine (the test session's): the C1 compiler
# only and a single-threaded collector spend much less CPU while the broker boots (~25% faster
# start measured on 2 shared cores) at some cost in peak throughput.
QUICK_START_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


class BrokerError(RuntimeError):
    """The local broker could not be fetched, started, found or stopped."""


class JarsFetchError(BrokerError):
    """Maven could not resolve the Kafka classpath."""


class BrokerStartError(BrokerError):
    """The broker process exited or did not answer in time; carries the broker log's tail."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- broker log tail ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


# --- classpath ---------------------------------------------------------------------------------


def jars_dir(kafka_dir: Path, version: str) -> Path:
    return Path(kafka_dir) / "jars" / version


def fetch_jars(kafka_dir: Path, version: str, pom: Path = POM_PATH) -> Path:
    """Resolve Kafka `version`'s runtime jars into ``<kafka_dir>/jars/<version>`` (idempotent).

    Concurrent callers (several test sessions on one machine) serialise on a lock file; the jars
    land in a temporary folder first and are renamed into place, so a half-copied folder is never
    used.
    """
    target = jars_dir(kafka_dir, version)
    if (target / _COMPLETE_MARK).exists():
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsFetchError("Maven (`mvn`) is not on PATH; install it (Debian: apt-get install maven)")
    if not pom.exists():
        raise JarsFetchError(f"{pom} is missing: the Kafka classpath pom ships with the repository")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / _COMPLETE_MARK).exists():
            return target  # another process fetched it while we waited
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
        try:
            cmd = [
                mvn, "-q", "-B", "-f", str(pom), f"-Dkafka.version={version}",
                "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=target.parent)
            if proc.returncode != 0 or not list(staging.glob(f"kafka_2.13-{version}.jar")):
                out = (proc.stdout + proc.stderr)[-3000:]
                raise JarsFetchError(f"mvn could not resolve Apache Kafka {version} (exit {proc.returncode}):\n{out}")
            (staging / _COMPLETE_MARK).write_text(version + "\n")
            if target.exists():
                shutil.rmtree(target)  # an incomplete leftover from a killed fetch
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


# --- the Kafka wire check ----------------------------------------------------------------------


def new_cluster_id(random_bytes: Callable[[], bytes] = lambda: uuid.uuid4().bytes) -> str:
    """A KRaft cluster id as Kafka 4's own `Uuid.randomUuid` makes them: 16 random bytes in
    unpadded URL-safe base64, drawn again while the text holds a "-" or the bytes are one of
    Kafka's reserved ids (zero, and the metadata topic's 0...01). An id starting with "-" made
    `kafka-storage format -t <id>` read it as an option and fail (1 format in 64)."""
    reserved = {bytes(16), bytes(15) + b"\x01"}
    while True:
        raw = random_bytes()
        cluster_id = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        if "-" not in cluster_id and raw not in reserved:
            return cluster_id


def broker_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when a Kafka broker at host:port answers an ApiVersions (v0) request without error.

    A bare TCP connect is not enough: the socket opens before the broker can serve requests.
    """
    request_body = struct.pack(">hhih", 18, 0, 0x7ACE, len(b"voicebus")) + b"voicebus"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack(">i", len(request_body)) + request_body)
            header = _recv_exact(sock, 4)
            (size,) = struct.unpack(">i", header)
            if not 6 <= size <= 1 << 20:
                return False
            payload = _recv_exact(sock, size)
    except OSError:
        return False
    correlation_id, error_code = struct.unpack(">ih", payload[:6])
    return correlation_id == 0x7ACE and error_code == 0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        chunks += chunk
    return bytes(chunks)


def parse_bootstrap(bootstrap: str) -> tuple[str, int]:
    """The first host:port of a bootstrap list."""
    first = bootstrap.split(",")[0].strip()
    first = first.split("://", 1)[-1]
    host, _, port = first.rpartition(":")
    if not host or not port.isdigit():
        raise BrokerError(f"bootstrap {bootstrap!r} is not host:port")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- the broker process ------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerStatus:
    bootstrap: str
    pid: int | None
    running: bool  # the process is alive
    answering: bool  # it answers Kafka requests

    def describe(self) -> str:
        if self.answering:
            return f"running (pid {self.pid}), answering at {self.bootstrap}"
        if self.running:
            return f"process {self.pid} alive but not answering at {self.bootstrap}"
        return f"not running (expected at {self.bootstrap})"


class LocalKafka:
    """One single-node KRaft Kafka (broker + controller) on loopback, with an explicit data dir.

    The process runs in its own session/process group so it outlives a CLI `start`; the pid file
    (``<data_dir>/kafka.pid``) lets any process find and stop it.
    """

    def __init__(
        self,
        data_dir: Path,
        jars: Path,
        port: int,
        controller_port: int,
        host: str = "127.0.0.1",
        heap: str = "512m",
        extra_config: Mapping[str, str] | None = None,
        jvm_options: tuple[str, ...] = DEFAULT_JVM_OPTIONS,
        die_with_parent: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.jars = Path(jars)
        self.host = host
        self.port = port
        self.controller_port = controller_port
        self.heap = heap
        self.extra_config = dict(extra_config or {})
        self.jvm_options = tuple(jvm_options)
        # A broker owned by a process (a test session) must not outlive it even if that process
        # is killed without running its finalizers: the kernel then sends the broker SIGTERM.
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen | None = None

    @classmethod
    def from_settings(cls, settings: Settings, data_dir: Path | None = None) -> "LocalKafka":
        """The broker `voicebus kafka start` runs: ports and cache dir from settings."""
        return cls(
            data_dir=data_dir or Path(settings.kafka_dir) / f"node-{settings.kafka_port}",
            jars=jars_dir(settings.kafka_dir, settings.kafka_version),
            port=settings.kafka_port,
            controller_port=settings.kafka_controller_port,
            extra_config={"num.partitions": str(settings.partitions)},
        )

    # paths
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def stdout_file(self) -> Path:
        return self.data_dir / "stdout.log"

    @property
    def log_dirs(self) -> Path:
        return self.data_dir / "kraft-logs"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    def server_properties(self) -> dict[str, str]:
        h = self.host
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"{h}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{h}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.log_dirs),
            # quick consumer groups in tests and demos: no 3 s wait for more members
            "group.initial.rebalance.delay.ms": "0",
            # one node: every internal topic has one replica; fewer partitions start faster
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "num.partitions": "6",
            "auto.create.topics.enable": "true",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "log.retention.hours": "24",
        }
        props.update(self.extra_config)
        return props

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text(
            "# written by voicebus (pipeline/broker.py); regenerated at every start\n"
            + "".join(f"{k}={v}\n" for k, v in self.server_properties().items())
        )
        (self.data_dir / "log4j2.properties").write_text(
            "status = warn\n"
            "appender.file.type = File\n"
            "appender.file.name = FILE\n"
            f"appender.file.fileName = {self.log_file}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\n"
            "rootLogger.appenderRef.file.ref = FILE\n"
            # the request log and state-change chatter drown the useful lines
            "logger.request.name = kafka.request.logger\nlogger.request.level = WARN\n"
            "logger.state.name = state.change.logger\nlogger.state.level = WARN\n"
        )

    def _java(self) -> str:
        java_home = os.environ.get("JAVA_HOME")  # the standard JVM lookup, not a voicebus setting
        if java_home and (Path(java_home) / "bin" / "java").exists():
            return str(Path(java_home) / "bin" / "java")
        java = shutil.which("java")
        if java is None:
            raise BrokerError("`java` (17 or newer) is not on PATH; Kafka 4 needs a Java 17+ runtime")
        return java

    def _java_cmd(self, main: str, *args: str) -> list[str]:
        if not (self.jars / _COMPLETE_MARK).exists() and not list(self.jars.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"no Kafka jars in {self.jars}: run `voicebus kafka fetch` first")
        return [
            self._java(),
            f"-Xmx{self.heap}", "-Xms128m", *self.jvm_options,
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp", str(self.jars / "*"),
            main, *args,
        ]

    def format_storage(self) -> None:
        """Format the KRaft storage dir once (kafka-storage.sh format --standalone)."""
        if (self.log_dirs / "meta.properties").exists():
            return
        cluster_id = new_cluster_id()
        cmd = self._java_cmd(
            STORAGE_TOOL, "format", "--standalone", "-t", cluster_id, "-c", str(self.properties_file)
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.data_dir)
        if proc.returncode != 0:
            raise BrokerStartError(
                f"formatting {self.log_dirs} failed (exit {proc.returncode})", (proc.stdout + proc.stderr)[-3000:]
            )

    def start(self, timeout: float = 90.0) -> "LocalKafka":
        """Start the broker and return once it answers; raise `BrokerStartError` otherwise."""
        existing = self._read_pid()
        if existing is not None and _is_our_kafka(existing, self.properties_file):
            if broker_answers(self.host, self.port):
                return self  # already running (started by an earlier `voicebus kafka start`)
            raise BrokerError(f"broker process {existing} from {self.data_dir} is alive but not answering")
        if broker_answers(self.host, self.port, timeout=0.5):
            raise BrokerError(f"another broker already answers at {self.bootstrap}")
        self._write_config()
        self.format_storage()
        cmd = self._java_cmd(SERVER_MAIN, str(self.properties_file))
        with open(self.stdout_file, "ab") as out:
            self._proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.data_dir, start_new_session=True,
                preexec_fn=_terminate_when_parent_dies if self.die_with_parent else None,
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._forget_pid()
                raise BrokerStartError(
                    f"Kafka exited with code {self._proc.returncode} during start", self.log_tail(60)
                )
            if broker_answers(self.host, self.port, timeout=0.5):
                return self
            time.sleep(0.2)
        self.stop()
        raise BrokerStartError(f"Kafka did not answer at {self.bootstrap} within {timeout:.0f} s", self.log_tail(60))

    def status(self) -> BrokerStatus:
        pid = self._read_pid()
        running = pid is not None and _is_our_kafka(pid, self.properties_file)
        return BrokerStatus(self.bootstrap, pid if running else None, running, running and broker_answers(self.host, self.port))

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the broker (a clean shutdown), SIGKILL it after `timeout`; True if one was stopped."""
        pid = self._proc.pid if self._proc is not None and self._proc.poll() is None else self._read_pid()
        if pid is None or not _is_our_kafka(pid, self.properties_file):
            self._forget_pid()
            self._reap()
            return False
        _signal_group(pid, signal.SIGTERM)
        if not self._wait_gone(pid, timeout):
            _signal_group(pid, signal.SIGKILL)
            self._wait_gone(pid, 10.0)
        self._forget_pid()
        return True

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for path in (self.stdout_file, self.log_file):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    parts.append(f"[{path.name}]\n" + "\n".join(text))
        return "\n".join(parts)

    # internals
    def _wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not _alive(pid):
                return True
            time.sleep(0.05)
        return False

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0)

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def _forget_pid(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()


def _terminate_when_parent_dies() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it when its parent dies."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait() is missing
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _is_our_kafka(pid: int, properties_file: Path) -> bool:
    """The pid is alive and is the Kafka started with this data dir (not a recycled pid)."""
    if not _alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return SERVER_MAIN.encode() in cmdline and str(properties_file).encode() in cmdline


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, sig)  # started with start_new_session: the group id is the pid
        except PermissionError:
            os.kill(pid, sig)


# --- for the demo and the benchmarks -----------------------------------------------------------


@contextlib.contextmanager
def ensure_local_kafka(settings: Settings, start_timeout: float = 90.0) -> Iterator[Settings]:
    """Yield settings pointed at a broker that answers.

    Uses the broker already answering at ``settings.bootstrap``; otherwise (loopback only) fetches
    the jars, starts a throwaway broker on that port in a temporary data dir, and stops it and
    removes the dir on exit.
    """
    host, port = parse_bootstrap(settings.bootstrap)
    if broker_answers(host, port):
        yield settings
        return
    if host not in {"127.0.0.1", "localhost", "::1"}:
        raise BrokerError(f"no broker answers at {settings.bootstrap}, and it is not a loopback address")
    jars = fetch_jars(settings.kafka_dir, settings.kafka_version)
    Path(settings.kafka_dir).mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="ephemeral-", dir=settings.kafka_dir))
    controller_port = settings.kafka_controller_port
    if controller_port == port or broker_answers("127.0.0.1", controller_port, timeout=0.2):
        controller_port = free_port()
    broker = LocalKafka(data_dir, jars, port=port, controller_port=controller_port,
                        extra_config={"num.partitions": str(settings.partitions)}, die_with_parent=True)
    try:
        broker.start(start_timeout)
        yield settings.replace(bootstrap=broker.bootstrap)
    finally:
        broker.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


# --- CLI -----------------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser("kafka", help="run a local Apache Kafka (KRaft, one node, no Docker)")
    sub = p.add_subparsers(dest="kafka_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="resolve the Kafka jars from Maven Central (once, cached)")
    fetch.set_defaults(func=_cmd_fetch)
    start = sub.add_parser(
        "start", help="start the broker; returns once it answers, printing its address",
        description="Start a local Kafka (KRaft, one node, loopback). Prints its bootstrap address once it answers. "
                    "The other voicebus commands connect to VOICEBUS_BOOTSTRAP (default 127.0.0.1:9092), which does "
                    "not follow --port: with another port, set VOICEBUS_BOOTSTRAP=127.0.0.1:<port> for them.")
    start.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the broker")
    status = sub.add_parser("status", help="say whether the broker runs and answers (exit 0 if it does)")
    stop = sub.add_parser("stop", help="stop the broker started by `voicebus kafka start`")
    for parser, func in ((start, _cmd_start), (status, _cmd_status), (stop, _cmd_stop)):
        parser.add_argument("--port", type=int, metavar="P",
                            help="the broker's client port (default: VOICEBUS_KAFKA_PORT, 9092)")
        parser.add_argument("--controller-port", type=int, metavar="P",
                            help="its KRaft controller port (default: VOICEBUS_KAFKA_CONTROLLER_PORT, 9093)")
        parser.set_defaults(func=func)
    p.set_defaults(func=lambda args, settings: (p.print_help(), 2)[1])


def broker_settings(args, settings: Settings) -> Settings:
    """`--port`/`--controller-port` mapped onto `Settings.kafka_port`/`kafka_controller_port`."""
    changes = {}
    if getattr(args, "port", None) is not None:
        changes["kafka_port"] = args.port
    if getattr(args, "controller_port", None) is not None:
        changes["kafka_controller_port"] = args.controller_port
    return settings.replace(**changes) if changes else settings


def _cmd_fetch(args, settings: Settings) -> int:
    try:
        path = fetch_jars(settings.kafka_dir, settings.kafka_version)
    except BrokerError as exc:
        print(f"voicebus kafka fetch: {exc}", file=sys.stderr)
        return 1
    print(f"Apache Kafka {settings.kafka_version} jars: {path}")
    return 0


def _cmd_start(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    try:
        fetch_jars(settings.kafka_dir, settings.kafka_version)
        broker = LocalKafka.from_settings(settings).start(args.timeout)
    except BrokerError as exc:
        print(f"voicebus kafka start: {exc}", file=sys.stderr)
        return 1
    if broker.bootstrap not in [b.strip() for b in settings.bootstrap.split(",")]:
        print(f"note: VOICEBUS_BOOTSTRAP is {settings.bootstrap}; the other commands reach this broker with "
              f"VOICEBUS_BOOTSTRAP={broker.bootstrap}", file=sys.stderr)
    print(broker.bootstrap)
    return 0


def _cmd_status(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    status = LocalKafka.from_settings(settings).status()
    print(status.describe())
    return 0 if status.answering else 1


def _cmd_stop(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    broker = LocalKafka.from_settings(settings)
    print("stopped" if broker.stop() else "not running")
    return 0
