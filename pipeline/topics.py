"""The topic map: every Kafka topic of voicebus, declared once.

Every message is keyed by `session_id` (UTF-8), so one session's events stay ordered in one
partition. Names come from `Settings`; this module says what each topic carries and who uses it.
The README's topic table is generated from `TOPIC_MAP` (`voicebus topics`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.settings import Settings


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    schema: str
    producer: str
    consumer: str
    pattern: bool = False  # True: a family of topics matched by prefix (one per agent)
    compacted: bool = False


def topic_map(settings: Settings) -> list[TopicSpec]:
    s = settings
    return [
        TopicSpec(s.text_topic_prefix + "<agent>", "session_id", "TextEvent",
                  "agents (SDK, OpenAI adapter, replay)", "gate (registered in the agent registry, or found by listing)",
                  pattern=True),
        TopicSpec(s.control_topic, "session_id", "ControlEvent",
                  "edge (barge-in), agents, CLI", "gate, synthesis workers, edge"),
        TopicSpec(s.synthesis_topic, "session_id", "SynthesisRequest", "gate", "synthesis workers (one group)"),
        TopicSpec(s.audio_topic, "session_id", "AudioChunk", "synthesis workers", "edge"),
        TopicSpec(s.playback_topic, "session_id", "PlaybackReport", "edge", "benchmarks, recorders"),
        TopicSpec(s.deadletter_topic, "original key", "original bytes + voicebus.error.* headers",
                  "every consumer", "operators"),
        TopicSpec(s.agents_topic, "agent_id", "registry record (JSON: agent id, text topic)",
                  "agents (SDK, when it creates or first uses its topic)", "gate (every worker, from the beginning)",
                  compacted=True),
        TopicSpec(s.gate_changelog_topic, "session_id (and one reserved key per partition)",
                  "gate state (JSON) and text positions", "gate", "gate (recovery of a partition)",
                  compacted=True),
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

    Every stage creates the fixed topics it uses when it starts (`pipeline.bus.ensure_topics`),
    so stages start in any order; `voicebus topics --create` creates them all at once."""
    return [t.name for t in topic_map(settings) if not t.pattern]


def compacted_topics(settings: Settings) -> set[str]:
    """Fixed topics that keep the latest record per key (cleanup.policy=compact)."""
    return {t.name for t in topic_map(settings) if t.compacted and not t.pattern}


def session_key(session_id: str) -> bytes:
    return session_id.encode("utf-8")
