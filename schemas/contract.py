"""The rest of the wire contract: what the `.avsc` files beside this module cannot say.

Avro says a field is an ``int`` or a ``string``; it cannot say that a sequence number is never
negative, which languages the pipeline can speak, or how long an id may be. This module says it,
once, for every stage: the codec (`voicebus.codecs.Codec`) checks every message against it when it
encodes (so a producer such as the agents SDK refuses what the pipeline cannot speak, at the
source, with a clear error) and when it decodes (so a consumer never hands a handler a record that
breaks it: the record policy in `voicebus.shell` dead-letters it with the violation's reason).

What is here:

- the enums of the schemas (`TextEventKind`, `ControlAction`, `AudioEncoding`, `PlaybackKind`),
  built from the `.avsc` symbols, so code compares ``event["kind"] == TextEventKind.TOKEN``
  (a ``str`` enum: equal to the decoded string) and never a bare literal;
- `LANGUAGES`: the language codes an agent may write, each mapped to the Kokoro code the engine
  speaks, and `SEGMENTER_LANGUAGE`: the sentence rules used for each Kokoro code. Only languages
  that both the gate can segment and the engine can phonemize are listed: a language one stage
  accepts and the next cannot speak is how a turn used to wedge;
- `KOKORO_VOICES`: the 54 voices of Kokoro-82M v1.0 (`VoiceInfo`: language and gender, read
  from the name), and voice specs (`parse_voice`): a voice is a name or a weighted mix of up to
  `Limits.max_voice_parts` voices, ``af_heart:0.7+af_bella:0.3``, normalized to a `VoiceMix`
  with one canonical spelling. The contract checks a spec's syntax only; which voices a worker
  has (Kokoro's, or packs of its own in its voices directory) is the worker's business;
- limits (`Limits`): text bytes, id lengths, sequence ranges, sample rates, audio bytes per chunk;
- `violations(message_type, value)`: the checks (the codec raises `InvalidMessage` with them;
  a `Violation` with a ``reason`` of its own, such as ``invalid-voice``, gives the dead letter
  that reason when it is the record's only kind of problem);
- the framing of Opus audio (`pack_opus_packets`, `split_opus_packets`, `check_opus_packets`):
  an OPUS AudioChunk's ``pcm`` holds whole packets, each a 2-byte little-endian length then the
  packet, the same bytes on the bus and in the edge's audio frames (docs/protocol.md).

Size: about 750 lines, one module by design: it is the single place a stage, the SDK and the codec
import the contract from (enums, languages, voices, limits, the checks, the Opus framing), next to
the `.avsc` files. Typed messages are in `voicebus.schemas.messages`.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from voicebus import schemas

# --- enums, from the schemas ---------------------------------------------------------------------


def _symbols(message_type: str, field_name: str) -> list[str]:
    for f in schemas.load(message_type)["fields"]:
        if f["name"] == field_name:
            return list(f["type"]["symbols"])
    raise KeyError(f"{message_type} has no enum field {field_name!r}")


class SchemaEnum(str, enum.Enum):
    """A schema enum: each member is its Avro symbol, equal to it and printed as it."""

    __str__ = str.__str__
    __format__ = str.__format__


def _enum(name: str, message_type: str, field_name: str) -> type[SchemaEnum]:
    symbols = _symbols(message_type, field_name)
    return SchemaEnum(name, [(s, s) for s in symbols], module=__name__)  # type: ignore[return-value]


TextEventKind = _enum("TextEventKind", "TextEvent", "kind")
ControlAction = _enum("ControlAction", "ControlEvent", "action")
AudioEncoding = _enum("AudioEncoding", "AudioChunk", "encoding")
PlaybackKind = _enum("PlaybackKind", "PlaybackReport", "kind")
FloorEventKind = _enum("FloorEventKind", "FloorEvent", "event")

EVIDENCE_KINDS = frozenset({TextEventKind.EVIDENCE_PENDING, TextEventKind.EVIDENCE_READY,
                            TextEventKind.EVIDENCE_FAILED})


class CancelReason(str, enum.Enum):
    """The ``reason`` voicebus itself writes on a CANCEL (the field is free text: an agent may
    write any): what an operator reading the control topic, a trace or a player's ``stop`` is told."""

    __str__ = str.__str__
    __format__ = str.__format__

    BARGE_IN = "barge-in"  # the listener interrupted (a player's cancel, a framework's interruption)
    IDLE_TIMEOUT = "idle-timeout"  # a framework plugin heard nothing of the turn from the edge for too long
    FAILED = "failed"  # a framework plugin's turn failed before its end (the edge lost, an error)

# --- languages -----------------------------------------------------------------------------------

# Language as an agent writes it (ISO code, or Kokoro's own one-letter code) -> Kokoro code.
LANGUAGES: Mapping[str, str] = {
    "en": "a", "en-us": "a", "en_us": "a", "a": "a",
    "en-gb": "b", "en_gb": "b", "b": "b",
    "es": "e", "e": "e",
    "pt": "p", "pt-br": "p", "pt_br": "p", "p": "p",
    "fr": "f", "fr-fr": "f", "fr_fr": "f", "f": "f",
    "it": "i", "i": "i",
    "hi": "h", "h": "h",
    "ja": "j", "j": "j",
    "zh": "z", "zh-cn": "z", "zh_cn": "z", "z": "z",
}
# Kokoro code -> the sentence rules the segmenter applies (`voicebus.gate.abbreviations`).
SEGMENTER_LANGUAGE: Mapping[str, str] = {"a": "en", "b": "en", "e": "es", "p": "pt", "f": "fr", "i": "it", "h": "hi",
                                         "j": "ja", "z": "zh"}
# A voice of each language, for an event that names none when the configured default is of another.
# Hindi's and Mandarin's were changed by a measured rule (`voicebus bench synth --voice-sweep
# hi,ja,zh`, docs/benchmarks.md): to a voice with no mid-phrase pause and fewer characters wrong
# (CER) than the default on both the bench's sentences and held-out ones; of several, the fewest
# over both.
DEFAULT_VOICES: Mapping[str, str] = {"a": "af_heart", "b": "bf_emma", "e": "ef_dora", "p": "pf_dora", "f": "ff_siwis",
                                     "i": "if_sara", "h": "hf_beta", "j": "jf_alpha", "z": "zm_yunxia"}
KOKORO_CODES = frozenset(LANGUAGES.values())
assert KOKORO_CODES == frozenset(SEGMENTER_LANGUAGE) == frozenset(DEFAULT_VOICES), "one entry per spoken language"


class UnknownLanguage(ValueError):
    """A language code the pipeline cannot speak (see `LANGUAGES`)."""

    reason = "unknown-language"


def kokoro_code(language: str | None, default: str | None = "en") -> str:
    """The Kokoro code for ``language`` (``None`` or empty: ``default``, where one is given);
    `UnknownLanguage` else. The one mapping of a language to Kokoro's code: gate, worker, edge
    and SDK call it."""
    code = (language or default or "").strip().lower()
    try:
        return LANGUAGES[code]
    except KeyError:
        raise UnknownLanguage(
            f"unknown language {code!r} cannot be spoken; known: {', '.join(sorted(LANGUAGES))}") from None


# --- limits --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The hard limits of every message. One instance, `LIMITS`; docs/protocol.md lists them."""

    max_text_bytes: int = 16 * 1024
    """A text field (token, sentence) longer than this in UTF-8 is refused as oversized."""
    max_id_chars: int = 128
    """session_id, turn_id, claim_id, client_id: at most this many characters, no control chars."""
    max_agent_id_chars: int = 200
    """agent_id: Kafka's legal topic characters, as the agent's text topic is named after it."""
    max_label_chars: int = 1000
    """Free text meant for people (reason, source, detail); a voice spec too is at most this long."""
    max_voice_parts: int = 4
    """A voice mix (`parse_voice`) blends at most this many voices."""
    max_voice_name_chars: int = 64
    """One voice name of a spec: at most this many characters (`VOICE_NAME`)."""
    max_seq: int = 2**31 - 1
    """sentence_seq and chunk_seq are 0 .. max_seq (Avro int is signed; negatives are refused)."""
    sample_rates: frozenset[int] = frozenset({8000, 16000, 22050, 24000, 32000, 44100, 48000})
    max_chunk_audio_bytes: int = 256 * 1024
    """One AudioChunk's audio: ~5.4 s of 24 kHz PCM16, far above the 150 ms chunks workers send."""
    min_speed: float = 0.25
    max_speed: float = 4.0
    max_priority: int = 1000
    """A TextEvent's floor ``priority`` is -max_priority .. max_priority."""
    max_turn_ids: int = 64
    """A ControlEvent cancels at most this many listed turns (``turn_ids``), each a valid id: a
    cancel cannot grow a stage's state (two cancels of 600 KB of ids once made the gate's state
    record too large to write)."""
    max_lexicon_entries: int = 32
    """A TextEvent's ``lexicon`` holds at most this many entries."""
    max_lexicon_match_chars: int = 100
    """A lexicon entry's ``match`` (a word, or a regular expression): 1 .. this many characters."""
    max_lexicon_say_chars: int = 200
    """A lexicon entry's ``say`` (the spoken form): at most this many characters."""
    max_phoneme_chars: int = 200
    """Phonemes (a lexicon entry's, an inline span's): 1 .. this many Kokoro symbols."""
    max_span_label_chars: int = 200
    """The written text of an inline phoneme span ``[text](/phonemes/)``: 1 .. this many characters."""


LIMITS = Limits()

# The values a metric label may take from a ControlEvent's free-text ``source``: what voicebus's
# own producers write. Any other value is counted as "other", so a writer of the control topic
# cannot add a metric series per value (20,000 distinct sources once made 20,000 series).
CANCEL_SOURCES = frozenset({"agent", "edge", "gate", "floor", "console", "openai-adapter", "openai-speech", "user", "cli",
                             "bus"})

# --- voices --------------------------------------------------------------------------------------

# Kokoro's language codes (a voice name's first letter), as hexgrad/Kokoro-82M's VOICES.md names
# them. Only those in `KOKORO_CODES` are spoken by the pipeline; the others are listed so that
# `voicebus voices` can say what a voice pack is.
KOKORO_LANGUAGE_NAMES: Mapping[str, str] = MappingProxyType({
    "a": "American English", "b": "British English", "e": "Spanish", "f": "French", "h": "Hindi",
    "i": "Italian", "j": "Japanese", "p": "Brazilian Portuguese", "z": "Mandarin Chinese",
})
KOKORO_GENDERS: Mapping[str, str] = MappingProxyType({"f": "female", "m": "male"})

# The 54 voices of Kokoro-82M v1.0 (the offline pack's, `voicebus weights prepare`), by language.
KOKORO_VOICE_NAMES: tuple[str, ...] = (
    "af_alloy", "af_aoede", "af_bella", "af_heart", "af_jessica", "af_kore", "af_nicole", "af_nova",
    "af_river", "af_sarah", "af_sky", "am_adam", "am_echo", "am_eric", "am_fenrir", "am_liam",
    "am_michael", "am_onyx", "am_puck", "am_santa",
    "bf_alice", "bf_emma", "bf_isabella", "bf_lily", "bm_daniel", "bm_fable", "bm_george", "bm_lewis",
    "ef_dora", "em_alex", "em_santa",
    "ff_siwis",
    "hf_alpha", "hf_beta", "hm_omega", "hm_psi",
    "if_sara", "im_nicola",
    "jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo",
    "pf_dora", "pm_alex", "pm_santa",
    "zf_xiaobei", "zf_xiaoni", "zf_xiaoxiao", "zf_xiaoyi", "zm_yunjian", "zm_yunxi", "zm_yunxia", "zm_yunyang",
)


@dataclass(frozen=True)
class VoiceInfo:
    """What a voice's name says about it (Kokoro names start with the language code and the
    gender: ``af_heart`` is American English, female)."""

    name: str
    language: str
    """The Kokoro code, the name's first letter."""
    language_name: str
    """``unknown`` for a code Kokoro does not have (a voice pack of one's own)."""
    gender: str
    """``female``, ``male``, or ``?`` when the name's second letter says neither."""
    spoken: bool
    """Whether the pipeline speaks the language (`KOKORO_CODES`)."""


def describe_voice(name: str) -> VoiceInfo:
    """`VoiceInfo` read from ``name`` (any name: a pack of one's own gets ``unknown``/``?``)."""
    code = name[:1]
    return VoiceInfo(name, code, KOKORO_LANGUAGE_NAMES.get(code, "unknown"), KOKORO_GENDERS.get(name[1:2], "?"),
                     code in KOKORO_CODES)


KOKORO_VOICES: Mapping[str, VoiceInfo] = MappingProxyType({n: describe_voice(n) for n in KOKORO_VOICE_NAMES})
assert len(KOKORO_VOICES) == 54 and all(
    v.language in KOKORO_LANGUAGE_NAMES and v.gender != "?" for v in KOKORO_VOICES.values()), "Kokoro-82M v1.0"
assert set(DEFAULT_VOICES.values()) <= set(KOKORO_VOICES) and all(
    KOKORO_VOICES[voice].language == code for code, voice in DEFAULT_VOICES.items()), \
    "each language's default is a Kokoro voice of that language"

# A voice name in a spec: what a voice pack's file name may be (``voices/<name>.pt``): ASCII
# letters and digits, then also ``_``, ``-`` and ``.``; never ``+``, ``:``, parentheses or spaces.
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_VOICE_WEIGHT = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
VOICE_WEIGHT_UNITS = 10_000
"""Normalized weights are kept in steps of 1/10000 (4 decimals), summing to exactly 1: a mix has
one spelling (`VoiceMix.canonical`), so equal mixes share one cache entry."""
VOICE_MIX_EXAMPLE = "af_heart:0.7+af_bella:0.3"


class InvalidVoice(ValueError):
    """A voice spec that `parse_voice` cannot read."""

    reason = "invalid-voice"


@dataclass(frozen=True)
class VoiceMix:
    """A voice: one name, or a blend of several voices' style vectors by weight.

    ``parts`` are (name, weight), the weights normalized to sum to 1 in steps of
    1/`VOICE_WEIGHT_UNITS`, the heaviest first (ties by name): equal mixes are equal objects
    with equal `canonical` strings however they were written. Build one with `parse_voice` or
    `VoiceMix.of`."""

    parts: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, parts: "Iterable[tuple[str, float]]", limits: "Limits | None" = None) -> "VoiceMix":
        """The mix of ``parts`` (name, weight > 0): names checked, weights normalized;
        `InvalidVoice` for what a spec could not say either."""
        limits = limits or LIMITS
        parts = list(parts)
        if not parts:
            raise InvalidVoice("a voice mix needs at least one voice")
        if len(parts) > limits.max_voice_parts:
            raise InvalidVoice(f"a voice mix blends at most {limits.max_voice_parts} voices, not {len(parts)}")
        seen: set[str] = set()
        for name, weight in parts:
            if not isinstance(name, str) or not 0 < len(name) <= limits.max_voice_name_chars \
                    or not VOICE_NAME.fullmatch(name):
                raise InvalidVoice(f"{_shown(name)} is not a voice name (ASCII letters, digits, '_', '-' and '.', "
                                   f"at most {limits.max_voice_name_chars} characters)")
            if name in seen:
                raise InvalidVoice(f"{name} appears twice in the mix")
            seen.add(name)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not math.isfinite(weight) or weight <= 0:
                raise InvalidVoice(f"the weight of {name} must be a positive finite number, not {weight!r}")
        total = math.fsum(w for _, w in parts)
        if not math.isfinite(total):
            raise InvalidVoice("the weights of the mix are too large")
        exact = [w / total * VOICE_WEIGHT_UNITS for _, w in parts]
        units = [math.floor(x) for x in exact]
        # largest remainder: the units left over go to the parts that lost the most to the floor
        order = sorted(range(len(parts)), key=lambda i: (-(exact[i] - units[i]), parts[i][0]))
        for i in order[:VOICE_WEIGHT_UNITS - sum(units)]:
            units[i] += 1
        for (name, _), u in zip(parts, units):
            if u == 0:
                raise InvalidVoice(f"the weight of {name} is under 1/{VOICE_WEIGHT_UNITS} of the mix")
        ranked = sorted(zip(units, (n for n, _ in parts)), key=lambda p: (-p[0], p[1]))
        return cls(tuple((name, u / VOICE_WEIGHT_UNITS) for u, name in ranked))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    @property
    def single(self) -> str | None:
        """The voice's name when it is one voice, else None."""
        return self.parts[0][0] if len(self.parts) == 1 else None

    @property
    def canonical(self) -> str:
        """The one spelling of this voice: the name alone for one voice, else
        ``name:weight+...`` with the weights in at most 4 decimals, heaviest first
        (``af_heart:0.7+af_bella:0.3``). `parse_voice` reads it back to an equal mix."""
        if len(self.parts) == 1:
            return self.parts[0][0]
        return "+".join(f"{name}:{_weight_text(w)}" for name, w in self.parts)

    def __str__(self) -> str:
        return self.canonical


def _weight_text(weight: float) -> str:
    units = round(weight * VOICE_WEIGHT_UNITS)
    return "1" if units >= VOICE_WEIGHT_UNITS else f"0.{units:04d}".rstrip("0")


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def parse_voice(spec: str, limits: "Limits | None" = None) -> VoiceMix:
    """The voice a spec names: ``af_heart``, or a mix of voices with optional weights,
    ``af_heart:0.7+af_bella:0.3`` (also written ``af_heart(0.7)+af_bella(0.3)``, Kokoro-FastAPI's
    form; ``af_heart+af_bella`` blends them equally). Weights are positive finite numbers,
    normalized to sum to 1; at most `Limits.max_voice_parts` voices, each once; spaces around
    ``+``, ``:`` and the parentheses are allowed. Only the syntax is checked, not whether a
    worker has the voices (see `KOKORO_VOICES`). `InvalidVoice` says what is wrong."""
    limits = limits or LIMITS
    if not isinstance(spec, str):
        raise InvalidVoice(f"a voice is a string, not {type(spec).__name__}")
    if len(spec) > limits.max_label_chars:
        raise InvalidVoice(f"voice spec is longer than {limits.max_label_chars} characters")
    if not spec.strip():
        raise InvalidVoice("voice is empty")
    try:
        pieces = spec.split("+")
        if len(pieces) > limits.max_voice_parts:
            raise InvalidVoice(f"a voice mix blends at most {limits.max_voice_parts} voices, not {len(pieces)}")
        parts = []
        for piece in pieces:
            piece = piece.strip()
            if not piece:
                raise InvalidVoice("a '+' with no voice on one side")
            if piece.endswith(")") and "(" in piece:  # Kokoro-FastAPI's name(weight)
                name, _, weight_text = piece[:-1].partition("(")
                name, weight_text = name.strip(), weight_text.strip()
            elif ":" in piece:
                name, _, weight_text = piece.partition(":")
                name, weight_text = name.strip(), weight_text.strip()
            else:
                name, weight_text = piece, None
            if weight_text is None:
                weight = 1.0
            elif _VOICE_WEIGHT.fullmatch(weight_text):
                weight = float(weight_text)
            else:
                shown = name if VOICE_NAME.fullmatch(name) else _shown(name)
                raise InvalidVoice(f"the weight of {shown} must be a positive number, not {_shown(weight_text)}")
            parts.append((name, weight))
        return VoiceMix.of(parts, limits)
    except InvalidVoice as exc:
        raise InvalidVoice(f"voice {_shown(spec)}: {exc}; a voice is a name or a mix such as "
                           f"{VOICE_MIX_EXAMPLE}") from None


VOICE_LANGUAGE_MISMATCH = "voice-language-mismatch"
VOICE_UNKNOWN = "voice-unknown"
# Languages that are one language to a voice: an American English voice reads British English text.
_SAME_TONGUE = {"b": "a"}


def voice_warnings(mix: VoiceMix, language: str) -> list[str]:
    """What a turn in Kokoro language ``language`` should be told about its voice, one entry per
    voice of the mix at most: ``voice-language-mismatch: ...`` for a Kokoro voice of another
    language (it speaks the text with its own accent), ``voice-unknown: ...`` for a name that is not
    one of `KOKORO_VOICES` (a pack of one's own may have it; a worker without it speaks the mix
    without it, or its fallback voice). Each under 200 characters."""
    turn_tongue = _SAME_TONGUE.get(language, language)
    out = []
    for name, _weight in mix.parts:
        info = KOKORO_VOICES.get(name)
        if info is None:
            out.append(f"{VOICE_UNKNOWN}: {name} is not a Kokoro-82M voice; a worker whose pack lacks it "
                       f"speaks without it")
        elif _SAME_TONGUE.get(info.language, info.language) != turn_tongue:
            out.append(f"{VOICE_LANGUAGE_MISMATCH}: {name} is a {info.language_name} voice; the turn is "
                       f"{KOKORO_LANGUAGE_NAMES.get(language, language)}")
    return out


# --- pronunciation (docs/protocol.md, "Pronunciation") ---------------------------------------------

# The phoneme symbols of Kokoro-82M v1.0: the keys of the ``vocab`` of its config.json (the offline
# pack's and the hub's; 114 symbols, the space and punctuation included). The model drops any
# other symbol, so phonemes an agent gives (a lexicon entry's) must be made of these.
KOKORO_VOCAB_SYMBOLS = (
    ';:,.!?—…"()“” \u0303ʣʥʦʨᵝ\uab67AIOQSTWYᵊabcdefhijklmnopqrstuvwxyzɑɐɒæβɔɕçɖðʤəɚɛɜɟɡɥɨɪʝɯɰŋɳɲɴøɸθœ'
    'ɹɾɻʁɽʂʃʈʧʊʋʌɣɤχʎʒʔˈˌːʰʲ↓→↗↘ᵻ'
)
# What phonemes written in a span may hold: the vocabulary less the parentheses, which would end
# the span ``[text](/phonemes/)`` early.
PHONEME_SYMBOLS = frozenset(KOKORO_VOCAB_SYMBOLS) - frozenset("()")
assert len(frozenset(KOKORO_VOCAB_SYMBOLS)) == len(KOKORO_VOCAB_SYMBOLS) == 114, "Kokoro-82M's vocab"

# An inline phoneme span: ``[Kokoro](/kˈOkəɹO/)``, the written text then its phonemes, the syntax
# misaki (Kokoro's English G2P) reads. The text has no brackets or line break; the phonemes no
# slash, parentheses, brackets or line break; their lengths are bounded (`Limits`), so a reader
# of streamed text knows within a bounded lookahead whether a ``[`` opens one.
PHONEME_SPAN = re.compile(
    r"\[([^\[\]\n]{1,%d})\]\(/([^/()\[\]\n]{1,%d})/\)" % (LIMITS.max_span_label_chars, LIMITS.max_phoneme_chars))
SPAN_LABEL_EXCLUDED = "[]\n"  # characters the written text of a span cannot hold
SPAN_PHONEMES_EXCLUDED = "/()[]\n"  # characters its phonemes cannot hold


def phoneme_span(text: str, phonemes: str) -> str:
    """The inline span that says `text` as `phonemes`: ``[text](/phonemes/)``."""
    return f"[{text}](/{phonemes}/)"


class InvalidLexicon(ValueError):
    """A TextEvent's ``lexicon`` that breaks the rules of docs/protocol.md, "Pronunciation"."""

    reason = "invalid-lexicon"


def phoneme_problem(phonemes: object, limits: "Limits | None" = None) -> str | None:
    """What is wrong with a phoneme string (None: nothing): 1 .. ``max_phoneme_chars`` symbols of
    `PHONEME_SYMBOLS`, not only spaces."""
    limits = limits or LIMITS
    if not isinstance(phonemes, str) or not phonemes.strip():
        return "phonemes must be a non-empty string"
    if len(phonemes) > limits.max_phoneme_chars:
        return f"phonemes are longer than {limits.max_phoneme_chars} characters"
    unknown = sorted(set(phonemes) - PHONEME_SYMBOLS)
    if unknown:
        return (f"phonemes {_shown(phonemes)} hold {''.join(unknown)!r}: not symbols of Kokoro-82M's phoneme "
                f"vocabulary (parentheses excluded; voicebus.schemas.contract.PHONEME_SYMBOLS)")
    return None


def _unbounded_repeats(pattern: str) -> bool:
    """Whether a regular expression repeats, without bound, a part that itself repeats without
    bound (``(a+)+``, ``(\\w+\\s?)*``): the shape of catastrophic backtracking."""
    try:
        from re import _parser as sre_parse  # type: ignore[attr-defined]
        from re._constants import MAXREPEAT  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - Python < 3.11
        import sre_parse  # type: ignore[no-redef]
        from sre_constants import MAXREPEAT  # type: ignore[no-redef]
    repeats = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}

    def walk(items, inside: bool) -> bool:
        for op, arg in items:
            name = str(op)
            if name in repeats:
                _lo, hi, sub = arg
                unbounded = hi == MAXREPEAT
                if unbounded and inside:
                    return True
                if walk(sub, inside or unbounded):
                    return True
            elif name == "SUBPATTERN":
                if walk(arg[-1], inside):
                    return True
            elif name == "BRANCH":
                if any(walk(b, inside) for b in arg[1]):
                    return True
            elif name in ("ASSERT", "ASSERT_NOT"):
                if walk(arg[1], inside):
                    return True
            elif name == "ATOMIC_GROUP":
                if walk(arg, inside):
                    return True
        return False

    return walk(sre_parse.parse(pattern), False)


def lexicon_problems(lexicon: object, limits: "Limits | None" = None) -> list[str]:
    """Every rule a TextEvent's ``lexicon`` breaks (empty: none; ``None`` is no lexicon): at most
    ``max_lexicon_entries`` entries; each a ``match`` of 1 .. ``max_lexicon_match_chars``
    characters and exactly one of ``phonemes`` (`phoneme_problem`) and ``say`` (at most
    ``max_lexicon_say_chars`` characters); a ``regex`` match compiles and repeats nothing
    unbounded inside an unbounded repeat."""
    limits = limits or LIMITS
    if lexicon is None:
        return []
    if not isinstance(lexicon, (list, tuple)):
        return [f"lexicon must be a list of entries, not {type(lexicon).__name__}"]
    if len(lexicon) > limits.max_lexicon_entries:
        return [f"lexicon has {len(lexicon)} entries, at most {limits.max_lexicon_entries}"]
    problems: list[str] = []
    for n, entry in enumerate(lexicon):
        where = f"lexicon entry {n}"
        if not isinstance(entry, Mapping):
            problems.append(f"{where} must be a record, not {type(entry).__name__}")
            continue
        match, regex = entry.get("match"), bool(entry.get("regex"))
        phonemes, say = entry.get("phonemes"), entry.get("say")
        if not isinstance(match, str) or not 0 < len(match) <= limits.max_lexicon_match_chars:
            problems.append(f"{where}: match must be 1-{limits.max_lexicon_match_chars} characters")
            continue
        where = f"lexicon entry {n} ({_shown(match, 40)})"
        if (phonemes is None) == (say is None):
            problems.append(f"{where} must give exactly one of phonemes and say")
        elif say is not None:
            if not isinstance(say, str) or len(say) > limits.max_lexicon_say_chars:
                problems.append(f"{where}: say must be at most {limits.max_lexicon_say_chars} characters")
        else:
            problem = phoneme_problem(phonemes, limits)
            if problem:
                problems.append(f"{where}: {problem}")
        if regex:
            try:
                compiled = re.compile(match)
            except (re.error, RecursionError, OverflowError) as exc:
                problems.append(f"{where}: not a regular expression ({exc})")
                continue
            if _unbounded_repeats(match):
                problems.append(f"{where}: a repeat inside a repeat (such as (a+)+) may take exponential "
                                f"time; write the regular expression without one")
            elif compiled.search("") is not None:
                problems.append(f"{where}: the regular expression matches the empty text")
    return problems


class Violation(str):
    """A problem `violations` found, with the dead-letter ``reason`` it calls for when it has one
    of its own (a plain ``str`` problem is a ``contract-violation``)."""

    reason: str

    def __new__(cls, text: str, reason: str) -> "Violation":
        violation = super().__new__(cls, text)
        violation.reason = reason
        return violation


# --- the floor (docs/protocol.md, "The floor") ---------------------------------------------------

FLOOR_QUEUE = "queue"  # a turn that finds the floor taken waits until the turn speaking ends
FLOOR_PREEMPT = "preempt"  # a turn that finds the floor taken cuts the turn speaking
FLOOR_POLICIES = (FLOOR_QUEUE, FLOOR_PREEMPT)
FLOOR_CANCEL_SOURCE = "floor"  # the source of the cancel the gate publishes for a preempted turn


def metric_label(value: object, allowed: frozenset[str]) -> str:
    """`value` when it is one of `allowed`, else ``other``: a label from a closed set."""
    return value if isinstance(value, str) and value in allowed else "other"

# --- Opus packet framing -------------------------------------------------------------------------

OPUS_LENGTH_BYTES = 2
MAX_OPUS_PACKET_BYTES = 1275  # RFC 6716 3.4: a frame is at most 1275 bytes
OPUS_SAMPLE_RATES = frozenset({8000, 16000, 24000, 48000})  # Opus rates (12 kHz too) that LIMITS.sample_rates allows


class MalformedOpusPayload(ValueError):
    """Bytes that are not a sequence of length-prefixed Opus packets."""


def pack_opus_packets(packets: "list[bytes] | tuple[bytes, ...]") -> bytes:
    """Whole Opus packets as one payload: each a 2-byte little-endian length, then the packet."""
    out = bytearray()
    for packet in packets:
        if not 0 < len(packet) <= MAX_OPUS_PACKET_BYTES:
            raise MalformedOpusPayload(f"an Opus packet of {len(packet)} bytes (1..{MAX_OPUS_PACKET_BYTES})")
        out += len(packet).to_bytes(OPUS_LENGTH_BYTES, "little")
        out += packet
    return bytes(out)


def split_opus_packets(payload: "bytes | bytearray | memoryview") -> list[bytes]:
    """The packets of a payload `pack_opus_packets` made; `MalformedOpusPayload` when a length
    is zero, too large or runs past the end."""
    data = memoryview(payload)
    return [bytes(data[at:at + size]) for at, size in _opus_packet_spans(data)]


def check_opus_packets(payload: "bytes | bytearray | memoryview") -> int:
    """How many packets a payload `pack_opus_packets` made holds, with `split_opus_packets`'
    checks and errors but no packet copied: what the codec's contract check and the edge's frame
    check run on every chunk."""
    return len(_opus_packet_spans(payload))


def _opus_packet_spans(data: "bytes | bytearray | memoryview") -> list[tuple[int, int]]:
    """(offset, length) of each packet of an Opus payload; `MalformedOpusPayload` as above."""
    spans: list[tuple[int, int]] = []
    at, end = 0, len(data)
    while at < end:
        if at + OPUS_LENGTH_BYTES > end:
            raise MalformedOpusPayload(f"{end - at} stray byte(s) at offset {at} of an Opus payload")
        size = data[at] | data[at + 1] << 8  # OPUS_LENGTH_BYTES, little-endian
        at += OPUS_LENGTH_BYTES
        if not 0 < size <= MAX_OPUS_PACKET_BYTES or at + size > end:
            raise MalformedOpusPayload(f"Opus packet length {size} at offset {at - OPUS_LENGTH_BYTES} "
                                       f"(1..{MAX_OPUS_PACKET_BYTES}, {end - at} bytes left)")
        spans.append((at, size))
        at += size
    return spans


_ID = re.compile(r"[^\x00-\x1f\x7f]+")


def is_valid_id(value: Any, limits: "Limits | None" = None) -> bool:
    """A session, turn, claim or client id: a non-empty string of at most ``max_id_chars``
    characters without control characters."""
    limit = (limits or LIMITS).max_id_chars
    return isinstance(value, str) and 0 < len(value) <= limit and bool(_ID.fullmatch(value))
_AGENT_ID = re.compile(r"[A-Za-z0-9._-]+")

# --- the checks ----------------------------------------------------------------------------------


def violations(message_type: str, value: Mapping[str, Any], limits: Limits = LIMITS) -> list[str]:
    """Every rule `value` breaks (empty when it is fine). Pure; fields Avro checks are not redone,
    and the text size is the codec's own check (`OversizedText`, with its setting). A problem
    with a dead-letter reason of its own is a `Violation` (a voice that is no spec:
    ``invalid-voice``); the others are plain strings (``contract-violation``)."""
    problems: list[str] = []

    def ident(name: str, *, optional: bool = False) -> None:
        v = value.get(name)
        if v is None and optional:
            return
        if not is_valid_id(v, limits):
            problems.append(f"{name} must be 1-{limits.max_id_chars} characters without control characters")

    def non_negative(name: str, top: int) -> None:
        v = value.get(name)
        if isinstance(v, int) and not 0 <= v <= top:
            problems.append(f"{name} {v} is outside 0..{top}")

    def label(name: str) -> None:
        v = value.get(name)
        if isinstance(v, str) and len(v) > limits.max_label_chars:
            problems.append(f"{name} is longer than {limits.max_label_chars} characters")

    def language(name: str = "language", *, optional: bool = False) -> None:
        v = value.get(name)
        if v is None and optional:
            return
        if not isinstance(v, str) or v.strip().lower() not in LANGUAGES:
            problems.append(f"{name} {v!r} cannot be spoken (known: {', '.join(sorted(LANGUAGES))})")

    def speed() -> None:
        v = value.get("speed")
        # not finite (NaN) fails the range check too: NaN compares false with everything
        if isinstance(v, (int, float)) and not limits.min_speed <= v <= limits.max_speed:
            problems.append(f"speed {v} is outside {limits.min_speed}..{limits.max_speed}")

    def voice(name: str = "voice") -> None:
        v = value.get(name)
        if v is None or v == "" or (isinstance(v, str) and len(v) > limits.max_label_chars):
            return  # none named (the gate's or worker's default), or too long: `label` says so
        try:
            parse_voice(v, limits)
        except InvalidVoice as exc:
            problems.append(Violation(str(exc), InvalidVoice.reason))

    def agent() -> None:
        v = value.get("agent_id")
        if not isinstance(v, str) or len(v) > limits.max_agent_id_chars or not _AGENT_ID.fullmatch(v):
            problems.append(f"agent_id must match [A-Za-z0-9._-]{{1,{limits.max_agent_id_chars}}}")

    if "session_id" in value:
        ident("session_id")
    if message_type == "TextEvent":
        ident("turn_id")
        agent()
        non_negative("seq", 2**63 - 1)
        non_negative("produced_at_us", 2**63 - 1)
        ident("claim_id", optional=True)
        language(optional=True)
        label("voice")
        voice()
        floor = value.get("floor")
        if floor is not None and floor not in FLOOR_POLICIES:
            problems.append(f"floor {floor!r} is not one of {', '.join(FLOOR_POLICIES)} (or null)")
        priority = value.get("priority")
        if isinstance(priority, int) and not -limits.max_priority <= priority <= limits.max_priority:
            problems.append(f"priority {priority} is outside -{limits.max_priority}..{limits.max_priority}")
        speed()
        for problem in lexicon_problems(value.get("lexicon"), limits):
            problems.append(Violation(problem, InvalidLexicon.reason))
    elif message_type == "ControlEvent":
        ident("turn_id", optional=True)
        ident("after_turn_id", optional=True)
        non_negative("issued_at_us", 2**63 - 1)
        label("reason")
        label("source")
        turn_ids = value.get("turn_ids") or ()
        if len(turn_ids) > limits.max_turn_ids:
            problems.append(f"turn_ids lists {len(turn_ids)} turns, at most {limits.max_turn_ids}")
        elif not all(is_valid_id(t, limits) for t in turn_ids):
            problems.append(f"each of turn_ids must be 1-{limits.max_id_chars} characters without control characters")
    elif message_type == "SynthesisRequest":
        ident("turn_id")
        agent()
        non_negative("sentence_seq", limits.max_seq)
        language()
        label("voice")
        voice()
        speed()
    elif message_type == "AudioChunk":
        ident("turn_id")
        non_negative("sentence_seq", limits.max_seq)
        non_negative("chunk_seq", limits.max_seq)
        rate = value.get("sample_rate")
        if isinstance(rate, int) and rate not in limits.sample_rates:
            problems.append(f"sample_rate {rate} is not one of {sorted(limits.sample_rates)}")
        audio = value.get("pcm")
        if isinstance(audio, (bytes, bytearray)):
            if len(audio) > limits.max_chunk_audio_bytes:
                problems.append(f"audio is {len(audio)} bytes, limit {limits.max_chunk_audio_bytes}")
            encoding = value.get("encoding", AudioEncoding.PCM16LE)
            if encoding == AudioEncoding.PCM16LE and len(audio) % 2:
                problems.append(f"{len(audio)} bytes of PCM16LE is not whole samples")
            elif encoding == AudioEncoding.OPUS:
                if isinstance(rate, int) and rate not in OPUS_SAMPLE_RATES:
                    problems.append(f"sample_rate {rate} is not an Opus rate {sorted(OPUS_SAMPLE_RATES)}")
                try:
                    check_opus_packets(audio)
                except MalformedOpusPayload as exc:
                    problems.append(str(exc))
        label("worker_id")
        label("end_reason")
        for word in value.get("words") or ():
            start, end, text = word.get("start"), word.get("end"), word.get("text")
            if isinstance(text, str) and len(text) > limits.max_label_chars:
                problems.append(f"word text is longer than {limits.max_label_chars} characters")
            if isinstance(start, int) and isinstance(end, int) and not 0 <= start <= end:
                problems.append(f"word {text!r} spans samples {start}..{end}: start must be 0 <= start <= end")
    elif message_type == "PlaybackReport":
        ident("turn_id")
        ident("client_id")
        seq = value.get("sentence_seq")
        if isinstance(seq, int) and not -1 <= seq <= limits.max_seq:
            problems.append(f"sentence_seq {seq} is outside -1..{limits.max_seq}")
        label("detail")
    elif message_type == "TurnHeard":
        ident("turn_id")
        non_negative("sentence_seq", limits.max_seq)
        non_negative("rendered_samples", limits.max_seq)
        label("client_id")
        if len(value.get("heard_text") or "") > limits.max_text_bytes:
            problems.append(f"heard_text is longer than {limits.max_text_bytes} characters")
    elif message_type == "FloorEvent":
        ident("turn_id")
        agent()
        non_negative("waited_us", 2**63 - 1)
        label("reason")
        warnings = value.get("warnings") or []
        if len(warnings) > limits.max_voice_parts:
            problems.append(f"warnings has {len(warnings)} entries (at most {limits.max_voice_parts})")
        if any(len(w) > limits.max_label_chars for w in warnings):
            problems.append(f"a warning is longer than {limits.max_label_chars} characters")
    return problems

