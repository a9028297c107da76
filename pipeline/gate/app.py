"""The gate as a faust stream processor: agents' text topics in, synthesis requests out.

`GateWorker` owns one faust App (app id ``settings.gate_app_id``) with:

- ``gate-text``: an agent over every agent text topic. faust-streaming cannot subscribe by
  pattern (its consumer subscribes to explicit names), so a discovery timer lists the broker's
  topics every ``discovery_interval_s`` and adds new ones matching
  `pipeline.topics.text_topic_pattern` to the agent's topic; the consumer resubscribes and the
  group rebalances. A new agent's topic is read from its beginning, so nothing it sent before the
  gate noticed it is lost (`_rewind_uncommitted_partitions` makes that hold across faust's
  rebalance-time seeks). (With no text topic at all at start, the worker creates an empty one
  for agent id ``_gate``: faust can only extend a subscription list that is not empty.)
- ``gate-control``: a separate agent on the control topic, so a cancel is applied to the session's
  state while the text agent still has a backlog (control overtakes data).
- ``gate_sessions``: a faust Table (memory store, compacted changelog
  ``settings.gate_changelog_topic``), session id -> `GateSession` state. A restarted or
  rebalanced worker recovers it from the changelog.
- a timer that applies hold timeouts (`GateSession.tick`) to the sessions that have one due.

Delivery: faust is at-least-once. For each event the worker (under one lock, so agents and timer
never interleave on a session) loads the session, applies the event, sends the resulting requests
and waits for the broker's acks, and only then writes the new state to the Table. A crash before
the write means the event is re-delivered and re-applied to the old state, giving the same
sentences with the same sentence_seq; a crash after it means the re-delivered event is ignored by
the (agent, turn, seq) guard in the state. So no sentence is lost; a repeat needs a crash in the
few milliseconds between the acks and the changelog write, and then carries the same
(session_id, turn_id, sentence_seq) so consumers can drop it.

Bad records (not decodable, wrong type, oversized, or an event the core rejects) go to the
dead-letter topic with the reason in headers; the worker keeps going.

Run it: ``voicebus gate``, ``python -m pipeline.gate.app`` (settings from ``VOICEBUS_*``), or
`start_gate_subprocess` from tests and demos.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.clock import now_us
from pipeline.codecs import CodecError, codec_for, deadletter_headers
from pipeline.gate.core import GateConfig, GateInputError, GateSession
from pipeline.gate.evidence import EvidenceError
from pipeline.settings import Settings
from pipeline.bus import ensure_topics
from pipeline.topics import session_key, text_topic, text_topic_pattern

log = logging.getLogger(__name__)

PLACEHOLDER_AGENT = "_gate"  # an agent id no agent uses; see GateWorker._initial_text_topics
READY_LINE = "voicebus-gate assigned"  # printed (JSON after it) when partitions are assigned


class GateWorker:
    """One gate worker: builds and owns its faust App. `run()` blocks until the worker stops."""

    def __init__(
        self,
        settings: Settings,
        *,
        commit_interval_s: float = 1.0,
        session_timeout_s: float = 10.0,
        timer_interval_s: float = 0.2,
        discovery_interval_s: float = 2.0,
        announce: bool = False,
    ) -> None:
        import faust

        self.settings = settings
        self.config = GateConfig.from_settings(settings)
        self.codec = codec_for(settings)
        self._pattern = re.compile(text_topic_pattern(settings))
        self._lock = asyncio.Lock()
        self._announce = announce
        initial_text_topics = self._initial_text_topics()  # before faust takes the event loop
        self.app = faust.App(
            settings.gate_app_id,
            broker=f"kafka://{settings.bootstrap}",
            store="memory://",
            datadir=str(Path(settings.cache_dir) / "gate-faust"),
            autodiscover=False,
            web_enabled=False,
            topic_partitions=settings.partitions,
            topic_replication_factor=settings.replication_factor,
            table_standby_replicas=0,  # a standby's keys would show up in the timer's scan
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=commit_interval_s,
            broker_session_timeout=session_timeout_s,
            broker_heartbeat_interval=max(0.5, session_timeout_s / 5),
            broker_rebalance_timeout=max(session_timeout_s, 10.0),
            producer_linger=0.0,
            producer_max_request_size=settings.max_message_bytes,
            key_serializer="raw",
            value_serializer="raw",
        )
        # Resubscribe soon after a new text topic appears (faust waits 45 s by default).
        self.app.topics._resubscribe_sleep_lock_seconds = 1.0
        raw = {"key_serializer": "raw", "value_serializer": "raw"}
        self.text_channel = self.app.topic(*initial_text_topics, **raw)
        # A list, not faust's tuple, shared with the agent's clone so discovery can extend it.
        self.text_channel.topics = list(initial_text_topics)
        self.control_channel = self.app.topic(settings.control_topic, **raw)
        self.synthesis_channel = self.app.topic(settings.synthesis_topic, **raw)
        self.deadletter_channel = self.app.topic(settings.deadletter_topic, **raw)
        self.table = self.app.Table(
            "gate_sessions",
            default=None,
            partitions=settings.partitions,
            changelog_topic=self.app.topic(
                settings.gate_changelog_topic, partitions=settings.partitions, compacting=True,
                deleting=False, internal=True, key_serializer="raw", value_serializer="json",
            ),
            schema=faust.Schema(key_serializer="raw", value_serializer="json"),
            # Changelog partition = the producer's partition for the session key, so writes from
            # the timer (no current event) land where the session's text and control records do.
            use_partitioner=True,
        )
        self.app.agent(self.text_channel, name="gate-text")(self._text_agent)
        self.app.agent(self.control_channel, name="gate-control")(self._control_agent)
        self.app.timer(timer_interval_s, name="gate-hold-timeouts")(self._hold_timeouts)
        self.app.timer(discovery_interval_s, name="gate-topic-discovery")(self._discover_text_topics)
        self.app.on_rebalance_complete.connect(self._on_rebalance_complete)
        # Revocation comes first in every rebalance (also the first, with nothing to revoke),
        # so the consumer's seek is wrapped before any recovery seeks with it.
        self.app.on_partitions_revoked.connect(self._rewind_uncommitted_partitions)
        self._rewinds_uncommitted = False

    # --- running ---------------------------------------------------------------------------------
    def run(self, loglevel: str = "WARNING") -> int:
        """Run the worker in this process until SIGINT/SIGTERM."""
        import faust

        worker = faust.Worker(self.app, loglevel=loglevel, quiet=True, override_logging=False)
        try:
            worker.execute_from_commandline()
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    # --- agents ----------------------------------------------------------------------------------
    async def _text_agent(self, stream: Any) -> None:
        async for event in stream.events():
            await self._on_record(event.message, "TextEvent")

    async def _control_agent(self, stream: Any) -> None:
        async for event in stream.events():
            await self._on_record(event.message, "ControlEvent")

    async def _on_record(self, message: Any, expect: str) -> None:
        try:
            value = self.codec.decode(message.value, expect=expect).value
        except CodecError as exc:
            await self._dead_letter(message, exc)
            return
        session_id = value["session_id"]
        async with self._lock:
            session = self._load(session_id)
            try:
                requests = session.apply(value, now_us())
            except (GateInputError, EvidenceError) as exc:
                await self._dead_letter(message, exc)
                return
            except Exception as exc:  # a bug must not wedge the partition: skip the event, loudly
                log.exception("gate: event %s[%s]@%s failed; state left as before it",
                              message.topic, message.partition, message.offset)
                await self._dead_letter(message, exc)
                return
            await self._emit(requests)
            self._store(session)

    async def _hold_timeouts(self) -> None:
        if self.app.rebalancing or self.app.tables.recovery.in_recovery:
            return  # the table is being rebuilt: a stale read now could be written back
        now = now_us()
        due = [k for k, v in list(self.table.items()) if v and v.get("deadline_us") is not None
               and v["deadline_us"] <= now]
        for key in due:
            async with self._lock:
                session = self._load(key.decode("utf-8"))
                requests = session.tick(now_us())
                await self._emit(requests)
                self._store(session)

    async def _discover_text_topics(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.bootstrap)
        try:
            await admin.start()
            names = {t for t in await admin.list_topics() if self._pattern.match(t)}
        except Exception as exc:  # the broker is briefly away: try again next tick
            log.warning("gate: cannot list topics: %s", exc)
            return
        finally:
            await admin.close()
        new = names - set(self.text_channel.topics)
        if new:
            log.info("gate: subscribing to new text topics %s", sorted(new))
            # In place: the agent's stream iterates a clone of the channel sharing this list.
            self.text_channel.topics.extend(sorted(new))
            self.app.topics._flag_changes()  # faust resubscribes (see __init__)

    async def _rewind_uncommitted_partitions(self, *args: Any, **kwargs: Any) -> None:
        if self._rewinds_uncommitted:
            return
        consumer = self.app.consumer
        # faust drops records it fetched while its flow was stopped (a rebalance in progress)
        # and then "seeks back to committed offsets". aiokafka's seek_to_committed does not move
        # a partition that has no committed offset (or 0), so those dropped records were never
        # read again: the first turn of a new agent, whose topic the gate had just discovered
        # with its records already in it, could vanish (seen once in a test run under load).
        # Rewinding such partitions to their beginning gives the auto_offset_reset=earliest
        # this worker asks for; records already applied come again and the state's seq guard
        # ignores them, as after any re-delivery.
        seek_to_committed = consumer.seek_to_committed

        async def seek_to_committed_or_beginning() -> Any:
            committed = await seek_to_committed()
            uncommitted = [tp for tp, offset in committed.items() if not offset and self._is_stream_topic(tp.topic)]
            if uncommitted:
                log.info("gate: %d partitions without a committed offset read from their beginning", len(uncommitted))
                for tp, offset in (await consumer.earliest_offsets(*uncommitted)).items():
                    await consumer.seek(tp, offset)
            return committed

        consumer.seek_to_committed = seek_to_committed_or_beginning
        self._rewinds_uncommitted = True

    def _is_stream_topic(self, topic: str) -> bool:
        """A topic the gate's agents read (not a changelog, which faust's recovery seeks itself)."""
        return topic == self.settings.control_topic or bool(self._pattern.match(topic))

    async def _on_rebalance_complete(self, sender: Any = None, **kwargs: Any) -> None:
        if self._announce:
            assigned = sorted(f"{tp.topic}:{tp.partition}" for tp in self.app.consumer.assignment())
            print(READY_LINE, json.dumps(assigned), flush=True)

    # --- state and output ------------------------------------------------------------------------
    def _load(self, session_id: str) -> GateSession:
        stored = self.table.get(session_key(session_id))
        return GateSession.from_state(session_id, self.config, stored["state"] if stored else None)

    def _store(self, session: GateSession) -> None:
        self.table[session_key(session.session_id)] = {
            "state": session.to_state(),
            "deadline_us": session.next_deadline_us(),
        }

    async def _emit(self, requests: list[dict]) -> None:
        futures = [
            await self.synthesis_channel.send(
                key=session_key(r["session_id"]), value=self.codec.encode("SynthesisRequest", r, self.settings.synthesis_topic)
            )
            for r in requests
        ]
        for fut in futures:
            await fut  # acked by the broker before the state that produced it is stored

    async def _dead_letter(self, message: Any, error: Exception) -> None:
        headers = deadletter_headers(error, message.topic, message.partition, message.offset)
        fut = await self.deadletter_channel.send(key=message.key, value=message.value, headers=headers)
        await fut
        log.warning("gate: dead-lettered %s[%s]@%s: %s", message.topic, message.partition, message.offset, error)

    def _initial_text_topics(self) -> list[str]:
        """Text topics that exist now (so the first assignment already covers them)."""
        from aiokafka.admin import AIOKafkaAdminClient

        async def list_matching() -> list[str]:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.bootstrap)
            await admin.start()
            try:
                names = sorted(t for t in await admin.list_topics() if self._pattern.match(t))
            finally:
                await admin.close()
            if not names:
                # faust copies an empty topic list into the agent's channel, which discovery
                # then could not extend: start from one (empty) text topic of the gate's own.
                names = [text_topic(self.settings, PLACEHOLDER_AGENT)]
                await ensure_topics(self.settings, names)
            return names

        try:
            return asyncio.run(list_matching())
        except Exception as exc:
            log.warning("gate: cannot list topics at start (%s); discovery will retry", exc)
            return []
        finally:
            # asyncio.run leaves no current loop behind; faust's worker needs one.
            asyncio.set_event_loop(asyncio.new_event_loop())


def run_gate_worker(settings: Settings, **options: Any) -> int:
    """Run one gate worker in this process until it is stopped (SIGINT/SIGTERM)."""
    loglevel = options.pop("loglevel", "WARNING")
    return GateWorker(settings, **options).run(loglevel=loglevel)


def start_gate_subprocess(
    settings: Settings, *, commit_interval_s: float = 1.0, session_timeout_s: float = 10.0,
    stdout: Any = subprocess.PIPE, stderr: Any = None, loglevel: str = "WARNING",
) -> subprocess.Popen:
    """Start a gate worker as a child process (`python -m pipeline.gate.app --announce`).

    The caller owns the process: it must terminate (or kill) and wait for it. With the default
    stdout, the child prints `READY_LINE` and its partitions after each rebalance.
    """
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline.gate.app", "--announce", "--loglevel", loglevel,
           "--commit-interval", str(commit_interval_s), "--session-timeout", str(session_timeout_s)]
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(cmd, env=env, cwd=str(root), stdout=stdout, stderr=stderr, text=True)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--commit-interval", type=float, default=1.0, metavar="S",
                        help="how often consumed offsets are committed (default 1.0)")
    parser.add_argument("--session-timeout", type=float, default=10.0, metavar="S",
                        help="consumer group session timeout: how soon a dead worker's partitions move")
    parser.add_argument("--loglevel", default="WARNING")
    parser.add_argument("--announce", action="store_true",
                        help=f"print '{READY_LINE} [partitions]' after each rebalance")


def gate_command(args: argparse.Namespace, settings: Settings) -> int:
    """`voicebus gate`: run one gate worker until stopped."""
    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_gate_worker(
        settings, commit_interval_s=args.commit_interval, session_timeout_s=args.session_timeout,
        announce=args.announce, loglevel=args.loglevel,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.gate.app", description="Run one gate worker.")
    add_worker_arguments(parser)
    return gate_command(parser.parse_args(argv), Settings.from_env())


if __name__ == "__main__":
    sys.exit(main())
