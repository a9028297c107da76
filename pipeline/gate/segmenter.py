"""The streaming sentence segmenter: text pieces in, speakable utterances out, each released as
soon as its end is certain.

Owns `StreamingSegmenter` (one per turn) and `Sentence`. The segmenter is fed pieces of any size,
split anywhere (inside a word, a number, a URL); it scans each character once and decides every
candidate end (a stop, a line break, a run-in list marker, a clause mark for the early first
clause) from the text before it plus the least lookahead that settles it, usually the next
non-space character ("U.S. How" against "U.S. Government" needs the next word). When the lookahead
has not arrived yet the decision waits; it is never taken on a guess, so any way of splitting the
same text gives the same utterances. `flush()` ends the turn: the end of text settles everything.

Bound: with ``max_buffer_chars`` (the gate passes ``Settings.gate_max_buffer_chars``), an
utterance still open when the buffer reaches that many characters is released at once, cut at
its last word boundary before the limit (inside one over-long word: at the limit). Run-on text
without punctuation is then spoken in pieces instead of piling up. Inside an unclosed code fence
the fence's placeholder is said once and the fenced text is dropped as it comes (the fence stays
open, so what follows it is still read as code), so a never-closed fence cannot grow the state.
The cut depends only on the text, not on how it was split into pieces.

An inline phoneme span, ``[Kokoro](/kˈOkəɹO/)`` (`voicebus.schemas.contract.PHONEME_SPAN`), is one
word: nothing inside it ends an utterance (a stop in its text or its phonemes), and it is kept in
the utterance's text for the worker to speak. Whether a ``[`` opens one is decided, like every
other decision, once the characters that settle it have arrived (at most the span's bounded
length: a ``[`` that no ``](/`` follows soon enough opens none).

Offsets count characters of everything fed since the segmenter was created:

- ``start``: the utterance's first raw character (its block marker included, e.g. ``- `` or ``1. ``);
- ``end``: just past its last raw character (the stop and any closing quote, bracket or emphasis);
- ``complete_at``: how many characters had been fed when it was released (``end <= complete_at``).
  **Release lag** = ``complete_at - end``: characters received after the utterance's last character
  before it was released. It is 0 when the piece that finished the utterance also settled it.

Rules are in docs/gate.md. State is plain data (`to_state`/`from_state`), so the gate can
keep it in its changelog topic.

Size: about 780 lines, one state machine: `StreamingSegmenter` scans each character once and every
rule (stops, abbreviations, decimals, quotes, lists, code fences, phoneme spans, the buffer bound)
decides on the same cursor and lookahead. The language word lists live in
`voicebus.gate.abbreviations`.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from voicebus.gate.abbreviations import LanguageRules, rules_for
from voicebus.gate.markdown import speakable_text
from voicebus.schemas.contract import LIMITS, SPAN_LABEL_EXCLUDED, SPAN_PHONEMES_EXCLUDED

STOPS = ".!?…"
CLOSERS = "\"'”’»)]}*_"
OPENERS = "\"'“‘«([{¿¡*_"
RUN_IN_BULLETS = "•⁃▪◦‣"
MARKDOWN_BULLETS = "-*+"
CLAUSE_MARKS = ",;:"
# After a stop, these signs continue the sentence ("la ave solitaria. / [...]", "x. + y").
CONTINUING_SIGNS = set("/&+=<>|\\~^%-–—:;,.)]}")

END = "\x00"  # what lies past the end of a flushed turn (matches no class of characters)
SPACES = " \t\u00a0\u202f"  # French typography puts a (narrow) no-break space before ? ! : ; »

KINDS = ("sentence", "heading", "list_item", "clause", "code")

_STATE_VERSION = 1


@dataclass(frozen=True)
class Sentence:
    """One released utterance. See the module docstring for the meaning of the offsets."""

    text: str
    """Speakable text: markup removed, whitespace normalised (a placeholder for a code block)."""
    start: int
    end: int
    kind: str
    """"sentence" | "heading" | "list_item" | "clause" (early first clause) | "code"."""
    complete_at: int

    @property
    def lag(self) -> int:
        """Release lag in characters: characters fed after `end` before the release."""
        return self.complete_at - self.end


class SegmenterStateError(ValueError):
    """A saved segmenter state cannot be restored (wrong version or missing fields)."""


class _NeedMore(Exception):
    """The decision at the scan position needs characters that have not arrived yet."""


_DOTTED = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")


def _is_mark(c: str) -> bool:
    """A combining mark (a Devanagari vowel sign, an accent in decomposed text): part of the
    word its letter starts, though not a letter itself."""
    return unicodedata.category(c)[0] == "M"


def _inside_span(text: str) -> bool:
    """Whether `text`, which starts with ``[``, is the start of an inline phoneme span and not yet
    all of it: a cut at its end would be inside the span."""
    close = text.find("]")
    label = text[1:] if close < 0 else text[1:close]
    if len(label) > LIMITS.max_span_label_chars or any(c in SPAN_LABEL_EXCLUDED for c in label):
        return False
    if close < 0:
        return True
    rest = text[close + 1:]
    if not label or not "(/".startswith(rest[:2]):
        return False
    if len(rest) < 2:
        return True
    phonemes, slash, tail = rest[2:].partition("/")
    if len(phonemes) > LIMITS.max_phoneme_chars or any(c in SPAN_PHONEMES_EXCLUDED for c in phonemes):
        return False
    return not slash or (bool(phonemes) and tail == "")


class StreamingSegmenter:
    """Turns one turn's text, fed piece by piece, into `Sentence`s (see the module docstring)."""

    def __init__(self, language: str = "en", first_clause_min_words: int = 0, max_buffer_chars: int = 0) -> None:
        if first_clause_min_words < 0:
            raise ValueError("first_clause_min_words must be >= 0 (0 disables early clauses)")
        if max_buffer_chars < 0:
            raise ValueError("max_buffer_chars must be >= 0 (0: no bound)")
        self.max_buffer_chars = max_buffer_chars
        self._rules: LanguageRules = rules_for(language)
        self._stops = STOPS + self._rules.stops
        self._closers = CLOSERS + self._rules.closers
        self._openers = OPENERS + self._rules.openers
        self.language = language
        self.first_clause_min_words = first_clause_min_words
        self._fed = 0
        self._base = 0  # absolute offset of _buf[0]
        self._buf = ""
        self._final = False
        self._reset_turn()

    # ----------------------------------------------------------------------------- public API
    @property
    def fed(self) -> int:
        """Characters fed so far."""
        return self._fed

    @property
    def settled(self) -> int:
        """Characters released or dropped for good: no utterance to come ends at or before this."""
        return self._base

    def feed(self, piece: str) -> list[Sentence]:
        """Add `piece`; return the utterances whose end became certain, in order."""
        if not piece:
            return []
        self._buf += piece
        self._fed += len(piece)
        out = self._drain()
        if self.max_buffer_chars and len(self._buf) >= self.max_buffer_chars:
            out.extend(self._bound())
        return out

    def flush(self) -> list[Sentence]:
        """End of turn: release everything still buffered. The segmenter is then ready for a new
        turn (offsets keep counting)."""
        self._final = True
        try:
            out = self._drain()
            if self._sent is not None:
                out.extend(self._emit(self._last_non_space_before(len(self._buf))))
            self._buf = ""
            self._base = self._fed
            self._pos = 0
        finally:
            self._final = False
        self._reset_turn()
        return out

    @property
    def open_at(self) -> int | None:
        """Absolute offset of the open utterance's first raw character (None between utterances)."""
        return None if self._sent is None else self._base + self._sent

    @property
    def scanned(self) -> int:
        """Absolute offset of the scan position: every character before it is decided."""
        return self._base + self._pos

    def speculation(self) -> Sentence | None:
        """The utterance that would end at the stop now under the scan position, if that end is
        almost certain; None otherwise. A query: nothing changes, and the decision itself still
        waits for its lookahead (`feed` releases or continues as always).

        Almost certain (docs/gate.md, "Speculative release"): the scan waits on a single ``.``,
        ``?`` or ``!`` that is the last non-space character fed, inside a plain sentence or list
        item (no heading, code, fence), after a word that is no known title or abbreviation, no
        initial or dotted acronym and does not end in a digit (a decimal, an ordinal) or hold a
        dot (a domain name). Only the next non-space character can then undo it (a lowercase
        letter, a continuing sign, a glued character)."""
        if self._sent is None or self._fence is not None or self._code_span or self._kind == "heading":
            return None
        buf, i = self._buf, self._pos
        if i >= len(buf) or buf[i] not in ".?!" or buf[i + 1:].strip():
            return None
        if i == 0 or not buf[i - 1].isalnum() or not self._has_content_before(i):
            return None
        k = i
        while k > self._content and not buf[k - 1].isspace():
            k -= 1
        token = buf[k:i].lstrip(self._openers)
        if not token or token[-1].isdigit() or "." in token:
            return None
        if buf[i] == "." and self._token_class(i) != "plain":
            return None
        text = speakable_text(buf[self._content : i + 1], heading=False)
        if not text:
            return None
        return Sentence(text, self._base + self._sent, self._base + i + 1, self._kind, self._fed)

    def to_state(self) -> dict[str, Any]:
        """Everything needed to go on after a restart, as JSON-serialisable data."""
        return {
            "v": _STATE_VERSION,
            "language": self.language,
            "first_clause_min_words": self.first_clause_min_words,
            "fed": self._fed,
            "base": self._base,
            "buf": self._buf,
            "pos": self._pos,
            "sent": self._sent,
            "kind": self._kind,
            "content": self._content,
            "enum": list(self._enum) if self._enum is not None else None,
            "words": self._words,
            "in_word": self._in_word,
            "code_span": self._code_span,
            "fence": self._fence,
            "line_start": self._line_start,
            "first_done": self._first_done,
            "fence_spoken": self._fence_spoken,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], max_buffer_chars: int = 0) -> "StreamingSegmenter":
        """Rebuild a segmenter saved by `to_state` (the bound is configuration, not state)."""
        if state.get("v") != _STATE_VERSION:
            raise SegmenterStateError(f"unknown segmenter state version {state.get('v')!r}")
        try:
            seg = cls(state["language"], state["first_clause_min_words"], max_buffer_chars)
            seg._fed = state["fed"]
            seg._base = state["base"]
            seg._buf = state["buf"]
            seg._pos = state["pos"]
            seg._sent = state["sent"]
            seg._kind = state["kind"]
            seg._content = state["content"]
            seg._enum = tuple(state["enum"]) if state["enum"] is not None else None
            seg._words = state["words"]
            seg._in_word = state["in_word"]
            seg._code_span = state["code_span"]
            seg._fence = state["fence"]
            seg._line_start = state["line_start"]
            seg._first_done = state["first_done"]
            seg._fence_spoken = state.get("fence_spoken", False)  # absent in states saved before the bound
        except KeyError as exc:
            raise SegmenterStateError(f"segmenter state lacks {exc.args[0]!r}") from None
        return seg

    # ----------------------------------------------------------------------------- internals
    def _reset_turn(self) -> None:
        self._pos = 0
        self._line_start = True  # the scan position is at the start of a line
        self._first_done = False  # an utterance was released in this turn
        self._reset_utterance()

    def _reset_utterance(self) -> None:
        self._sent: int | None = None  # buffer index of the utterance's first raw character
        self._kind = "sentence"
        self._content = 0  # buffer index just past the block marker
        self._enum: tuple | None = None  # run-in list marker style: ("bullet", "•") / ("num", 1, ".") / ("alpha", "a", ")")
        self._words = 0
        self._in_word = False
        self._code_span = False
        self._fence: str | None = None
        self._fence_spoken = False  # the open fence's placeholder went out already (see _bound)

    def _at(self, j: int) -> str:
        """The character at buffer index j; END past the end of a flushed turn; waits otherwise."""
        if j < len(self._buf):
            return self._buf[j]
        if self._final:
            return END
        raise _NeedMore

    def _last_non_space_before(self, j: int) -> int:
        buf = self._buf
        while j > 0 and buf[j - 1].isspace():
            j -= 1
        return j

    def _drain(self) -> list[Sentence]:
        out: list[Sentence] = []
        while self._pos < len(self._buf):
            try:
                released = self._step()
            except _NeedMore:
                break
            if released:
                out.extend(released)
        return out

    def _bound(self) -> list[Sentence]:
        """Release or drop buffered text until the buffer is under ``max_buffer_chars``."""
        out: list[Sentence] = []
        limit = self.max_buffer_chars
        while len(self._buf) >= limit:
            before = len(self._buf)
            if self._sent is None:  # only space scanned since the last utterance: forget it
                drop = self._pos
                self._buf = self._buf[drop:]
                self._base += drop
                self._pos = 0
            elif self._fence is not None:
                # The fenced text scanned so far holds no closing fence (it would have ended the
                # utterance): say the placeholder once, drop the text, keep the fence open.
                cut = self._pos
                if cut > self._sent and not self._fence_spoken:
                    out.append(Sentence(self._rules.code_placeholder, self._base + self._sent,
                                        self._base + cut, "code", self._fed))
                    self._fence_spoken = True
                    self._first_done = True
                self._buf = self._buf[cut:]
                self._base += cut
                self._pos = 0
                self._sent = 0
                self._content = 0
            else:
                buf = self._buf
                hi = min(len(buf), max(self._sent + 1, self._content + 1, limit))
                k = hi
                while k > self._content and not buf[k - 1].isspace():
                    k -= 1
                cut = self._last_non_space_before(k) if k > self._content else hi
                if cut <= self._content:
                    cut = hi  # one word longer than the limit: cut inside it
                # a phoneme span is one word: never cut inside what may be one (judged from the
                # text before the cut only, so the cut does not depend on how the text was split)
                opening = buf.rfind("[", self._content, cut)
                if opening >= 0 and _inside_span(buf[opening:cut]):
                    before = self._last_non_space_before(opening)
                    cut = before if before > self._content else cut
                out.extend(self._emit(cut))
                self._line_start = False  # the rest goes on mid-line
                out.extend(self._drain())
            if len(self._buf) >= before:
                break  # nothing could go (a lookahead longer than the limit): wait for more text
        return out

    def _emit(self, end: int, kind: str | None = None) -> list[Sentence]:
        """Release buffer[_sent:end] and start a new utterance at `end`."""
        kind = kind or self._kind
        if self._fence is not None and self._fence_spoken:
            text = ""  # its placeholder was said when the bound dropped its text
        elif self._fence is not None or kind == "code":
            text = self._rules.code_placeholder
        else:
            text = speakable_text(self._buf[self._content : end], heading=kind == "heading")
        out = []
        if text:
            out.append(Sentence(text, self._base + self._sent, self._base + end, kind, self._fed))
            self._first_done = True
        self._buf = self._buf[end:]
        self._base += end
        self._pos = 0
        self._reset_utterance()
        return out

    def _step(self) -> list[Sentence] | None:
        """Examine the character at the scan position. Either advance past it (and maybe past a
        few more), or release an utterance. Raises _NeedMore before changing anything."""
        i = self._pos
        c = self._buf[i]

        if self._sent is None:  # between utterances: skip space, then classify the start
            if c.isspace():
                self._pos = i + 1
                if c == "\n":
                    self._line_start = True
                return None
            self._start_utterance(i)
            return None

        if self._fence is not None:
            return self._step_in_fence(i, c)

        if c == "\n":
            return self._at_newline(i)
        if c == "`":
            self._code_span = not self._code_span
            self._advance(i, c)
            return None
        if self._code_span:
            self._advance(i, c)
            return None
        if c == "[":
            end = self._phoneme_span_end(i)
            if end is not None:  # one word, whatever it holds
                if not self._in_word:
                    self._words += 1
                self._in_word = False
                self._pos = end
                return None
        if c in self._stops and self._kind != "heading":
            return self._at_stop(i)
        if (
            c in CLAUSE_MARKS
            and self.first_clause_min_words
            and not self._first_done
            and self._kind in ("sentence", "list_item")
            and self._words >= self.first_clause_min_words
        ):
            if self._at(i + 1).isspace():
                return self._emit(i + 1, "clause")
        if c.isspace() and self._enum is not None and self._next_enumerator_at(i + 1):
            return self._emit(self._last_non_space_before(i))
        self._advance(i, c)
        return None

    def _phoneme_span_end(self, i: int) -> int | None:
        """The buffer index just past the inline phoneme span ``[text](/phonemes/)`` that starts
        at i, or None when none does (waits while the characters that decide it are missing)."""
        at = self._at
        j = i + 1
        while (ch := at(j)) != "]":
            if ch == END or ch in SPAN_LABEL_EXCLUDED or j - i > LIMITS.max_span_label_chars:
                return None
            j += 1
        if j == i + 1 or at(j + 1) != "(" or at(j + 2) != "/":
            return None
        k = j + 3
        while (ch := at(k)) != "/":
            if ch == END or ch in SPAN_PHONEMES_EXCLUDED or k - (j + 3) >= LIMITS.max_phoneme_chars:
                return None
            k += 1
        if k == j + 3 or at(k + 1) != ")":
            return None
        return k + 2

    def _advance(self, i: int, c: str) -> None:
        if c.isalnum():
            if not self._in_word:
                self._words += 1
                self._in_word = True
        elif self._in_word and _is_mark(c):
            pass  # a vowel sign goes on the word (Hindi किताब is one word, not three)
        else:
            self._in_word = False
        self._pos = i + 1

    # ---- utterance starts: block markers ------------------------------------------------
    def _start_utterance(self, i: int) -> None:
        kind, content, enum, fence = self._classify_start(i)
        self._sent = i
        self._kind = kind
        self._content = content
        self._enum = enum
        self._fence = fence
        self._line_start = False
        self._pos = content

    def _classify_start(self, i: int) -> tuple[str, int, tuple | None, str | None]:
        """(kind, content start, run-in marker style, code fence) of an utterance starting at i."""
        at = self._at
        j = i
        kind = "sentence"
        if self._line_start:
            c = at(j)
            if c == ">":  # block quote: read its content
                while at(j) == ">" or at(j) in " \t":
                    j += 1
                c = at(j)
            if c in "`~" and at(j + 1) == c and at(j + 2) == c:
                return "code", j + 3, None, c * 3
            if c == "#":
                k = j
                while at(k) == "#":
                    k += 1
                if k - j <= 6 and at(k) in " \t":
                    while at(k) in " \t":
                        k += 1
                    return "heading", k, None, None
            if c in MARKDOWN_BULLETS and at(j + 1) in " \t":
                k = j + 1
                while at(k) in " \t":
                    k += 1
                return "list_item", self._skip_ordinal(k)[0], None, None
        bullet = None
        if at(j) in RUN_IN_BULLETS:
            bullet = at(j)
            j += 1
            while at(j) in " \t":
                j += 1
        k, ordinal = self._skip_ordinal(j)
        if bullet is not None:
            return "list_item", k, ("bullet", bullet), None
        if ordinal is not None:
            return "list_item", k, ordinal, None
        return kind, j, None, None

    def _skip_ordinal(self, j: int) -> tuple[int, tuple | None]:
        """If an ordinal list marker (12. / 12) / 12.) / a. / b)) followed by space starts at j,
        return (index past it and its spaces, its style); else (j, None)."""
        at = self._at
        k = j
        while at(k).isdigit() and k - j < 9:
            k += 1
        if k > j:
            value: Any = int(self._buf[j:k])
            style = "num"
        elif at(k).isalpha() and at(k).islower() and at(k).isascii():
            value = at(k)
            style = "alpha"
            k += 1
        else:
            return j, None
        if at(k) == "." and at(k + 1) == ")":
            suffix = ".)"
        elif at(k) in ".)":
            suffix = at(k)
        else:
            return j, None
        k += len(suffix)
        if not at(k).isspace() or at(k) == "\n":
            return j, None
        while at(k) in " \t":
            k += 1
        return k, (style, value, suffix)

    def _next_enumerator_at(self, j: int) -> bool:
        """Whether the next marker of the current run-in list ("2." after "1.", "b)" after "a)",
        the same bullet) starts at j."""
        enum = self._enum
        at = self._at
        if enum[0] == "bullet":
            return at(j) == enum[1]
        style, value, suffix = enum
        expected = str(value + 1) if style == "num" else chr(ord(value) + 1)
        for k, ch in enumerate(expected + suffix):
            if at(j + k) != ch:
                return False
        after = at(j + len(expected) + len(suffix))
        return after in " \t"

    # ---- code fences ------------------------------------------------------------------------
    def _step_in_fence(self, i: int, c: str) -> list[Sentence] | None:
        if c != "\n":
            self._pos = i + 1
            return None
        at = self._at
        k = i + 1
        while at(k) in " \t" and k - i <= 4:
            k += 1
        if at(k) == self._fence[0] and at(k + 1) == self._fence[0] and at(k + 2) == self._fence[0]:
            m = k + 3
            while at(m) not in ("\n", END):
                m += 1
            return self._emit(m)
        self._pos = i + 1
        return None

    # ---- line breaks ------------------------------------------------------------------------
    def _at_newline(self, i: int) -> list[Sentence] | None:
        """A line break ends the utterance unless the next line continues it (starts lowercase:
        a soft wrap). A heading always ends at its line break."""
        end = self._last_non_space_before(i)
        if self._kind == "heading":
            return self._emit(end)
        k = i + 1
        while (ch := self._at(k)) in " \t":
            k += 1
        if ch == END or ch == "\n" or not ch.islower():
            return self._emit(end)
        self._code_span = False
        self._advance(i, " ")
        return None

    # ---- stops ------------------------------------------------------------------------------
    def _at_stop(self, i: int) -> list[Sentence] | None:
        at = self._at
        buf = self._buf
        rules = self._rules
        stops, closers, openers = self._stops, self._closers, self._openers
        # The cluster: stops, closing quotes/brackets/emphasis, spaced dots (". . ."), and a
        # closing quote after a space where the language's typography spaces it ("? »").
        marks: list[str] = []
        first_dot_spaced = False
        closed = False  # a closing quote or bracket is part of the cluster
        j = i
        while True:
            ch = at(j)
            if ch in stops:
                marks.append(ch)
                j += 1
            elif ch in closers:
                closed = True
                j += 1
            elif ch == " " and marks and marks[-1] == "." and at(j + 1) == ".":
                if len(marks) == 1:
                    first_dot_spaced = True
                j += 1
            elif ch in SPACES and rules.spaced_closers and self._spaced_closer_after(j):
                while at(j) in SPACES:
                    j += 1
            else:
                break
        cluster_end = j
        only_dots = all(m in ".…" for m in marks)
        dots = sum(3 if m == "…" else 1 for m in marks)

        def advance_past_cluster() -> None:
            self._in_word = False
            self._pos = cluster_end

        # "[...]" and "(...)" mark an omission, never an end.
        if only_dots and i > 0 and buf[i - 1] in "[(" and at(i + len(marks)) in ")]":
            advance_past_cluster()
            return None
        # Nothing said yet ("1." markers are cut off already; a leading ". . ."): not an end.
        if not self._has_content_before(i):
            advance_past_cluster()
            return None
        # A stop of a script that puts no space between sentences: certain now that the character
        # after the cluster is known, whatever it is.
        after = at(cluster_end)
        if self._ends_unspaced(i, marks, after):
            if closed and after in rules.quote_continuers:  # 「行きます。」と言った
                advance_past_cluster()
                return None
            return self._emit(cluster_end)

        # What follows: space (a line break?), then openers, then the first character.
        k = cluster_end
        newline = False
        while (ch := at(k)).isspace():
            newline = newline or ch == "\n"
            k += 1
        if ch == END:
            return self._emit(cluster_end)
        if k == cluster_end:  # glued to the next character: 3.14, e.g, example.com, Jr.'s
            advance_past_cluster()
            return None
        m = k
        while (first := at(m)) in openers or (
                first in SPACES and rules.spaced_closers and m > k and at(m - 1) in openers):
            m += 1  # "« Bonjour": the opening quote and its space
        if first == END:
            return self._emit(cluster_end)
        if first.islower():
            advance_past_cluster()
            return None
        if newline:
            return self._emit(cluster_end)

        # A period attached to a word and followed by an ellipsis (". . . ."): the period ends
        # the sentence and the ellipsis opens the next one.
        if only_dots and dots == 4 and first_dot_spaced and i > 0 and not buf[i - 1].isspace():
            if first.isalpha():
                return self._emit(i + 1)

        if first.isdigit() or first in "$€£¥":
            if marks == ["."] and self._token_class(i) != "plain":
                advance_past_cluster()
                return None
            return self._emit(cluster_end)
        if first.isalpha():
            if marks == ["."]:
                cls = self._token_class(i)
                if cls == "title":
                    advance_past_cluster()
                    return None
                if cls == "general":
                    word = self._word_at(m)
                    if word.lower() in self._rules.starters:
                        return self._emit(cluster_end)
                    advance_past_cluster()
                    return None
                return self._emit(cluster_end)
            if only_dots and dots <= 3:  # an ellipsis: "is . . . I didn't" goes on
                if self._word_at(m) == "I":
                    advance_past_cluster()
                    return None
            return self._emit(cluster_end)
        if first in RUN_IN_BULLETS or first == "#":
            return self._emit(cluster_end)
        if first in CONTINUING_SIGNS:
            advance_past_cluster()
            return None
        return self._emit(cluster_end)  # emoji, other scripts' signs: a new sentence

    def _spaced_closer_after(self, j: int) -> bool:
        """Whether the spaces starting at j lead to a closing quote the language writes after a
        space (``Oui ! »``); waits for the character after them."""
        at = self._at
        k = j
        while at(k) in SPACES:
            if k - j >= 2:
                return False
            k += 1
        return at(k) in self._rules.spaced_closers

    def _ends_unspaced(self, i: int, marks: list[str], after: str) -> bool:
        """Whether the cluster of the stop at i ends its sentence whatever follows: it holds one
        of the language's final stops (``。``, ``।``), or it is a ``!``/``?`` after a character of
        the script with a character glued to it (``すごい!本当``; ``Yahoo!ニュース`` goes on)."""
        rules = self._rules
        if self._inside_title(i):
            return False
        if any(mark in rules.final_stops for mark in marks):
            return True
        return (rules.glued_exclamations and after != END and not after.isspace() and after not in CONTINUING_SIGNS
                and all(mark in "!?" for mark in marks) and i > 0 and not self._buf[i - 1].isascii())

    def _inside_title(self, i: int) -> bool:
        """Whether the utterance holds a title bracket still open at i (《摔跤吧！ ...)."""
        pairs = self._rules.title_brackets
        if not pairs:
            return False
        text = self._buf[self._content : i]
        return any(text.count(pairs[k]) > text.count(pairs[k + 1]) for k in range(0, len(pairs), 2))

    def _has_content_before(self, i: int) -> bool:
        buf = self._buf
        for j in range(self._content, i):
            if buf[j].isalnum():
                return True
        return False

    def _word_at(self, m: int) -> str:
        """The letters starting at m (waits until a non-letter settles the word)."""
        k = m
        while (ch := self._at(k)).isalpha() or (k > m and _is_mark(ch)):
            k += 1
        return self._buf[m:k]

    def _token_class(self, i: int) -> str:
        """What the word ending just before the stop at i is: "title", "numeric", "general"
        (abbreviation, dotted acronym, initial) or "plain"."""
        buf = self._buf
        k = i
        lo = self._content
        while k > lo and not buf[k - 1].isspace():
            k -= 1
        token = buf[k:i].lstrip(self._openers)
        if not token or "@" in token or "/" in token:
            return "plain"
        if self._rules.elision:
            token = re.split("['’]", token)[-1] or token  # l'art. is art.
        low = token.lower()
        rules = self._rules
        if low in rules.titles:
            return "title"
        if low in rules.numeric:
            return "numeric"
        if low in rules.general:
            return "general"
        if _DOTTED.fullmatch(token):
            return "general"
        if len(token) == 1 and token.isalpha():
            if token == "I" and rules.code == "en":
                prev = buf[lo:k].split()
                if prev and prev[-1][:1].islower():
                    return "plain"  # the pronoun: "you and I."
            return "general"  # an initial: "Jonas E. Smith"
        if rules.doubled_letter_plurals and len(token) in (2, 4) and token.isupper() and token[0] == token[1]:
            return "general"  # EE. UU.
        return "plain"
