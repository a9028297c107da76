"""Adding partitions to a running deployment's topics (`voicebus topics grow`).

A session's partition is the hash of its key modulo the partition count, so adding partitions
moves most sessions: what is written after the growth goes to another partition than what was
written before it. Every stage reads a partition in order and keeps state per partition (the
gate's sessions and text positions on its changelog partition, the edges' ownership and replay,
the workers' order per session), so a turn whose records straddle the growth could be heard out
of order, twice or not at all. Kafka cannot take partitions away again.

So only a drained deployment grows (docs/kafka.md, "Adding partitions"): the agents have stopped
at a turn boundary, and `grow_partitions` waits until

* every gate session in the changelog is idle (`GateSession.idle`: no turn open, nothing held,
  nothing waiting for the floor), so no turn has records on both sides of the growth and no
  state a later turn needs stays behind on the old partition;
* the synthesis workers' group has committed every request (lag 0);
* no record was written to any session-keyed topic for `quiet_s` (audio in flight has reached
  the edges, the players' reports are in),

then grows every session-keyed topic (text, control, synthesis, audio, playback, heard, floor,
dead letters, the gate's changelog) in one request, so they stay co-partitioned. The gate
workers, synthesis workers and edges read the count when they start: restart them with the new
``VOICEBUS_PARTITIONS``, then let the agents speak again.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Callable

from voicebus.settings import Settings

POLL_S = 0.5


class GrowthError(RuntimeError):
    """The topics cannot grow as asked: the count would not grow, or the session-keyed topics do
    not share one count now (a deployment that is not co-partitioned is repaired first)."""


class NotDrained(GrowthError):
    """The deployment did not drain within the wait; the message says what still moves."""


def session_keyed_topics(settings: Settings, existing: list[str]) -> list[str]:
    """Of `existing` topic names, those keyed by session id: every fixed topic but the agent
    registry and the edge directory (keyed by agent and edge), and every agent's text topic."""
    from voicebus.topics import fixed_topics, text_topic_pattern

    registries = {settings.agents_topic, settings.edges_topic}
    fixed = [t for t in fixed_topics(settings) if t not in registries and t in existing]
    return fixed + sorted(t for t in existing if re.match(text_topic_pattern(settings), t))


async def partition_counts(settings: Settings, topics: list[str]) -> dict[str, int]:
    from voicebus.bus import partitions_of

    counts: dict[str, int] = {t: 0 for t in topics}
    for tp in await partitions_of(settings, topics):
        counts[tp.topic] += 1
    return counts


async def undrained(settings: Settings, topics: list[str]) -> list[str]:
    """What keeps the deployment from being drained now (empty: drained but for the quiet wait)."""
    from voicebus.bus import committed_offsets, end_offsets, read_to_end
    from voicebus.gate.app import POSITIONS_KEY
    from voicebus.gate.core import GateConfig, GateSession
    from voicebus.topics import worker_group_id

    reasons: list[str] = []
    states: dict[str, bytes | None] = {}
    if settings.gate_changelog_topic in topics:
        for record in await read_to_end(settings, [settings.gate_changelog_topic]):
            if record.key is not None and record.key != POSITIONS_KEY:
                states[record.key.decode("utf-8")] = record.value  # the latest per session; None: expired
    config = GateConfig.from_settings(settings)
    for session_id, value in sorted(states.items()):
        if value is not None and not GateSession.from_state(session_id, config, json.loads(value)).idle:
            reasons.append(f"session {session_id}: a turn is open in the gate")
    if settings.synthesis_topic in topics:
        committed = await committed_offsets(settings, worker_group_id(settings))
        ends = await end_offsets(settings, [settings.synthesis_topic])
        behind = sum(end - committed.get(tp, 0) for tp, end in ends.items() if end > committed.get(tp, 0))
        if behind:
            reasons.append(f"the synthesis workers have {behind} request(s) not committed")
    return reasons


async def grow_partitions(settings: Settings, partitions: int, quiet_s: float = 5.0, wait_s: float = 300.0,
                          say: Callable[[str], None] = print) -> list[str]:
    """Grow every session-keyed topic to `partitions` once the deployment is drained (the module
    says when that is); returns the topics grown. Raises `GrowthError` when the count would not
    grow or the topics disagree, `NotDrained` when the deployment did not drain in `wait_s`."""
    from voicebus.bus import end_offsets, make_admin

    admin = make_admin(settings)
    await admin.start()
    try:
        topics = session_keyed_topics(settings, await admin.list_topics())
    finally:
        await admin.close()
    if not topics:
        raise GrowthError("no voicebus topic on this bus: create them with `voicebus topics --create` "
                          f"and VOICEBUS_PARTITIONS={partitions}")
    counts = await partition_counts(settings, topics)
    if len(set(counts.values())) != 1:
        raise GrowthError("the session-keyed topics do not share one partition count: "
                          + ", ".join(f"{t}={n}" for t, n in sorted(counts.items())))
    current = next(iter(counts.values()))
    if partitions <= current:
        raise GrowthError(f"the topics have {current} partitions already; Kafka only adds partitions "
                          f"(asked for {partitions})")
    say(f"growing {len(topics)} topics from {current} to {partitions} partitions once drained")
    deadline = time.monotonic() + wait_s
    ends, quiet_since, reasons = None, time.monotonic(), ["not checked yet"]
    while True:
        reasons = await undrained(settings, topics)
        now_ends = await end_offsets(settings, topics)
        if reasons or now_ends != ends:
            ends, quiet_since = now_ends, time.monotonic()  # the quiet wait starts again
        elif time.monotonic() - quiet_since >= quiet_s:
            break
        if time.monotonic() > deadline:
            moving = reasons or [f"records still written within the last {quiet_s:g} s"]
            raise NotDrained(f"not drained within {wait_s:g} s: " + "; ".join(moving))
        await asyncio.sleep(POLL_S)
    await _create_partitions(settings, topics, partitions)
    say(f"grew {', '.join(topics)} to {partitions} partitions; now restart the gate workers, synthesis "
        f"workers and edges with VOICEBUS_PARTITIONS={partitions}, then let the agents speak again")
    return topics


async def _create_partitions(settings: Settings, topics: list[str], partitions: int) -> None:
    """Every topic grows in one CreatePartitions request, then until the metadata shows it."""
    from aiokafka.admin import NewPartitions
    from aiokafka.errors import KafkaError

    from voicebus.bus import make_admin

    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_partitions({t: NewPartitions(total_count=partitions) for t in topics})
    except KafkaError as exc:  # a refusal names its topic
        raise GrowthError(f"the broker refused to grow the topics: {exc}") from exc
    finally:
        await admin.close()
    deadline = time.monotonic() + 30
    while set((await partition_counts(settings, topics)).values()) != {partitions}:
        if time.monotonic() > deadline:
            raise GrowthError(f"the topics do not show {partitions} partitions 30 s after growing")
        await asyncio.sleep(POLL_S)
