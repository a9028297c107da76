"""The ACLs each role gets on a secured bus (pure: what `voicebus topics --create` grants)."""

from __future__ import annotations

from voicebus.acls import Operation, Pattern, Resource, agent_acls, role_acls, stage_acls
from voicebus.settings import Settings
from voicebus.topics import fixed_topics

S = Settings()


def writes(acls) -> set[tuple[str, Pattern]]:
    return {(a.name, a.pattern) for a in acls if a.resource is Resource.TOPIC and a.operation is Operation.WRITE}


def test_each_stage_writes_only_what_it_produces():
    L = Pattern.LITERAL
    # the gate writes cancels too: a whole-session cancel's resolution and the floor's cuts
    assert writes(stage_acls(S, "gate")) == {(S.synthesis_topic, L), (S.gate_changelog_topic, L), (S.deadletter_topic, L),
                                             (S.control_topic, L), (S.floor_topic, L)}
    assert writes(stage_acls(S, "worker")) == {(S.audio_topic, L), (S.deadletter_topic, L)}
    assert writes(stage_acls(S, "edge")) == {(S.control_topic, L), (S.playback_topic, L), (S.heard_topic, L),
                                             (S.edges_topic, L), (S.deadletter_topic, L)}


def test_the_speech_endpoint_publishes_as_an_agent_of_its_own_never_as_the_edge():
    speech = S.replace(speech_api_kafka_username="tts-door")
    acls = [a for a in role_acls(speech) if a.principal == "User:tts-door"]
    assert writes(acls) == {("voicebus.text.openai-speech", Pattern.LITERAL), (S.agents_topic, Pattern.LITERAL),
                            (S.control_topic, Pattern.LITERAL)}
    assert not [a for a in role_acls(speech) if a.principal == "User:edge" and a.name.startswith(S.text_topic_prefix)]
    assert not [a for a in role_acls(S.replace(speech_api=False)) if a.name == "voicebus.text.openai-speech"]


def test_an_agent_writes_its_own_text_topic_only():
    acls = agent_acls(S, "host", "User:alice")
    assert {a.principal for a in acls} == {"User:alice"}
    assert writes(acls) == {("voicebus.text.host", Pattern.LITERAL), (S.agents_topic, Pattern.LITERAL),
                            (S.control_topic, Pattern.LITERAL)}
    assert not any(a.pattern is Pattern.PREFIXED for a in acls)
    assert {a.name for a in acls if a.operation is Operation.CREATE} == {"voicebus.text.host"}


def test_nobody_but_the_admin_may_create_fixed_topics_or_alter_anything():
    acls = role_acls(S, {"host": "User:host"})
    assert {a.operation for a in acls} <= {Operation.READ, Operation.WRITE, Operation.DESCRIBE, Operation.CREATE}
    assert not {a.name for a in acls if a.operation is Operation.CREATE} & set(fixed_topics(S))
    assert all(a.principal != "User:admin" for a in acls)


def test_every_stage_may_find_every_fixed_topic_at_start():
    for role in ("gate", "worker", "edge"):
        described = {a.name for a in stage_acls(S, role) if a.operation is Operation.DESCRIBE}
        assert set(fixed_topics(S)) <= described
