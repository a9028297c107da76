"""The local broker: start/status/stop of a real Kafka, across processes, leaving no process."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from voicebus.ops.broker import BrokerError, LocalKafka, broker_answers, new_cluster_id, parse_bootstrap
from voicebus.ops.cluster import ensure_local_kafka
from voicebus.ops.daemon import free_port
from voicebus.settings import Settings
from tests.processes import kafka_pids_under


def test_parse_bootstrap_takes_the_first_address():
    assert parse_bootstrap("127.0.0.1:9092,other:1") == ("127.0.0.1", 9092)
    assert parse_bootstrap("kafka://localhost:19092") == ("localhost", 19092)


def test_cluster_ids_are_drawn_as_kafka_draws_them():
    # 0xF8 encodes to "-" first: such an id made `kafka-storage format -t <id>` fail (seen in a
    # run). Kafka's Uuid.randomUuid also redraws a "-" anywhere and its reserved ids.
    good = bytes([0x10]) + bytes(range(15))
    draws = iter([bytes([0xF8]) + bytes(15), bytes([0x10, 0x0F, 0x80]) + bytes(13), bytes(16), bytes(15) + b"\x01", good])
    assert new_cluster_id(lambda: next(draws)) == base64.urlsafe_b64encode(good).rstrip(b"=").decode()
    assert next(draws, None) is None, "every bad draw was redrawn"
    ids = [new_cluster_id() for _ in range(2000)]
    assert all(len(i) == 22 and "-" not in i for i in ids) and len(set(ids)) == 2000


def test_broker_answers_is_false_on_a_closed_port():
    assert broker_answers("127.0.0.1", free_port(), timeout=0.3) is False


def test_server_properties_are_kraft_single_node_on_loopback(tmp_path):
    broker = LocalKafka(tmp_path, tmp_path / "jars", port=1234, controller_port=1235)
    props = broker.server_properties()
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:1234,CONTROLLER://127.0.0.1:1235"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["auto.create.topics.enable"] == "false"  # a topic exists because voicebus created it


def test_a_secured_node_serves_sasl_ssl_and_enforces_acls(tmp_path):
    from voicebus.ops.kafka_security import SecurityMaterial

    material = SecurityMaterial(tmp_path / "security").ensure()
    props = LocalKafka(tmp_path, tmp_path / "jars", port=1234, controller_port=1235, security=material).server_properties()
    assert props["listeners"] == "SASL_SSL://127.0.0.1:1234,CONTROLLER://127.0.0.1:1235"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SSL"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    assert (tmp_path / "security" / "admin.password").stat().st_mode & 0o077 == 0


@pytest.mark.kafka
def test_session_broker_answers(kafka_broker):
    assert broker_answers(*parse_bootstrap(kafka_broker.bootstrap))
    assert kafka_broker.status().answering


@pytest.mark.kafka
def test_ensure_local_kafka_uses_a_broker_that_already_answers(make_settings, kafka_broker):
    settings = make_settings()
    with ensure_local_kafka(settings) as live:
        assert live == settings
    assert kafka_broker.status().answering  # not stopped: it was not ours to stop


@pytest.mark.kafka
def test_a_second_broker_on_a_taken_port_is_refused(kafka_broker, tmp_path):
    other = LocalKafka(tmp_path, kafka_broker.jars, port=kafka_broker.port, controller_port=free_port())
    with pytest.raises(BrokerError, match="already answers"):
        other.start(timeout=5)
    assert other.stop() is False  # nothing of its own to stop
    assert kafka_broker.status().answering


@pytest.mark.kafka
def test_cli_start_status_stop_across_processes_leaves_no_process(kafka_broker, tmp_path):
    # `kafka_broker` guarantees the jars are fetched; this test runs a second broker via the CLI.
    shared = Settings.from_env()
    port, controller_port = free_port(), free_port()
    env = {  # the ports come from the command line (--port, --controller-port), not the environment
        **{k: v for k, v in os.environ.items() if k not in ("VOICEBUS_KAFKA_PORT", "VOICEBUS_KAFKA_CONTROLLER_PORT",
                                                             "VOICEBUS_BOOTSTRAP")},
        "VOICEBUS_CACHE_DIR": str(tmp_path),
        "VOICEBUS_KAFKA_VERSION": shared.kafka_version,
    }
    ports = ("--port", str(port), "--controller-port", str(controller_port))
    # share the already-fetched jars instead of fetching again into tmp_path
    (tmp_path / "kafka" / "jars").mkdir(parents=True)
    (tmp_path / "kafka" / "jars" / shared.kafka_version).symlink_to(kafka_broker.jars)
    data_dir = tmp_path / "kafka" / f"node-{port}"

    def cli(action: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "voicebus", "kafka", action, *ports], env=env,
                              capture_output=True, text=True, timeout=180)

    try:
        started = cli("start")
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"
        # VOICEBUS_BOOTSTRAP (default 127.0.0.1:9092) does not follow --port: it says how to match it
        assert f"VOICEBUS_BOOTSTRAP=127.0.0.1:{port}" in started.stderr
        assert broker_answers("127.0.0.1", port)
        assert len(kafka_pids_under(data_dir)) == 1

        status = cli("status")
        assert status.returncode == 0 and "answering" in status.stdout

        stopped = cli("stop")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout
        assert kafka_pids_under(data_dir) == []
        assert not broker_answers("127.0.0.1", port, timeout=0.3)

        after = cli("status")
        assert after.returncode == 1 and "not running" in after.stdout
        assert cli("stop").stdout.strip() == "not running"
    finally:
        for pid in kafka_pids_under(data_dir):  # only if an assertion failed mid-way
            os.kill(pid, 9)


def test_kafka_start_help_shows_the_port_options_and_the_bootstrap_rule(capsys):
    from voicebus.ops.kafka_cli import broker_settings
    from voicebus.cli import build_parser, main

    with pytest.raises(SystemExit):
        main(["kafka", "start", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--port P" in help_text and "--controller-port P" in help_text
    assert "VOICEBUS_BOOTSTRAP=127.0.0.1:<port>" in help_text
    for action in ("start", "status", "stop"):
        args = build_parser().parse_args(["kafka", action, "--port", "19092", "--controller-port", "19093"])
        mapped = broker_settings(args, Settings())
        assert (mapped.kafka_port, mapped.kafka_controller_port) == (19092, 19093)
    assert broker_settings(build_parser().parse_args(["kafka", "status"]), Settings()) == Settings()


def test_two_processes_cannot_run_brokers_from_one_state_directory(tmp_path, kafka_jars):
    """The state directory is locked while its broker runs (the broker process inherits the lock):
    before, two `voicebus kafka start` at once could both format and launch from it."""
    import fcntl

    broker = LocalKafka(tmp_path, kafka_jars, port=free_port(), controller_port=free_port())
    fd = os.open(tmp_path / "voicebus.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's start holds it
        with pytest.raises(BrokerError, match=f"the Kafka state directory {tmp_path} is in use by another process"):
            broker.launch()
        assert not (tmp_path / "server.properties").exists() and broker.exited() is None
    finally:
        os.close(fd)


def test_the_running_broker_holds_its_state_lock(kafka_broker):
    import fcntl

    fd = os.open(kafka_broker.data_dir / "voicebus.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
