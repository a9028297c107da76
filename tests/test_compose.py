"""docker-compose.yml stays valid (Debian's docker-compose validates it without an engine) and in
step with the local setup: the same VOICEBUS_* variables, topic names and Kafka version; by default
three KRaft brokers replicated as `voicebus kafka start --brokers 3` replicates, one broker in the
`single` profile; a healthcheck on every service; the schema registry behind basic auth, on the
compose network only, its password a compose secret the voicebus services read as a file."""

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
from tests.waiting import eventually_sync

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
EDGES = ("edge-1", "edge-2", "edge-3")
VOICEBUS_SERVICES = {"gate": "gate", "worker": "worker", **{edge: "edge" for edge in EDGES}}
CLUSTER_NODES = ("kafka-1", "kafka-2", "kafka-3")
CLUSTER_BOOTSTRAP = "kafka-1:9092,kafka-2:9092,kafka-3:9092"
SINGLE = "single"  # the laptop profile
SINGLE_NODE = "kafka"
SINGLE_SERVICES = {"gate-single": "gate", "worker-single": "worker", "edge-single": "edge"}
ALL_VOICEBUS_SERVICES = {**VOICEBUS_SERVICES, **SINGLE_SERVICES}
REGISTRY_SECRET = "registry-password"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
TEST_SECRET = "compose-test-secret-0123456789abcdef"
TEST_REGISTRY_PASSWORD = "compose-test-registry-password"


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


@pytest.mark.parametrize("name", EDGES + ("edge-single",))
def test_the_compose_edges_pass_the_edges_own_exposure_check(compose, secrets_dir, name):
    """Each edge service listens on 0.0.0.0 with the secret the user set: the edge accepts that
    (and would refuse the same service with the public default)."""
    from voicebus.players.edge import InsecureEdgeConfig, check_exposure

    edge = service_settings(compose, name, secrets_dir)
    assert edge.edge_host == "0.0.0.0" and edge.edge_secret.get_secret_value() == TEST_SECRET
    check_exposure(edge)
    with pytest.raises(InsecureEdgeConfig):
        check_exposure(edge.replace(edge_secret=Settings().edge_secret))


def test_the_edges_share_one_group_and_the_proxy_routes_to_each_by_its_public_url(compose, secrets_dir):
    """Several edges behind nginx (docs/edge.md, "Behind a proxy"): one consumer group on one audio
    topic, a distinct id each; the proxy is the only published port, balances /ws over every edge,
    and routes each edge's public URL (what its redirects name) to that edge alone."""
    import re

    from voicebus.topics import edge_group_id

    edges = {name: service_settings(compose, name, secrets_dir) for name in EDGES}
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


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """Stands in for /run/secrets: each compose secret as the file a container would see."""
    path = tmp_path_factory.mktemp("run-secrets")
    (path / REGISTRY_SECRET).write_text(TEST_REGISTRY_PASSWORD + "\n")  # as `openssl rand -hex 32 >` writes it
    return path


def service_env(compose: dict, name: str, secrets_dir: Path | None = None) -> dict[str, str]:
    """A service's environment as strings; with `secrets_dir`, /run/secrets/X paths point into it."""
    env = {k: str(v) for k, v in compose["services"][name].get("environment", {}).items()}
    if secrets_dir is not None:
        env = {k: v.replace("/run/secrets/", f"{secrets_dir}/") if k.endswith("_FILE") else v for k, v in env.items()}
    return env


def service_settings(compose: dict, name: str, secrets_dir: Path) -> Settings:
    return Settings.from_env(service_env(compose, name, secrets_dir))


def profiles_of(service: dict) -> list[str]:
    return list(service.get("profiles") or [])


def test_every_voicebus_env_var_is_a_settings_field(compose):
    """A VOICEBUS_* variable is a Settings field, or the _FILE form of a secret field."""
    from voicebus.settings import _secret_fields

    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    fields |= {ENV_PREFIX + name.upper() + "_FILE" for name in _secret_fields()}
    used = set()
    for name, service in compose["services"].items():
        for var in service.get("environment", {}):
            if var.startswith(ENV_PREFIX):
                used.add(var)
                assert var in fields, f"{name}: {var} is not a Settings field"
    assert "VOICEBUS_BOOTSTRAP" in used


def test_services_parse_into_settings_with_the_default_topic_names(compose, secrets_dir):
    """The cluster's services reach its three brokers, the single profile's its one broker."""
    defaults = Settings()
    for name, command in ALL_VOICEBUS_SERVICES.items():
        service = compose["services"][name]
        assert service["command"][:2] == ["voicebus", command]
        settings = service_settings(compose, name, secrets_dir)
        assert settings.bootstrap == ("kafka:9092" if name in SINGLE_SERVICES else CLUSTER_BOOTSTRAP), name
        for topic_field in ("text_topic_prefix", "control_topic", "synthesis_topic", "audio_topic",
                            "playback_topic", "deadletter_topic", "gate_app_id", "gate_changelog_topic"):
            assert getattr(settings, topic_field) == getattr(defaults, topic_field), topic_field


def kafka_nodes(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if str(s.get("image", "")).startswith("apache/kafka:")}


def test_kafka_is_the_official_image_at_our_version_in_kraft_mode(compose):
    """Every node, of the cluster and of the single profile, is a combined broker + controller."""
    assert set(kafka_nodes(compose)) == {*CLUSTER_NODES, SINGLE_NODE}
    for name, kafka in kafka_nodes(compose).items():
        assert kafka["image"] == f"apache/kafka:{Settings().kafka_version}", name
        assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller", name
        assert kafka["environment"]["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0", name
        assert str(kafka["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]) == "false", name


def test_the_default_cluster_is_three_kraft_nodes_with_one_quorum(compose):
    """kafka-1..3 run without a profile (`docker compose up`); each node is a voter of the same
    quorum, of the same cluster id, advertises its own name and keeps its data in its own volume."""
    nodes = {name: compose["services"][name] for name in CLUSTER_NODES}
    envs = {name: node["environment"] for name, node in nodes.items()}
    assert all(not profiles_of(node) for node in nodes.values())
    assert sorted(str(env["KAFKA_NODE_ID"]) for env in envs.values()) == ["1", "2", "3"]
    voters = {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in envs.values()}
    assert voters == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"}
    assert len({env["CLUSTER_ID"] for env in envs.values()}) == 1
    for name, env in envs.items():
        node_id = str(env["KAFKA_NODE_ID"])
        assert f"{node_id}@{name}:9093" in env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert nodes[name]["hostname"] == name
    assert CLUSTER_BOOTSTRAP == ",".join(f"{name}:9092" for name in CLUSTER_NODES)
    data = [tuple(v.split(":")[:2]) if isinstance(v, str) else (v["source"], v["target"])
            for n in nodes.values() for v in n["volumes"]]
    assert len({source for source, _ in data}) == 3 and {target for _, target in data} == {"/var/lib/kafka/data"}, data
    assert all(env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data" for env in envs.values())


def kafka_property(env: dict, key: str) -> str:
    return str(env["KAFKA_" + key.upper().replace(".", "_")])


@pytest.mark.parametrize("nodes, names, rf, isr", [(3, CLUSTER_NODES, "3", "2"), (1, (SINGLE_NODE,), "1", "1")])
def test_replication_fits_the_compose_kafka_and_matches_the_local_broker(compose, secrets_dir, nodes, names, rf, isr):
    """The cluster: replication 3, min ISR 2, the offsets and transaction state topics replicated 3
    times (every property `voicebus kafka start --brokers 3` sets); the single broker: all 1. The
    services' automatic replication makes the same choice for topics they create."""
    assert len([n for n in kafka_nodes(compose) if n in names]) == nodes
    local = cluster_properties(nodes)  # what `voicebus kafka start` sets for this size
    for name in names:
        env = compose["services"][name]["environment"]
        for key, value in local.items():
            assert kafka_property(env, key) == value, (name, key)
        assert kafka_property(env, "default.replication.factor") == rf
        assert kafka_property(env, "min.insync.replicas") == isr
        assert kafka_property(env, "offsets.topic.replication.factor") == rf
        assert kafka_property(env, "transaction.state.log.replication.factor") == rf
        assert kafka_property(env, "transaction.state.log.min.isr") == isr
        assert kafka_property(env, "auto.create.topics.enable") == "false"
    services = SINGLE_SERVICES if nodes == 1 else VOICEBUS_SERVICES
    for name in services:
        durable = durability(service_settings(compose, name, secrets_dir), nodes)  # raises if they could not be created
        assert (durable.replication_factor, durable.min_insync_replicas) == (int(rf), int(isr)), name


def test_the_single_profile_is_a_whole_stack_of_its_own(compose):
    """`docker compose --profile single up edge-single` starts one broker, the registry, a gate, a
    CPU worker and an edge on port 8765, and nothing of the cluster: the profiled services depend
    only on each other and on the unprofiled registry; the cluster's never on the single broker."""
    services = compose["services"]
    profiled = {name for name, s in services.items() if profiles_of(s)}
    assert profiled == {SINGLE_NODE, *SINGLE_SERVICES}
    assert all(profiles_of(services[name]) == [SINGLE] for name in profiled)

    def needs(name: str) -> set[str]:
        deps = set(services[name].get("depends_on") or [])
        return deps.union(*(needs(d) for d in deps)) if deps else set()

    assert needs("edge-single") == {SINGLE_NODE, "registry", "gate-single", "worker-single"}
    for name in SINGLE_SERVICES:
        assert not needs(name) & set(CLUSTER_NODES), name
        assert services[name]["depends_on"][SINGLE_NODE]["condition"] == "service_healthy"
    for name in [*VOICEBUS_SERVICES, "proxy", "registry"]:
        assert SINGLE_NODE not in needs(name) and not profiled & needs(name), name
    for name in VOICEBUS_SERVICES:
        assert all(services[name]["depends_on"][node]["condition"] == "service_healthy" for node in CLUSTER_NODES)
    worker = services["worker-single"]
    assert worker["environment"]["VOICEBUS_DEVICE"] == "cpu" and "deploy" not in worker  # a laptop: no GPU
    port = services["edge-single"]["ports"][0]
    assert port == "8765:8765" or int(port["published"]) == 8765, port


def test_every_service_has_a_healthcheck(compose):
    """Every service has a healthcheck that is not disabled; a voicebus stage's probes the
    /healthz of the port it serves (the gate's and worker's --metrics-port, the edge's port)."""
    import re

    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        assert check and not check.get("disable") and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL") and check["test"] != ["NONE"], name
    for name, command in ALL_VOICEBUS_SERVICES.items():
        service = compose["services"][name]
        probed = re.search(r"http://127\.0\.0\.1:(\d+)/healthz", " ".join(service["healthcheck"]["test"]))
        assert probed, name
        if command == "edge":
            assert probed.group(1) == str(service["environment"]["VOICEBUS_EDGE_PORT"]), name
        else:
            cmd = service["command"]
            assert cmd[cmd.index("--metrics-port") + 1] == probed.group(1), name
    # a service another waits on as healthy has the healthcheck that says so
    for name, service in compose["services"].items():
        deps = service.get("depends_on") or {}
        for dep, how in (deps.items() if isinstance(deps, dict) else []):
            if how.get("condition") == "service_healthy":
                assert compose["services"][dep].get("healthcheck"), (name, dep)


def test_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_the_registry_is_apicurio_at_our_version_and_every_stage_can_resolve_ids(compose, secrets_dir):
    registry = compose["services"]["registry"]
    assert registry["image"] == f"apicurio/apicurio-registry:{Settings().registry_version}"
    for name in ALL_VOICEBUS_SERVICES:
        settings = service_settings(compose, name, secrets_dir)
        assert settings.registry_url == "http://registry:8080/apis/ccompat/v7"
        assert settings.wire_format == "single-object"
        assert compose["services"][name]["depends_on"]["registry"]["condition"] == "service_healthy"


def registry_user(compose: dict) -> tuple[str, str, str]:
    """(user, the variable its password is exported as, the secret file it is read from), from the
    registry's start command; the password itself is in no compose variable."""
    import re

    registry = compose["services"]["registry"]
    script = " ".join(registry["command"])
    exported = re.search(r"export (QUARKUS_SECURITY_USERS_EMBEDDED_USERS_(\w+))=\"\$\$?password\"", script)
    read = re.search(r"password=\"\$\$?\(cat (/run/secrets/[\w-]+)\)\"", script)
    assert exported and read, script
    return exported.group(2), exported.group(1), read.group(1)


def test_the_registry_requires_basic_auth_and_is_on_the_compose_network_only(compose):
    """Apicurio's HTTP basic auth (Quarkus's, with its embedded user realm) and role-based
    authorization, one user of role sr-developer whose password is the compose secret, read from
    its file when the container starts; no port on the host."""
    registry = compose["services"]["registry"]
    env = {k: str(v) for k, v in registry["environment"].items()}
    assert env["QUARKUS_HTTP_AUTH_BASIC"] == "true"
    assert env["QUARKUS_OIDC_TENANT_ENABLED"] == "false"
    assert env["APICURIO_AUTH_ROLE_BASED_AUTHORIZATION"] == "true"
    user, variable, path = registry_user(compose)
    assert env[f"QUARKUS_SECURITY_USERS_EMBEDDED_ROLES_{user}"] == "sr-developer"
    assert variable not in env and not any("PASSWORD" in k for k in env), "a password in the compose file"
    assert path == f"/run/secrets/{REGISTRY_SECRET}"
    assert REGISTRY_SECRET in [s if isinstance(s, str) else s["source"] for s in registry["secrets"]]
    assert registry["entrypoint"] == ["/bin/sh", "-c"]
    assert "exec /opt/jboss/container/java/run/run-java.sh" in registry["command"][0]  # the image's own start
    # an empty or missing secret stops the container instead of starting a registry with an empty password
    assert '[ -n "$$password" ]' in registry["command"][0] or '[ -n "$password" ]' in registry["command"][0]
    assert "ports" not in registry and registry.get("network_mode") in (None, "bridge")
    assert compose["secrets"][REGISTRY_SECRET]["file"].endswith(f"/secrets/{REGISTRY_SECRET}")


def test_the_voicebus_services_read_the_registry_password_from_the_secret(compose, secrets_dir):
    """VOICEBUS_REGISTRY_USERNAME is the registry's user, VOICEBUS_REGISTRY_PASSWORD_FILE the secret
    it reads its password from (mounted in each voicebus service); no service has the password."""
    user, _, path = registry_user(compose)
    for name in ALL_VOICEBUS_SERVICES:
        service = compose["services"][name]
        env = service_env(compose, name)
        assert env["VOICEBUS_REGISTRY_USERNAME"] == user, name
        assert env["VOICEBUS_REGISTRY_PASSWORD_FILE"] == path, name
        assert "VOICEBUS_REGISTRY_PASSWORD" not in env, name
        assert REGISTRY_SECRET in [s if isinstance(s, str) else s["source"] for s in service["secrets"]], name
        settings = service_settings(compose, name, secrets_dir)
        assert settings.registry_username == user
        assert settings.registry_password.get_secret_value() == TEST_REGISTRY_PASSWORD


@pytest.mark.registry
def test_the_compose_registry_settings_make_apicurio_refuse_anonymous_requests(compose, secrets_dir, tmp_path):
    """The registry service's environment, given to the Apicurio Registry jars `voicebus registry`
    runs (the image's version), with the password its start command exports: its healthcheck's
    /health/ready answers without credentials, the API answers 401 without credentials or with a
    wrong password, and a voicebus stage's settings (user, password file) register a schema."""
    import base64
    import os
    import re
    import subprocess
    import urllib.error
    import urllib.request

    from voicebus.codecs import codec_for
    from voicebus.ops.daemon import free_port, popen_dying_with_parent
    from voicebus.ops.registry_server import QUICK_START_JVM_OPTIONS, LocalRegistry, fetch_registry

    registry_service = compose["services"]["registry"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUARKUS_", "APICURIO_"))}
    env.update({k: str(v) for k, v in registry_service["environment"].items() if not k.startswith("APICURIO_STORAGE")})
    user, variable, _ = registry_user(compose)
    env[variable] = TEST_REGISTRY_PASSWORD  # what the container's start command exports
    health_port = int(re.search(r"localhost:(\d+)/health/ready", " ".join(registry_service["healthcheck"]["test"]))[1])
    assert health_port == 9000  # Quarkus's management port in the image; here a free one
    shared = Settings.from_env()
    app = fetch_registry(shared.registry_dir, shared.registry_version)
    registry = LocalRegistry(tmp_path, app, port=free_port(), jvm_options=QUICK_START_JVM_OPTIONS)
    management = free_port()
    log = tmp_path / "registry.log"
    with open(log, "wb") as out:
        process = popen_dying_with_parent(registry.command(management), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=tmp_path, env=env)
    try:
        def ready() -> bool:
            assert process.poll() is None, log.read_text(errors="replace")[-4000:]  # died: say why at once
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{management}/health/ready", timeout=2) as answer:
                    return answer.status == 200
            except (urllib.error.URLError, OSError):
                return False

        eventually_sync(ready, timeout_s=180, interval_s=0.3, what="the registry's /health/ready answers 200",
                        detail=lambda: log.read_text(errors="replace")[-4000:])
        for auth in (None, f"{user}:wrong-password"):
            request = urllib.request.Request(registry.url + "/subjects")
            if auth:
                request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401, auth
        stage = service_env(compose, "gate", secrets_dir)
        stage["VOICEBUS_REGISTRY_URL"] = registry.url
        codec = codec_for(Settings.from_env(stage))
        assert codec.register("voicebus.synthesis", "SynthesisRequest") >= 0
        assert "voicebus.synthesis-value" in codec.registry.subjects()
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_readme_names_the_single_profile():
    """The README's deploy section says how to run the laptop profile."""
    readme = (ROOT / "README.md").read_text()
    assert f"--profile {SINGLE}" in readme
