"""A replicated local Kafka: N KRaft nodes of `voicebus.ops.broker.LocalKafka` on loopback whose
controllers form one quorum, and the throwaway brokers and clusters the demo and the benchmarks
start for themselves.

* `LocalCluster` runs N nodes (each a combined broker + controller with its own ports and data
  dir) whose controllers form an N-voter quorum, formatted with ``--initial-controllers``; it
  starts, SIGKILLs (`kill`), restarts and stops nodes, and reads which node leads which partition
  from the cluster metadata (`cluster_metadata`, aiokafka's admin client). One node is the single
  `LocalKafka`, in the layout it always had. docs/kafka.md has the details.
* `ensure_local_kafka(settings)` is for the demo and the benchmarks: it uses a broker already
  answering at ``settings.bootstrap`` or starts a throwaway one and stops it on exit
  (``start=False``, a command given ``--bootstrap``: never starts one);
  `ephemeral_cluster(settings, n)` starts an N-node one on free ports for a benchmark's own use
  (`throwaway_cluster`: the same, as settings, for benchmarks that compare sizes).

Size: about 540 lines, most of them `LocalCluster` (start, kill, restart and stop of N nodes and
the metadata it reads). Operations code, not on the runtime path.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from voicebus.ops.broker import (CLUSTER_MANIFEST, DEFAULT_JVM_OPTIONS, QUORUMLESS_GRACE_S, BrokerError, BrokerStartError,
                                 BrokerStatus, LocalKafka, Voter, broker_answers, fetch_jars, jars_dir, new_cluster_id,
                                 parse_bootstrap)
from voicebus.ops.daemon import free_port
from voicebus.ops.kafka_security import SecurityMaterial, client_settings_env
from voicebus.settings import Settings

log = logging.getLogger(__name__)


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
