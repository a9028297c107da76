"""docker-compose.yml stays valid (Debian's docker-compose validates it without an engine) and in
step with the local setup: the same VOICEBUS_* variables, topic names and Kafka version."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from voicebus.ops.broker import cluster_properties
from voicebus.settings import ENV_PREFIX, Settings
from voicebus.topics import durability

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
EDGES = ("edge-1", "edge-2", "edge-3")
VOICEBUS_SERVICES = {"gate": "gate", "worker": "worker", **{edge: "edge" for edge in EDGES}}
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
TEST_SECRET = "compose-test-secret-0123456789abcdef"


def _env(**overrides: str | None) -> dict[str, str]:
    """This process's environment without any VOICEBUS_* variable, plus `overrides` (None removes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOICEBUS_")}
    env.update({k: v for k, v in overrides.items() if v is not None})
    return env


def compose_config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    docker_compose = shutil.which("docker-compose")
    assert docker_compose, "docker-compose is not installed (make system-deps installs Debian's package)"
    return subprocess.run([docker_compose, "-f", str(COMPOSE), "config", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=env)


def resolved_compose() -> dict:
    proc = compose_config(env=_env(VOICEBUS_EDGE_SECRET=TEST_SECRET))
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose_file_validates():
    proc = compose_config("-q", env=_env(VOICEBUS_EDGE_SECRET=TEST_SECRET))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("secret", [None, ""])
def test_compose_requires_the_edge_secret_to_be_set(secret):
    """Unset or empty, docker-compose refuses the file and says which variable to set."""
    proc = compose_config("-q", env=_env(VOICEBUS_EDGE_SECRET=secret))
    assert proc.returncode != 0
    assert "set VOICEBUS_EDGE_SECRET to a long random string" in proc.stderr


@pytest.mark.parametrize("name", EDGES)
def test_the_compose_edges_pass_the_edges_own_exposure_check(compose, name):
    """Each edge service listens on 0.0.0.0 with the secret the user set: the edge accepts that
    (and would refuse the same service with the public default)."""
    from voicebus.players.edge import InsecureEdgeConfig, check_exposure

    edge = Settings.from_env({k: str(v) for k, v in compose["services"][name]["environment"].items()})
    assert edge.edge_host == "0.0.0.0" and edge.edge_secret.get_secret_value() == TEST_SECRET
    check_exposure(edge)
    with pytest.raises(InsecureEdgeConfig):
        check_exposure(edge.replace(edge_secret=Settings().edge_secret))


def test_the_edges_share_one_group_and_the_proxy_routes_to_each_by_its_public_url(compose):
    """Several edges behind nginx (docs/edge.md, "Behind a proxy"): one consumer group on one audio
    topic, a distinct id each; the proxy is the only published port, balances /ws over every edge,
    and routes each edge's public URL (what its redirects name) to that edge alone."""
    import re

    from voicebus.topics import edge_group_id

    edges = {name: Settings.from_env({k: str(v) for k, v in compose["services"][name]["environment"].items()})
             for name in EDGES}
    assert len({edge_group_id(s) for s in edges.values()}) == 1
    assert len({s.audio_topic for s in edges.values()}) == 1 and len({s.edges_topic for s in edges.values()}) == 1
    assert sorted(s.edge_id for s in edges.values()) == sorted(EDGES)
    for name in EDGES:
        assert "ports" not in compose["services"][name], f"{name} is reached through the proxy only"
    proxy = compose["services"]["proxy"]
    port = proxy["ports"][0]
    assert proxy["image"].startswith("nginx:") and (port == "8765:8765" or int(port["published"]) == 8765), port
    assert set(proxy["depends_on"]) == set(EDGES)
    mounts = [tuple(v.split(":")[:2]) if isinstance(v, str) else (v["source"], v["target"]) for v in proxy["volumes"]]
    assert (str(NGINX_CONF), "/etc/nginx/conf.d/default.conf") in mounts, mounts
    conf = NGINX_CONF.read_text()
    upstream = re.search(r"upstream voicebus_edges \{(.*?)\}", conf, re.S).group(1)
    assert sorted(re.findall(r"server ([\w-]+):8765", upstream)) == sorted(EDGES)
    for name, s in edges.items():
        path = s.edge_public_url
        assert path.startswith("/") and path.endswith("/ws")
        prefix = path[: -len("ws")]
        assert re.search(rf"location {re.escape(prefix)} \{{ proxy_pass http://{name}:{s.edge_port}/; \}}", conf), name
    assert re.search(r"location / \{\s*proxy_pass http://voicebus_edges;", conf)
    assert "proxy_set_header Upgrade $http_upgrade;" in conf and "proxy_set_header Host $http_host;" in conf


def test_an_unknown_option_fails_validation(tmp_path):
    """The check above can fail: docker-compose rejects what it does not know."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("    hostname: kafka\n", "    hostname: kafka\n    no_such_option: 1\n"))
    proc = subprocess.run(["docker-compose", "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=120,
                          env=_env(VOICEBUS_EDGE_SECRET=TEST_SECRET))
    assert proc.returncode != 0 and "no_such_option" in proc.stderr


@pytest.fixture(scope="module")
def compose() -> dict:
    return resolved_compose()


def test_every_voicebus_env_var_is_a_settings_field(compose):
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    used = set()
    for name, service in compose["services"].items():
        for var in service.get("environment", {}):
            if var.startswith(ENV_PREFIX):
                used.add(var)
                assert var in fields, f"{name}: {var} is not a Settings field"
    assert "VOICEBUS_BOOTSTRAP" in used


def test_services_parse_into_settings_with_the_default_topic_names(compose):
    defaults = Settings()
    for name, command in VOICEBUS_SERVICES.items():
        service = compose["services"][name]
        assert service["command"] == ["voicebus", command]
        settings = Settings.from_env({k: str(v) for k, v in service["environment"].items()})
        assert settings.bootstrap == "kafka:9092"
        for topic_field in ("text_topic_prefix", "control_topic", "synthesis_topic", "audio_topic",
                            "playback_topic", "deadletter_topic", "gate_app_id", "gate_changelog_topic"):
            assert getattr(settings, topic_field) == getattr(defaults, topic_field), topic_field


def test_kafka_is_the_official_image_at_our_version_in_kraft_mode(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{Settings().kafka_version}"
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert kafka["environment"]["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0"


def test_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_the_registry_is_apicurio_at_our_version_and_every_stage_can_resolve_ids(compose):
    registry = compose["services"]["registry"]
    assert registry["image"] == f"apicurio/apicurio-registry:{Settings().registry_version}"
    for name in VOICEBUS_SERVICES:
        settings = Settings.from_env({k: str(v) for k, v in compose["services"][name]["environment"].items()})
        assert settings.registry_url == "http://registry:8080/apis/ccompat/v7"
        assert settings.wire_format == "single-object"
        assert "registry" in compose["services"][name]["depends_on"]


def test_replication_fits_the_compose_kafka_and_matches_the_local_broker(compose):
    kafka_nodes = [s for s in compose["services"].values() if str(s.get("image", "")).startswith("apache/kafka:")]
    assert len(kafka_nodes) == 1
    kafka_env = kafka_nodes[0]["environment"]
    local = cluster_properties(len(kafka_nodes))  # what `voicebus kafka start` sets for this size
    for key in ("default.replication.factor", "min.insync.replicas", "offsets.topic.replication.factor",
                "transaction.state.log.min.isr"):
        assert str(kafka_env["KAFKA_" + key.upper().replace(".", "_")]) == local[key], key
    for name in VOICEBUS_SERVICES:
        settings = Settings.from_env({k: str(v) for k, v in compose["services"][name]["environment"].items()})
        durable = durability(settings, len(kafka_nodes))  # raises if the topics could not be created
        assert (durable.replication_factor, durable.min_insync_replicas) == (1, 1)


def test_the_unauthenticated_registry_is_reachable_on_the_compose_network_only(compose):
    assert "ports" not in compose["services"]["registry"]
