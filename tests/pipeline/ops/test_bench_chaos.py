"""`voicebus bench chaos`'s own machinery as the fault tests: one SIGKILL of each kind in
the middle of a turn, on the real cluster, with the gate, synthesis worker (tiny random-weight
Kokoro) and edge as processes and a listener that reconnects with ``resume``: every sentence
heard whole, none twice, none out of order, the turn ended.

The process kinds and ``broker_leader`` share one pipeline on the session's 3-node cluster (a
module-scoped `ChaosRun`, one test per kind, one faulty turn each); ``broker_single`` runs on a
one-node cluster of its own (the session's single broker is shared by every other test). More
turns per kind: ``voicebus bench chaos`` (docs/benchmarks.md). The scoring is tested pure.
"""

from __future__ import annotations

import shutil

import pytest
import pytest_asyncio

from voicebus.ops.bench.chaos import (ChaosPlan, ChaosRun, Frame, chaos_settings, cluster_kinds, recovery_stages, score_turn,
                                  summarise_kind, summarise_stages)
from voicebus.ops.broker import QUICK_START_JVM_OPTIONS
from voicebus.ops.cluster import LocalCluster
from tests.conftest import distinct_free_ports

CLUSTER_KINDS = ("broker_leader", "gate", "worker", "edge")


def frames(*keys, samples=2400, step_us=50_000):
    """Frames (sentence, chunk[, last]) arriving every `step_us`, 100 ms of audio each."""
    out = []
    for i, key in enumerate(keys):
        sentence, chunk, *last = key
        out.append(Frame(i * step_us, sentence, chunk, bool(last and last[0]), samples))
    return out


def test_a_turn_is_scored_against_what_the_agent_said():
    clean = frames((0, 0), (0, 1, True), (1, 0, True))
    assert score_turn(clean, 2) == {"lost": 0, "heard_twice": 0, "out_of_order": 0, "unexpected": 0, "max_gap_ms": 0.0}
    # sentence 1 missing its first chunk, sentence 2 never heard
    assert score_turn(frames((0, 0, True), (1, 1, True)), 3)["lost"] == 2
    # a repeated start of sentence 0 (a worker re-spoke it and the edge forwarded it again)
    twice = score_turn(frames((0, 0), (0, 1), (0, 0), (0, 1), (0, 2, True)), 1)
    assert (twice["lost"], twice["heard_twice"]) == (0, 1)
    # sentence 0's tail arrives after sentence 1 has begun
    late = score_turn(frames((0, 0), (1, 0, True), (0, 1, True)), 2)
    assert (late["lost"], late["out_of_order"]) == (0, 1)
    assert score_turn(frames((0, 0, True), (1, 0, True)), 1)["unexpected"] == 1
    # 100 ms of audio, then the next frame 1.1 s after the first: 1000 ms of silence inside the turn
    gap = [Frame(0, 0, 0, False, 2400), Frame(1_100_000, 0, 1, True, 2400)]
    assert score_turn(gap, 1)["max_gap_ms"] == 1000.0


def test_the_kinds_are_spread_over_the_cluster_sizes_and_summarised_as_the_issue_names_them():
    kinds = ("broker_leader", "broker_single", "gate", "worker", "edge")
    assert cluster_kinds(3, kinds, 3) == ("broker_leader", "gate", "worker", "edge")
    assert cluster_kinds(1, kinds, 3) == ("broker_single",)
    assert cluster_kinds(1, kinds, 1) == ("broker_single", "gate", "worker", "edge")
    row = summarise_kind([{"expected": 3, "lost": 0, "heard_twice": 0, "out_of_order": 0, "max_gap_ms": 12.0}],
                         [100.0, 300.0, 200.0])
    assert row == {"turns": 1, "sentences": 3, "lost": 0, "heard_twice": 0, "out_of_order": 0, "max_gap_ms": 12.0,
                   "recovery_ms": {"p50": 200.0, "p95": 290.0}}


def test_a_recovery_is_broken_down_by_the_stages_of_the_sentence_that_brought_it():
    fault = 1_000_000
    timeline = {"text_complete_at_us": 990_000, "released_at_us": 5_000_000, "request_received_at_us": 5_010_000,
                "synthesis_started_at_us": 5_010_500, "audio_ready_at_us": 6_000_000, "published_at_us": 6_000_100,
                "edge_received_at_us": 6_005_000, "sent_at_us": 6_005_500}
    stages = recovery_stages(fault, timeline, 6_006_000)
    assert stages == {"sentence complete": -10.0, "released": 4000.0, "request received": 4010.0,
                      "synthesis start": 4010.5, "first audio": 5000.0, "published": 5000.1, "edge received": 5005.0,
                      "sent": 5005.5, "received": 5006.0}
    assert list(stages) == list(summarise_stages([stages]))  # in the order the audio passed them
    summary = summarise_stages([stages, {**stages, "released": 2000.0}, {"received": 7000.0}])
    assert summary["released"] == {"p50": 3000.0, "p95": 3900.0} and summary["received"]["p50"] == 5006.0


def assert_clean(run: ChaosRun, kind: str, row: dict) -> None:
    details = run.details[kind]
    assert details["faults"] == 1, details
    assert row["turns"] == run.plan.sessions * run.plan.turns
    assert (row["lost"], row["heard_twice"], row["out_of_order"]) == (0, 0, 0), (row, details, run.scored[kind])
    assert details["unended_turns"] == 0 and details["unexpected_sentences"] == 0, details
    assert row["recovery_ms"]["p50"] is not None, "no new audio after the fault"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster_run(kafka_cluster, make_cluster_settings_module):
    plan = ChaosPlan(kinds=CLUSTER_KINDS, turns=1, sessions=1, every=1, sentences=2)
    settings = chaos_settings(make_cluster_settings_module(), kafka_cluster.bootstrap, "t" + kafka_cluster.cluster_id[:5])
    async with ChaosRun(settings, kafka_cluster, plan, log=print) as run:
        yield run
    kafka_cluster.wait_in_sync(180)  # as the session found it


@pytest.fixture(scope="module")
def make_cluster_settings_module(kafka_cluster, tmp_path_factory):
    from tests.conftest import _settings_factory

    first = kafka_cluster.nodes[0]
    return _settings_factory(kafka_cluster.bootstrap, first.port, first.controller_port, tmp_path_factory)


@pytest.mark.kafka
@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("kind", CLUSTER_KINDS)
async def test_a_fault_mid_turn_loses_and_repeats_nothing(kind, cluster_run):
    row = await cluster_run.run_kind(kind)
    assert_clean(cluster_run, kind, row)


@pytest.mark.kafka
@pytest.mark.timeout(600)
async def test_the_single_broker_killed_mid_turn_everything_resumes_on_its_own(kafka_jars, tmp_path,
                                                                               tmp_path_factory):
    from tests.conftest import _settings_factory

    port, controller_port = distinct_free_ports(2)
    cluster = LocalCluster(tmp_path / "kafka", kafka_jars, ports=[(port, controller_port)],
                           extra_config={"num.partitions": "3"}, jvm_options=QUICK_START_JVM_OPTIONS,
                           die_with_parent=True)
    cluster.start(180)
    try:
        base = _settings_factory(cluster.bootstrap, port, controller_port, tmp_path_factory)()
        plan = ChaosPlan(kinds=("broker_single",), turns=1, sessions=1, every=1, sentences=2)
        async with ChaosRun(chaos_settings(base, cluster.bootstrap, "single"), cluster, plan, log=print) as run:
            row = await run.run_kind("broker_single")
            assert_clean(run, "broker_single", row)
            assert run.details["broker_single"]["stage_restarts"] == {"gate": 0, "worker": 0, "edge": 0}
    finally:
        cluster.stop()
        shutil.rmtree(tmp_path / "kafka", ignore_errors=True)
