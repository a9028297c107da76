"""`voicebus bench hostile`'s core: what the hostile agent puts on the real broker is what it
claims (every record of a refused kind is refused by the codec and contract the stages use, the
others decode), and the comparison of normal turns with the clean run. The whole benchmark
against live stage processes is `voicebus bench hostile --quick` (docs/benchmarks.md)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from aiokafka.structs import TopicPartition

from voicebus.agents.sdk import Publisher
from voicebus.ops.bench.hostile import (
    HOSTILE_AGENT, KIND_HEADER, REFUSED_KINDS, HeardResult, HostileAgent, affected, sentence_hashes,
)
from voicebus.bus import ensure_topics, make_consumer, make_producer
from voicebus.codecs import CodecError, codec_for
from voicebus.topics import fixed_topics, text_topic
from voicebus.players.listener import HeardTurn

TOPIC_TYPES = {"text": "TextEvent", "control": "ControlEvent", "synthesis": "SynthesisRequest", "audio": "AudioChunk"}


@pytest.mark.kafka
async def test_the_hostile_agent_sends_refused_kinds_that_every_decoder_refuses_and_valid_kinds_that_decode(
        make_settings):
    settings = make_settings(partitions=2)
    await ensure_topics(settings, [*fixed_topics(settings), text_topic(settings, HOSTILE_AGENT)])
    producer = make_producer(settings, enable_idempotence=False)
    await producer.start()
    try:
        async with Publisher(settings, HOSTILE_AGENT) as publisher:
            agent = HostileAgent(settings, producer, publisher, random.Random(1), scale=1)
            await agent.records([b"normal-session"])
    finally:
        await producer.stop()
    topics = {"text": text_topic(settings, HOSTILE_AGENT), "control": settings.control_topic,
              "synthesis": settings.synthesis_topic, "audio": settings.audio_topic}
    codec = codec_for(settings)
    seen: Counter[str] = Counter()
    consumer = make_consumer(settings, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics.values() for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for record in records:
                    kind = dict(record.headers or []).get(KIND_HEADER, b"").decode()
                    if not kind:
                        continue  # the SDK's valid turns (run-on text, an unclosed fence, ...)
                    family, _, what = kind.partition(":")
                    expect = TOPIC_TYPES[family]
                    assert topics[family] == tp.topic, kind
                    seen[kind] += 1
                    if what in REFUSED_KINDS:
                        with pytest.raises(CodecError):
                            codec.decode(record.value, expect=expect)
                    elif kind not in ("text:wrong-partition",):  # decodes; the gate refuses it by partition
                        assert codec.decode(record.value, expect=expect).type == expect, kind
    finally:
        await consumer.stop()
    sent = {k: v for k, v in agent.inputs.items() if k.split(":")[1] not in
            ("run-on", "unclosed-fence", "emoji-and-controls")}
    assert seen == sent
    assert {k.split(":")[0] for k in seen} == set(TOPIC_TYPES)


def _turn(frames: list[tuple[int, bytes]]) -> HeardTurn:
    turn = HeardTurn("t")
    for i, (sentence, pcm) in enumerate(frames):
        turn.frames.append((i, sentence, i, len(pcm) // 2))
        turn.pcm += pcm
    return turn


def test_sentence_hashes_split_the_audio_by_sentence():
    a = sentence_hashes(_turn([(0, b"\x01\x00" * 3), (0, b"\x02\x00"), (1, b"\x03\x00")]))
    b = sentence_hashes(_turn([(0, b"\x01\x00" * 3 + b"\x02\x00"), (1, b"\x03\x00")]))  # other chunking, same audio
    c = sentence_hashes(_turn([(0, b"\x01\x00" * 3), (1, b"\x02\x00\x03\x00")]))  # a sample moved across sentences
    assert a == b and len(a) == 2 and a != c


def test_a_turn_is_affected_when_it_did_not_end_ended_with_a_reason_or_sounds_different():
    clean = [HeardResult((0, t), True, "", ["h0", "h1"]) for t in range(4)]
    hostile = [HeardResult((0, 0), True, "", ["h0", "h1"]), HeardResult((0, 1), False, "", ["h0"]),
               HeardResult((0, 2), True, "synthesis-failed", ["h0", "h1"]), HeardResult((0, 3), True, "", ["h0", "hX"])]
    assert [key for key, _why in affected(clean, hostile)] == [(0, 1), (0, 2), (0, 3)]


def test_memory_per_round_tells_a_leak_from_high_water_marks():
    from voicebus.ops.bench.hostile import memory_per_round

    # after the clean run, then rounds 1..6: a step up (a larger forward pass), a release, flat
    steps = [2000.0, 2070.0, 2870.0, 2870.1, 2870.2, 2440.0, 2440.1]
    leak = [50.0, 51.0, 53.0, 55.0, 57.0, 59.0, 61.0]
    assert memory_per_round({"worker": steps, "edge": leak, "short": [1.0, 2.0, 3.0]}) == {
        "worker": 0.1, "edge": 2.0, "short": None}


def test_cases_are_chosen_by_name_all_by_default_and_an_unknown_name_is_refused():
    from voicebus.ops.bench.hostile_cases import CASES, parse_cases

    assert parse_cases(None) == parse_cases("all") == list(CASES)
    assert parse_cases("none") == []
    assert parse_cases("label-flood, huge-turn-ids") == ["label-flood", "huge-turn-ids"]
    with pytest.raises(ValueError, match="no-such-case"):
        parse_cases("huge-turn-ids,no-such-case")
    assert {"directory-forgery", "near-max-record", "missing-dlq", "huge-turn-ids", "label-flood",
            "report-ping-flood", "pre-hello-flood", "unknown-schema-flood", "session-flood", "zombie-gate"} <= set(CASES)


def test_a_case_passes_only_with_nothing_died_nothing_affected_and_the_rejection_reported():
    from voicebus.ops.bench.hostile_cases import case_ok, format_cases

    good = {"processes_died": 0, "normal_turns": 2, "normal_turns_affected": 0, "rejection_reported": True,
            "reason": "dead-lettered x", "memory_growth_mb": {"gate": 0.1, "worker": -2.0, "edge": 0.0}}
    assert case_ok(good)
    assert not case_ok(good | {"rejection_reported": False})
    assert not case_ok(good | {"normal_turns_affected": 1})
    assert not case_ok(good | {"processes_died": 1})
    table = format_cases({"huge-turn-ids": good, "label-flood": good | {"rejection_reported": False}})
    assert "huge-turn-ids" in table and "+0.1/-2.0/+0.0" in table and "NO" in table.splitlines()[2]


@pytest.mark.kafka
@pytest.mark.timeout(600)
@pytest.mark.parametrize("names", [
    ["huge-turn-ids"],
    # each also has its own test against a live edge (test_edge_shard_kafka, test_edge): here
    # they only show the bench runs them, with the stage processes' 30 s start paid again
    pytest.param(["directory-forgery", "report-ping-flood"], marks=pytest.mark.long),
], ids=lambda names: "+".join(names))
async def test_named_cases_beside_a_normal_session_kill_nothing_affect_nothing_and_report_the_rejection(
        make_settings, names):
    """Named cases against live stage processes on the test session's broker: a cancel with too
    many turn ids (refused by every stage with its reason), the forged edge directory
    (dead-lettered with its reason, no redirect) and a ping and report flood (rate limited).
    Without the memory method's replays: the memory figures are the full run's
    (docs/benchmarks.md)."""
    from voicebus.ops.bench.hostile import Plan, run_bench

    results = await run_bench(make_settings(), Plan(sessions=1, turns=1, rounds=0, scale=1, memory=False),
                              start_broker=False, cases=names)
    assert list(results["cases"]) == names
    for name, case in results["cases"].items():
        assert (case["processes_died"], case["normal_turns_affected"]) == (0, 0), (name, case)
        assert case["normal_turns"] == 1
        assert case["rejection_reported"], (name, case["reason"], case["detail"])
        assert set(case["memory_growth_mb"]) == {"gate", "worker", "edge"}
    details = {name: case["detail"] for name, case in results["cases"].items()}
    if "huge-turn-ids" in details:
        huge = details["huge-turn-ids"]
        assert all(v >= 1 for v in huge["counter_increase"].values()) and "at most 64" in huge["message"]
    if "directory-forgery" in details:
        forged = details["directory-forgery"]
        assert forged["dead_letter_reasons"] == {"forged-directory-record": 2}
        assert forged["new_player_first_message"] == "ready" and not forged["forged_owners"]
    if "report-ping-flood" in details:
        flood = details["report-ping-flood"]
        assert flood["open_after"] and flood["errors_received"] > 0 and sum(flood["refused"].values()) > 0
    assert results["processes_died"] == 0


def test_a_case_s_memory_growth_is_counted_over_the_higher_level_around_its_control_replay():
    from voicebus.ops.bench.hostile_cases import attack_only, format_cases, growth, memory_ok

    raw = growth({"gate": 48.0, "worker": 2000.0, "edge": 51.0}, {"gate": 48.3, "worker": 2009.4, "edge": 51.2})
    assert raw == {"gate": 0.3, "worker": 9.4, "edge": 0.2}
    # the worker's allocator handed 8 MB back during the control and took them again in the case:
    # not the attack's; a step up in the control is the replay's, and the case grows from there
    control = {"gate": 0.1, "worker": -8.0, "edge": 0.4}
    assert attack_only(raw, control) == {"gate": 0.3, "worker": 1.4, "edge": 0.2}
    case = {"processes_died": 0, "normal_turns": 4, "normal_turns_affected": 0, "rejection_reported": True,
            "reason": "r", "memory_growth_mb": attack_only(raw, control), "memory_growth_raw_mb": raw,
            "memory_control_mb": control}
    assert memory_ok(case) and not memory_ok(case | {"memory_growth_mb": {"gate": 5.1, "worker": 0.0, "edge": 0.0}})
    row = format_cases({"session-flood": case}).splitlines()[1]
    assert "+0.3/+1.4/+0.2" in row and "+0.3/+9.4/+0.2" in row and "+0.1/-8.0/+0.4" in row


def test_a_session_flood_must_evict_what_goes_past_the_gate_s_bound():
    from voicebus.ops.bench.hostile_faults import flood_expectation

    assert flood_expectation(200, 30, 400) == 230
    assert flood_expectation(200, 0, 150) == 0


def test_the_zombie_probe_speaks_only_sentences_the_normal_turns_speak():
    """A sentence the worker never spoke costs it a one-time memory step, which the zombie case
    (about the fence) would count as the attack's: +12.6 MB before its probe reused them."""
    from voicebus.ops.bench.hostile import NORMAL_TEXTS
    from voicebus.ops.bench.hostile_faults import ZOMBIE_PROBE

    spoken = {s.strip() + "." for text in NORMAL_TEXTS for s in text.split(".") if s.strip()}
    assert ZOMBIE_PROBE and all(token.strip() in spoken for token in ZOMBIE_PROBE)


def test_the_zombie_gate_s_announcements_fence_lines_and_duplicates_are_read_from_its_output():
    from voicebus.ops.bench.hostile_faults import (_gate_cmd, fence_report, owned_control, ready_partitions,
                                                   released_twice)

    ready = "voicebus-gate assigned"
    lines = ['voicebus-gate assigned ["c:0", "c:1", "text.a:0", "text.a:1"]',
             "INFO gate: partitions [0, 1] revoked",
             "INFO gate: fenced after a stall: partitions [0] may have moved (IllegalGenerationError)",
             'voicebus-gate assigned ["c:1", "text.a:1"]', "voicebus-gate assigned not json",
             "INFO gate: partitions [1] assigned and recovered (3 sessions)"]
    announced = ready_partitions(lines, ready)
    assert [owned_control(p, "c") for p in announced] == [2, 1, 0]
    report = fence_report(lines)
    assert len(report["fenced"]) == 1 and report["revoked"] == ["INFO gate: partitions [0, 1] revoked"]
    # a speculative release and its confirmation are two requests of one sentence, not a repeat
    probe = [("t", 0, True, "One."), ("t", 0, False, "One."), ("t", 1, False, "Two."), ("t", 1, False, "Two.")]
    assert released_twice(probe) == {"t#1#False#Two.": 2}
    cmd = ["py", "-m", "voicebus.gate.cli", "--announce", "--log-level", "WARNING", "--metrics-port", "9"]
    assert _gate_cmd(cmd, "INFO", 6.0) == ["py", "-m", "voicebus.gate.cli", "--announce", "--metrics-port", "9",
                                           "--log-level", "INFO", "--session-timeout", "6"]
    assert _gate_cmd(_gate_cmd(cmd, "INFO", 6.0), "INFO", 6.0) == _gate_cmd(cmd, "INFO", 6.0)
