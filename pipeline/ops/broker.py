"""A local Apache Kafka broker (or a replicated cluster) run by the project itself, without Docker.

This module owns `voicebus kafka fetch|start [--brokers N]|status|kill N|restart N|stop` and the
`LocalKafka` and `LocalCluster` classes behind them:

* `fetch_jars` resolves the broker's classpath (the official jars from Maven Central) once with the
  machine's Maven, from `pipeline/ops/maven/kafka/pom.xml`, into ``<kafka_dir>/jars/<version>/``.
* `LocalKafka` writes a KRaft ``server.properties`` (one node, combined broker + controller,
  loopback only), formats its storage with `kafka.tools.StorageTool format --standalone` (what
  ``bin/kafka-storage.sh`` runs), and starts `kafka.Kafka` (what ``bin/kafka-server-start.sh``
  runs) in its own process group. `start()` returns once the broker answers a Kafka ApiVersions
  request; `stop()` sends SIGTERM, then SIGKILL, and leaves no process. A pid file in the data dir
  lets another process (the CLI's ``status``/``stop``) find the broker.
* `LocalCluster` runs N such nodes (each a combined broker + controller with its own ports and
  data dir) whose controllers form an N-voter quorum, formatted with ``--initial-controllers``;
  it starts, SIGKILLs (`kill`), restarts and stops nodes, and reads which node leads which
  partition from the cluster metadata (`cluster_metadata`, aiokafka's admin client). One node is
  the single `LocalKafka` above, in the layout it always had. docs/kafka.md has the details.
* `ensure_local_kafka(settings)` is for the demo and the benchmarks: it uses a broker already
  answering at ``settings.bootstrap`` or starts a throwaway one and stops it on exit
  (``start=False``, a command given ``--bootstrap``: never starts one);
  `ephemeral_cluster(settings, n)` starts an N-node one on free ports for a benchmark's own use
  (`throwaway_cluster`: the same, as settings, for benchmarks that compare sizes).
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
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from voicebus.ops.daemon import (COMPLETE_MARK, DaemonError, MavenFetchError, OwnedProcess, free_port, maven_fetch,
                                 state_lock)
from voicebus.ops.kafka_security import ROLES, SecurityMaterial, broker_properties, client_settings_env, scram_format_args
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


# --- a replicated cluster ---------------------------------------------------------------------------

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


def cluster_ports(port: int, controller_port: int, nodes: int) -> list[tuple[int, int]]:
    """The (broker, controller) ports of `voicebus kafka start --brokers N`: node i (from 1) uses
    ``port + 2(i-1)`` and ``controller_port + 2(i-1)``, so node 1 keeps the one-node ports (9092,
    9093 by default) and the others follow (9094/9095, 9096/9097)."""
    ports = [(port + 2 * i, controller_port + 2 * i) for i in range(nodes)]
    flat = [p for pair in ports for p in pair]
    if len(set(flat)) != len(flat) or max(flat) > 65535:
        raise BrokerError(f"ports {port} and {controller_port} do not leave {nodes} distinct port pairs "
                          "(node i uses port + 2(i-1) and controller port + 2(i-1))")
    return ports


@dataclass(frozen=True)
class PartitionState:
    topic: str
    partition: int
    leader: int  # -1: no leader
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass(frozen=True)
class ClusterMetadata:
    """What the cluster's metadata says: the brokers registered and not fenced, every partition."""

    brokers: frozenset[int]
    partitions: tuple[PartitionState, ...]

    def leader_of(self, topic: str, partition: int) -> int:
        for p in self.partitions:
            if p.topic == topic and p.partition == partition:
                return p.leader
        raise KeyError(f"{topic}[{partition}] is not in the metadata")

    def partitions_of(self, topic: str) -> list[PartitionState]:
        return sorted((p for p in self.partitions if p.topic == topic), key=lambda p: p.partition)


def leaders_by_node(partitions: Iterable[PartitionState]) -> dict[int, dict[str, list[int]]]:
    """node id -> topic -> the partitions it leads (sorted); leaderless partitions under -1."""
    leads: dict[int, dict[str, list[int]]] = {}
    for p in partitions:
        leads.setdefault(p.leader, {}).setdefault(p.topic, []).append(p.partition)
    for topics in leads.values():
        for parts in topics.values():
            parts.sort()
    return leads


def describe_leads(topics: Mapping[str, list[int]], internal_prefix: str = "__") -> str:
    """``voicebus.audio[0,3] voicebus.control[1] (+12 internal)`` for one node's leaderships."""
    shown = [f"{t}[{','.join(map(str, ps))}]" for t, ps in sorted(topics.items()) if not t.startswith(internal_prefix)]
    internal = sum(len(ps) for t, ps in topics.items() if t.startswith(internal_prefix))
    text = " ".join(shown) if shown else "no topic partitions"
    return text + (f" (+{internal} internal)" if internal else "")


def cluster_metadata(bootstrap: str, timeout: float = 10.0, client: Settings | None = None) -> ClusterMetadata:
    """Ask the cluster (any broker of `bootstrap` that answers) for its brokers and partitions
    (with `client`'s security: a secured cluster's admin).

    Runs aiokafka's admin client on its own event loop in a worker thread, so it may be called
    from synchronous code and from inside a running event loop alike. Raises `BrokerError`.
    """
    import asyncio
    import concurrent.futures

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaConnectionError, KafkaError, NodeNotReadyError, RequestTimedOutError

    from voicebus.bus import client_options

    async def query() -> ClusterMetadata:
        options = client_options(client.replace(bootstrap=bootstrap)) if client else {"bootstrap_servers": bootstrap}
        admin = AIOKafkaAdminClient(**options, request_timeout_ms=int(timeout * 1000))
        await admin.start()
        try:
            while True:
                # The admin client sends each request to a random known broker; right after a
                # crash the metadata still lists the dead one until the controller fences it.
                try:
                    cluster = await admin.describe_cluster()
                    topics = await admin.describe_topics()
                    break
                except (NodeNotReadyError, KafkaConnectionError, RequestTimedOutError):
                    await asyncio.sleep(0.1)
        finally:
            await admin.close()
        partitions = tuple(
            PartitionState(t["topic"], p["partition"], p["leader"], tuple(p["replicas"]), tuple(p["isr"]))
            for t in topics if t["error_code"] == 0
            for p in t["partitions"]
        )
        return ClusterMetadata(frozenset(b["node_id"] for b in cluster["brokers"]), partitions)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="voicebus-metadata") as pool:
        try:
            return pool.submit(asyncio.run, asyncio.wait_for(query(), timeout + 5)).result()
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:
            raise BrokerError(f"no cluster metadata from {bootstrap}: {exc!r}") from exc


@dataclass(frozen=True)
class NodeStatus:
    node_id: int
    broker: BrokerStatus
    controller_port: int
    registered: bool  # in the cluster metadata (registered with the controller, not fenced)
    leads: Mapping[str, list[int]]

    def describe(self) -> str:
        line = f"node {self.node_id}: {self.broker.describe()}, controller port {self.controller_port}"
        if self.broker.answering and not self.registered:
            line += ", not (yet) in the cluster metadata"
        if self.broker.answering:
            line += f"\n  leads {describe_leads(self.leads)}"
        return line


@dataclass(frozen=True)
class ClusterStatus:
    nodes: tuple[NodeStatus, ...]
    metadata_error: str | None = None

    @property
    def healthy(self) -> bool:
        return all(n.broker.answering and n.registered for n in self.nodes)

    def describe(self) -> str:
        answering = sum(n.broker.answering for n in self.nodes)
        if len(self.nodes) == 1:  # the one-node wording `voicebus kafka status` always had
            lines = [self.nodes[0].broker.describe()]
            if self.nodes[0].broker.answering:
                lines.append(f"  leads {describe_leads(self.nodes[0].leads)}")
        else:
            lines = [f"cluster of {len(self.nodes)} nodes, {answering} answering"]
            lines += [n.describe() for n in self.nodes]
        if self.metadata_error:
            lines.append(f"metadata: {self.metadata_error}")
        return "\n".join(lines)


class LocalCluster:
    """N KRaft nodes on loopback, each a combined broker + controller with its own ports and data
    dir; the N controllers form the quorum (N voters, a majority must live), formatted with
    ``kafka-storage format --initial-controllers`` and one cluster id.

    One node is exactly the `LocalKafka` of a single broker (its data dir is `root` itself,
    formatted ``--standalone``). With more, node i's data dir is ``root/node-<i>`` and
    ``root/cluster.json`` keeps the cluster id, the ports and each controller's directory id,
    so a node restarted (or the cluster started again) rejoins the same cluster.
    """

    def __init__(
        self,
        root: Path,
        jars: Path,
        ports: list[tuple[int, int]],
        host: str = "127.0.0.1",
        heap: str = "512m",
        extra_config: Mapping[str, str] | None = None,
        jvm_options: tuple[str, ...] = DEFAULT_JVM_OPTIONS,
        die_with_parent: bool = False,
        secure: bool = False,
    ) -> None:
        if not ports:
            raise BrokerError("a cluster needs at least one node")
        flat = [p for pair in ports for p in pair]
        if len(set(flat)) != len(flat):
            raise BrokerError(f"the nodes' ports are not distinct: {ports}")
        self.root = Path(root)
        self.host = host
        # one CA, node certificate and set of role users for the whole cluster
        self.security = SecurityMaterial(self.root / "security").ensure() if secure else None
        common = dict(host=host, heap=heap, extra_config=extra_config, jvm_options=jvm_options,
                      die_with_parent=die_with_parent, security=self.security)
        if len(ports) == 1:
            self.cluster_id = None
            self.nodes = [LocalKafka(self.root, jars, port=ports[0][0], controller_port=ports[0][1], **common)]
            return
        manifest = self._manifest()
        if manifest is not None and [tuple(n["ports"]) for n in manifest["nodes"]] != [tuple(p) for p in ports]:
            raise BrokerError(f"the cluster in {self.root} was made with ports "
                              f"{[tuple(n['ports']) for n in manifest['nodes']]}, not {ports}")
        if manifest is None:
            manifest = {"cluster_id": new_cluster_id(),
                        "nodes": [{"node_id": i + 1, "ports": list(pair), "directory_id": new_cluster_id()}
                                  for i, pair in enumerate(ports)]}
        self._manifest_data = manifest
        self.cluster_id = manifest["cluster_id"]
        voters = tuple(Voter(n["node_id"], host, n["ports"][1], n["directory_id"]) for n in manifest["nodes"])
        self.nodes = [
            LocalKafka(self.root / f"node-{n['node_id']}", jars, port=n["ports"][0], controller_port=n["ports"][1],
                       node_id=n["node_id"], voters=voters, cluster_id=self.cluster_id, **common)
            for n in manifest["nodes"]
        ]

    @classmethod
    def from_settings(cls, settings: Settings, brokers: int | None = None, secure: bool | None = None) -> "LocalCluster":
        """The cluster `voicebus kafka` runs: ``<cache>/kafka/node-<port>`` for one node (the
        layout one broker always had), ``<cache>/kafka/cluster-<port>`` for more, and the same
        names with ``secure-`` before them for a secured one. Without `brokers` (status, kill,
        restart, stop): the cluster made there by an earlier ``start --brokers N``, unless the
        one-node broker is the one running; without `secure`, the secured one where a secured
        one runs and no plain one does."""
        if secure is None:
            plain = cls.from_settings(settings, brokers, secure=False)
            if any(n.running for n in plain.nodes):
                return plain
            guarded = cls.from_settings(settings, brokers, secure=True) if cls._secure_state_exists(settings) else None
            return guarded if guarded is not None and any(n.running for n in guarded.nodes) else plain
        kafka_dir = Path(settings.kafka_dir)
        prefix = "secure-" if secure else ""
        single = kafka_dir / f"{prefix}node-{settings.kafka_port}"
        multi = kafka_dir / f"{prefix}cluster-{settings.kafka_port}"
        common = dict(jars=jars_dir(settings.kafka_dir, settings.kafka_version),
                      extra_config={"num.partitions": str(settings.partitions)}, secure=secure)
        if brokers is None:
            manifest = cls._read_manifest(multi)
            one = cls(single, ports=[(settings.kafka_port, settings.kafka_controller_port)], **common)
            if manifest is None or one.nodes[0].status().running:
                return one
            brokers = len(manifest["nodes"])
        if brokers < 1:
            raise BrokerError(f"--brokers {brokers}: a cluster needs at least one node")
        root = single if brokers == 1 else multi
        return cls(root, ports=cluster_ports(settings.kafka_port, settings.kafka_controller_port, brokers), **common)

    @staticmethod
    def _secure_state_exists(settings: Settings) -> bool:
        kafka_dir = Path(settings.kafka_dir)
        return any((kafka_dir / f"secure-{kind}-{settings.kafka_port}").exists() for kind in ("node", "cluster"))

    # --- addresses ---------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        """Every node's address: a client finds the cluster through any node that answers."""
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def ports(self) -> list[tuple[int, int]]:
        return [(n.port, n.controller_port) for n in self.nodes]

    def node(self, node_id: int) -> LocalKafka:
        if not 1 <= node_id <= len(self.nodes):
            raise BrokerError(f"no node {node_id}: the cluster has nodes 1 to {len(self.nodes)}")
        return self.nodes[node_id - 1]

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "LocalCluster":
        """Start every node that is not running and return once all answer and are registered in
        the cluster metadata; on failure, stop the nodes this call started and raise."""
        to_launch = []
        for node in self.nodes:
            status = node.status()
            if status.running:
                continue
            if node.answers(timeout=0.5):
                raise BrokerError(f"another broker already answers at {node.bootstrap}")
            to_launch.append(node)
        self._write_manifest()
        try:
            for node in to_launch:
                node.launch()
            self.wait_ready(timeout)
        except BaseException:
            for node in to_launch:
                node.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 120.0, nodes: list[LocalKafka] | None = None) -> ClusterMetadata:
        """Wait until `nodes` (default: all) answer and the metadata lists them as brokers."""
        nodes = self.nodes if nodes is None else nodes
        deadline = time.monotonic() + timeout
        waiting_for = "the nodes to answer"
        while time.monotonic() < deadline:
            for node in nodes:
                code = node.exited()
                if code is not None:
                    raise BrokerStartError(f"Kafka node {node.node_id} exited with code {code} during start",
                                           node.log_tail(60))
            if all(n.answers(timeout=0.5) for n in nodes):
                waiting_for = "the nodes to register with the controller quorum"
                try:
                    metadata = self.metadata(timeout=5.0)
                except BrokerError:
                    metadata = None
                if metadata is not None and {n.node_id for n in nodes} <= metadata.brokers:
                    return metadata
            time.sleep(0.25)
        tails = "\n".join(f"--- node {n.node_id} ---\n{n.log_tail(30)}" for n in nodes)
        raise BrokerStartError(f"the cluster at {self.bootstrap} was not ready within {timeout:.0f} s "
                               f"(waiting for {waiting_for})", tails)

    def wait_in_sync(self, timeout: float = 120.0, topics: Iterable[str] | None = None) -> ClusterMetadata:
        """Wait until every node is registered and every partition (of `topics`, default all; each
        of them must be in the metadata) has a leader and all its replicas in sync: the state to
        run the next chaos step from."""
        wanted = set(topics) if topics is not None else None
        deadline = time.monotonic() + timeout
        last = "no metadata yet"
        while time.monotonic() < deadline:
            try:
                metadata = cluster_metadata(self.bootstrap, timeout=5.0)
            except BrokerError as exc:
                last = str(exc)
            else:
                lagging = [p for p in metadata.partitions
                           if (wanted is None or p.topic in wanted)
                           and (p.leader < 0 or set(p.isr) != set(p.replicas))]
                missing = (wanted or set()) - {p.topic for p in metadata.partitions}
                if metadata.brokers >= {n.node_id for n in self.nodes} and not lagging and not missing:
                    return metadata
                last = (f"brokers {sorted(metadata.brokers)}, {len(lagging)} partitions not fully in sync, "
                        f"topics not in the metadata yet: {sorted(missing)}")
            time.sleep(0.25)
        raise BrokerError(f"the cluster at {self.bootstrap} did not get back in sync within {timeout:.0f} s: {last}")

    def kill(self, node_id: int) -> int | None:
        """SIGKILL node `node_id` (a crash); its pid, or None if it was not running."""
        return self.node(node_id).kill()

    def restart(self, node_id: int, timeout: float = 120.0) -> LocalKafka:
        """Start node `node_id` again (stopping it first if it runs); return once it answers and is
        registered in the metadata again. Its replicas catch up afterwards (`wait_in_sync`)."""
        node = self.node(node_id)
        node.stop()
        if broker_answers(node.host, node.port, timeout=0.5):
            raise BrokerError(f"another broker already answers at {node.bootstrap}")
        node.launch()
        try:
            self.wait_ready(timeout, nodes=[node])
        except BaseException:
            node.stop()
            raise
        return node

    def stop(self, timeout: float = 20.0, quorumless_grace: float = QUORUMLESS_GRACE_S) -> int:
        """Stop every node (SIGTERM to all at once, a controlled shutdown each); how many ran.

        A node's controlled shutdown needs the controller quorum, a majority of the nodes: once
        the others have exited it cannot finish and would wait for minutes, so a node still alive
        `quorumless_grace` seconds after the quorum is gone is SIGKILLed (its log is recovered at
        the next start; nothing acknowledged is lost: Kafka's data is in the page cache, not the
        process), as is any node alive after `timeout`. Returns once no node process is left.
        """
        if len(self.nodes) == 1:
            return int(self.nodes[0].stop(timeout))
        pids = {n.node_id: pid for n in self.nodes if (pid := n.terminate()) is not None}
        majority = len(self.nodes) // 2 + 1
        deadline = time.monotonic() + timeout
        quorum_lost_at = None
        while time.monotonic() < deadline:
            alive = [n for n in self.nodes if n.node_id in pids and n.running]
            if not alive:
                break
            if len(alive) < majority:
                quorum_lost_at = quorum_lost_at or time.monotonic()
                if time.monotonic() - quorum_lost_at > quorumless_grace:
                    break
            time.sleep(0.05)
        for node in self.nodes:
            if node.node_id in pids and node.running:
                log.warning("node %d did not finish its controlled shutdown (no controller quorum left): SIGKILL",
                            node.node_id)
                node.kill()
            node.stop(0)  # reaps our child and removes the pid file
        return len(pids)

    def status(self) -> ClusterStatus:
        brokers = [n.status() for n in self.nodes]
        metadata, error = None, None
        if any(b.answering for b in brokers):
            try:
                metadata = cluster_metadata(self.bootstrap, timeout=5.0)
            except BrokerError as exc:
                error = str(exc)
        leads = leaders_by_node(metadata.partitions) if metadata else {}
        return ClusterStatus(tuple(
            NodeStatus(n.node_id, b, n.controller_port, bool(metadata and n.node_id in metadata.brokers),
                       leads.get(n.node_id, {}))
            for n, b in zip(self.nodes, brokers)
        ), error)

    def metadata(self, timeout: float = 10.0) -> ClusterMetadata:
        return cluster_metadata(self.bootstrap, timeout, self.client_settings("admin"))

    def client_settings(self, role: str = "admin", base: Settings | None = None) -> Settings | None:
        """Settings with which a process of `role` reaches this cluster (its bootstrap and, on a
        secured cluster, the role's SASL user, password file and the CA); None for a plain
        cluster without `base`."""
        if self.security is None:
            return None if base is None else base.replace(bootstrap=self.bootstrap)
        env = client_settings_env(self.security, role, self.bootstrap)
        return Settings.from_env(env) if base is None else base.replace(**Settings.from_env(env).model_dump(
            include={"bootstrap", "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username",
                     "kafka_sasl_password", "kafka_ssl_cafile"}))

    # --- the manifest ----------------------------------------------------------------------------
    def _manifest(self) -> dict | None:
        return self._read_manifest(self.root)

    @staticmethod
    def _read_manifest(root: Path) -> dict | None:
        import json

        path = Path(root) / CLUSTER_MANIFEST
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise BrokerError(f"{path} is unreadable: {exc}") from exc

    def _write_manifest(self) -> None:
        import json

        if len(self.nodes) == 1:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / CLUSTER_MANIFEST
        if not path.exists():
            path.write_text(json.dumps(self._manifest_data, indent=2) + "\n")


# --- for the demo and the benchmarks -----------------------------------------------------------


@contextlib.contextmanager
def ensure_local_kafka(settings: Settings, start_timeout: float = 90.0, *, start: bool = True) -> Iterator[Settings]:
    """Yield settings pointed at a broker that answers.

    Uses the broker already answering at ``settings.bootstrap`` (or the secured bus the settings
    name, as they are); otherwise (loopback only) fetches
    the jars, starts a throwaway broker on that port in a temporary data dir, and stops it and
    removes the dir on exit. ``start=False`` (a command given ``--bootstrap``): the settings as
    they are, whether a broker answers there or not; nothing is started.
    """
    if not start or settings.kafka_security_protocol != "PLAINTEXT":
        yield settings  # a named bus, or a secured one, is the operator's: voicebus starts only plaintext throwaway brokers
        return
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


@contextlib.contextmanager
def ephemeral_cluster(settings: Settings, brokers: int, start_timeout: float = 240.0,
                      jvm_options: tuple[str, ...] = DEFAULT_JVM_OPTIONS, partitions: int | None = None,
                      prefix: str = "ephemeral", extra_config: Mapping[str, str] | None = None) -> Iterator[LocalCluster]:
    """Start a `brokers`-node cluster on free loopback ports in a temporary data dir under the
    cache, yield it (its nodes can be killed and restarted), and stop it and remove the dir on
    exit; nothing of the machine's own broker is touched. `partitions`: the cluster's default
    ``num.partitions`` (`settings.partitions` when None); `extra_config`: node properties over
    voicebus's own (a benchmark's A/B of one of them)."""
    jars = fetch_jars(settings.kafka_dir, settings.kafka_version)
    Path(settings.kafka_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{prefix}-{brokers}x-", dir=settings.kafka_dir))
    ports: list[int] = []
    while len(ports) < 2 * brokers:
        port = free_port()
        if port not in ports:
            ports.append(port)
    cluster = LocalCluster(root, jars, ports=[(ports[2 * i], ports[2 * i + 1]) for i in range(brokers)],
                           extra_config={"num.partitions": str(settings.partitions if partitions is None else partitions),
                                         **(extra_config or {})},
                           jvm_options=jvm_options, die_with_parent=True)
    try:
        cluster.start(start_timeout)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def throwaway_cluster(settings: Settings, brokers: int, start_timeout: float = 240.0,
                      jvm_options: tuple[str, ...] = DEFAULT_JVM_OPTIONS) -> Iterator[Settings]:
    """An `ephemeral_cluster`, as settings pointed at all its nodes (for benchmarks that compare
    cluster sizes)."""
    with ephemeral_cluster(settings, brokers, start_timeout, jvm_options) as cluster:
        yield settings.replace(bootstrap=cluster.bootstrap)


# --- CLI -----------------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser("kafka", help="run a local Apache Kafka (KRaft on loopback, 1 or more nodes, no Docker)")
    sub = p.add_subparsers(dest="kafka_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="resolve the Kafka jars from Maven Central (once, cached)")
    fetch.set_defaults(func=_cmd_fetch)
    start = sub.add_parser(
        "start", help="start the broker(s); returns once they answer, printing the bootstrap list",
        description="Start a local Kafka (KRaft, loopback): one node, or --brokers N nodes whose controllers form "
                    "the quorum. Prints the bootstrap list once every node answers. The other voicebus commands "
                    "connect to VOICEBUS_BOOTSTRAP (default 127.0.0.1:9092), which does not follow --port: with "
                    "another port, set VOICEBUS_BOOTSTRAP=127.0.0.1:<port> for them (for a cluster, the printed "
                    "list).")
    start.add_argument("--brokers", type=int, default=1,
                       help="nodes (combined broker + controller, a quorum of all of them); default 1. "
                            "Node i uses the port + 2(i-1) and the controller port + 2(i-1)")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the nodes")
    start.add_argument("--secure", action="store_true",
                       help="SASL_SSL (SCRAM-SHA-512 over TLS) for clients, mutual TLS between nodes, ACLs "
                            "enforced; a CA, certificates and one user per role (admin, agent, gate, worker, edge) "
                            "are generated once; prints the VOICEBUS_KAFKA_* lines of --role to export")
    start.add_argument("--role", default="admin", choices=ROLES,
                       help="whose VOICEBUS_KAFKA_* lines --secure prints (default admin)")
    env = sub.add_parser("env", help="the VOICEBUS_* lines a role exports to reach the secured local broker "
                                     "(the password as a file, never its value)")
    env.add_argument("--role", default="admin", choices=ROLES)
    status = sub.add_parser("status", help="every node: alive, answering, ports, partitions it leads "
                                           "(exit 0 if all answer)")
    kill = sub.add_parser("kill", help="SIGKILL node N (a crash, for chaos runs)")
    kill.add_argument("node", type=int, help="node id (1 to the number of brokers)")
    restart = sub.add_parser("restart", help="start node N again (stopping it first if it runs)")
    restart.add_argument("node", type=int, help="node id (1 to the number of brokers)")
    restart.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the node")
    stop = sub.add_parser("stop", help="stop every node started by `voicebus kafka start`")
    for parser, func in ((start, _cmd_start), (status, _cmd_status), (kill, _cmd_kill), (restart, _cmd_restart),
                         (stop, _cmd_stop), (env, _cmd_env)):
        parser.add_argument("--port", type=int, metavar="P",
                            help="node 1's client port (default: VOICEBUS_KAFKA_PORT, 9092)")
        parser.add_argument("--controller-port", type=int, metavar="P",
                            help="node 1's KRaft controller port (default: VOICEBUS_KAFKA_CONTROLLER_PORT, 9093)")
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
        cluster = LocalCluster.from_settings(settings, brokers=args.brokers, secure=args.secure).start(args.timeout)
    except BrokerError as exc:
        print(f"voicebus kafka start: {exc}", file=sys.stderr)
        return 1
    if cluster.security is not None:
        print(cluster.bootstrap)
        print(f"# SASL_SSL (SCRAM-SHA-512 over TLS) at {cluster.bootstrap}; the settings of {args.role}:")
        _print_exports(cluster, args.role)
        return 0
    configured = {b.strip() for b in settings.bootstrap.split(",")}
    if not configured & {n.bootstrap for n in cluster.nodes}:
        print(f"note: VOICEBUS_BOOTSTRAP is {settings.bootstrap}; the other commands reach this "
              f"{'broker' if len(cluster.nodes) == 1 else 'cluster'} with VOICEBUS_BOOTSTRAP={cluster.bootstrap}",
              file=sys.stderr)
    print(cluster.bootstrap)
    return 0


def _print_exports(cluster: LocalCluster, role: str) -> None:
    for name, value in client_settings_env(cluster.security, role, cluster.bootstrap).items():
        print(f"export {name}={value}")


def _cmd_env(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    try:
        cluster = LocalCluster.from_settings(settings, secure=True) if LocalCluster._secure_state_exists(settings) else None
    except BrokerError as exc:
        print(f"voicebus kafka env: {exc}", file=sys.stderr)
        return 1
    if cluster is None:
        print("voicebus kafka env: no secured local broker here (start one with `voicebus kafka start --secure`)",
              file=sys.stderr)
        return 1
    _print_exports(cluster, args.role)
    return 0


def _cmd_status(args, settings: Settings) -> int:
    try:
        status = LocalCluster.from_settings(broker_settings(args, settings)).status()
    except BrokerError as exc:
        print(f"voicebus kafka status: {exc}", file=sys.stderr)
        return 1
    print(status.describe())
    return 0 if status.healthy else 1


def _cmd_kill(args, settings: Settings) -> int:
    try:
        pid = LocalCluster.from_settings(broker_settings(args, settings)).kill(args.node)
    except BrokerError as exc:
        print(f"voicebus kafka kill: {exc}", file=sys.stderr)
        return 1
    print(f"killed node {args.node} (pid {pid})" if pid is not None else f"node {args.node} was not running")
    return 0 if pid is not None else 1


def _cmd_restart(args, settings: Settings) -> int:
    try:
        node = LocalCluster.from_settings(broker_settings(args, settings)).restart(args.node, timeout=args.timeout)
    except BrokerError as exc:
        print(f"voicebus kafka restart: {exc}", file=sys.stderr)
        return 1
    print(node.bootstrap)
    return 0


def _cmd_stop(args, settings: Settings) -> int:
    try:
        cluster = LocalCluster.from_settings(broker_settings(args, settings))
    except BrokerError as exc:
        print(f"voicebus kafka stop: {exc}", file=sys.stderr)
        return 1
    stopped = cluster.stop()
    if not stopped:
        print("not running")
    elif len(cluster.nodes) == 1:
        print("stopped")
    else:
        print(f"stopped {stopped} of {len(cluster.nodes)} nodes")
    return 0
