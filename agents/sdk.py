"""The agent producer SDK: how an agent streams a turn onto its text topic.

Owns the `TextEvent`/`ControlEvent` records an agent publishes and the Kafka producer that sends
them. A few lines stream a turn:

    async with Publisher(settings, agent_id="assistant") as agent:
        async with agent.turn("session-1") as turn:
            await turn.token("Hello")
            await turn.token(" world.")
        # END_OF_TURN is published when the block exits

Pure core: `TurnEvents` numbers a turn's events (`seq` from 0) and refuses events after the end
of the turn; it builds the `TextEvent`s (`voicebus.schemas.messages`) without touching Kafka.
Thin shell: `Publisher` (an async context manager that owns one producer) sends them, each agent
to its own topic (`voicebus.topics.text_topic`, created on first use), keyed by session id. One
`Publisher` can speak for several agents at once (`agent_id=` on `turn` / `evidence_source`).

`seq` counts per (agent, session, turn): each agent numbers only the events it produces, so a
retrieval agent that resolves a claim of the assistant's turn has its own sequence from 0.

Tracing (``VOICEBUS_TRACING``, `voicebus.tracing`): a turn's first event opens its trace (the
root span ``voicebus.turn``) and every event of the turn carries its W3C context in the record
headers; END_OF_TURN (or a cancel) ends the root span.

Size: about 630 lines: the agent-facing API in one module (publisher, turns, evidence, and the
followers of what was heard and of the floor), so an agent imports one thing; the pure cores
(`TurnEvents`) are separate classes in it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterable, Iterable, Mapping, Sequence

from voicebus.clock import now_us
from voicebus.codecs import Codec, codec_for
from voicebus.lifecycle import Owned
from voicebus.settings import Settings
from voicebus import tracing
from voicebus.topics import text_topic
from voicebus.tracing import LiveSpan, StageTracer, tracer_for
from voicebus.schemas import contract
from voicebus.schemas.contract import TextEventKind
from voicebus.schemas.messages import ControlEvent, FloorEvent, Message, TextEvent, TurnHeard

log = logging.getLogger(__name__)

# The kinds of TextEvent, as the schema's enum (voicebus.schemas.contract): equal to their Avro symbols.
TOKEN = TextEventKind.TOKEN
EVIDENCE_PENDING = TextEventKind.EVIDENCE_PENDING
EVIDENCE_READY = TextEventKind.EVIDENCE_READY
EVIDENCE_FAILED = TextEventKind.EVIDENCE_FAILED
END_OF_TURN = TextEventKind.END_OF_TURN
TEXT_EVENT_KINDS = tuple(TextEventKind)
EVIDENCE_KINDS = (EVIDENCE_PENDING, EVIDENCE_READY, EVIDENCE_FAILED)
MAX_TRACED_TURNS = 4096  # open turn spans one publisher keeps (tracing on); the oldest is ended beyond


class AgentError(RuntimeError):
    """Base of the SDK's errors."""


class TurnEndedError(AgentError):
    """An event was added to a turn after its END_OF_TURN."""


class InvalidEventError(AgentError, ValueError):
    """An event the pipeline could not act on: missing what its kind needs (a claim id for
    evidence, ...), or breaking the contract (a language it cannot speak, an id too long, ...)."""


def _check_contract(message_type: str, value: dict[str, Any]) -> dict[str, Any]:
    problems = contract.violations(message_type, value)
    if problems:
        raise InvalidEventError(f"{message_type}: " + "; ".join(problems))
    return value


class PublisherNotStartedError(AgentError):
    """The publisher was used outside its `async with` block (or after `stop()`)."""


def lexicon_entries(lexicon: "Sequence[Mapping[str, Any]] | None") -> list[dict[str, Any]] | None:
    """A turn's lexicon as TextEvent records: each entry a mapping with ``match`` and one of
    ``phonemes`` or ``say`` (and ``regex``: True for a regular expression), completed with the
    schema's defaults; None or empty: no lexicon. `InvalidEventError` when the contract refuses
    it (docs/protocol.md, "Pronunciation")."""
    if lexicon is None:
        return None
    if isinstance(lexicon, (str, bytes, Mapping)) or not isinstance(lexicon, Sequence):
        raise InvalidEventError(f"lexicon must be a list of entries (dicts), not {type(lexicon).__name__}")
    out = []
    for n, entry in enumerate(lexicon):
        if not isinstance(entry, Mapping):
            raise InvalidEventError(f"lexicon entry {n} must be a dict, not {type(entry).__name__}")
        unknown = set(entry) - {"match", "regex", "phonemes", "say"}
        if unknown:
            raise InvalidEventError(f"lexicon entry {n} has unknown keys {sorted(unknown)} "
                                    "(match, regex, phonemes, say)")
        out.append({"match": entry.get("match"), "regex": bool(entry.get("regex", False)),
                    "phonemes": entry.get("phonemes"), "say": entry.get("say")})
    problems = contract.lexicon_problems(out)
    if problems:
        raise InvalidEventError("lexicon: " + "; ".join(problems))
    return out or None


def new_turn_id() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def new_session_id() -> str:
    return "s-" + uuid.uuid4().hex[:12]


def text_event(
    *,
    session_id: str,
    turn_id: str,
    agent_id: str,
    seq: int,
    kind: str,
    text: str = "",
    claim_id: str | None = None,
    language: str | None = None,
    voice: str | None = None,
    floor: str | None = None,
    priority: int = 0,
    speed: float | None = None,
    lexicon: "Sequence[Mapping[str, Any]] | None" = None,
    produced_at_us: int | None = None,
) -> TextEvent:
    """A `TextEvent` (schemas/text_event.avsc), checked for what its kind needs and against the
    contract.

    `floor` (``queue`` or ``preempt``; None: the gate's policy) and `priority` say how the turn
    takes the session's floor when another turn is speaking (docs/protocol.md, "The floor");
    `speed` is the turn's speaking rate (None: the gate's default); `lexicon` how it says some
    words (`lexicon_entries`; docs/protocol.md, "Pronunciation"), read from its first event."""
    if kind not in TEXT_EVENT_KINDS:
        raise InvalidEventError(f"unknown TextEvent kind {kind!r}; expected one of {TEXT_EVENT_KINDS}")
    if kind in EVIDENCE_KINDS and not claim_id:
        raise InvalidEventError(f"{kind} needs a claim_id")
    if kind != TOKEN and text:
        raise InvalidEventError(f"{kind} carries no text (got {text!r})")
    if seq < 0:
        raise InvalidEventError(f"seq must be >= 0, got {seq}")
    return TextEvent.from_record(_check_contract("TextEvent", {
        "session_id": session_id,
        "turn_id": turn_id,
        "agent_id": agent_id,
        "seq": seq,
        "kind": kind,
        "text": text,
        "claim_id": claim_id,
        "language": language,
        "voice": voice,
        "floor": floor,
        "priority": priority,
        "speed": None if speed is None else float(speed),
        "lexicon": lexicon_entries(lexicon),
        "produced_at_us": now_us() if produced_at_us is None else produced_at_us,
    }))


def cancel_event(
    session_id: str, turn_id: str | None = None, *, reason: str = "", source: str = "agent",
    issued_at_us: int | None = None, turn_ids: list[str] | tuple[str, ...] = (),
) -> ControlEvent:
    """A CANCEL `ControlEvent`, checked against the contract: one turn; or, with `turn_id=None`,
    the turns in `turn_ids`, or (none listed) every turn of the session that each stage has seen
    when the cancel reaches it. `issued_at_us` is for latency metrics only; no stage compares it
    with its own clock."""
    event = ControlEvent.cancel(session_id, turn_id, reason=reason, source=source, turn_ids=turn_ids,
                                issued_at_us=now_us() if issued_at_us is None else issued_at_us)
    _check_contract("ControlEvent", event.to_record())
    return event


class TurnEvents:
    """Pure core of one agent's part of a turn: numbers events from 0, stamps them, and refuses
    anything after END_OF_TURN. `ended` tells whether the end was produced. The turn's `lexicon`
    goes with its first event only (the gate reads it from there; the others stay small)."""

    def __init__(self, session_id: str, turn_id: str, agent_id: str,
                 language: str | None = None, voice: str | None = None, *,
                 floor: str | None = None, priority: int = 0, speed: float | None = None,
                 lexicon: "Sequence[Mapping[str, Any]] | None" = None) -> None:
        text_topic(Settings(), agent_id)  # validates the agent id early, with a clear message
        self.session_id = session_id
        self.turn_id = turn_id
        self.agent_id = agent_id
        self.language = language
        self.voice = voice
        self.floor = floor
        self.priority = priority
        self.speed = speed
        self.lexicon = lexicon_entries(lexicon)
        self.next_seq = 0
        self.ended = False

    def make(self, kind: str, text: str = "", claim_id: str | None = None,
             produced_at_us: int | None = None) -> TextEvent:
        if self.ended:
            raise TurnEndedError(
                f"turn {self.turn_id} of session {self.session_id} (agent {self.agent_id}) already ended; "
                f"cannot add {kind}"
            )
        event = text_event(
            session_id=self.session_id, turn_id=self.turn_id, agent_id=self.agent_id, seq=self.next_seq,
            kind=kind, text=text, claim_id=claim_id, language=self.language, voice=self.voice,
            floor=self.floor, priority=self.priority, speed=self.speed,
            lexicon=self.lexicon if self.next_seq == 0 else None, produced_at_us=produced_at_us,
        )
        self.next_seq += 1
        if kind == END_OF_TURN:
            self.ended = True
        return event


class Publisher(Owned):
    """Owns one Kafka producer and publishes agents' events. Use as `async with`.

    `agent_id` is the default agent; `turn(..., agent_id=...)` speaks for another one. Each
    agent's text topic is created (idempotently) the first time this publisher uses it.
    `voice`, `language`, `floor`, `priority`, `speed` and `lexicon` are the defaults of this
    publisher's turns (an agent declares its voice once, so two agents in one session are told
    apart by ear); a turn may override each.
    """

    def __init__(self, settings: Settings, agent_id: str = "assistant", *, codec: Codec | None = None,
                 producer_options: dict[str, Any] | None = None, tracer: StageTracer | None = None,
                 voice: str | None = None, language: str | None = None, floor: str | None = None,
                 priority: int = 0, speed: float | None = None,
                 lexicon: "Sequence[Mapping[str, Any]] | None" = None) -> None:
        text_topic(settings, agent_id)  # validate early
        self.settings = settings
        self.agent_id = agent_id
        self.voice, self.language, self.floor, self.priority = voice, language, floor, priority
        self.speed = speed
        self.lexicon = lexicon_entries(lexicon)
        # the defaults checked once, here, with the contract's message (not at the first turn)
        text_event(session_id="check", turn_id="check", agent_id=agent_id, seq=0, kind=TOKEN, voice=voice,
                   language=language, floor=floor, priority=priority, speed=speed, lexicon=self.lexicon,
                   produced_at_us=0)
        self.codec = codec or codec_for(settings)
        self.tracer = tracer if tracer is not None else tracer_for(settings, "agent")
        self._producer_options = producer_options or {}
        self._producer = None
        self._ready_topics: set[str] = set()
        # (session, turn) -> the turn's root span, open from its first event to its END_OF_TURN
        self._turn_spans: OrderedDict[tuple[str, str], LiveSpan] = OrderedDict()

    async def start(self) -> None:
        from voicebus.bus import ensure_topics, make_producer, register_schemas

        if self._producer is not None:
            return
        await ensure_topics(self.settings, [self.settings.control_topic])
        await register_schemas(self.codec, {self.settings.control_topic: "ControlEvent"})
        self._ready_topics.add(self.settings.control_topic)
        producer = make_producer(self.settings, **self._producer_options)
        await producer.start()
        self._producer = producer
        await self.ensure_agent_topic(self.agent_id)

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    def _require_producer(self):
        if self._producer is None:
            raise PublisherNotStartedError("use the Publisher inside `async with` (or call start() first)")
        return self._producer

    async def ensure_agent_topic(self, agent_id: str) -> str:
        """The agent's text topic, created if missing, its metadata loaded into the producer and
        registered in the agent registry (``settings.agents_topic``) for the gate (once per
        publisher). Call it before the clock matters: on a new topic this takes a few
        hundred milliseconds (creation, leader election) that would otherwise delay the first
        token and everything queued behind it."""
        from voicebus.bus import ensure_topics, register_schemas
        from voicebus.shell import register_topic

        topic = text_topic(self.settings, agent_id)
        if topic not in self._ready_topics:
            await ensure_topics(self.settings, [topic, self.settings.agents_topic])
            producer = self._require_producer()
            await producer.partitions_for(topic)  # ensure_topics returned once its leaders serve
            await register_schemas(self.codec, {topic: "TextEvent"})
            # The gate follows the agent registry: it reads the new topic within milliseconds
            # instead of finding it by its periodic listing (docs/gate.md, "New agents").
            await register_topic(producer, self.settings, agent_id, topic)
            self._ready_topics.add(topic)
        return topic

    async def publish_text_event(self, event: "TextEvent | Mapping[str, Any]", *, wait: bool = True):
        """Send one `TextEvent` (or its record, a dict) to its agent's topic, keyed by its session id.

        `wait=True` returns once the broker acked; `wait=False` returns the delivery future once
        the record is queued (per-partition order is kept either way)."""
        if not isinstance(event, TextEvent):
            record = _check_contract("TextEvent", dict(event))
            try:
                event = TextEvent.from_record(record)
            except (TypeError, ValueError) as exc:  # a field missing, a kind no schema has
                raise InvalidEventError(f"TextEvent: {exc}") from None
        producer = self._require_producer()
        topic = await self.ensure_agent_topic(event.agent_id)
        headers = self._trace_headers(event) if self.tracer.enabled else None
        return await self._send(producer, topic, "TextEvent", event, wait, headers)

    def _trace_headers(self, event: TextEvent) -> list[tuple[str, bytes]] | None:
        """The turn's trace context for one of its events: the turn's root span starts at its
        first event (any agent's, through this publisher) and ends with its END_OF_TURN."""
        key = (event.session_id, event.turn_id)
        span = self._turn_spans.get(key)
        if span is None:
            span = self._turn_spans[key] = self.tracer.start(
                tracing.TURN_SPAN, None, event.produced_at_us, root=True,
                **{tracing.SESSION: key[0], tracing.TURN: key[1], tracing.AGENT: event.agent_id})
            while len(self._turn_spans) > MAX_TRACED_TURNS:  # turns that never ended (an agent died)
                self._turn_spans.popitem(last=False)[1].end()
        headers = self.tracer.headers(span.context)
        if event.kind == END_OF_TURN:
            self._turn_spans.pop(key)
            span.end(event.produced_at_us, **{"voicebus.events": event.seq + 1})
        return headers

    def _end_turn_spans(self, session_id: str, turn_id: str | None) -> None:
        """A cancelled turn (all of the session's, without a turn id) ends its root span."""
        for key in [k for k in self._turn_spans if k[0] == session_id and turn_id in (None, k[1])]:
            self._turn_spans.pop(key).end(**{"voicebus.cancelled": True})

    async def publish_control_event(self, event: "ControlEvent | dict[str, Any]", *, wait: bool = True):
        producer = self._require_producer()
        return await self._send(producer, self.settings.control_topic, "ControlEvent", event, wait)

    async def _send(self, producer, topic: str, message_type: str, value: "Message | dict[str, Any]", wait: bool,
                    headers: list[tuple[str, bytes]] | None = None):
        from voicebus.topics import session_key

        if isinstance(value, Message):
            value = value.to_record()

        data = self.codec.encode(message_type, value, topic)
        if wait:
            return await producer.send_and_wait(topic, data, key=session_key(value["session_id"]), headers=headers)
        return await producer.send(topic, data, key=session_key(value["session_id"]), headers=headers)

    def turn(self, session_id: str, turn_id: str | None = None, *, agent_id: str | None = None,
             language: str | None = None, voice: str | None = None, floor: str | None = None,
             priority: int | None = None, speed: float | None = None,
             lexicon: "Sequence[Mapping[str, Any]] | None" = None) -> "Turn":
        """A turn of `agent_id` (default: this publisher's agent) for `session_id`; language,
        voice, floor, priority, speed and lexicon default to the publisher's (``lexicon=[]``:
        none for this turn)."""
        events = TurnEvents(session_id, turn_id or new_turn_id(), agent_id or self.agent_id,
                            language or self.language, voice or self.voice, floor=floor or self.floor,
                            priority=self.priority if priority is None else priority,
                            speed=self.speed if speed is None else speed,
                            lexicon=self.lexicon if lexicon is None else lexicon)
        return Turn(self, events)

    def evidence_source(self, session_id: str, turn_id: str, *, agent_id: str) -> "EvidenceSource":
        """A side agent (retrieval, a tool) that resolves claims of someone else's turn."""
        return EvidenceSource(self, TurnEvents(session_id, turn_id, agent_id))

    async def cancel(self, session_id: str, turn_id: str | None = None, *, reason: str = "",
                     source: str = "agent") -> dict[str, Any]:
        """Publish a CANCEL on the control topic (barge-in); returns the event sent."""
        event = cancel_event(session_id, turn_id, reason=reason, source=source)
        await self.publish_control_event(event)
        if self._turn_spans:
            self._end_turn_spans(session_id, turn_id)
        return event


class EvidenceSource:
    """Publishes EVIDENCE_* events for a claim of a turn; never tokens, never END_OF_TURN (the
    turn's speaking agent owns its end)."""

    def __init__(self, publisher: Publisher, events: TurnEvents) -> None:
        self._publisher = publisher
        self.events = events

    async def _emit(self, kind: str, claim_id: str) -> TextEvent:
        event = self.events.make(kind, claim_id=claim_id)
        await self._publisher.publish_text_event(event)
        return event

    async def evidence_pending(self, claim_id: str) -> TextEvent:
        return await self._emit(EVIDENCE_PENDING, claim_id)

    async def evidence_ready(self, claim_id: str) -> TextEvent:
        return await self._emit(EVIDENCE_READY, claim_id)

    async def evidence_failed(self, claim_id: str) -> TextEvent:
        return await self._emit(EVIDENCE_FAILED, claim_id)


class Turn(EvidenceSource):
    """One agent's turn for a session. Use as `async with`: END_OF_TURN is published on exit,
    also when the block raises (the gate then speaks what arrived instead of holding it), and the
    error propagates."""

    @property
    def session_id(self) -> str:
        return self.events.session_id

    @property
    def turn_id(self) -> str:
        return self.events.turn_id

    @property
    def ended(self) -> bool:
        return self.events.ended

    async def __aenter__(self) -> "Turn":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.events.ended:
            return
        if exc_type is None:
            await self.end()
            return
        try:
            await self.end()
        except Exception:  # the original error matters more; say why the end was not sent
            log.exception("could not publish END_OF_TURN for %s/%s after %s",
                          self.session_id, self.turn_id, exc_type.__name__)

    async def token(self, text: str) -> TextEvent | None:
        """Publish one token (a word piece with its spaces). Empty text is ignored: streaming
        APIs often send empty deltas."""
        if not text:
            return None
        return await self._emit_text(text)

    async def _emit_text(self, text: str) -> TextEvent:
        event = self.events.make(TOKEN, text=text)
        await self._publisher.publish_text_event(event)
        return event

    async def tokens(self, pieces: Iterable[str] | AsyncIterable[str]) -> int:
        """Publish every piece of a (sync or async) iterable; returns how many were sent."""
        sent = 0
        if hasattr(pieces, "__aiter__"):
            async for piece in pieces:  # type: ignore[union-attr]
                sent += await self.token(piece) is not None
        else:
            for piece in pieces:  # type: ignore[union-attr]
                sent += await self.token(piece) is not None
        return sent

    async def end(self) -> TextEvent:
        event = self.events.make(END_OF_TURN)
        await self._publisher.publish_text_event(event)
        return event

    async def cancel(self, reason: str = "", source: str = "agent") -> dict[str, Any]:
        """Cancel this turn everywhere (the turn is then over: no END_OF_TURN follows)."""
        event = await self._publisher.cancel(self.session_id, self.turn_id, reason=reason, source=source)
        self.events.ended = True
        return event


class HeardTimeout(AgentError, TimeoutError):
    """No TurnHeard for a turn within the time given (no player reported it, or none listened)."""


class HeardFollower(Owned):
    """What listeners heard of turns: every TurnHeard the edge publishes (``settings.heard_topic``,
    docs/protocol.md "Heard report"), for an agent to continue from what was actually heard.

        async with Publisher(settings) as agent, HeardFollower(agent) as heard:
            async with agent.turn("s1") as turn:
                ...
            result = await heard.wait(turn.session_id, turn.turn_id, timeout_s=10)
            result.heard_text, result.interrupted, result.unheard_words

    Each is a `voicebus.schemas.messages.TurnHeard` (``unheard_words`` a tuple). ``on_heard`` (or
    `add_callback`) is called with every TurnHeard (sync or async). It uses the
    publisher's producer (for dead letters: a record that cannot be decoded is dead-lettered
    like any stage's) and a consumer of its own on every partition, ``lookback_s`` back at start
    (so a turn that ended just before is still found), with no consumer group. Records it has
    seen are kept for the last ``keep`` turns, so `wait` returns at once for a turn already heard.
    """

    topic_setting = "heard_topic"  # the Settings field naming the topic followed
    message_type = "TurnHeard"
    name = "heard"

    def __init__(self, publisher: Publisher, *, on_heard: Any = None, lookback_s: float = 60.0, keep: int = 4096) -> None:
        from collections import OrderedDict

        self.publisher = publisher
        self.settings = publisher.settings
        self.lookback_s = lookback_s
        self.keep = keep
        self._callbacks: list[Any] = [on_heard] if on_heard is not None else []
        self._heard: "OrderedDict[tuple, Message]" = OrderedDict()
        self._waiters: dict[tuple[str, str], list] = {}
        self._follower = None
        self._task = None

    def add_callback(self, callback: Any) -> None:
        self._callbacks.append(callback)

    async def start(self) -> None:
        import asyncio

        from voicebus.bus import ensure_topics
        from voicebus.shell import ControlFollower, RecordPolicy

        topic = getattr(self.settings, self.topic_setting)
        await ensure_topics(self.settings, [topic])
        policy = RecordPolicy(f"agent-{self.name}", self.settings, self.publisher.codec, self.publisher._require_producer())
        self._follower = ControlFollower(self.settings, policy, self._on_record, lookback_s=self.lookback_s,
                                         topic=topic, message_type=self.message_type)
        await self._follower.start()
        self._task = asyncio.create_task(self._follower.follow(), name=f"{self.name}-follower")

    async def stop(self) -> None:
        import asyncio
        import contextlib

        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        follower, self._follower = self._follower, None
        if follower is not None:
            await follower.stop()
        for waiters in self._waiters.values():
            for future in waiters:
                future.cancel()
        self._waiters.clear()

    @staticmethod
    def _key(record: TurnHeard) -> tuple:
        """What a record is kept and waited on by: here (session, turn)."""
        return (record.session_id, record.turn_id)

    async def _on_record(self, record: Message) -> None:
        key = self._key(record)
        self._heard[key] = record
        self._heard.move_to_end(key)
        while len(self._heard) > self.keep:
            self._heard.popitem(last=False)
        for future in self._waiters.pop(key, []):
            if not future.done():
                future.set_result(record)
        for callback in self._callbacks:
            try:
                result = callback(record)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - an agent's callback must not stop the follower
                log.exception("%s callback failed for %s", self.name, "/".join(map(str, key)))

    def heard(self, session_id: str, turn_id: str) -> TurnHeard | None:
        """The TurnHeard of a turn if it was seen already, else None."""
        return self._heard.get((session_id, turn_id))

    async def wait(self, session_id: str, turn_id: str, timeout_s: float = 10.0) -> TurnHeard:
        """The TurnHeard of a turn: at once if seen already, else when it comes; `HeardTimeout`
        after `timeout_s` (no player reported the turn: nobody listened, or a player that
        does not send heard reports)."""
        return await self._wait_for((session_id, turn_id), timeout_s, lambda: HeardTimeout(
            f"no TurnHeard for {session_id}/{turn_id} within {timeout_s:g} s"))

    async def _wait_for(self, key: tuple, timeout_s: float, timeout_error) -> Any:
        """The record kept under `key`: at once if seen already, else when it comes;
        ``timeout_error()`` raised after `timeout_s`."""
        if self._follower is None:
            raise PublisherNotStartedError(f"use the {type(self).__name__} inside `async with` (or call start() first)")
        known = self._heard.get(key)
        if known is not None:
            return known
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise timeout_error() from None
        finally:
            waiters = self._waiters.get(key)
            if waiters and future in waiters:
                waiters.remove(future)
                if not waiters:
                    del self._waiters[key]


class FloorTimeout(AgentError, TimeoutError):
    """No floor event of the kind waited for, for a turn, within the time given."""


class FloorFollower(HeardFollower):
    """What happened to turns on their session's floor: every FloorEvent the gate publishes
    (``settings.floor_topic``, docs/protocol.md "The floor"), for an agent that does its own
    turn-taking (wait for its turn to be granted, learn that it was queued, cut or refused).

        async with Publisher(settings, agent_id="expert") as agent, FloorFollower(agent) as floor:
            async with agent.turn("s1") as turn:
                granted = await floor.wait(turn.session_id, turn.turn_id, "GRANTED", timeout_s=30)
                granted.waited_us, granted.warnings  # e.g. a voice of another language

    Each event is a `voicebus.schemas.messages.FloorEvent`. ``on_event`` (or `add_callback`) is
    called with every one. The same plumbing as
    `HeardFollower`: a consumer of its own, ``lookback_s`` back at start, no consumer group."""

    topic_setting = "floor_topic"
    message_type = "FloorEvent"
    name = "floor"

    def __init__(self, publisher: Publisher, *, on_event: Any = None, lookback_s: float = 60.0,
                 keep: int = 4096) -> None:
        super().__init__(publisher, on_heard=on_event, lookback_s=lookback_s, keep=keep)

    @staticmethod
    def _key(record: FloorEvent) -> tuple:  # type: ignore[override]
        # Kept and waited on per (session, turn, event kind): a turn is queued, then granted.
        return (record.session_id, record.turn_id, str(record.event))

    def events(self, session_id: str, turn_id: str) -> dict[str, FloorEvent]:
        """The floor events seen for a turn, by kind (``GRANTED``, ``QUEUED``, ...)."""
        return {k[2]: e for k, e in self._heard.items() if k[:2] == (session_id, turn_id)}

    async def wait(self, session_id: str, turn_id: str, event: str = "GRANTED",  # type: ignore[override]
                   timeout_s: float = 10.0) -> FloorEvent:
        """The turn's floor event of kind `event`: at once if seen already, else when it comes;
        `FloorTimeout` after `timeout_s`."""
        return await self._wait_for((session_id, turn_id, str(event)), timeout_s, lambda: FloorTimeout(
            f"no {event} floor event for {session_id}/{turn_id} within {timeout_s:g} s"))

