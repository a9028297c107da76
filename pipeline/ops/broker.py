"""One local Apache Kafka node run by the project itself, without Docker: its classpath, its
configuration and its process (`voicebus.ops.cluster` runs N of them as one cluster;
`voicebus.ops.kafka_cli` is ``voicebus kafka``).

* `fetch_jars` resolves the broker's classpath (the official jars from Maven Central) once with the
  machine's Maven, from `pipeline/ops/maven/kafka/pom.xml`, into ``<kafka_dir>/jars/<version>/``.
* `LocalKafka` writes a KRaft ``server.properties`` (combined broker + controller, loopback only;
  with `Voter`s and `cluster_properties` when it is one node of a cluster), formats its storage
  with `kafka.tools.StorageTool format` (what ``bin/kafka-storage.sh`` runs), and starts
  `kafka.Kafka` (what ``bin/kafka-server-start.sh`` runs) in its own process group. `start()`
  returns once the broker answers a Kafka ApiVersions request (`broker_answers`); `stop()` sends
  SIGTERM, then SIGKILL, and leaves no process. A pid file in the data dir lets another process
  (the CLI's ``status``/``stop``) find the broker, and a lock file keeps a second broker off the
  same state directory.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from voicebus.ops.daemon import (COMPLETE_MARK, DaemonError, MavenFetchError, OwnedProcess, maven_fetch,
                                 state_lock)
from voicebus.ops.kafka_security import SecurityMaterial, broker_properties, scram_format_args
from voicebus.settings import Settings

log = logging.getLogger(__name__)

POM_PATH = Path(__file__).resolve().parent / "maven" / "kafka" / "pom.xml"
SERVER_MAIN = "kafka.Kafka"  # bin/kafka-server-start.sh
STATE_LOCK = "voicebus.lock"  # held by the broker process of a state directory while it runs
STORAGE_TOOL = "kafka.tools.StorageTool"  # bin/kafka-storage.sh
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
    """Resolve Kafka `version`'s runtime jars into ``<kafka_dir>/jars/<version>`` (idempotent;
    `voicebus.ops.daemon.maven_fetch` serialises concurrent callers and never leaves a half-copied
    folder in place)."""

    def install(download: Path, staging: Path) -> None:
        if not list(download.glob(f"kafka_2.13-{version}.jar")):
            raise JarsFetchError(f"mvn brought no kafka_2.13-{version}.jar")
        for jar in download.iterdir():
            jar.rename(staging / jar.name)

    try:
        return maven_fetch(
            jars_dir(kafka_dir, version), pom, [f"-Dkafka.version={version}", "-DincludeScope=runtime"],
            f"Apache Kafka {version}", install,
        )
    except MavenFetchError as exc:
        raise JarsFetchError(str(exc)) from exc


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


def broker_answers(host: str, port: int, timeout: float = 1.0, ssl_context: "ssl.SSLContext | None" = None) -> bool:
    """True when a Kafka broker at host:port answers an ApiVersions (v0) request without error
    (over TLS with `ssl_context`: a SASL_SSL listener answers ApiVersions before authentication).

    A bare TCP connect is not enough: the socket opens before the broker can serve requests.
    """
    request_body = struct.pack(">hhih", 18, 0, 0x7ACE, len(b"voicebus")) + b"voicebus"
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout))
            if ssl_context is not None:
                sock = stack.enter_context(ssl_context.wrap_socket(sock, server_hostname=host))
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
        node_id: int = 1,
        voters: tuple["Voter", ...] = (),
        cluster_id: str | None = None,
        security: SecurityMaterial | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        # A secured node: clients on SASL_SSL (SCRAM), the quorum on mutual TLS, ACLs enforced
        # (voicebus.ops.kafka_security). None: one PLAINTEXT listener, no authorizer.
        self.security = security
        self.jars = Path(jars)
        self.host = host
        self.port = port
        self.controller_port = controller_port
        self.heap = heap
        self.extra_config = dict(extra_config or {})
        self.jvm_options = tuple(jvm_options)
        # One node of a multi-node cluster: its id, every controller of the quorum (this node's
        # included) and the cluster id all nodes are formatted with. Empty voters: a one-node
        # cluster, formatted --standalone with a fresh id.
        self.node_id = node_id
        self.voters = tuple(voters)
        self.cluster_id = cluster_id
        # A broker owned by a process (a test session) must not outlive it even if that process
        # is killed without running its finalizers: the kernel then sends the broker SIGTERM.
        self.die_with_parent = die_with_parent
        self._process = OwnedProcess(
            self.data_dir / "kafka.pid", [SERVER_MAIN.encode(), str(self.properties_file).encode()], die_with_parent
        )

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

    @property
    def listener(self) -> str:
        """The client listener's name (and security protocol)."""
        return "SASL_SSL" if self.security else "PLAINTEXT"

    def probe_ssl_context(self) -> ssl.SSLContext | None:
        """What `broker_answers` wraps its probe in: TLS trusting the node's CA on a secured node."""
        return ssl.create_default_context(cafile=str(self.security.ca_file)) if self.security else None

    def answers(self, timeout: float = 1.0) -> bool:
        return broker_answers(self.host, self.port, timeout, ssl_context=self.probe_ssl_context())

    def server_properties(self) -> dict[str, str]:
        h = self.host
        quorum = ",".join(f"{v.host}:{v.port}" for v in self.voters) or f"{h}:{self.controller_port}"
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.bootstrap.servers": quorum,
            "listeners": f"{self.listener}://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}",
            "advertised.listeners": f"{self.listener}://{h}:{self.port}",
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
            # a topic exists because voicebus created it (with its retention, partitions and
            # replication), never because a client named it in a produce or a metadata request
            "auto.create.topics.enable": "false",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "log.retention.hours": "24",
        }
        if self.voters:
            props.update(cluster_properties(len(self.voters)))
        if self.security:
            props.update(broker_properties(self.security, self.listener))
        props.update(self.extra_config)
        return props

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text(
            "# written by voicebus (pipeline/ops/broker.py); regenerated at every start\n"
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
        if not (self.jars / COMPLETE_MARK).exists() and not list(self.jars.glob("kafka_2.13-*.jar")):
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
        """Format the KRaft storage dir once: ``kafka-storage.sh format --standalone`` for one
        node, ``--initial-controllers`` (the same list and cluster id on every node) for a cluster."""
        if (self.log_dirs / "meta.properties").exists():
            return
        cluster_id = self.cluster_id or new_cluster_id()
        quorum = (["--initial-controllers", ",".join(v.spec() for v in self.voters)] if self.voters
                  else ["--standalone"])
        users = scram_format_args(self.security) if self.security else []
        cmd = self._java_cmd(STORAGE_TOOL, "format", *quorum, *users, "-t", cluster_id, "-c", str(self.properties_file))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.data_dir)
        if proc.returncode != 0:
            raise BrokerStartError(
                f"formatting {self.log_dirs} failed (exit {proc.returncode})", (proc.stdout + proc.stderr)[-3000:]
            )

    def start(self, timeout: float = 90.0) -> "LocalKafka":
        """Start the broker and return once it answers; raise `BrokerStartError` otherwise."""
        existing = self._process.pid()
        if existing is not None:
            if self.answers():
                return self  # already running (started by an earlier `voicebus kafka start`)
            raise BrokerError(f"broker process {existing} from {self.data_dir} is alive but not answering")
        if self.answers(timeout=0.5):
            raise BrokerError(f"another broker already answers at {self.bootstrap}")
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self._process.launched_and_exited()
            if code is not None:
                raise BrokerStartError(f"Kafka exited with code {code} during start", self.log_tail(60))
            if self.answers(timeout=0.5):
                return self
            time.sleep(0.2)
        self.stop()
        raise BrokerStartError(f"Kafka did not answer at {self.bootstrap} within {timeout:.0f} s", self.log_tail(60))

    @property
    def running(self) -> bool:
        """The process of this data dir is alive (whether or not it answers yet)."""
        return self._process.pid() is not None

    def status(self) -> BrokerStatus:
        pid = self._process.pid()
        running = pid is not None
        return BrokerStatus(self.bootstrap, pid, running, running and self.answers())

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the broker (a clean shutdown), SIGKILL it after `timeout`; True if one was stopped."""
        return self._process.stop(timeout)

    def terminate(self) -> int | None:
        """Send SIGTERM (start a controlled shutdown) without waiting; the pid, or None."""
        return self._process.signal(signal.SIGTERM)

    def kill(self) -> int | None:
        """SIGKILL the broker (a crash: no controlled shutdown); its pid, or None if it
        was not running. Returns once the process is gone."""
        try:
            return self._process.kill(10.0)
        except DaemonError as exc:
            raise BrokerError(str(exc)) from exc

    def launch(self) -> None:
        """Start the broker process without waiting for it to answer (a cluster's nodes must all
        be launched before any can answer: a broker serves requests only once the controller
        quorum, a majority of the nodes, has formed). `start` launches and waits."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            with state_lock(self.data_dir / STATE_LOCK, f"the Kafka state directory {self.data_dir}") as fd:
                self._write_config()
                self.format_storage()
                self._process.launch(self._java_cmd(SERVER_MAIN, str(self.properties_file)), self.stdout_file,
                                     self.data_dir, keep_fds=(fd,))
        except DaemonError as exc:
            raise BrokerError(str(exc)) from None

    def exited(self) -> int | None:
        """The exit code of the process this object launched, or None while it runs (or if it
        was launched by another process)."""
        return self._process.exited()

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for path in (self.stdout_file, self.log_file):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    parts.append(f"[{path.name}]\n" + "\n".join(text))
        return "\n".join(parts)


# --- a node of a replicated cluster ------------------------------------------------------------

CLUSTER_MANIFEST = "cluster.json"
# A killed node is fenced (its partitions' leadership and ISR places move to the others) once the
# controller misses its heartbeats for this long. Kafka's 9 s default (2 s heartbeats) would stall
# the partitions it led, and acks=all writes to those it followed, for 9 s or more after a crash;
# 4 s is still 8 missed heartbeats, which a busy machine's pauses do not reach.
CLUSTER_HEARTBEAT_MS = 500
CLUSTER_SESSION_TIMEOUT_MS = 4000
# A follower whose fetch from its leader failed waits this long before it fetches again. Kafka's
# 1 s default is paid right after a leader dies: the surviving follower's fetches to the dead
# leader failed, so it starts fetching from the new leader up to 1 s late, and every acks=all write
# to the partition (min.insync.replicas = 2) waits for it. Measured: the first acked write to a
# partition after a failover came up to 1.1 s after the election at 1 s, 0.15-0.19 s at 100 ms
# (`voicebus bench failover`, an A/B in one run; docs/kafka.md, "Failover").
CLUSTER_REPLICA_FETCH_BACKOFF_MS = 100
# How long `LocalCluster.stop` lets a node without a controller quorum try to shut down cleanly.
QUORUMLESS_GRACE_S = 3.0


@dataclass(frozen=True)
class Voter:
    """One controller of a multi-voter KRaft quorum, as ``kafka-storage format
    --initial-controllers`` names it: ``id@host:port:directory-id``."""

    node_id: int
    host: str
    port: int
    directory_id: str

    def spec(self) -> str:
        return f"{self.node_id}@{self.host}:{self.port}:{self.directory_id}"


def cluster_properties(nodes: int) -> dict[str, str]:
    """What a node of an `nodes`-node cluster adds to the one-node properties: internal topics and
    auto-created topics replicated as voicebus replicates its own (`voicebus.topics.durability`),
    and quicker fencing of a dead node."""
    from voicebus.topics import durability

    durable = durability(Settings(), nodes)
    rf, isr = str(durable.replication_factor), str(durable.min_insync_replicas)
    return {
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "broker.heartbeat.interval.ms": str(CLUSTER_HEARTBEAT_MS),
        "broker.session.timeout.ms": str(CLUSTER_SESSION_TIMEOUT_MS),
        "replica.fetch.backoff.ms": str(CLUSTER_REPLICA_FETCH_BACKOFF_MS),
    }
