"""Shared fixtures: the test session's own Apache Kafka broker and settings pointed at it.

* `kafka_broker` (session): a real single-node KRaft Kafka (`pipeline.broker.LocalKafka`) on free
  loopback ports, with a temporary data dir; the jars come from the shared cache
  (``<cache_dir>/kafka/jars/<version>``, fetched once per machine). It starts only when a test
  asks for it, so pure tests run without Java. If it cannot start, the test FAILS with the broker
  log's tail: a Kafka test never skips.
* `schema_registry` (session): a real Apicurio Registry (`pipeline.registry_server.LocalRegistry`,
  in-memory storage) on a free loopback port, from the shared cache
  (``<cache_dir>/registry/apicurio-<version>``, fetched once per machine). Like the broker it
  starts only when a test asks for it (`registry_settings`), and a failure to start FAILS the
  test with the registry log's tail.
* `make_settings(**overrides)`: a factory returning `Settings` pointed at that broker, with topic
  names, app ids and a cache dir unique to each call, so tests sharing the broker never see each
  other's messages.

Mark tests that use them ``@pytest.mark.kafka`` (and ``@pytest.mark.registry`` for the registry).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import pytest

from pipeline.broker import QUICK_START_JVM_OPTIONS, BrokerError, LocalKafka, fetch_jars, free_port
from pipeline.registry_server import QUICK_START_JVM_OPTIONS as REGISTRY_QUICK_START
from pipeline.registry_server import LocalRegistry, RegistryServerError, fetch_registry
from pipeline.settings import Settings


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory):
    shared = Settings.from_env()  # where the machine's jar cache is, and which Kafka version
    try:
        jars = fetch_jars(shared.kafka_dir, shared.kafka_version)
    except BrokerError as exc:
        pytest.fail(f"could not fetch the Apache Kafka jars: {exc}", pytrace=False)
    port = free_port()
    controller_port = free_port()
    while controller_port == port:
        controller_port = free_port()
    broker = LocalKafka(
        tmp_path_factory.mktemp("kafka"), jars, port=port, controller_port=controller_port,
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


@pytest.fixture
def make_settings(kafka_broker: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        uid = uuid.uuid4().hex[:10]
        values: dict[str, Any] = dict(
            bootstrap=kafka_broker.bootstrap,
            kafka_port=kafka_broker.port,
            kafka_controller_port=kafka_broker.controller_port,
            cache_dir=tmp_path_factory.mktemp(f"cache-{uid}"),
            text_topic_prefix=f"t{uid}.text.",
            control_topic=f"t{uid}.control",
            synthesis_topic=f"t{uid}.synthesis",
            audio_topic=f"t{uid}.audio",
            playback_topic=f"t{uid}.playback",
            deadletter_topic=f"t{uid}.deadletter",
            gate_app_id=f"gate-{uid}",
            gate_changelog_topic=f"gate-{uid}-gate_sessions-changelog",
        )
        values.update(overrides)
        return Settings(**values)

    return make
