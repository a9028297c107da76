"""The topic map's durability rules: replication from the broker count, min ISR, retention classes."""

from __future__ import annotations

import pytest

from voicebus.settings import Settings
from voicebus.topics import (AUDIO_RETENTION, DEADLETTER_RETENTION, EVENT_RETENTION, Durability, TopicConfigError,
                             durability, text_topic, topic_configs)


@pytest.mark.parametrize("brokers, expected", [(1, Durability(1, 1)), (2, Durability(2, 1)), (3, Durability(3, 2)),
                                               (5, Durability(3, 2))])
def test_automatic_replication_is_min_3_brokers_and_min_isr_one_less(brokers, expected):
    assert durability(Settings(), brokers) == expected


def test_explicit_replication_and_min_isr_win_and_are_checked():
    assert durability(Settings(replication_factor=2), 3) == Durability(2, 1)
    assert durability(Settings(replication_factor=3, min_insync_replicas=3), 3) == Durability(3, 3)
    assert durability(Settings(min_insync_replicas=1), 3) == Durability(3, 1)
    with pytest.raises(TopicConfigError, match="needs 3 brokers"):
        durability(Settings(replication_factor=3), 1)
    with pytest.raises(TopicConfigError, match="min.insync.replicas 4"):
        durability(Settings(min_insync_replicas=4), 3)
    with pytest.raises(TopicConfigError):
        durability(Settings(), 0)


def test_the_defaults_read_from_the_environment_are_automatic():
    settings = Settings.from_env({"VOICEBUS_REPLICATION_FACTOR": "0", "VOICEBUS_MIN_INSYNC_REPLICAS": "0"})
    assert settings.replication_factor == 0 and settings.min_insync_replicas == 0
    assert Settings.from_env({}).replication_factor == 0


def test_each_topic_class_has_its_retention():
    s = Settings()
    durable = Durability(3, 2)
    audio = topic_configs(s, s.audio_topic, durable)
    text = topic_configs(s, text_topic(s, "assistant"), durable)
    control = topic_configs(s, s.control_topic, durable)
    dlq = topic_configs(s, s.deadletter_topic, durable)
    assert audio["retention.ms"] == str(AUDIO_RETENTION.retention_ms)
    assert text["retention.ms"] == control["retention.ms"] == str(EVENT_RETENTION.retention_ms)
    assert dlq["retention.ms"] == str(DEADLETTER_RETENTION.retention_ms)
    # audio short, text and control longer, dead letters longest
    assert AUDIO_RETENTION.retention_ms < EVENT_RETENTION.retention_ms < DEADLETTER_RETENTION.retention_ms
    for configs in (audio, text, control, dlq):
        assert configs["cleanup.policy"] == "delete"
        assert configs["min.insync.replicas"] == "2"
        # Kafka deletes closed segments only: a segment must roll well within the retention
        assert int(configs["segment.ms"]) <= int(configs["retention.ms"]) // 6
    # a topic outside the map (a benchmark's) gets the durability but the broker's retention
    assert topic_configs(s, "voicebus.bench.bus.x", durable) == {"min.insync.replicas": "2"}


def test_the_readme_and_kafka_md_topic_tables_are_what_voicebus_topics_prints(capsys):
    from pathlib import Path

    from voicebus.topics_cli import run

    run(None, Settings())
    printed = capsys.readouterr().out.strip()
    assert "| `voicebus.audio` |" in printed and "delete, 1 h |" in printed
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/kafka.md"):
        assert printed in (root / doc).read_text(), f"{doc}'s topic table is not `voicebus topics`'s"
