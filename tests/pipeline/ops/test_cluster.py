"""The replicated local cluster: 3 KRaft nodes, leaderships, a SIGKILLed leader, a restart, a stop
that leaves no process; and the CLI (`voicebus kafka start --brokers 3|status|kill|restart|stop`)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from voicebus.ops.broker import CLUSTER_MANIFEST, BrokerError, broker_answers, cluster_properties
from voicebus.ops.cluster import LocalCluster, PartitionState, cluster_ports, describe_leads, leaders_by_node
from voicebus.bus import ensure_topics, make_consumer, make_producer
from voicebus.settings import Settings
from tests.processes import kafka_pids_under
from tests.waiting import eventually


# --- pure ------------------------------------------------------------------------------------------


def test_cluster_ports_keep_node_1_on_the_one_node_ports_and_stay_distinct():
    assert cluster_ports(9092, 9093, 1) == [(9092, 9093)]
    assert cluster_ports(9092, 9093, 3) == [(9092, 9093), (9094, 9095), (9096, 9097)]
    with pytest.raises(BrokerError, match="distinct"):
        cluster_ports(9092, 9094, 3)  # node 2's broker port would be node 1's controller port


def test_a_cluster_node_is_configured_for_a_3_voter_quorum(tmp_path):
    cluster = LocalCluster(tmp_path, tmp_path / "jars", ports=[(1000, 1001), (1002, 1003), (1004, 1005)])
    props = [n.server_properties() for n in cluster.nodes]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    assert {p["controller.quorum.bootstrap.servers"] for p in props} == {
        "127.0.0.1:1001,127.0.0.1:1003,127.0.0.1:1005"}
    assert props[1]["listeners"] == "PLAINTEXT://127.0.0.1:1002,CONTROLLER://127.0.0.1:1003"
    assert "controller.quorum.voters" not in props[0]  # the dynamic quorum: --initial-controllers
    for p in props:
        assert p["offsets.topic.replication.factor"] == "3"
        assert p["min.insync.replicas"] == "2" and p["default.replication.factor"] == "3"
        assert p["transaction.state.log.min.isr"] == "2"
    assert cluster.bootstrap == "127.0.0.1:1000,127.0.0.1:1002,127.0.0.1:1004"
    assert len({n.data_dir for n in cluster.nodes}) == 3
    voters = cluster.nodes[0].voters
    assert [v.spec().split(":")[0] for v in voters] == ["1@127.0.0.1", "2@127.0.0.1", "3@127.0.0.1"]
    assert len({v.directory_id for v in voters}) == 3


def test_a_one_node_cluster_is_the_single_broker_as_before(tmp_path):
    cluster = LocalCluster(tmp_path, tmp_path / "jars", ports=[(1000, 1001)])
    (node,) = cluster.nodes
    assert node.data_dir == tmp_path and node.voters == ()
    props = node.server_properties()
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props
    assert cluster_properties(1)["min.insync.replicas"] == "1"


def test_the_manifest_keeps_the_cluster_identity_and_refuses_other_ports(tmp_path):
    ports = [(1000, 1001), (1002, 1003), (1004, 1005)]
    first = LocalCluster(tmp_path, tmp_path / "jars", ports=ports)
    first._write_manifest()
    again = LocalCluster(tmp_path, tmp_path / "jars", ports=ports)
    assert again.cluster_id == first.cluster_id
    assert again.nodes[2].voters == first.nodes[2].voters
    with pytest.raises(BrokerError, match="was made with ports"):
        LocalCluster(tmp_path, tmp_path / "jars", ports=[(2000, 2001), (2002, 2003), (2004, 2005)])


def test_the_cli_finds_the_cluster_an_earlier_start_made(tmp_path):
    settings = Settings(cache_dir=tmp_path, kafka_port=1000, kafka_controller_port=1001)
    assert len(LocalCluster.from_settings(settings).nodes) == 1  # nothing made yet: one node
    made = LocalCluster.from_settings(settings, brokers=3)
    made._write_manifest()
    assert made.root == tmp_path / "kafka" / "cluster-1000"
    found = LocalCluster.from_settings(settings)
    assert found.ports == [(1000, 1001), (1002, 1003), (1004, 1005)] and found.cluster_id == made.cluster_id
    assert LocalCluster.from_settings(settings, brokers=1).nodes[0].data_dir == tmp_path / "kafka" / "node-1000"


def test_leaderships_are_grouped_by_node_and_described():
    parts = [PartitionState("a", 1, 2, (2, 1), (2, 1)), PartitionState("a", 0, 2, (2, 1), (2,)),
             PartitionState("b", 0, 1, (1, 2), (1, 2)), PartitionState("__consumer_offsets", 3, 1, (1,), (1,)),
             PartitionState("b", 1, -1, (3,), ())]
    leads = leaders_by_node(parts)
    assert leads == {2: {"a": [0, 1]}, 1: {"b": [0], "__consumer_offsets": [3]}, -1: {"b": [1]}}
    assert describe_leads(leads[2]) == "a[0,1]"
    assert describe_leads(leads[1]) == "b[0] (+1 internal)"
    assert describe_leads({}) == "no topic partitions"


# --- the session's 3-node cluster -------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(300)
async def test_topics_on_the_cluster_are_replicated_3_times_and_every_node_leads_some(
        kafka_cluster, make_cluster_settings):
    settings = make_cluster_settings()
    await ensure_topics(settings, [settings.audio_topic])
    metadata = await asyncio.to_thread(kafka_cluster.wait_in_sync, 120, [settings.audio_topic])
    parts = metadata.partitions_of(settings.audio_topic)
    assert len(parts) == settings.partitions
    assert all(len(p.replicas) == 3 for p in parts)
    status = await asyncio.to_thread(kafka_cluster.status)
    assert status.healthy and [n.node_id for n in status.nodes] == [1, 2, 3]
    led = {(settings.audio_topic, p) for n in status.nodes for p in n.leads.get(settings.audio_topic, [])}
    assert led == {(settings.audio_topic, p.partition) for p in parts}  # each partition has one leader
    assert all(n.leads for n in status.nodes)  # leadership is spread: every node leads something
    text = status.describe()
    assert "cluster of 3 nodes, 3 answering" in text
    for node in kafka_cluster.nodes:
        assert f"node {node.node_id}: running" in text and f"answering at {node.bootstrap}" in text


@pytest.mark.kafka
@pytest.mark.long  # the same fault through the whole pipeline: test_bench_chaos's broker_leader case
@pytest.mark.timeout(420)
async def test_a_sigkilled_leader_hands_over_and_acks_all_writes_go_on(kafka_cluster, make_cluster_settings):
    settings = make_cluster_settings(partitions=3)
    topic = settings.control_topic
    await ensure_topics(settings, [topic])
    await asyncio.to_thread(kafka_cluster.wait_in_sync, 120, [topic])
    sent: list[bytes] = []
    async with make_producer(settings) as producer:
        for i in range(3):
            await producer.send_and_wait(topic, f"before {i}".encode(), partition=i)
            sent.append(f"before {i}".encode())

    leader = (await asyncio.to_thread(kafka_cluster.metadata)).leader_of(topic, 0)
    assert leader in (1, 2, 3)
    pid = await asyncio.to_thread(kafka_cluster.kill, leader)
    assert pid is not None and not kafka_cluster.node(leader).running
    try:
        killed_at = time.monotonic()
        # Services starting now: until the controller fences the dead node (seconds) it is still in
        # the metadata, and the admin client sends each request to a random known broker. Each
        # call makes three requests; one reaching the dead node failed at once before the retry.
        for i in range(6):
            await ensure_topics(settings, [f"{settings.playback_topic}.{i}"], partitions=1)

        def moved():
            m = kafka_cluster.metadata()
            p0 = m.partitions_of(topic)[0]
            return p0.leader not in (leader, -1) and leader not in p0.isr and m

        metadata = await eventually(lambda: asyncio.to_thread(moved), timeout_s=60, interval_s=0.2,
                                    what=f"partition 0's leadership to leave node {leader}")
        handover_s = time.monotonic() - killed_at
        assert leader not in metadata.brokers  # fenced
        status = await asyncio.to_thread(kafka_cluster.status)
        assert not status.healthy
        assert f"node {leader}: not running" in status.describe()

        # acks=all with min.insync.replicas=2: two of three replicas take every partition's writes
        async with make_producer(settings) as producer:
            for i in range(3):
                await asyncio.wait_for(producer.send_and_wait(topic, f"after {i}".encode(), partition=i), 60)
                sent.append(f"after {i}".encode())
    finally:
        await asyncio.to_thread(kafka_cluster.restart, leader)
    metadata = await asyncio.to_thread(kafka_cluster.wait_in_sync, 180, [topic])
    assert leader in metadata.partitions_of(topic)[0].isr  # the restarted node caught up
    assert kafka_cluster.status().healthy

    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, i) for i in range(3)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        got: list[bytes] = []

        async def read_all():
            while len(got) < len(sent):
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    got.extend(r.value for r in records)

        await asyncio.wait_for(read_all(), 60)
    finally:
        await consumer.stop()
    assert sorted(got) == sorted(sent)  # nothing acknowledged was lost, nothing doubled
    print(f"leadership of {topic}[0] left killed node {leader} after {handover_s:.1f} s")


# --- the CLI, on a cluster of its own ----------------------------------------------------------------


def _base_ports_for(nodes: int) -> tuple[int, int]:
    """A port p with p..p+2*nodes-1 all free: the CLI's layout (node i: p+2(i-1), p+1+2(i-1))."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 * nodes > 65535:
            continue
        try:
            socks = []
            for port in range(base, base + 2 * nodes):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base, base + 1
    raise RuntimeError("no run of free ports")


@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_cli_cluster_start_status_kill_restart_stop_leaves_no_process(kafka_jars, tmp_path):
    shared = Settings.from_env()
    port, controller_port = _base_ports_for(3)
    env = {
        **os.environ,
        "VOICEBUS_CACHE_DIR": str(tmp_path),
        "VOICEBUS_KAFKA_PORT": str(port),
        "VOICEBUS_KAFKA_CONTROLLER_PORT": str(controller_port),
        "VOICEBUS_KAFKA_VERSION": shared.kafka_version,
    }
    (tmp_path / "kafka" / "jars").mkdir(parents=True)
    (tmp_path / "kafka" / "jars" / shared.kafka_version).symlink_to(kafka_jars)
    root = tmp_path / "kafka" / f"cluster-{port}"
    addresses = [f"127.0.0.1:{port + 2 * i}" for i in range(3)]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "voicebus", "kafka", *args], env=env,
                              capture_output=True, text=True, timeout=300)

    try:
        started = cli("start", "--brokers", "3", "--timeout", "240")
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == ",".join(addresses)
        assert (root / CLUSTER_MANIFEST).exists()
        assert len(kafka_pids_under(root)) == 3

        status = cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "cluster of 3 nodes, 3 answering" in status.stdout
        for i, address in enumerate(addresses, 1):
            assert f"node {i}: running" in status.stdout and address in status.stdout
        assert status.stdout.count("  leads ") == 3

        killed = cli("kill", "2")
        assert killed.returncode == 0 and "killed node 2" in killed.stdout
        assert len(kafka_pids_under(root)) == 2
        assert not broker_answers("127.0.0.1", port + 2, timeout=0.3)
        degraded = cli("status")
        assert degraded.returncode == 1
        assert "node 2: not running" in degraded.stdout and "2 answering" in degraded.stdout
        assert cli("kill", "2").returncode == 1  # nothing left to kill
        assert cli("kill", "4").returncode == 1  # no such node

        restarted = cli("restart", "2", "--timeout", "240")
        assert restarted.returncode == 0, restarted.stderr
        assert restarted.stdout.strip() == addresses[1]
        assert cli("status").returncode == 0

        stopped = cli("stop")
        assert stopped.returncode == 0 and "stopped 3 of 3 nodes" in stopped.stdout
        assert kafka_pids_under(root) == []
        assert not any(broker_answers("127.0.0.1", port + 2 * i, timeout=0.3) for i in range(3))
        after = cli("status")
        assert after.returncode == 1 and after.stdout.count("not running") == 3
        assert cli("stop").stdout.strip() == "not running"
    finally:
        for pid in kafka_pids_under(root):  # only if an assertion failed mid-way
            os.kill(pid, 9)
