"""Who may do what on a secured bus: the Kafka ACLs of each voicebus role, derived from the topic
map. Pure: `role_acls` says what to grant; `voicebus.bus.create_acls` grants it.

The rule is least privilege per stage, so that a principal with write access to one topic can
hurt only what that topic feeds:

* an **agent** (principal ``User:<agent id>``) writes only its own text topic (created on first
  use), registers it in the agent registry, sends cancels on the control topic and reads what
  its listeners heard and what happened to its turns on the floor;
* the **gate** reads the text topics, the agent registry and control, keeps its changelog,
  writes sentences to synthesis, floor events, and cancels on control (a whole-session cancel's
  resolution, a preempted turn);
* a **worker** reads synthesis and control and writes audio;
* the **edge** reads audio and control, writes cancels (barge-in), playback reports and what was
  heard, and keeps the edge directory; it cannot write text or audio. Its OpenAI-compatible speech
  endpoint publishes as an agent of its own (``speech_api_agent_id``, principal
  ``User:<speech_api_kafka_username>``), with that agent's rights and no more;
* every stage writes dead letters and may describe the fixed topics (to find them at start);
* nobody but the admin (a super user) creates fixed topics, alters, deletes or reconfigures any.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from voicebus.settings import Settings
from voicebus.topics import edge_group_id, fixed_topics, text_topic, worker_group_id


class Resource(enum.IntEnum):
    """Kafka's resource types (the wire values of the ACL requests)."""

    TOPIC = 2
    GROUP = 3


class Pattern(enum.IntEnum):
    LITERAL = 3
    PREFIXED = 4


class Operation(enum.IntEnum):
    READ = 3
    WRITE = 4
    CREATE = 5
    DESCRIBE = 8


STAGE_ROLES = ("gate", "worker", "edge")


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule: `principal` may do `operation` on the resource `name` (`pattern`)."""

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: Operation

    def describe(self) -> str:
        kind = "prefix " if self.pattern is Pattern.PREFIXED else ""
        return f"{self.principal}: {self.operation.name} {self.resource.name.lower()} {kind}{self.name}"


def _topic(principal: str, name: str, *operations: Operation, prefixed: bool = False) -> list[Acl]:
    pattern = Pattern.PREFIXED if prefixed else Pattern.LITERAL
    return [Acl(principal, Resource.TOPIC, name, pattern, op) for op in operations]


def _group(principal: str, name: str) -> list[Acl]:
    return [Acl(principal, Resource.GROUP, name, Pattern.LITERAL, Operation.READ),
            Acl(principal, Resource.GROUP, name, Pattern.LITERAL, Operation.DESCRIBE)]


def stage_acls(settings: Settings, role: str, principal: str | None = None) -> list[Acl]:
    """The ACLs of a stage (``gate``, ``worker`` or ``edge``), for ``User:<role>`` unless
    `principal` names another."""
    s = settings
    who = principal or f"User:{role}"
    R, W, D = Operation.READ, Operation.WRITE, Operation.DESCRIBE
    acls = [a for t in fixed_topics(s) for a in _topic(who, t, D)] + _topic(who, s.deadletter_topic, W)
    if role == "gate":
        acls += _topic(who, s.text_topic_prefix, R, D, prefixed=True)
        # the gate writes control too: a whole-session cancel's resolution, the floor's cuts
        acls += _topic(who, s.agents_topic, R) + _topic(who, s.control_topic, R, W)
        acls += _topic(who, s.gate_changelog_topic, R, W) + _topic(who, s.synthesis_topic, W)
        acls += _topic(who, s.floor_topic, W)
        acls += _group(who, s.gate_app_id)
    elif role == "worker":
        acls += _topic(who, s.synthesis_topic, R) + _topic(who, s.control_topic, R)
        acls += _topic(who, s.audio_topic, W) + _group(who, worker_group_id(s))
    elif role == "edge":
        acls += _topic(who, s.audio_topic, R) + _topic(who, s.control_topic, R, W)
        acls += _topic(who, s.playback_topic, W) + _topic(who, s.heard_topic, W)
        acls += _topic(who, s.edges_topic, R, W) + _group(who, edge_group_id(s))
    else:
        raise ValueError(f"unknown stage role {role!r}: one of {', '.join(STAGE_ROLES)}")
    return sorted(set(acls))


def agent_acls(settings: Settings, agent_id: str, principal: str | None = None) -> list[Acl]:
    """The ACLs of agent `agent_id` (``User:<agent id>`` unless `principal` names another)."""
    s = settings
    who = principal or f"User:{agent_id}"
    R, W, C, D = Operation.READ, Operation.WRITE, Operation.CREATE, Operation.DESCRIBE
    acls = _topic(who, text_topic(s, agent_id), C, W, D)
    acls += _topic(who, s.agents_topic, W, D) + _topic(who, s.control_topic, W, D) + _topic(who, s.heard_topic, R, D)
    acls += _topic(who, s.floor_topic, R, D)
    return sorted(set(acls))


def speech_api_principal(settings: Settings) -> str:
    """The principal the edges' speech endpoint publishes as (an agent's: `agent_acls`)."""
    return f"User:{settings.speech_api_kafka_username or settings.speech_api_agent_id}"


def role_acls(settings: Settings, agents: dict[str, str] | None = None) -> list[Acl]:
    """Every stage's ACLs, those of each agent in `agents` (agent id -> principal) and, with the
    speech endpoint on, those of its agent (`speech_api_principal`)."""
    acls = [a for role in STAGE_ROLES for a in stage_acls(settings, role)]
    if settings.speech_api:
        acls += agent_acls(settings, settings.speech_api_agent_id, speech_api_principal(settings))
    for agent_id, principal in (agents or {}).items():
        acls += agent_acls(settings, agent_id, principal)
    return sorted(set(acls))
