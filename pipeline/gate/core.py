"""The gate's pure core: one session's token events in, synthesis requests out.

`GateSession` combines, per turn, the streaming segmenter (`voicebus.gate.segmenter`), evidence
gating (`voicebus.gate.evidence`) and cancellation. It takes `TextEvent`s and `ControlEvent`s
and returns `SynthesisRequest`s; time comes in as explicit ``now_us``
arguments, so the core runs the same in tests, in the Kafka worker (`voicebus.gate.app`) and in
replays. Its whole state is a JSON-serialisable dict (`to_state` / `from_state`): the worker keeps
it in memory and in its changelog topic.

Decisions (docs/gate.md says more):
- Idempotence: every event carries (agent, turn, seq); an event whose seq is not above the
  highest already applied for its (agent, turn) is ignored, so a re-delivered event repeats
  nothing. sentence_seq is assigned in release order, so a replay gives the same numbering.
- End of turn: the last request of a turn has ``is_last_in_turn``. When every sentence was already
  released before END_OF_TURN (or the tail was dropped), the gate sends an empty-text request with
  ``is_last_in_turn`` so downstream always learns that the turn ended.
- A failed claim (or one dropped by the hold-timeout policy) is replaced by one short spoken notice
  in the turn's language (`FAILURE_NOTICES`), at the place of its first dropped sentence.
- Cancel (one turn, or every turn of the session started before it) drops buffered and held text
  and every sentence not yet released; later events of a cancelled turn are ignored.
- ``gate_mode = buffered`` (a baseline for benchmarks): the same rules, but a turn's released
  sentences are joined into one request, sent at the end of the turn.
- Bounds (docs/gate.md, "Bounds"): a request's text is at most ``max_text_bytes`` (longer text is
  split at word boundaries into several requests); each turn's segmenter releases what it holds
  once its buffer reaches ``max_buffer_chars``; a session whose state grows past
  ``max_state_bytes`` has its oldest live turns ended (`shed`); a session with no event for
  ``idle_expiry_us`` has its live turns ended and can be deleted (`expire`).
- Every turn ends: a turn the gate fails on (`end_failed_turn`), sheds or expires still gets its
  ``is_last_in_turn`` request.
- Pronunciation: a turn's lexicon (its first event's ``lexicon``) rewrites each sentence as it
  is released (`apply_lexicon`): the segmenter sees the agent's text, the worker the spoken form.
- The floor (`voicebus.gate.floor`): one turn of a session speaks at a time. Every request the
  session produces passes through its `Floor`, which holds a waiting turn's requests until it gets
  the floor; a preempted turn is cancelled and `controls` carries the cancel the shell publishes.

Size: about 820 lines, most of them the one `GateSession`: every decision about one session
(segmenting, evidence, cancels, the floor, the lexicon, hold timeouts, idle expiry) reads and
writes the same JSON state, and replaying a changelog must give the same requests. The segmenter,
evidence gating and the floor are their own modules.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Iterable

from voicebus.gate.floor import PREEMPTING, REFUSED, Floor, turn_floor
from voicebus.gate.evidence import (
    FAILED,
    READY,
    Dropped,
    EarlyResolutions,
    EvidenceGate,
)
import json
import re

from voicebus.schemas.messages import ControlEvent, FloorEvent, LexiconEntry, SynthesisRequest, TextEvent
from voicebus.settings import Settings
from voicebus.schemas.contract import (DEFAULT_VOICES, FLOOR_CANCEL_SOURCE, FLOOR_QUEUE, LIMITS,
                                       PHONEME_SPAN, SEGMENTER_LANGUAGE, SPAN_LABEL_EXCLUDED,
                                       InvalidVoice, TextEventKind, UnknownLanguage, kokoro_code, lexicon_problems,
                                       parse_voice, phoneme_span, voice_warnings)

RESOLUTION_SOURCE = "gate"  # the source of the gate's resolution of a whole-session cancel

log = logging.getLogger(__name__)

# What the listener hears in place of a claim whose evidence failed or was dropped on timeout.
FAILURE_NOTICES = {"en": "I couldn't confirm that.", "es": "No pude confirmarlo.",
                   "pt": "Não consegui confirmar isso.", "fr": "Je n'ai pas pu le confirmer.",
                   "it": "Non sono riuscito a confermarlo.", "hi": "मैं इसकी पुष्टि नहीं कर सका।",
                   "ja": "確認できませんでした。", "zh": "我无法确认这一点。"}

GATE_MODE_INCREMENTAL = "incremental"  # each sentence goes out when released (the point of voicebus)
GATE_MODE_BUFFERED = "buffered"  # one request per turn at its end (the baseline voicebus replaces)
GATE_MODES = (GATE_MODE_INCREMENTAL, GATE_MODE_BUFFERED)

MAX_TURNS_KEPT = 64  # finished/cancelled turns remembered per session (to ignore late events)
MAX_GUARDS_KEPT = 256  # (agent, turn) seq high-water marks remembered per session


class GateInputError(ValueError):
    """A decoded event the gate cannot act on (wrong session, unknown kind, missing claim id)."""

    reason = "gate-rejected"  # the dead-letter header's reason


class TurnRejected(GateInputError):
    """A turn that cannot be spoken at all (its first event names a language the gate refuses)."""


@dataclass(frozen=True)
class GateConfig:
    """The settings the core needs, resolved once."""

    default_language: str = "en"
    default_voice: str = "af_heart"
    default_speed: float = 1.0
    first_clause_min_words: int = 0
    hold_timeout_us: int = 10_000_000
    hold_timeout_policy: str = "release"
    gate_mode: str = GATE_MODE_INCREMENTAL
    max_text_bytes: int = LIMITS.max_text_bytes
    max_buffer_chars: int = 2048
    max_state_bytes: int = 256 * 1024
    idle_expiry_us: int = 3600 * 1_000_000
    speculative_release: bool = True
    floor_policy: str = FLOOR_QUEUE
    floor_max_waiting: int = 4

    @classmethod
    def from_settings(cls, settings: Settings) -> "GateConfig":
        # gate_mode and hold_timeout_policy are among the allowed values: Settings validates them
        return cls(
            default_language=settings.default_language,
            default_voice=settings.default_voice,
            default_speed=float(settings.default_speed),
            first_clause_min_words=int(settings.first_clause_min_words),
            hold_timeout_us=int(settings.hold_timeout_s * 1_000_000),
            hold_timeout_policy=settings.hold_timeout_policy,
            gate_mode=settings.gate_mode,
            max_text_bytes=int(settings.max_text_bytes),
            max_buffer_chars=int(settings.gate_max_buffer_chars),
            max_state_bytes=int(settings.gate_max_session_state_bytes),
            idle_expiry_us=int(settings.gate_session_idle_s * 1_000_000),
            speculative_release=bool(settings.speculative_release),
            floor_policy=settings.floor_policy,
            floor_max_waiting=int(settings.floor_max_waiting_turns),
        )


def kokoro_language(language: str | None, default: str) -> str:
    """The turn's Kokoro code (`contract.kokoro_code`); a language it cannot speak rejects the turn."""
    try:
        return kokoro_code(language, default or "en")
    except UnknownLanguage as exc:
        raise TurnRejected(str(exc)) from None


def compact_lexicon(lexicon: "tuple[LexiconEntry, ...] | None") -> list[dict] | None:
    """A TextEvent's lexicon as the gate keeps it in its state (JSON): each entry's ``match`` and
    its ``phonemes`` or ``say``, ``regex`` only when true; None when there is none."""
    if not lexicon:
        return None
    out = []
    for entry in lexicon:
        kept: dict[str, Any] = {"match": entry.match}
        if entry.regex:
            kept["regex"] = True
        if entry.say is not None:
            kept["say"] = entry.say
        else:
            kept["phonemes"] = entry.phonemes
        out.append(kept)
    return out


def _lexicon_pattern(entry: dict) -> "re.Pattern[str]":
    # re caches compiled patterns (512 of them): a turn's at most 32 entries are compiled once
    if entry.get("regex"):
        return re.compile(entry["match"])
    return re.compile(r"(?<!\w)" + re.escape(entry["match"]) + r"(?!\w)")


def apply_lexicon(text: str, lexicon: list[dict] | None) -> str:
    """`text` as the lexicon says it: each match of an entry replaced by its ``say``, or wrapped as
    an inline phoneme span ``[match](/phonemes/)``. A plain entry matches the whole word,
    case-sensitively; a ``regex`` entry is a Python regular expression searched in the text. One
    pass over the original text: entries are tried in order, and a match that overlaps an earlier
    entry's match or a phoneme span already in the text is left alone, so no replacement is
    rewritten again. A phonemes entry's match that a span cannot hold (a bracket, a line break, or
    too long) is left as it is."""
    if not lexicon or not text:
        return text
    taken = [(m.start(), m.end()) for m in PHONEME_SPAN.finditer(text)]
    chosen: list[tuple[int, int, str]] = []
    for entry in lexicon:
        for m in _lexicon_pattern(entry).finditer(text):
            start, end = m.span()
            if start == end or any(start < e and s < end for s, e in taken):
                continue
            word = m.group(0)
            if entry.get("say") is not None:
                spoken = entry["say"]
            elif len(word) > LIMITS.max_span_label_chars or any(c in SPAN_LABEL_EXCLUDED for c in word):
                continue
            else:
                spoken = phoneme_span(word, entry["phonemes"])
            taken.append((start, end))
            chosen.append((start, end, spoken))
    if not chosen:
        return text
    chosen.sort()
    out, at = [], 0
    for start, end, spoken in chosen:
        out.append(text[at:start])
        out.append(spoken)
        at = end
    out.append(text[at:])
    return "".join(out)


def split_text(text: str, max_bytes: int) -> list[str]:
    """`text` in pieces of at most `max_bytes` UTF-8 bytes, cut at the last space before the
    limit (inside a word longer than the limit: at the limit, never inside a character), and
    never inside an inline phoneme span (before it instead, when something comes before it).
    Text within the limit comes back as one piece (also the empty text)."""
    if len(text.encode("utf-8")) <= max_bytes:
        return [text]
    pieces: list[str] = []
    rest = text
    while len(rest.encode("utf-8")) > max_bytes:
        # The longest prefix within the limit, in characters.
        lo, hi = 0, len(rest)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(rest[:mid].encode("utf-8")) <= max_bytes:
                lo = mid
            else:
                hi = mid - 1
        cut = rest.rfind(" ", 0, lo + 1) if lo < len(rest) else lo
        if cut <= 0:
            cut = max(1, lo)
        for span in PHONEME_SPAN.finditer(rest, 0, lo + 1 + LIMITS.max_span_label_chars + LIMITS.max_phoneme_chars):
            if span.start() < cut < span.end() and span.start() > 0:
                cut = span.start()
                break
        piece = rest[:cut].rstrip()
        if piece:
            pieces.append(piece)
        rest = rest[cut:].lstrip()
    if rest:
        pieces.append(rest)
    return pieces


def _segmenter_class():
    # Imported lazily so evidence-only users of this module need not load the segmenter rules.
    from voicebus.gate.segmenter import StreamingSegmenter

    return StreamingSegmenter


class _Turn:
    """One turn of a session: its segmenter, its evidence gate and its numbering."""

    def __init__(self, config: GateConfig, turn_id: str, state: dict) -> None:
        self.turn_id = turn_id
        self.agent_id: str = state["agent_id"]
        self.language: str = state["language"]
        self.voice: str = state["voice"]
        self.speed: float | None = state.get("speed")  # the turn's own rate (its first event); None: the default
        self.lexicon: list[dict] | None = state.get("lexicon")  # `compact_lexicon` of its first event's
        self.started_at_us: int = state["started_at_us"]
        self.first_token_at_us: int = state.get("first_token_at_us", -1)
        self.next_seq: int = state.get("next_seq", 0)
        self.ended: bool = state.get("ended", False)
        self.finished: bool = state.get("finished", False)
        self.cancelled: bool = state.get("cancelled", False)
        self.arrivals: list[list[int]] = state.get("arrivals", [])  # [fed offset after token, at_us]
        self.buffered: list[list] = state.get("buffered", [])  # gate_mode buffered: [text, complete_us]
        # The tentative sentence out and not yet settled: {"seq", "text", "start", "stop"} or None.
        self.spec: dict | None = state.get("spec")
        self._config = config
        self.segmenter = None
        self.evidence: EvidenceGate | None = None
        if self.live:
            seg_cls = _segmenter_class()
            seg_state = state.get("segmenter")
            self.segmenter = (
                seg_cls.from_state(seg_state, config.max_buffer_chars) if seg_state is not None
                else seg_cls(language=SEGMENTER_LANGUAGE.get(self.language, "en"),
                             first_clause_min_words=config.first_clause_min_words,
                             max_buffer_chars=config.max_buffer_chars)
            )
            self.evidence = EvidenceGate.from_state(
                state.get("evidence", {}), config.hold_timeout_us, config.hold_timeout_policy
            )

    @functools.cached_property
    def voice_warnings(self) -> list[str]:
        """What its floor events tell the agent about its voice (`voice_warnings`): derived from the
        voice and language the state keeps, so they need no state of their own."""
        try:
            return voice_warnings(parse_voice(self.voice), self.language)
        except InvalidVoice:  # refused at intake: not a turn's voice
            return []

    @property
    def live(self) -> bool:
        return not (self.finished or self.cancelled)

    def retire(self) -> None:
        self.segmenter = None
        self.evidence = None
        self.arrivals = []
        self.buffered = []
        self.spec = None

    def to_state(self) -> dict:
        state: dict[str, Any] = {
            "agent_id": self.agent_id, "language": self.language, "voice": self.voice,
            "started_at_us": self.started_at_us, "first_token_at_us": self.first_token_at_us,
            "next_seq": self.next_seq, "ended": self.ended, "finished": self.finished,
            "cancelled": self.cancelled,
        }
        if self.speed is not None:
            state["speed"] = self.speed
        if self.lexicon:
            state["lexicon"] = self.lexicon
        if self.live:
            state["segmenter"] = self.segmenter.to_state()
            state["evidence"] = self.evidence.to_state()
            state["arrivals"] = self.arrivals
            state["buffered"] = self.buffered
            state["spec"] = self.spec
        return state


class GateSession:
    """Everything the gate knows about one session. Feed it events; it returns requests."""

    def __init__(self, session_id: str, config: GateConfig, state: dict | None = None) -> None:
        state = state or {}
        self.session_id = session_id
        self.config = config
        self._turns: dict[str, _Turn] = {t: _Turn(config, t, s) for t, s in state.get("turns", {}).items()}
        self._guards: dict[str, int] = dict(state.get("guards", {}))
        self._early = EarlyResolutions.from_state(state.get("early", {}))
        cancel = state.get("cancel", {})
        self._cancelled_turns: list[str] = list(cancel.get("turns", []))
        self.last_event_us: int = state.get("last_event_us", -1)
        self._floor = Floor(config.floor_max_waiting, state.get("floor"))
        self._passed: list[SynthesisRequest] = []  # requests the floor let out while applying (a holder cancelled)
        # The ControlEvents the shell must publish after the last call that returned requests: the
        # gate's resolution of a whole-session cancel (the turns it cancelled), and the cancel of
        # each turn cut by a preempting one. Not part of the state.
        self.controls: list[ControlEvent] = []
        # The FloorEvents since the last call (granted, queued, preempting, cut, refused), for the
        # shell to publish on the floor topic and count. Not part of the state.
        self.floor_events: list[FloorEvent] = []

    # --- state ---------------------------------------------------------------------------------
    def to_state(self) -> dict:
        return {
            "turns": {t: turn.to_state() for t, turn in self._turns.items()},
            "guards": self._guards,
            "early": self._early.to_state(),
            "cancel": {"turns": self._cancelled_turns},
            "last_event_us": self.last_event_us,
            "floor": self._floor.to_state(),
        }

    @classmethod
    def from_state(cls, session_id: str, config: GateConfig, state: dict | None) -> "GateSession":
        return cls(session_id, config, state)

    # --- input ---------------------------------------------------------------------------------
    def apply(self, event: TextEvent | ControlEvent, now_us: int) -> list[SynthesisRequest]:
        """A `TextEvent` or a `ControlEvent`."""
        self._begin()
        self.last_event_us = max(self.last_event_us, now_us)
        if isinstance(event, ControlEvent):
            return self._settle(self._apply_control(event, now_us), now_us)
        return self._settle(self._apply_text(event, now_us), now_us)

    def _begin(self) -> None:
        self.controls = []
        self.floor_events = []
        self._passed = []

    def _settle(self, requests: list[SynthesisRequest], now_us: int) -> list[SynthesisRequest]:
        """Every request the core produced, through the floor: what may go out now, in order.
        Turns the floor cut are cancelled here, and their cancels queued in `controls`."""
        out, cut = self._floor.route(requests, now_us)
        out = self._passed + out
        self._passed = []
        for turn_id, by in cut:
            self._cut(turn_id, by, now_us)
        for event in self._floor.take_events():
            turn = self._turns.get(event["turn_id"])
            self.floor_events.append(FloorEvent(
                self.session_id, event["turn_id"], turn.agent_id if turn is not None else "unknown", event["event"],
                event["at_us"], event["waited_us"], event["reason"][:LIMITS.max_label_chars],
                tuple(turn.voice_warnings) if turn is not None else ()))
        return out

    def _apply_text(self, event: TextEvent, now_us: int) -> list[SynthesisRequest]:
        self._check_session(event.session_id)
        kind = event.kind
        turn_id, agent_id, seq = event.turn_id, event.agent_id, event.seq
        guard = f"{agent_id}\x1f{turn_id}"
        if seq <= self._guards.get(guard, -1):
            return []  # already applied: a re-delivery after a restart
        self._guards.pop(guard, None)
        self._guards[guard] = seq
        while len(self._guards) > MAX_GUARDS_KEPT:
            self._guards.pop(next(iter(self._guards)))

        if kind in (TextEventKind.EVIDENCE_READY, TextEventKind.EVIDENCE_FAILED):
            return self._resolve_claim(self._claim_id(event), READY if kind == TextEventKind.EVIDENCE_READY else FAILED, now_us)

        turn = self._turns.get(turn_id)
        if turn is None:
            turn = self._open_turn(event, now_us)
            if turn.finished:  # refused the floor: it ends now, with nothing spoken
                return [self._request(turn, "", now_us, now_us, last=True)]
        if not turn.live:
            return []
        if kind == TextEventKind.TOKEN:
            return self._feed(turn, event, now_us)
        if kind == TextEventKind.EVIDENCE_PENDING:
            claim_id = self._claim_id(event)
            turn.evidence.place(claim_id, turn.segmenter.fed, now_us, early=self._early.take(claim_id, now_us))
            return []
        if kind == TextEventKind.END_OF_TURN:
            turn.ended = True
            sentences = turn.segmenter.flush()
            out = self._withdraw_if_undone(turn, sentences, now_us)
            for sentence in sentences:
                self._offer(turn, sentence, now_us)
            return out + self._drain(turn, now_us)
        raise GateInputError(f"unknown TextEvent kind {kind!r}")

    def _apply_control(self, event: ControlEvent, now_us: int) -> list[SynthesisRequest]:
        """A CANCEL for one turn (``turn_id``), for the turns listed in ``turn_ids``, or (turn_id
        null, no list) for every turn of the session the gate holds now. No clock is compared:
        a turn whose first event reaches the gate after the cancel is a new turn. For the last
        kind, `controls` gets the ControlEvent that names the turns cancelled, for the shell to
        publish so that later stages drop them even if they had not seen them yet. A cancelled
        turn that held the floor passes it on: the next turn's held requests are returned."""
        self._check_session(event.session_id)
        if not event.is_cancel:
            return []
        turn_id = event.turn_id
        listed = list(event.turn_ids)
        targets = [turn_id] if turn_id is not None else listed or list(self._turns)
        newly = []
        for target in targets:
            if target not in self._cancelled_turns:
                self._cancelled_turns.append(target)
                newly.append(target)
            turn = self._turns.get(target)
            if turn is not None:
                self._cancel(turn)
                self._passed.extend(self._floor.close(target, now_us))
        del self._cancelled_turns[:-MAX_TURNS_KEPT]
        if turn_id is None and not listed and newly:
            # a ControlEvent lists at most LIMITS.max_turn_ids turns: the latest ones (a session
            # with more live turns at once is beyond any real conversation)
            self.controls.append(ControlEvent.cancel(
                self.session_id, None, reason=f"resolved: {event.reason or 'session cancel'}"[:200],
                source=RESOLUTION_SOURCE, issued_at_us=now_us, turn_ids=newly[-LIMITS.max_turn_ids:]))
        return []

    def tick(self, now_us: int) -> list[SynthesisRequest]:
        """Apply hold timeouts due at `now_us`; returns what they release (or the notices)."""
        self._begin()
        self._early.prune(now_us)
        out: list[SynthesisRequest] = []
        for turn in list(self._turns.values()):
            if turn.live and turn.evidence.expire(now_us):
                out.extend(self._drain(turn, now_us))
        return self._settle(out, now_us)

    def end_failed_turn(self, event: TextEvent, now_us: int, error: BaseException) -> list[SynthesisRequest]:
        """The gate failed on `event` (a TextEvent) with `error`; make sure its turn still ends.

        Call it on the state as it was *before* the failed event. A turn that cannot be spoken
        at all (`TurnRejected`) or that a bug (an untyped error) stopped is recorded as finished,
        so its later events are ignored, and gets its end request now (empty text,
        ``is_last_in_turn``), after what was released so far. A turn whose event was merely bad
        input (an evidence mark without a claim id) goes on."""
        self._begin()
        return self._settle(self._end_failed_turn(event, now_us, error), now_us)

    def _end_failed_turn(self, event: TextEvent, now_us: int, error: BaseException) -> list[SynthesisRequest]:
        turn_id = event.turn_id
        if not turn_id or event.kind in (TextEventKind.EVIDENCE_READY, TextEventKind.EVIDENCE_FAILED):
            return []
        bug = getattr(error, "reason", None) is None
        if not (bug or isinstance(error, TurnRejected)):
            return []
        turn = self._turns.get(turn_id)
        if turn is None:
            turn = _Turn(self.config, turn_id, {
                "agent_id": event.agent_id, "language": self.config.default_language,
                "voice": self.config.default_voice, "started_at_us": event.produced_at_us,
                "finished": True})
            self._turns[turn_id] = turn
            return [self._request(turn, "", now_us, now_us, last=True)]
        if turn.live:
            out = self._withdraw(turn, now_us) if turn.spec is not None else []
            turn.ended = True
            turn.finished = True
            turn.retire()
            return out + [self._request(turn, "", now_us, now_us, last=True)]
        return []

    def shed(self, now_us: int) -> tuple[list[SynthesisRequest], str]:
        """Keep the state within ``max_state_bytes``: end the oldest live turns (their text flushed
        and released, holds resolved as on timeout) until it fits. Returns the requests that
        released and the state as JSON (the caller stores it). Turns waiting for the floor go
        first, newest first: they are refused (ended with nothing spoken)."""
        self._begin()
        out: list[SynthesisRequest] = []
        encoded = json.dumps(self.to_state(), separators=(",", ":"))
        while len(encoded.encode("utf-8")) > self.config.max_state_bytes:
            live = [t for t in self._turns.values() if t.live]
            waiting = [w["turn"] for w in self._floor.waiting if w["turn"] in self._turns]
            if waiting:
                turn = self._turns[waiting[-1]]
                log.warning("session %s: state over %d bytes, waiting turn %s refused", self.session_id,
                            self.config.max_state_bytes, turn.turn_id)
                self._floor.close(turn.turn_id, now_us)
                out.extend(self._settle(self._refuse(turn, now_us), now_us))
            elif live:
                log.warning("session %s: state over %d bytes, turn %s ended early", self.session_id,
                            self.config.max_state_bytes, live[0].turn_id)
                out.extend(self._settle(self._force_end(live[0], now_us), now_us))
            elif len(self._turns) > 1 or self._guards or len(self._early):
                # Only memory of the past is left: forget the oldest half of it.
                for old in list(self._turns)[: max(1, len(self._turns) // 2)]:
                    del self._turns[old]
                for old in list(self._guards)[: len(self._guards) // 2 or len(self._guards)]:
                    del self._guards[old]
                self._early = EarlyResolutions.from_state({})
            else:
                break
            encoded = json.dumps(self.to_state(), separators=(",", ":"))
        return out, encoded

    def expire(self, now_us: int) -> list[SynthesisRequest]:
        """The session was idle for ``idle_expiry_us``: end every live turn (as `shed` does). The
        caller then deletes the session's state."""
        self._begin()
        out: list[SynthesisRequest] = []
        for turn in list(self._turns.values()):
            if turn.live:
                out.extend(self._force_end(turn, now_us))
        return self._settle(out, now_us)

    def expires_at_us(self) -> int | None:
        """When the session counts as idle and may be expired (None: it never saw an event)."""
        return None if self.last_event_us < 0 else self.last_event_us + self.config.idle_expiry_us

    # --- queries -------------------------------------------------------------------------------
    def next_deadline_us(self) -> int | None:
        deadlines = [t.evidence.next_deadline_us() for t in self._turns.values() if t.live]
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines else None

    def is_cancelled(self, turn_id: str) -> bool:
        turn = self._turns.get(turn_id)
        return turn_id in self._cancelled_turns or (turn is not None and turn.cancelled)

    def pending_claims(self) -> dict[str, list[str]]:
        return {t: turn.evidence.pending_claims() for t, turn in self._turns.items() if turn.live}

    @property
    def idle(self) -> bool:
        """Nothing buffered, held or pending: the state could be compacted away."""
        return (all(not t.live for t in self._turns.values()) and not len(self._early)
                and not self._floor.waiting and not self._floor.held)

    # --- internals -----------------------------------------------------------------------------
    def _check_session(self, session_id: str | None) -> None:
        if session_id != self.session_id:
            raise GateInputError(f"event of session {session_id!r} given to {self.session_id!r}")

    @staticmethod
    def _claim_id(event: TextEvent) -> str:
        claim_id = event.claim_id
        if not claim_id:
            raise GateInputError(f"{event.kind} event without a claim_id (turn {event.turn_id!r})")
        return claim_id

    def _open_turn(self, event: TextEvent, now_us: int) -> _Turn:
        language = kokoro_language(event.language, self.config.default_language)
        lexicon = event.lexicon
        if lexicon:  # the codec checked it; a replay may not have
            problems = lexicon_problems([entry.to_record() for entry in lexicon])
            if problems:
                raise TurnRejected(f"turn {event.turn_id!r}: {problems[0]}")
        voice = event.voice or (
            self.config.default_voice if self.config.default_voice[:1] == language
            else DEFAULT_VOICES.get(language, self.config.default_voice)
        )
        started = event.produced_at_us
        cancelled = event.turn_id in self._cancelled_turns
        turn = _Turn(self.config, event.turn_id, {
            "agent_id": event.agent_id, "language": language, "voice": voice, "speed": event.speed,
            "lexicon": compact_lexicon(lexicon), "started_at_us": started, "cancelled": cancelled,
        })
        self._turns[turn.turn_id] = turn
        for warning in turn.voice_warnings:
            log.info("session %s: turn %s of %s: %s", self.session_id, turn.turn_id, turn.agent_id, warning)
        if not cancelled:
            policy, priority = turn_floor(event, self.config.floor_policy)
            fate, cut = self._floor.open(turn.turn_id, policy, priority, now_us)
            for other, by in cut:
                self._cut(other, by, now_us)
            if fate == REFUSED:
                log.warning("session %s: turn %s of %s refused: %d turns already wait for the floor",
                            self.session_id, turn.turn_id, turn.agent_id, self.config.floor_max_waiting)
                turn.ended = turn.finished = True
                turn.retire()
            elif fate == PREEMPTING:
                log.info("session %s: turn %s of %s will preempt the turn speaking", self.session_id,
                         turn.turn_id, turn.agent_id)
        for old in [t for t, tt in self._turns.items() if not tt.live][:-MAX_TURNS_KEPT]:
            del self._turns[old]
        return turn

    def _feed(self, turn: _Turn, event: TextEvent, now_us: int) -> list[SynthesisRequest]:
        text = event.text or ""
        if turn.first_token_at_us < 0:
            turn.first_token_at_us = event.produced_at_us
        if not text:
            return []
        sentences = turn.segmenter.feed(text)
        turn.arrivals.append([turn.segmenter.fed, now_us])
        out = self._withdraw_if_undone(turn, sentences, now_us)
        for sentence in sentences:
            self._offer(turn, sentence, now_us)
        settled = turn.segmenter.settled  # arrivals only matter for ends still to come
        if turn.arrivals and turn.arrivals[0][0] <= settled:
            turn.arrivals = [a for a in turn.arrivals if a[0] > settled]
        if sentences:
            out.extend(self._drain(turn, now_us))
        out.extend(self._speculate(turn, now_us))
        return out

    # --- speculative release (docs/gate.md, "Speculative release") ------------------------------
    def _speculate(self, turn: _Turn, now_us: int) -> list[SynthesisRequest]:
        """Release the sentence ending at an almost certain stop now, tentative. Only where its
        release could not be held or reordered: incremental mode, no claim pending or held in the
        turn, and text within one request."""
        config = self.config
        if (not config.speculative_release or config.gate_mode != GATE_MODE_INCREMENTAL or turn.spec is not None
                or not turn.live or turn.evidence.held or turn.evidence.pending_claims()):
            return []
        sentence = turn.segmenter.speculation()
        if sentence is None:
            return []
        # rewritten as its release will be, so that the settlement compares like with like
        text = apply_lexicon(sentence.text.strip(), turn.lexicon)
        if not text or len(text.encode("utf-8")) > config.max_text_bytes:
            return []
        request = replace(self._request(turn, text, now_us, now_us), tentative=True)
        turn.spec = {"seq": request.sentence_seq, "text": text, "start": sentence.start, "stop": sentence.end}
        return [request]

    def _withdraw_if_undone(self, turn: _Turn, sentences: list, now_us: int) -> list[SynthesisRequest]:
        """The tentative sentence's stop turned out to be no end (the segmenter scanned past it
        without releasing a sentence that starts where it starts): withdraw it at once (tentative,
        empty text), so the worker drops it now; its sentence_seq is given to the next release."""
        spec = turn.spec
        if spec is None or any(s.start == spec["start"] for s in sentences):
            return []  # still undecided, or released now: `_request` confirms or replaces it
        seg = turn.segmenter
        if seg.open_at == spec["start"] and seg.scanned < spec["stop"]:
            return []  # the scan still waits at the stop
        return self._withdraw(turn, now_us)

    def _withdraw(self, turn: _Turn, now_us: int) -> list[SynthesisRequest]:
        """Withdraw the turn's tentative sentence (tentative, empty text, its sentence_seq, which
        the next release reuses)."""
        spec, turn.spec = turn.spec, None
        withdrawal = replace(self._request(turn, "", now_us, now_us), sentence_seq=spec["seq"], tentative=True)
        turn.next_seq = spec["seq"]
        log.debug("session %s turn %s: tentative %r withdrawn", self.session_id, turn.turn_id, spec["text"])
        return [withdrawal]

    def _offer(self, turn: _Turn, sentence: Any, now_us: int) -> None:
        end = int(sentence.end)
        # When the sentence's last character reached the gate: the first token ending at/after it.
        complete_us = next((at for fed, at in turn.arrivals if fed >= end), now_us)
        turn.arrivals = [a for a in turn.arrivals if a[0] >= end]
        text = sentence.text.strip()
        if text:
            turn.evidence.offer(end, {"text": text, "complete_us": complete_us})

    def _drain(self, turn: _Turn, now_us: int) -> list[SynthesisRequest]:
        released: list[tuple[str, int]] = []  # (text, complete_us) in order
        for item in turn.evidence.drain():
            if isinstance(item, Dropped):
                log.info("session %s turn %s: dropped %r of claim %s (%s)", self.session_id, turn.turn_id,
                         item.payload["text"], item.claim_id, item.reason)
                if item.first:
                    notice = FAILURE_NOTICES[SEGMENTER_LANGUAGE.get(turn.language, "en")]
                    released.append((apply_lexicon(notice, turn.lexicon), item.payload["complete_us"]))
            else:
                released.append((apply_lexicon(item.payload["text"], turn.lexicon), item.payload["complete_us"]))
        finished = turn.ended and turn.evidence.held == 0
        limit = self.config.max_text_bytes
        if self.config.gate_mode == GATE_MODE_BUFFERED:
            # The whole answer at the end of the turn (the TTFA baseline), in as few requests as
            # the text limit allows.
            turn.buffered.extend([text, at] for text, at in released)
            if not finished:
                return []
            text = " ".join(t for t, _ in turn.buffered)
            complete_us = max((at for _, at in turn.buffered), default=now_us)
            out = [self._request(turn, piece, complete_us, now_us) for piece in split_text(text, limit)]
            out[-1] = replace(out[-1], is_last_in_turn=True)
        else:
            out = [self._request(turn, piece, at, now_us) for text, at in released
                   for piece in split_text(text, limit)]
            if finished:
                if out:
                    out[-1] = replace(out[-1], is_last_in_turn=True)
                else:  # everything was released already: say so with an empty end-of-turn request
                    out.append(self._request(turn, "", now_us, now_us, last=True))
        if finished:
            turn.finished = True
            turn.retire()
        return out

    def _request(self, turn: _Turn, text: str, complete_us: int, now_us: int,
                 last: bool = False) -> SynthesisRequest:
        spec = turn.spec
        if spec is not None and text:
            # The first release after a tentative one is the sentence it guessed (it starts at the
            # same place; nothing can be released before it): the same sentence_seq settles it.
            # The same text: confirmed (empty text, the worker publishes what it made); other
            # text (the stop was a closer or a longer cluster away): replaced.
            turn.spec = None
            request = self._request(turn, "" if text == spec["text"] else text, complete_us, now_us, last)
            turn.next_seq -= 1
            return replace(request, sentence_seq=spec["seq"])
        seq = turn.next_seq
        turn.next_seq += 1
        return SynthesisRequest(
            session_id=self.session_id, turn_id=turn.turn_id, agent_id=turn.agent_id,
            sentence_seq=seq, text=text, language=turn.language, voice=turn.voice,
            speed=turn.speed if turn.speed is not None else self.config.default_speed, is_last_in_turn=last,
            first_token_at_us=turn.first_token_at_us if turn.first_token_at_us >= 0 else turn.started_at_us,
            text_complete_at_us=complete_us, released_at_us=now_us, tentative=False,
        )

    def _resolve_claim(self, claim_id: str, status: str, now_us: int) -> list[SynthesisRequest]:
        # The newest turn with this claim pending (agents may reuse claim ids from turn to turn).
        for turn in reversed(list(self._turns.values())):
            if turn.evidence is not None and claim_id in turn.evidence.pending_claims():
                turn.evidence.resolve(claim_id, status, now_us)
                return self._drain(turn, now_us)
        # No pending mark yet: keep it for the mark to come. A repeat of a resolution already
        # applied lands here too; it is only used if a later mark reuses the claim id.
        self._early.add(claim_id, status, now_us)
        return []

    def _force_end(self, turn: _Turn, now_us: int) -> list[SynthesisRequest]:
        """End a live turn now: flush its text, resolve its holds as a timeout would."""
        turn.ended = True
        for sentence in turn.segmenter.flush():
            self._offer(turn, sentence, now_us)
        turn.evidence.expire(now_us + turn.evidence.hold_timeout_us)
        return self._drain(turn, now_us)

    def _cancel(self, turn: _Turn) -> None:
        if turn.live:
            turn.cancelled = True
            turn.retire()

    def _cut(self, turn_id: str, by: str, now_us: int) -> None:
        """A turn preempted by turn `by`: cancelled here, and a cancel for the later stages (which
        drop what they hold of it and report what the listener heard of it; the edge stops it at
        the players when `by`'s first audio arrives, so the listener is not left in silence)."""
        if turn_id not in self._cancelled_turns:
            self._cancelled_turns.append(turn_id)
            del self._cancelled_turns[:-MAX_TURNS_KEPT]
        turn = self._turns.get(turn_id)
        if turn is not None:
            self._cancel(turn)
        self.controls.append(ControlEvent.cancel(self.session_id, turn_id, reason="preempted by a newer turn",
                                                 source=FLOOR_CANCEL_SOURCE, issued_at_us=now_us, after_turn_id=by))

    def _refuse(self, turn: _Turn, now_us: int) -> list[SynthesisRequest]:
        """End a turn that will never get the floor: nothing of it was sent, so its end request is
        its first (sentence 0, empty text)."""
        turn.ended = turn.finished = True
        turn.retire()
        turn.next_seq = 0
        turn.spec = None
        return [self._request(turn, "", now_us, now_us, last=True)]


class Gate:
    """Many sessions' `GateSession`s in memory: the core without Kafka (tests, replays, demos)."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self.sessions: dict[str, GateSession] = {}

    def session(self, session_id: str) -> GateSession:
        if session_id not in self.sessions:
            self.sessions[session_id] = GateSession(session_id, self.config)
        return self.sessions[session_id]

    def apply(self, event: TextEvent | ControlEvent, now_us: int) -> list[SynthesisRequest]:
        return self.session(event.session_id).apply(event, now_us)

    def tick(self, now_us: int) -> list[SynthesisRequest]:
        return [r for s in self.sessions.values() for r in s.tick(now_us)]


def gate_sentences(events: Iterable[TextEvent | ControlEvent], settings: Settings | GateConfig,
                   now_us: int | None = None) -> list[SynthesisRequest]:
    """Run `TextEvent`s and `ControlEvent`s through a fresh gate; the synthesis requests.

    Each event is applied at `now_us` when given, else at its own ``produced_at_us`` /
    ``issued_at_us`` (so hold timeouts follow the events' clock), with a tick before each one.
    """
    config = settings if isinstance(settings, GateConfig) else GateConfig.from_settings(settings)
    gate = Gate(config)
    out: list[SynthesisRequest] = []
    for event in events:
        if now_us is not None:
            at = now_us
        elif isinstance(event, ControlEvent):
            at = event.issued_at_us
        else:
            at = event.produced_at_us
        out.extend(gate.tick(at))
        out.extend(gate.apply(event, at))
    return out
