"""voicebus on a secured Kafka: the local broker of `voicebus kafka start --secure` (SASL_SSL with
SCRAM-SHA-512 for clients, mutual TLS between nodes, the StandardAuthorizer), and every client
connecting through the ``VOICEBUS_KAFKA_*`` settings.

One real secured broker for the module, on free loopback ports. The whole pipeline runs on it
(agent -> gate subprocess -> worker -> edge -> listener); a wrong password, a plaintext client and
an untrusted certificate fail in seconds with a message that says where, how and why, never with
the password in it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from voicebus.agents.sdk import Publisher
from voicebus.credentials import BUS_ACCESS
from voicebus.bus import diagnose_connection, make_admin, make_producer
from voicebus.ops.broker import QUICK_START_JVM_OPTIONS, BrokerError
from voicebus.ops.cluster import LocalCluster
from voicebus.ops.daemon import free_port
from voicebus.ops.kafka_security import ROLES, client_settings_env
from voicebus.ops.runtime import PipelineStack
from voicebus.players.listener import Listener
from voicebus.settings import Settings
from voicebus.synthesis.engine import SynthesisEngine
from tests.conftest import distinct_free_ports

pytestmark = pytest.mark.kafka


def _secured_cluster(root: Path, jars: Path, extra_config: dict[str, str] | None = None):
    """A started one-node secured broker, stopped when the generator closes; a broker that does
    not start fails the test saying why."""
    port, controller_port = distinct_free_ports(2)
    cluster = LocalCluster(root, jars, ports=[(port, controller_port)], jvm_options=QUICK_START_JVM_OPTIONS,
                           die_with_parent=True, secure=True, extra_config=extra_config)
    try:
        cluster.start(timeout=120)
    except BrokerError as exc:
        cluster.stop()
        pytest.fail(f"the secured Kafka broker did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def secure_cluster(kafka_jars: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from _secured_cluster(tmp_path_factory.mktemp("kafka-secure"), kafka_jars)


@pytest.fixture(scope="module")
def reauth_cluster(kafka_jars: Path, tmp_path_factory: pytest.TempPathFactory):
    """A secured broker that ends each client's SASL session after 3 s (``connections.max.reauth.ms``,
    as managed clusters set it): aiokafka does not re-authenticate, so its connections are closed
    and opened again, and a user deleted meanwhile is refused within seconds."""
    yield from _secured_cluster(tmp_path_factory.mktemp("kafka-reauth"), kafka_jars,
                                {"connections.max.reauth.ms": "3000"})


def role_settings(cluster: LocalCluster, role: str = "admin", **overrides) -> Settings:
    """Settings of `role` from the variables `voicebus kafka env --role` prints, plus per-test topics."""
    uid = uuid.uuid4().hex[:10]
    base = Settings.from_env(client_settings_env(cluster.security, role, cluster.bootstrap))
    return base.replace(
        text_topic_prefix=f"t{uid}.text.", control_topic=f"t{uid}.control", synthesis_topic=f"t{uid}.synthesis",
        audio_topic=f"t{uid}.audio", playback_topic=f"t{uid}.playback", heard_topic=f"t{uid}.heard",
        floor_topic=f"t{uid}.floor",
        deadletter_topic=f"t{uid}.deadletter", agents_topic=f"t{uid}.agents", edges_topic=f"t{uid}.edges",
        gate_app_id=f"gate-{uid}", gate_changelog_topic=f"gate-{uid}-gate_sessions-changelog", **overrides)


def test_the_password_is_a_file_and_never_printed(secure_cluster):
    env = client_settings_env(secure_cluster.security, "gate", secure_cluster.bootstrap)
    password = secure_cluster.security.password("gate")
    assert password not in "".join(env.values())
    assert Path(env["VOICEBUS_KAFKA_SASL_PASSWORD_FILE"]).stat().st_mode & 0o077 == 0
    assert len({secure_cluster.security.password(r) for r in ROLES}) == len(ROLES)


async def test_every_role_authenticates(secure_cluster):
    for role in ROLES:
        admin = make_admin(role_settings(secure_cluster, role))
        await admin.start()
        await admin.close()


@pytest.mark.parametrize("case, change, expected", [
    ("wrong password", {"kafka_sasl_password": SecretStr("not-the-password")},
     "over SASL_SSL (SCRAM-SHA-512 as 'admin'): authentication failed: "),
    ("plaintext client", {"kafka_security_protocol": "PLAINTEXT"},
     "over PLAINTEXT: the broker closed the connection"),
    ("untrusted certificate", {"kafka_ssl_cafile": None}, "TLS certificate is not trusted"),
])
async def test_a_refused_client_fails_in_seconds_saying_why(secure_cluster, case, change, expected):
    settings = role_settings(secure_cluster).replace(**change)
    started = time.monotonic()
    producer = make_producer(settings)
    with pytest.raises(Exception):
        await producer.start()
    await producer.stop()
    message = await diagnose_connection(settings)
    assert time.monotonic() - started < 20
    assert message.startswith(f"Kafka at {secure_cluster.bootstrap}") and expected in message, message
    assert "not-the-password" not in message and secure_cluster.security.password("admin") not in message


def test_the_cli_reports_a_refused_client_without_a_stack_trace(secure_cluster, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    env = {**os.environ, **client_settings_env(secure_cluster.security, "admin", secure_cluster.bootstrap),
           "VOICEBUS_KAFKA_SASL_PASSWORD_FILE": str(wrong)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "voicebus", "topics", "--create"], env=env, cwd="/",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert "Traceback" not in result.stderr, result.stderr
    assert (f"voicebus topics: cannot connect: Kafka at {secure_cluster.bootstrap} over SASL_SSL "
            "(SCRAM-SHA-512 as 'admin'): authentication failed") in result.stderr
    assert "not-the-password" not in result.stderr + result.stdout


async def test_the_whole_pipeline_runs_on_sasl_ssl(secure_cluster):
    """agent -> gate (a subprocess, given the settings as variables) -> worker -> edge -> listener,
    every client on SASL_SSL."""
    settings = role_settings(secure_cluster, edge_port=free_port(), worker_max_in_flight=2)
    async with PipelineStack(settings, SynthesisEngine.tiny(seed=3)) as stack:
        async with Listener(stack.edge_url, "s-secure", settings.edge_secret) as listener:
            async with Publisher(stack.settings, agent_id="assistant") as publisher:
                async with publisher.turn("s-secure", "t1", language="en") as turn:
                    for piece in ["Hello", " there.", " All", " is", " secure."]:
                        await turn.token(piece)
                        await asyncio.sleep(0.02)
            done = await listener.wait_turn_end("t1", timeout=240)
    assert {sentence for _, sentence, _, _ in done.frames} >= {0, 1} and done.duration_s > 0.2


# --- ACLs: each principal may do only its own part ------------------------------------------------


async def _grant(cluster: LocalCluster, settings: Settings, agents: dict[str, str]) -> None:
    from voicebus.acls import role_acls
    from voicebus.bus import create_acls, ensure_topics

    admin = settings.replace(**{k: getattr(role_settings(cluster, "admin"), k)
                                for k in ("kafka_sasl_username", "kafka_sasl_password")})
    await ensure_topics(admin)
    assert await create_acls(admin, role_acls(admin, agents)) > 0


def refused_for_authorization():
    """What an agent meets on a topic that is not its own: the broker's authorization error, or
    (the topic not existing yet) the SDK's refused creation naming it."""
    from aiokafka.errors import TopicAuthorizationFailedError

    from voicebus.bus import TopicCreationError

    return pytest.raises((TopicAuthorizationFailedError, TopicCreationError), match="(?i)authorization")


async def test_an_agent_may_write_its_own_text_topic_and_no_other(secure_cluster):
    agent = role_settings(secure_cluster, "agent")
    await _grant(secure_cluster, agent, {"host": "User:agent"})
    async with Publisher(agent, agent_id="host") as publisher:
        async with publisher.turn("s-acl", "t1", language="en") as turn:
            await turn.token("Allowed.")
    with refused_for_authorization():
        async with Publisher(agent, agent_id="expert") as publisher:
            async with publisher.turn("s-acl", "t2", language="en") as turn:
                await turn.token("Not mine.")


@pytest.mark.parametrize("role, topic", [("edge", "audio_topic"), ("edge", "text_topic_prefix"),
                                         ("worker", "synthesis_topic"), ("gate", "audio_topic")])
async def test_a_stage_cannot_write_what_it_does_not_produce(secure_cluster, role, topic):
    from aiokafka.errors import KafkaError

    settings = role_settings(secure_cluster, role)
    await _grant(secure_cluster, settings, {})
    name = getattr(settings, topic) + ("intruder" if topic == "text_topic_prefix" else "")
    producer = make_producer(settings)
    await producer.start()
    try:
        with pytest.raises(KafkaError) as caught:
            await producer.send_and_wait(name, b"forged", key=b"s")
    finally:
        await producer.stop()
    assert "Authorization" in type(caught.value).__name__, repr(caught.value)


@pytest.mark.parametrize("role, topic", [("gate", "control_topic"), ("gate", "floor_topic"),
                                         ("gate", "synthesis_topic"), ("edge", "heard_topic")])
async def test_a_stage_may_write_what_it_produces(secure_cluster, role, topic):
    """Regression: the gate publishes cancels (a whole-session cancel's resolution, a preempted
    turn) but its ACLs once let it only read the control topic."""
    settings = role_settings(secure_cluster, role)
    await _grant(secure_cluster, settings, {})
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(getattr(settings, topic), b"allowed", key=b"s")
    finally:
        await producer.stop()


async def test_no_stage_may_reconfigure_a_topic(secure_cluster):
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    settings = role_settings(secure_cluster, "gate")
    await _grant(secure_cluster, settings, {})
    admin = make_admin(settings)
    await admin.start()
    try:
        [response] = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, settings.synthesis_topic,
                                                               configs={"retention.ms": "1"})])
    finally:
        await admin.close()
    [(code, *_rest)] = response.resources
    assert code != 0, "the gate altered a topic's configuration"


async def test_a_refused_agent_harms_no_one_else(secure_cluster):
    """The pipeline (its stages as the admin) keeps serving a listener while an agent principal
    is refused on a topic that is not its own."""
    stages = role_settings(secure_cluster, edge_port=free_port(), worker_max_in_flight=2)
    agent = stages.replace(kafka_sasl_username="agent", kafka_sasl_password=secure_cluster.security.password("agent"))
    await _grant(secure_cluster, stages, {"host": "User:agent"})
    async with PipelineStack(stages, SynthesisEngine.tiny(seed=3)) as stack:
        async with Listener(stack.edge_url, "s-good", stages.edge_secret) as listener:
            with refused_for_authorization():
                async with Publisher(agent, agent_id="expert") as intruder:
                    async with intruder.turn("s-good", "forged", language="en") as turn:
                        await turn.token("Forged words.")
            async with Publisher(agent, agent_id="host") as publisher:
                async with publisher.turn("s-good", "t1", language="en") as turn:
                    for piece in ["Still", " here.", " All", " well."]:
                        await turn.token(piece)
            done = await listener.wait_turn_end("t1", timeout=240)
    assert done.duration_s > 0.2 and "forged" not in done.timelines


async def test_the_speech_endpoint_speaks_as_an_agent_of_its_own_never_as_the_edge(secure_cluster):
    """The edge's principal may not write text: its speech endpoint publishes as an agent user
    of its own. Without one the edge still serves, and the endpoint says what is missing."""
    from aiohttp.test_utils import TestClient, TestServer

    from voicebus.players.edge import make_app
    from voicebus.players.openai_speech import publisher_settings

    edge = role_settings(secure_cluster, "edge", edge_secret="a-real-secret")
    door = edge.replace(speech_api_kafka_username="agent",
                        speech_api_kafka_password=secure_cluster.security.password("agent"))
    await _grant(secure_cluster, door, {})  # grants User:agent the speech agent's rights
    async with TestClient(TestServer(make_app(edge))) as client:
        answer = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})
        assert answer.status == 503
        assert "VOICEBUS_SPEECH_API_KAFKA_USERNAME" in (await answer.json())["error"]["message"]
        assert (await client.get("/healthz")).status == 200  # its players are served all the same
    async with Publisher(publisher_settings(door), agent_id=door.speech_api_agent_id) as publisher:
        async with publisher.turn("s-door", "t1", language="en") as turn:
            await turn.token("Spoken through the door.")


# --- a user deleted while its stage runs ----------------------------------------------------------


async def test_running_stages_whose_users_are_deleted_say_so_and_heal_when_restored(reauth_cluster, caplog):
    """Gate, worker and edge run, each as its own user; the three users are deleted. Each
    stage's next connection is refused: the error is logged once per user (not once per retry),
    each ``/healthz`` answers 503 naming the user, where and why; restoring the users makes every
    stage healthy again without a restart."""
    import contextlib

    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    from voicebus.gate.app import GateWorker
    from voicebus.players.edge import make_app
    from voicebus.synthesis.worker import SynthesisWorker
    from tests.pipeline.ops.scram_users import delete_user, set_password
    from tests.waiting import eventually

    cluster, roles = reauth_cluster, ("gate", "worker", "edge")
    base = role_settings(cluster, "admin", edge_secret="a-real-secret", partitions=1)
    await _grant(cluster, base, {})
    as_role = {role: base.replace(kafka_sasl_username=role, kafka_sasl_password=cluster.security.password(role))
               for role in roles}
    ports = {role: free_port() for role in ("gate", "worker")}
    admin = make_admin(base)
    await admin.start()
    caplog.set_level("INFO", logger="voicebus.credentials")
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        gate = GateWorker(as_role["gate"], metrics_port=ports["gate"])
        await gate.start()
        stack.push_async_callback(gate.stop)
        await stack.enter_async_context(SynthesisWorker(as_role["worker"], SynthesisEngine.tiny(seed=3),
                                                        worker_id="w1", warm_up=False, metrics_port=ports["worker"]))
        edge = await stack.enter_async_context(TestClient(TestServer(make_app(as_role["edge"]))))
        stack.push_async_callback(admin.close)

        async def health(role: str) -> tuple[int, dict]:
            if role == "edge":
                response = await edge.get("/healthz")
                return response.status, await response.json()
            async with http.get(f"http://{base.edge_host}:{ports[role]}/healthz") as response:
                return response.status, await response.json()

        async def every(status: int, refused: bool) -> dict | None:
            answers = {role: await health(role) for role in roles}
            ok = all(code == status and bool(body["credentials_refused"]) == refused
                     for code, body in answers.values())
            return {role: body for role, (_code, body) in answers.items()} if ok else None

        await eventually(lambda: every(200, refused=False), timeout_s=60, what="every stage healthy")
        for role in roles:
            await delete_user(admin, role)
        bodies = await eventually(lambda: every(503, refused=True), timeout_s=30,
                                  what="every /healthz reporting its deleted user")
        for role, body in bodies.items():
            refusal = body["credentials_refused"]
            assert refusal["user"] == role and refusal["where"] == cluster.bootstrap, body
            assert "invalid credentials with SASL mechanism SCRAM-SHA-512" in refusal["reason"]
        await eventually(lambda: all(BUS_ACCESS.refusal(role).attempts >= 3 for role in roles),
                         what="the clients retrying")
        errors = [r.getMessage() for r in caplog.records if r.name == "voicebus.credentials" and r.levelname == "ERROR"]
        assert sorted(e.split("credentials of ")[1].split(",")[0] for e in errors) == ["'edge'", "'gate'", "'worker'"]
        assert all("which it had accepted" in e for e in errors), errors

        for role in roles:
            await set_password(admin, role, cluster.security.password(role))
        await eventually(lambda: every(200, refused=False), timeout_s=30,
                         what="every stage healthy once its user is restored")
    assert sum("accepts the credentials of" in r.getMessage() for r in caplog.records) == 3
    assert not any(cluster.security.password(role) in caplog.text for role in roles)
