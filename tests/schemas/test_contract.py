"""The contract beside the schemas: enums from the .avsc files, languages, limits, the checks."""

from __future__ import annotations

import pytest

from voicebus import schemas
from voicebus.codecs import Codec, InvalidMessage
from voicebus.gate.core import kokoro_language, GateInputError
from voicebus.schemas import contract


def test_enums_are_the_schema_symbols():
    for enum_type, message_type, field_name in [
        (contract.TextEventKind, "TextEvent", "kind"), (contract.ControlAction, "ControlEvent", "action"),
        (contract.AudioEncoding, "AudioChunk", "encoding"), (contract.PlaybackKind, "PlaybackReport", "kind"),
    ]:
        symbols = next(f["type"]["symbols"] for f in schemas.load(message_type)["fields"] if f["name"] == field_name)
        assert [m.value for m in enum_type] == symbols
    assert contract.ControlAction.CANCEL == "CANCEL" and f"{contract.ControlAction.CANCEL}" == "CANCEL"


def test_gate_and_worker_accept_exactly_the_contract_languages():
    for code, kokoro in contract.LANGUAGES.items():
        assert kokoro_language(code, "en") == kokoro == contract.kokoro_code(code, default=None)
    assert {"fr", "f", "it", "i", "hi", "h", "ja", "j", "zh", "z"} <= set(contract.LANGUAGES)
    for unspeakable in ("de", "ko", "k", "klingon"):  # no Kokoro-82M v1.0 voice speaks these
        with pytest.raises(GateInputError):
            kokoro_language(unspeakable, "en")
        with pytest.raises(contract.UnknownLanguage):
            contract.kokoro_code(unspeakable)


def _chunk(**changes):
    value = dict(session_id="s1", turn_id="t1", sentence_seq=0, chunk_seq=0, is_last_chunk=True,
                 is_last_in_turn=False, sample_rate=24000, encoding="PCM16LE", pcm=b"\x00\x00" * 10,
                 worker_id="w", first_token_at_us=0, text_complete_at_us=0, released_at_us=0,
                 request_received_at_us=0, synthesis_started_at_us=0, audio_ready_at_us=0, published_at_us=0)
    value.update(changes)
    return value


@pytest.mark.parametrize("changes, problem", [
    ({"sentence_seq": -1}, "sentence_seq -1"),
    ({"chunk_seq": -5}, "chunk_seq -5"),
    ({"sample_rate": 0}, "sample_rate 0"),
    ({"pcm": b"\x00" * 3}, "not whole samples"),
    ({"session_id": ""}, "session_id"),
    ({"turn_id": "x" * 129}, "turn_id"),
    ({"turn_id": "a\nb"}, "turn_id"),
])
def test_codec_refuses_both_ways_what_the_contract_forbids(changes, problem):
    codec = Codec()
    with pytest.raises(InvalidMessage, match=problem) as caught:
        codec.encode("AudioChunk", _chunk(**changes))
    assert caught.value.reason == "contract-violation"


def test_decode_refuses_a_negative_sequence_written_by_another_producer():
    import io

    from fastavro import parse_schema, schemaless_writer

    from voicebus.codecs import MAGIC

    codec = Codec()
    buf = io.BytesIO()
    buf.write(MAGIC + codec.fingerprint_of("AudioChunk"))
    schemaless_writer(buf, parse_schema(schemas.load("AudioChunk")), _chunk(sentence_seq=-3))
    with pytest.raises(InvalidMessage, match="sentence_seq -3"):
        codec.decode(buf.getvalue(), expect="AudioChunk")
    assert codec.decode(codec.encode("AudioChunk", _chunk()), expect="AudioChunk").value["sentence_seq"] == 0


def test_text_event_rules():
    codec = Codec()
    good = dict(session_id="s", turn_id="t", agent_id="agent-1", seq=0, kind="TOKEN", text="Hi.",
                claim_id=None, language="pt-br", voice=None, produced_at_us=1)
    codec.encode("TextEvent", good)
    for changes, problem in [({"language": "ko"}, "cannot be spoken"), ({"agent_id": "a/b"}, "agent_id"),
                             ({"seq": -1}, "seq -1")]:
        with pytest.raises(InvalidMessage, match=problem):
            codec.encode("TextEvent", {**good, **changes})


@pytest.mark.parametrize("turn_ids, problem", [
    ([f"t{i}" for i in range(65)], "turn_ids lists 65 turns, at most 64"),
    (["x" * 600_000], "each of turn_ids"),
    (["ok", ""], "each of turn_ids"),
])
def test_a_cancel_cannot_list_unbounded_turns(turn_ids, problem):
    """Two cancels with 600 KB of turn ids once made the gate's state record too big to write."""
    event = {"session_id": "s", "turn_id": None, "action": "CANCEL", "reason": "", "source": "agent",
             "issued_at_us": 1, "turn_ids": turn_ids}
    with pytest.raises(InvalidMessage, match=problem) as caught:
        Codec().encode("ControlEvent", event)
    assert caught.value.reason == "contract-violation"
    Codec().encode("ControlEvent", {**event, "turn_ids": [f"t{i}" for i in range(64)]})


# --- voices ----------------------------------------------------------------------------------------


def test_the_catalog_is_kokoros_54_voices_with_language_and_gender_from_the_name():
    voices = contract.KOKORO_VOICES
    assert len(voices) == 54
    assert voices["af_heart"] == contract.VoiceInfo("af_heart", "a", "American English", "female", True)
    assert voices["jm_kumo"] == contract.VoiceInfo("jm_kumo", "j", "Japanese", "male", True)
    assert all(v.spoken for v in voices.values())  # every language of Kokoro-82M v1.0
    assert {v.language for v in voices.values()} == set(contract.KOKORO_LANGUAGE_NAMES) == set("abefhijpz")
    assert set(contract.DEFAULT_VOICES.values()) <= set(voices)
    assert all(contract.VOICE_NAME.fullmatch(name) for name in voices)
    from voicebus.synthesis import weights  # the worker's catalog is the contract's, not a copy
    assert weights.KOKORO_VOICES is voices and weights.describe_voice is contract.describe_voice


@pytest.mark.parametrize("spec, parts, canonical", [
    ("af_heart", [("af_heart", 1.0)], "af_heart"),
    ("af_heart:0.7+af_bella:0.3", [("af_heart", 0.7), ("af_bella", 0.3)], "af_heart:0.7+af_bella:0.3"),
    (" af_bella : 3 +\taf_heart:7 ", [("af_heart", 0.7), ("af_bella", 0.3)], "af_heart:0.7+af_bella:0.3"),
    ("af_heart(7)+af_bella(3)", [("af_heart", 0.7), ("af_bella", 0.3)], "af_heart:0.7+af_bella:0.3"),
    ("af_sky+af_bella", [("af_bella", 0.5), ("af_sky", 0.5)], "af_bella:0.5+af_sky:0.5"),
    ("af_heart:2+af_sky", [("af_heart", 0.6667), ("af_sky", 0.3333)], "af_heart:0.6667+af_sky:0.3333"),
    ("c+b+a", [("a", 0.3334), ("b", 0.3333), ("c", 0.3333)], "a:0.3334+b:0.3333+c:0.3333"),
    ("af_heart:0.25", [("af_heart", 1.0)], "af_heart"),  # one voice: its weight says nothing
    ("my-pack.v2:1e-3+af_heart:.004", [("af_heart", 0.8), ("my-pack.v2", 0.2)], "af_heart:0.8+my-pack.v2:0.2"),
])
def test_a_voice_spec_is_normalized_to_one_canonical_mix(spec, parts, canonical):
    mix = contract.parse_voice(spec)
    assert mix.parts == tuple(parts) and mix.canonical == str(mix) == canonical
    assert contract.parse_voice(canonical) == mix


@pytest.mark.parametrize("spec, problem", [
    ("", "empty"), ("  ", "empty"),
    ("af_heart+", "no voice on one side"), ("+af_heart", "no voice on one side"),
    ("af_heart:0+af_bella", "positive finite"), ("af_heart:-1+af_bella", "positive number"),
    ("af_heart:nan", "positive number"), ("af_heart:inf", "positive number"), ("af_heart:1e999", "positive finite"),
    ("af_heart:", "positive number"), ("af_heart:x", "positive number"), ("af_heart:1:2", "positive number"),
    ("af_heart+af_heart:2", "af_heart appears twice"),
    ("a+b+c+d+e", "at most 4 voices, not 5"),
    ("af heart", "not a voice name"), (":0.5", "not a voice name"), ("../x", "not a voice name"),
    ("x" * 65, "not a voice name"), ("a:1+b:0.00001", "under 1/10000"),
])
def test_what_is_not_a_voice_spec_is_refused_with_the_reason(spec, problem):
    with pytest.raises(contract.InvalidVoice, match=problem) as caught:
        contract.parse_voice(spec)
    assert caught.value.reason == "invalid-voice" and isinstance(caught.value, ValueError)


def test_any_mix_reads_back_to_itself_whatever_its_order_and_spelling():
    from hypothesis import given, settings, strategies as st

    names = st.lists(st.sampled_from(sorted(contract.KOKORO_VOICES)), min_size=1, max_size=4, unique=True)

    @settings(max_examples=150, deadline=None)
    @given(names.flatmap(lambda ns: st.tuples(
        st.just(ns), st.lists(st.floats(0.1, 10), min_size=len(ns), max_size=len(ns)),
        st.lists(st.sampled_from(["{n}:{w!r}", "{n} : {w!r}", "{n}({w!r})", " {n}( {w!r} ) "]),
                 min_size=len(ns), max_size=len(ns)),
        st.permutations(range(len(ns))))))
    def check(case):
        ns, ws, forms, order = case
        spec = "+".join(forms[i].format(n=ns[i], w=ws[i]) for i in order)
        mix = contract.parse_voice(spec)
        total = sum(ws)
        assert sorted(mix.names) == sorted(ns)
        assert abs(sum(w for _, w in mix.parts) - 1) < 1e-9
        for name, weight in mix.parts:
            assert abs(weight - ws[ns.index(name)] / total) <= 1e-4 or len(ns) == 1
        assert contract.parse_voice(mix.canonical) == mix  # the canonical spelling is a fixed point
        same = "+".join(f"{ns[i]}:{ws[i]!r}" for i in range(len(ns)))
        assert contract.parse_voice(same).canonical == mix.canonical  # order and spelling do not matter

    check()


def test_the_wire_refuses_a_voice_that_is_no_spec_with_its_own_reason():
    codec = Codec()
    good = dict(session_id="s", turn_id="t", agent_id="agent-1", seq=0, kind="TOKEN", text="Hi.",
                claim_id=None, language="en", voice="af_heart:0.7+af_bella:0.3", produced_at_us=1)
    assert codec.decode(codec.encode("TextEvent", good)).value["voice"] == "af_heart:0.7+af_bella:0.3"
    for voice in (None, "", "nobody", "my_pack+af_heart"):  # none named, or voices a worker may have
        codec.encode("TextEvent", {**good, "voice": voice})
    request = dict(session_id="s", turn_id="t", agent_id="a", sentence_seq=0, text="Hi.", language="en",
                   voice="af_heart+af_bella", speed=1.0, is_last_in_turn=True, first_token_at_us=1,
                   text_complete_at_us=1, released_at_us=1)
    codec.encode("SynthesisRequest", request)
    for message_type, value in (("TextEvent", {**good, "voice": "af_heart:0.7+"}),
                                ("SynthesisRequest", {**request, "voice": "af_heart:-1"})):
        with pytest.raises(InvalidMessage, match="voice 'af_heart") as caught:
            codec.encode(message_type, value)
        assert caught.value.reason == "invalid-voice"
    # with another kind of problem too, the record is a plain contract violation
    with pytest.raises(InvalidMessage, match="seq -1.*voice") as caught:
        codec.encode("TextEvent", {**good, "voice": "a+a", "seq": -1})
    assert caught.value.reason == "contract-violation"


@pytest.mark.parametrize("voice,language,warned", [
    ("af_heart", "a", []), ("af_heart", "b", []), ("bf_emma", "a", []), ("ff_siwis", "f", []),
    ("jf_alpha", "a", [("voice-language-mismatch", "jf_alpha")]),
    ("af_heart:0.5+ef_dora:0.3+pf_dora:0.2", "e",
     [("voice-language-mismatch", "af_heart"), ("voice-language-mismatch", "pf_dora")]),
    ("my_pack_voice+af_heart", "a", [("voice-unknown", "my_pack_voice")]),  # a pack of one's own may have it
    ("x" * 64, "a", [("voice-unknown", "x" * 64)]),  # the longest name a spec allows
])
def test_a_voice_of_another_language_or_none_known_is_a_warning_per_voice(voice, language, warned):
    warnings = contract.voice_warnings(contract.parse_voice(voice), language)
    assert [(w.split(": ")[0], w.split(": ")[1].split(" ")[0]) for w in warnings] == warned
    assert all(len(w) < 200 for w in warnings)


def test_a_floor_event_carries_at_most_a_mix_of_warnings():
    codec = Codec()
    event = dict(session_id="s", turn_id="t", agent_id="a", event="GRANTED", waited_us=0, reason="", at_us=1,
                 warnings=["voice-language-mismatch: jf_alpha is a Japanese voice; the turn is American English"])
    assert codec.decode(codec.encode("FloorEvent", event)).value["warnings"] == event["warnings"]
    with pytest.raises(InvalidMessage, match="warnings has 5 entries"):
        codec.encode("FloorEvent", {**event, "warnings": ["w"] * 5})


def test_the_sdk_refuses_a_voice_that_is_no_spec_at_the_source():
    from voicebus.agents.sdk import InvalidEventError, text_event

    event = dict(session_id="s", turn_id="t", agent_id="a", seq=0, kind="TOKEN", text="Hi.")
    assert text_event(**event, voice="af_heart(2)+af_sky(1)").voice == "af_heart(2)+af_sky(1)"
    with pytest.raises(InvalidEventError, match="at most 4 voices"):
        text_event(**event, voice="a+b+c+d+e")


def test_reading_a_hostile_voice_spec_costs_no_time():
    """Every record is checked on decode: a 1000-character voice must not make a stage backtrack."""
    import time

    for spec in ("a(" + " " * 990 + "x", " " * 500 + "(" + " " * 490 + ")x", "a:" + "1." * 490, "+" * 999):
        started = time.perf_counter()
        with pytest.raises(contract.InvalidVoice):
            contract.parse_voice(spec)
        assert time.perf_counter() - started < 0.1, spec[:20]


# --- pronunciation ---------------------------------------------------------------------------------

_LEXICON_EVENT = dict(session_id="s", turn_id="t", agent_id="agent-1", seq=0, kind="TOKEN", text="Hi.",
                      claim_id=None, language="en", voice=None, produced_at_us=1)


def _entry(match="SQL", regex=False, phonemes=None, say=None):
    return {"match": match, "regex": regex, "phonemes": phonemes, "say": say}


def test_a_lexicon_within_the_rules_goes_on_the_wire_and_back():
    codec = Codec()
    lexicon = [_entry(say="sequel"), _entry("Kokoro", phonemes="kˈOkəɹO"),
               _entry(r"K8s?", regex=True, say="kubernetes"), _entry(r"v\d{1,3}(?:\.\d{1,3})*", regex=True, say="v"),
               *[_entry(f"w{i}", say="x") for i in range(28)]]
    assert len(lexicon) == contract.LIMITS.max_lexicon_entries
    event = {**_LEXICON_EVENT, "lexicon": lexicon}
    assert codec.decode(codec.encode("TextEvent", event)).value["lexicon"] == lexicon
    assert codec.decode(codec.encode("TextEvent", _LEXICON_EVENT)).value["lexicon"] is None


@pytest.mark.parametrize("lexicon, problem", [
    ([_entry(say="x")] * 33, "33 entries, at most 32"),
    ([_entry("", say="x")], "match must be 1-100"),
    ([_entry("x" * 101, say="x")], "match must be 1-100"),
    ([_entry(say="x" * 201)], "say must be at most 200"),
    ([_entry()], "exactly one of phonemes and say"),
    ([_entry(say="sequel", phonemes="sˈikwəl")], "exactly one of phonemes and say"),
    ([_entry(phonemes="kˈO" * 70)], "longer than 200"),
    ([_entry(phonemes="   ")], "non-empty"),
    ([_entry(phonemes="k#O")], "'#': not symbols of Kokoro-82M"),
    ([_entry(phonemes="kO)/")], "not symbols of Kokoro-82M"),  # would close the span early
    ([_entry("(unclosed", regex=True, say="x")], "not a regular expression"),
    ([_entry("(a+)+$", regex=True, say="x")], "a repeat inside a repeat"),
    ([_entry(r"(\w+\s?)*", regex=True, say="x")], "a repeat inside a repeat"),
    ([_entry("a?", regex=True, say="x")], "matches the empty text"),
    ([_entry("x" * 101, regex=True, say="x")], "match must be 1-100"),
])
def test_a_lexicon_that_breaks_a_rule_is_refused_with_its_own_reason(lexicon, problem):
    from voicebus.agents.sdk import InvalidEventError, text_event

    with pytest.raises(InvalidMessage, match=problem) as caught:
        Codec().encode("TextEvent", {**_LEXICON_EVENT, "lexicon": lexicon})
    assert caught.value.reason == "invalid-lexicon" == contract.InvalidLexicon.reason
    with pytest.raises(InvalidEventError, match=problem):  # the SDK refuses it at the source
        text_event(session_id="s", turn_id="t", agent_id="a", seq=0, kind="TOKEN", lexicon=lexicon)


def test_the_phoneme_symbols_are_kokoros_vocabulary():
    """Kokoro-82M's config.json (the offline pack's, where it was built) has these 114 symbols."""
    import json

    from voicebus.synthesis.engine import _TINY_SYMBOLS
    from voicebus.synthesis.weights import PACK_DIRNAME
    from voicebus.settings import Settings

    assert set(_TINY_SYMBOLS) <= set(contract.KOKORO_VOCAB_SYMBOLS)  # the tiny test model speaks a subset
    assert contract.PHONEME_SYMBOLS == set(contract.KOKORO_VOCAB_SYMBOLS) - {"(", ")"}
    config = Settings().weights_cache_dir / PACK_DIRNAME / "config.json"
    if config.is_file():
        assert set(json.loads(config.read_text())["vocab"]) == set(contract.KOKORO_VOCAB_SYMBOLS)


@pytest.mark.usefixtures("settled_heap")
def test_a_hostile_lexicon_costs_no_time():
    import time

    started = time.perf_counter()
    lexicon = [_entry("(" * 50 + ")" * 50, regex=True, say="x")] * 32
    assert contract.lexicon_problems(lexicon)
    assert time.perf_counter() - started < 0.5


def test_checking_an_opus_payload_finds_what_splitting_it_finds_for_any_bytes():
    from hypothesis import given, settings, strategies as st

    packets = st.lists(st.binary(min_size=1, max_size=contract.MAX_OPUS_PACKET_BYTES), max_size=6)
    payloads = st.one_of(
        packets.map(contract.pack_opus_packets),  # well framed
        packets.map(contract.pack_opus_packets).flatmap(  # framed, then cut or given stray bytes
            lambda p: st.tuples(st.just(p), st.integers(0, len(p)), st.binary(max_size=3)).map(
                lambda c: c[0][:c[1]] + c[2])),
        st.binary(max_size=64),  # anything
    )

    @settings(max_examples=300, deadline=None)
    @given(payloads)
    def check(payload):
        try:
            split = contract.split_opus_packets(payload)
        except contract.MalformedOpusPayload as exc:
            with pytest.raises(contract.MalformedOpusPayload) as checked:
                contract.check_opus_packets(payload)
            assert str(checked.value) == str(exc)  # the same reason, word for word
        else:
            assert contract.check_opus_packets(payload) == len(split)
            assert contract.pack_opus_packets(split) == payload

    check()
