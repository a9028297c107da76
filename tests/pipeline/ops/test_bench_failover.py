"""`voicebus bench failover` (pipeline/ops/bench/failover.py): the variants it parses, its summary, and
one leader kill on the test session's real 3-node cluster."""

from __future__ import annotations

import uuid

import pytest

from voicebus.ops.bench.failover import FailoverProbe, parse_variants, summarise


def test_variants_are_voicebus_defaults_or_node_properties_over_them():
    assert parse_variants("default;replica.fetch.backoff.ms=1000,num.io.threads=4") == {
        "default": {}, "replica.fetch.backoff.ms=1000,num.io.threads=4":
            {"replica.fetch.backoff.ms": "1000", "num.io.threads": "4"}}
    for bad in ("", "replica.fetch.backoff.ms", "=3"):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_the_summary_is_median_and_max_per_figure():
    rows = [{"election_ms": e, "first_ack_after_election_ms": a} for e, a in ((4000, 150), (7000, 1100), (4200, 170))]
    out = summarise(rows)
    assert out["kills"] == 3 and out["election_ms"] == {"median": 4200, "max": 7000}
    assert out["first_ack_after_election_ms"] == {"median": 170, "max": 1100}


@pytest.mark.kafka
@pytest.mark.timeout(300)
async def test_a_leader_kill_is_timed_and_every_write_is_acked(kafka_cluster, make_cluster_settings):
    settings = make_cluster_settings().replace(partitions=1)
    probe = FailoverProbe(kafka_cluster, settings, topic=f"failover-{uuid.uuid4().hex[:8]}")
    await probe.start()
    try:
        row = await probe.cycle()
    finally:
        await probe.stop()
    assert row["unacked"] == 0, row  # acks=all + idempotence: every write survives the leader's death
    assert row["election_ms"] > 0 and row["first_ack_after_election_ms"] >= 0, row
    assert len(kafka_cluster.metadata().brokers) == 3  # the killed node is back
