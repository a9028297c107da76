"""The topic map: every Kafka topic of voicebus, declared once.

Every message is keyed by `session_id` (UTF-8), so one session's events stay ordered in one
partition. Names come from `Settings`; this module says what each topic carries and who uses it.
The README's topic table is generated from `TOPIC_MAP` (`voicebus topics`).

It also owns how durable and how long-lived each topic is: `durability` turns the settings and
the cluster's broker count into a replication factor and ``min.insync.replicas``, and each
`TopicSpec` carries its class's retention and cleanup policy (`topic_configs` gives the Kafka
topic configs `voicebus.bus.ensure_topics` creates a topic with). docs/kafka.md explains the
numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from voicebus.settings import Settings

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS


class TopicConfigError(ValueError):
    """The replication settings cannot be met (e.g. more replicas than the cluster has brokers)."""


@dataclass(frozen=True)
class Retention:
    """How long a topic class keeps its records, and how they are cleaned up.

    `segment_ms` is set with the retention because Kafka deletes whole closed segments only: with
    its default (7 days) a one-hour retention would keep a week of audio.
    """

    retention_ms: int
    segment_ms: int
    cleanup_policy: str = "delete"

    def describe(self) -> str:
        if self.cleanup_policy == "compact":
            return "compact (latest per key)"
        return f"{self.cleanup_policy}, {_duration(self.retention_ms)}"


# Audio is bulky (a few KB per 150 ms chunk) and useful only while someone listens or resumes:
# short. Text, control, requests and playback reports are small and what a replay, a recorder or
# an incident review reads: a week. Dead letters wait for an operator: a month.
AUDIO_RETENTION = Retention(retention_ms=1 * HOUR_MS, segment_ms=10 * MINUTE_MS)
EVENT_RETENTION = Retention(retention_ms=7 * DAY_MS, segment_ms=1 * DAY_MS)
# What a listener heard is conversation history: an agent reads it within seconds, a transcript
# or an audit of what a caller was told weeks later. A month, like the dead letters.
HEARD_RETENTION = Retention(retention_ms=30 * DAY_MS, segment_ms=1 * DAY_MS)
DEADLETTER_RETENTION = Retention(retention_ms=30 * DAY_MS, segment_ms=1 * DAY_MS)
# The agent registry and the gate's changelog keep the latest record per key for good (compaction;
# a tombstone deletes). Hour-long segments: only closed segments are compacted.
COMPACTED = Retention(retention_ms=7 * DAY_MS, segment_ms=1 * HOUR_MS, cleanup_policy="compact")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    schema: str
    producer: str
    consumer: str
    retention: Retention = EVENT_RETENTION
    pattern: bool = False  # True: a family of topics matched by prefix (one per agent)
    compacted: bool = False


@dataclass(frozen=True)
class Durability:
    """Replicas per partition, and how many must have a write before an acks=all produce succeeds."""

    replication_factor: int
    min_insync_replicas: int


def durability(settings: Settings, brokers: int) -> Durability:
    """The replication of the topics voicebus creates on a cluster of `brokers` brokers.

    ``VOICEBUS_REPLICATION_FACTOR`` 0 (the default) means min(3, brokers): one replica on the
    demo's single broker, three on `voicebus kafka start --brokers 3` or any larger cluster.
    ``VOICEBUS_MIN_INSYNC_REPLICAS`` 0 means replication - 1 when replication >= 2, else 1: a
    3-replica topic takes acks=all writes with one broker down and refuses them with two down.
    """
    if brokers < 1:
        raise TopicConfigError(f"the cluster reports {brokers} brokers")
    rf = settings.replication_factor or min(3, brokers)
    min_isr = settings.min_insync_replicas or (rf - 1 if rf >= 2 else 1)
    if rf < 1:
        raise TopicConfigError(f"replication factor {rf} must be >= 1 (0 = automatic)")
    if rf > brokers:
        raise TopicConfigError(f"replication factor {rf} needs {rf} brokers; the cluster has {brokers}")
    if not 1 <= min_isr <= rf:
        raise TopicConfigError(f"min.insync.replicas {min_isr} must be between 1 and the replication factor {rf}")
    return Durability(rf, min_isr)


def topic_spec_for(settings: Settings, name: str) -> TopicSpec | None:
    """The map's entry for a concrete topic name (a text topic matches its prefix), or None."""
    for spec in topic_map(settings):
        if spec.name == name or (spec.pattern and re.fullmatch(text_topic_pattern(settings), name)):
            return spec
    return None


def topic_configs(settings: Settings, name: str, durable: Durability) -> dict[str, str]:
    """The Kafka topic configs `name` is created with: its class's retention and cleanup policy
    (none for a topic outside the map, e.g. a benchmark's) and min.insync.replicas."""
    configs = {"min.insync.replicas": str(durable.min_insync_replicas)}
    spec = topic_spec_for(settings, name)
    if spec is not None:
        configs.update({
            "cleanup.policy": spec.retention.cleanup_policy,
            "retention.ms": str(spec.retention.retention_ms),
            "segment.ms": str(spec.retention.segment_ms),
        })
    return configs


def _duration(ms: int) -> str:
    for unit, size in (("d", DAY_MS), ("h", HOUR_MS), ("min", MINUTE_MS)):
        if ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"


def topic_map(settings: Settings) -> list[TopicSpec]:
    s = settings
    return [
        TopicSpec(s.text_topic_prefix + "<agent>", "session_id", "TextEvent",
                  "agents (SDK, OpenAI adapter, replay)", "gate (registered in the agent registry, or found by listing)",
                  pattern=True),
        TopicSpec(s.control_topic, "session_id", "ControlEvent",
                  "edge (barge-in), agents, CLI, gate (resolutions, floor cuts)", "gate, synthesis workers, edge"),
        TopicSpec(s.synthesis_topic, "session_id", "SynthesisRequest", "gate", "synthesis workers (one group)"),
        TopicSpec(s.audio_topic, "session_id", "AudioChunk", "synthesis workers",
                  "edges (one group: each reads the partitions it owns)", retention=AUDIO_RETENTION),
        TopicSpec(s.playback_topic, "session_id", "PlaybackReport", "edge", "benchmarks, recorders"),
        TopicSpec(s.heard_topic, "session_id", "TurnHeard", "edge (from the players' heard reports)",
                  "agents (SDK `HeardFollower`, OpenAI adapter), recorders", retention=HEARD_RETENTION),
        TopicSpec(s.floor_topic, "session_id", "FloorEvent", "gate (the session's floor: granted, queued, cut, ...)",
                  "agents (SDK `FloorFollower`)", retention=HEARD_RETENTION),
        TopicSpec(s.deadletter_topic, "original key", "original bytes + voicebus.error.* headers",
                  "every consumer", "operators", retention=DEADLETTER_RETENTION),
        TopicSpec(s.agents_topic, "agent_id", "registry record (JSON: agent id, text topic)",
                  "agents (SDK, when it creates or first uses its topic)", "gate (every worker, from the beginning)",
                  retention=COMPACTED, compacted=True),
        TopicSpec(s.edges_topic, "<edge group>/<edge id>", "edge directory record (JSON: edge id, public URL, partitions owned)",
                  "edges (after each rebalance; a tombstone when one stops)", "edges (every edge, from the beginning)",
                  retention=COMPACTED, compacted=True),
        TopicSpec(s.gate_changelog_topic, "session_id (and one reserved key per partition)",
                  "gate state (JSON) and text positions", "gate", "gate (recovery of a partition)",
                  retention=COMPACTED, compacted=True),
    ]


def text_topic(settings: Settings, agent_id: str) -> str:
    """The text topic of one agent. Agent ids are restricted to Kafka's legal topic characters."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", agent_id):
        raise ValueError(f"agent id {agent_id!r} must match [A-Za-z0-9._-]{{1,200}}")
    return settings.text_topic_prefix + agent_id


def text_topic_pattern(settings: Settings) -> str:
    """The regex a text topic name matches (the gate reads every topic that matches it)."""
    return "^" + re.escape(settings.text_topic_prefix) + r"[A-Za-z0-9._-]+$"


def fixed_topics(settings: Settings) -> list[str]:
    """The topics created at start (text topics are created by each agent's producer).

    Every stage creates the fixed topics it uses when it starts (`voicebus.bus.ensure_topics`),
    so stages start in any order; `voicebus topics --create` creates them all at once."""
    return [t.name for t in topic_map(settings) if not t.pattern]


def compacted_topics(settings: Settings) -> set[str]:
    """Fixed topics that keep the latest record per key (cleanup.policy=compact)."""
    return {t.name for t in topic_map(settings) if t.retention.cleanup_policy == "compact" and not t.pattern}


WORKER_GROUP_SUFFIX = "-workers"


def worker_group_id(settings: Settings) -> str:
    """The consumer group of all synthesis workers of one deployment."""
    return settings.synthesis_topic + WORKER_GROUP_SUFFIX


def edge_group_id(settings: Settings) -> str:
    """The consumer group of the edges sharing ``settings.audio_topic``."""
    return settings.edge_group_id or f"voicebus-edge.{settings.audio_topic}"


def session_key(session_id: str) -> bytes:
    return session_id.encode("utf-8")


def partition_of(session_id: str, partitions: int) -> int:
    """The partition of `session_id` in a topic of `partitions` partitions: Kafka's default
    partitioner (murmur2) on the session key, what every voicebus producer uses. Topics with the
    same count are co-partitioned: a session is on the same partition number in all of them."""
    from aiokafka.partitioner import DefaultPartitioner

    every = list(range(partitions))
    return DefaultPartitioner()(session_key(session_id), every, every)
