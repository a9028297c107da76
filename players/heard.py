"""What the listener heard: the edge's pure core that turns players' heard reports into TurnHeard.

The edge sees every word timing on its way to the players (``AudioChunk.words``: text, start and
end in samples of the sentence). When a turn's audio ends or is stopped, each player reports how
far it *rendered* (a PLAYBACK_END or STOPPED report with ``rendered_sentence_seq`` and
``rendered_samples``: the furthest sentence its AudioWorklet rendered, and how many of its samples).
`HeardTracker` turns that into one TurnHeard per turn:

- **heard**: every word of the sentences before the rendered one, and the words of the rendered
  sentence whose start lies before the rendered position (the word in progress counts as heard);
- **unheard_words**: the other words of the turn the edge received, in order;
- **interrupted**: the report was a stop, or some word was not heard;
- **several players on one session: the furthest report counts** (the listener heard at least
  that much on one of their devices). The turn is published as soon as every player the turn was
  sent to has reported, or `wait_us` after the first report (a player that left or never reports
  does not hold it up); later reports of a published turn are ignored.

State is bounded: the words of at most `max_turns` turns (the oldest go first) and the ids of at
most `max_turns` published turns. The clock (epoch µs) is passed in; nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from voicebus.schemas.contract import PlaybackKind
from voicebus.schemas.messages import TurnHeard, WordTiming

HEARD_KINDS = frozenset({PlaybackKind.PLAYBACK_END, PlaybackKind.STOPPED})


@dataclass(frozen=True)
class Rendered:
    """One player's report of how far it rendered a turn."""

    client_id: str
    sentence_seq: int
    samples: int
    stopped: bool
    at_us: int

    def key(self) -> tuple[int, int]:
        return self.sentence_seq, self.samples


@dataclass
class _TurnWords:
    session_id: str
    turn_id: str
    sentences: dict[int, list[WordTiming]] = field(default_factory=dict)  # sentence_seq -> words by start
    expected: frozenset[str] = frozenset()  # the players the turn was sent to when the first report came
    reports: dict[str, Rendered] = field(default_factory=dict)
    deadline_us: int | None = None
    started_us: int = 0  # the earliest audible start a player reported (0: none)


class HeardTracker:
    """Word timings per turn, players' heard reports, and the TurnHeard records they make."""

    def __init__(self, wait_us: int = 500_000, max_turns: int = 4096) -> None:
        self.wait_us, self.max_turns = wait_us, max_turns
        self._turns: OrderedDict[tuple[str, str], _TurnWords] = OrderedDict()
        self._published: OrderedDict[tuple[str, str], None] = OrderedDict()

    def _turn(self, session_id: str, turn_id: str) -> _TurnWords:
        key = (session_id, turn_id)
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _TurnWords(session_id, turn_id)
            while len(self._turns) > self.max_turns:
                self._turns.popitem(last=False)
        return turn

    def add_words(self, session_id: str, turn_id: str, sentence_seq: int, words: Iterable[WordTiming]) -> None:
        """Words of one chunk (its ``words``); a copy already seen is ignored."""
        words = list(words)
        if not words or (session_id, turn_id) in self._published:
            return
        known = self._turn(session_id, turn_id).sentences.setdefault(sentence_seq, [])
        seen = {(w.start, w.text) for w in known}
        known.extend(w for w in words if (w.start, w.text) not in seen)
        known.sort(key=lambda w: w.start)

    def audible(self, session_id: str, turn_id: str, at_us: int) -> None:
        """A player reported audio of the turn audible at `at_us` (server clock): the earliest is
        when the turn started to be heard."""
        if at_us <= 0 or (session_id, turn_id) in self._published:
            return
        turn = self._turn(session_id, turn_id)
        turn.started_us = at_us if not turn.started_us else min(turn.started_us, at_us)

    def words_of(self, session_id: str, turn_id: str) -> dict[int, list[WordTiming]]:
        turn = self._turns.get((session_id, turn_id))
        return dict(turn.sentences) if turn else {}

    def report(self, session_id: str, turn_id: str, rendered: Rendered, players: Iterable[str],
               now_us: int) -> TurnHeard | None:
        """A player's heard report. `players`: the ids of the session's players the turn was sent
        to. Returns the turn's `TurnHeard` when this report completes the turn, else None."""
        if (session_id, turn_id) in self._published:
            return None
        turn = self._turn(session_id, turn_id)
        if not turn.reports:
            turn.expected = frozenset(players) | {rendered.client_id}
            turn.deadline_us = now_us + self.wait_us
        previous = turn.reports.get(rendered.client_id)
        if previous is None or rendered.key() >= previous.key():
            turn.reports[rendered.client_id] = rendered
        if turn.expected <= set(turn.reports):
            return self._publish(turn, now_us)
        return None

    def due(self, now_us: int) -> list[TurnHeard]:
        """The `TurnHeard` of each turn whose wait for more reports is over."""
        ready = [t for t in self._turns.values() if t.reports and t.deadline_us is not None and t.deadline_us <= now_us]
        return [self._publish(t, now_us) for t in ready]

    def next_deadline_us(self) -> int | None:
        deadlines = [t.deadline_us for t in self._turns.values() if t.reports and t.deadline_us is not None]
        return min(deadlines, default=None)

    def _publish(self, turn: _TurnWords, now_us: int) -> TurnHeard:
        furthest = max(turn.reports.values(), key=lambda r: (r.key(), -r.at_us))
        heard: list[str] = []
        unheard: list[str] = []
        for seq in sorted(turn.sentences):
            for w in turn.sentences[seq]:
                if seq < furthest.sentence_seq or (seq == furthest.sentence_seq and w.start < furthest.samples):
                    heard.append(w.text)
                else:
                    unheard.append(w.text)
        key = (turn.session_id, turn.turn_id)
        self._turns.pop(key, None)
        self._published[key] = None
        while len(self._published) > self.max_turns:
            self._published.popitem(last=False)
        return TurnHeard(
            session_id=turn.session_id, turn_id=turn.turn_id, heard_text=" ".join(heard),
            interrupted=bool(furthest.stopped or unheard), unheard_words=tuple(unheard),
            sentence_seq=furthest.sentence_seq, rendered_samples=furthest.samples,
            client_id=furthest.client_id, reports=len(turn.reports), started_at_us=turn.started_us,
            stopped_at_us=furthest.at_us,
            published_at_us=now_us,
        )
