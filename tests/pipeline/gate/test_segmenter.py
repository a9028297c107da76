"""The streaming segmenter: rule families per language, streaming invariants, state round trips."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from voicebus.gate.abbreviations import UnsupportedLanguage
from voicebus.gate.cli import word_tokens
from voicebus.gate.segmenter import Sentence, StreamingSegmenter


def feed_all(text: str, pieces: list[str] | None = None, lang: str = "en", **kw) -> list[Sentence]:
    seg = StreamingSegmenter(lang, **kw)
    out: list[Sentence] = []
    for piece in pieces if pieces is not None else word_tokens(text):
        out += seg.feed(piece)
    return out + seg.flush()


def raw_spans(text: str, lang: str = "en", **kw) -> list[str]:
    """Sentences as raw slices of the input, fed one character at a time."""
    return [text[s.start : s.end] for s in feed_all(text, list(text), lang, **kw)]


def texts(text: str, lang: str = "en", **kw) -> list[str]:
    return [s.text for s in feed_all(text, lang=lang, **kw)]


# ---------------------------------------------------------------------------- stops and quotes
@pytest.mark.parametrize(
    "text, expected",
    [
        ("It rained. We stayed in.", ["It rained.", "We stayed in."]),
        ("Is it? No way! Fine.", ["Is it?", "No way!", "Fine."]),
        ("Wait?! Really!! OK.", ["Wait?!", "Really!!", "OK."]),
        ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
        ('He said "stop." and left.', ['He said "stop." and left.']),
        ("(It was late.) We slept.", ["(It was late.)", "We slept."]),
        ("The end is near… Or is it?", ["The end is near…", "Or is it?"]),
        ("Well... I guess so. Bye.", ["Well... I guess so.", "Bye."]),
        ("So... what now?", ["So... what now?"]),
        ("Quoted [...] text here. Next one.", ["Quoted [...] text here.", "Next one."]),
        ("Wow! 🎉 Party time.", ["Wow!", "🎉 Party time."]),
    ],
)
def test_stops_quotes_and_ellipses_en(text, expected):
    assert raw_spans(text) == expected


# ---------------------------------------------------------------------------- abbreviations
@pytest.mark.parametrize(
    "text, expected",
    [
        ("Dr. Ruiz met Mrs. Lee at noon. They talked.", ["Dr. Ruiz met Mrs. Lee at noon.", "They talked."]),
        ("Use a tool, e.g. a hammer. It works.", ["Use a tool, e.g. a hammer.", "It works."]),
        ("Fruit, i.e. apples, etc. are fine. Eat them.", ["Fruit, i.e. apples, etc. are fine.", "Eat them."]),
        ("Born in the U.S. How odd.", ["Born in the U.S.", "How odd."]),
        ("The U.S. Navy sailed.", ["The U.S. Navy sailed."]),
        ("Call at 9 a.m. We open then.", ["Call at 9 a.m.", "We open then."]),
        ("J. R. R. Tolkien wrote it. Read it.", ["J. R. R. Tolkien wrote it.", "Read it."]),
        ("Read p. 12 and fig. 3 first.", ["Read p. 12 and fig. 3 first."]),
        ("It was me. No. Not really.", ["It was me.", "No.", "Not really."]),
        ("See Acme Inc. for details.", ["See Acme Inc. for details."]),
        ("You and I. Then Henry I. Smith came.", ["You and I.", "Then Henry I. Smith came."]),
    ],
)
def test_abbreviations_titles_initials_en(text, expected):
    assert raw_spans(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("La Sra. Gómez llegó. El Lic. Pérez no.", ["La Sra. Gómez llegó.", "El Lic. Pérez no."]),
        ("Son aprox. 20 km. Vamos.", ["Son aprox. 20 km.", "Vamos."]),
        ("Ver pág. 4 del cap. 2. Gracias.", ["Ver pág. 4 del cap. 2.", "Gracias."]),
        ("Viajó a EE. UU. el lunes.", ["Viajó a EE. UU. el lunes."]),
        ("¿Vienes? ¡Claro que sí! Bien.", ["¿Vienes?", "¡Claro que sí!", "Bien."]),
        ("Dijo «ya voy.», y se fue.", ["Dijo «ya voy.», y se fue."]),
    ],
)
def test_spanish(text, expected):
    assert raw_spans(text, "es") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("A Dra. Silva chegou. O Sr. Costa também.", ["A Dra. Silva chegou.", "O Sr. Costa também."]),
        ("Frutas, p. ex. maçãs, são boas. Coma.", ["Frutas, p. ex. maçãs, são boas.", "Coma."]),
        ("Custa R$ 1.234,56. É caro.", ["Custa R$ 1.234,56.", "É caro."]),
    ],
)
def test_portuguese(text, expected):
    assert raw_spans(text, "pt") == expected


def test_kokoro_language_codes_and_unknown_language():
    assert raw_spans("Sr. Gómez vino. Bien.", "e") == ["Sr. Gómez vino.", "Bien."]
    assert raw_spans("A Sra. Ana veio. Bom.", "p") == ["A Sra. Ana veio.", "Bom."]
    with pytest.raises(UnsupportedLanguage):
        StreamingSegmenter("xx")


# ---------------------------------------------------------------------------- numbers and tokens
@pytest.mark.parametrize(
    "text, expected",
    [
        ("Pi is 3.14159. Nice.", ["Pi is 3.14159.", "Nice."]),
        ("It costs $1,234.56 or 1.234,56 €. Pay now.", ["It costs $1,234.56 or 1.234,56 €.", "Pay now."]),
        ("Upgrade to 2.14.1 today. Done.", ["Upgrade to 2.14.1 today.", "Done."]),
        ("Meet at 10:30. Be on time.", ["Meet at 10:30.", "Be on time."]),
        ("Call 555.123.4567 now. Thanks.", ["Call 555.123.4567 now.", "Thanks."]),
        ("Growth was 12.5%. Good.", ["Growth was 12.5%.", "Good."]),
        ("It was 1999. 2000 came next.", ["It was 1999.", "2000 came next."]),
        ("See https://ex.com/a.b?x=1!y. Then go.", ["See https://ex.com/a.b?x=1!y.", "Then go."]),
        ("Mail ann.lee@mail.co.uk. She replies.", ["Mail ann.lee@mail.co.uk.", "She replies."]),
        ("Edit setup.py. Then rerun.", ["Edit setup.py.", "Then rerun."]),
        ("Call `os.path.join(a, b)` here. Done.", ["Call `os.path.join(a, b)` here.", "Done."]),
        ("Run `x = 1. Y = 2.` now. Ok.", ["Run `x = 1. Y = 2.` now.", "Ok."]),
    ],
)
def test_numbers_urls_code(text, expected):
    assert raw_spans(text) == expected


# ---------------------------------------------------------------------------- markdown
def test_markdown_headings_lists_emphasis_and_code():
    text = (
        "## Getting *started*\n"
        "First, **install** it. Then _run_ it.\n"
        "- Open the `my_file.txt` file\n"
        "* Read [the docs](https://x.io/a.b) now\n"
        "1. Step one.\n"
        "2. Step two\n"
        "\n"
        "```bash\n"
        "echo hi. Bye.\n"
        "```\n"
        "> Quoted words.\n"
        "---\n"
        "The end."
    )
    got = [(s.kind, s.text) for s in feed_all(text)]
    assert got == [
        ("heading", "Getting started"),
        ("sentence", "First, install it."),
        ("sentence", "Then run it."),
        ("list_item", "Open the my_file.txt file"),
        ("list_item", "Read the docs now"),
        ("list_item", "Step one."),
        ("list_item", "Step two"),
        ("code", "Code block omitted."),
        ("sentence", "Quoted words."),
        ("sentence", "The end."),
    ]


def test_soft_wrapped_line_continues_the_sentence():
    assert texts("This line wraps\nhere and ends. Next.") == ["This line wraps here and ends.", "Next."]


def test_run_in_enumerations_split_before_the_next_marker():
    assert raw_spans("1) Eggs 2) Milk 3) Bread") == ["1) Eggs", "2) Milk", "3) Bread"]
    assert raw_spans("a. red b. green") == ["a. red", "b. green"]
    assert raw_spans("• one • two") == ["• one", "• two"]
    # Only the next marker of the same list splits: "1) ... 3)" does not.
    assert raw_spans("1) Eggs and 3) more") == ["1) Eggs and 3) more"]


def test_unclosed_code_fence_is_released_at_flush_as_one_placeholder():
    got = feed_all("Look:\n```\nx = 1. Y.\n")
    assert [(s.kind, s.text) for s in got] == [("sentence", "Look:"), ("code", "Code block omitted.")]


def test_markup_only_utterances_are_not_emitted():
    assert feed_all("---\n***\n| --- | --- |\n") == []


# ---------------------------------------------------------------------------- release timing
def test_release_waits_only_for_the_next_non_space_character():
    seg = StreamingSegmenter("en")
    assert seg.feed("It rained.") == []
    assert seg.feed("   ") == []
    (s,) = seg.feed("W")
    assert (s.text, s.end, s.complete_at, s.lag) == ("It rained.", 10, 14, 4)


def test_abbreviation_before_a_capital_waits_for_the_whole_word():
    seg = StreamingSegmenter("en")
    assert seg.feed("I live in the U.S. Ho") == []
    (s,) = seg.feed("w about you?")
    assert s.text == "I live in the U.S."
    seg = StreamingSegmenter("en")
    assert seg.feed("I work for the U.S. Government") == []
    assert seg.flush()[0].text == "I work for the U.S. Government"


def test_first_clause_is_released_early_only_for_the_first_sentence():
    text = "When the model finished loading after a long wait, the server started. Later, all was well, truly."
    got = feed_all(text, first_clause_min_words=5)
    assert [(s.kind, s.text) for s in got] == [
        ("clause", "When the model finished loading after a long wait,"),
        ("sentence", "the server started."),
        ("sentence", "Later, all was well, truly."),
    ]
    # Short first clauses are not cut off; numbers with a comma are not clause marks.
    assert [s.kind for s in feed_all("Yes, 1,234 apples were eaten today.", first_clause_min_words=3)] == ["sentence"]


# ---------------------------------------------------------------------------- state
def test_state_round_trip_mid_sentence_through_json():
    text = "Dr. Smith went to Washington. He met the U.S. President. They talked, at length."
    seg = StreamingSegmenter("en", first_clause_min_words=3)
    out: list[Sentence] = []
    for piece in [text[i : i + 7] for i in range(0, len(text), 7)]:
        out += seg.feed(piece)
        seg = StreamingSegmenter.from_state(json.loads(json.dumps(seg.to_state())))
    out += seg.flush()
    key = lambda ss: [(s.text, s.start, s.end, s.kind) for s in ss]  # noqa: E731
    assert key(out) == key(feed_all(text, [text], first_clause_min_words=3))
    assert [s.text for s in out] == [
        "Dr. Smith went to Washington.",
        "He met the U.S. President.",
        "They talked, at length.",
    ]
    assert seg.fed == len(text)


# ---------------------------------------------------------------------------- properties
_ALPHABET = st.sampled_from(
    list("abcXYZ ..,!?1234\n\"')(#-*`")
    + ["Dr.", "U.S.", "e.g.", "Sr.", "...", " I ", "3.5", "\n\n", "- ", "1. ", "```", "¿", "¡", "«", "»"]
)
_TEXT = st.lists(_ALPHABET, max_size=40).map("".join)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces, prev = [], 0
    for p in points + [len(text)]:
        pieces.append(text[prev:p])
        prev = p
    return pieces


@settings(max_examples=300, deadline=None)
@given(_TEXT, st.lists(st.integers(min_value=0, max_value=10_000), max_size=12), st.sampled_from(["en", "es"]),
       st.sampled_from([0, 2]))
def test_any_split_gives_the_same_sentences(text, cuts, lang, min_words):
    whole = feed_all(text, [text], lang, first_clause_min_words=min_words)
    split = feed_all(text, _split(text, cuts), lang, first_clause_min_words=min_words)
    by_char = feed_all(text, list(text), lang, first_clause_min_words=min_words)
    key = lambda ss: [(s.text, s.start, s.end, s.kind) for s in ss]  # noqa: E731
    assert key(split) == key(whole) == key(by_char)
    for s in split:
        assert s.end <= s.complete_at <= len(text)


_PROSE = st.lists(
    st.sampled_from(["Hello", "world", "Dr.", "e.g.", "U.S.", "3.14", "it", "I", "Yes", "no", "¿Qué", "!", "?", ".",
                     "...", ",", "\"", "(", ")", "12:30", "a.m.", "x@y.com", "\n"]),
    max_size=30,
).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(_PROSE, st.lists(st.integers(min_value=0, max_value=10_000), max_size=8), st.sampled_from([0, 3]))
def test_no_speakable_character_is_lost_or_repeated(text, cuts, min_words):
    """Plain prose (no markup): the released raw spans follow each other without overlap, only
    punctuation-only scraps (nothing to say) fall between them, and each speakable text is its
    span with whitespace normalised; so every letter and digit is said exactly once."""
    got = feed_all(text, _split(text, cuts), "en", first_clause_min_words=min_words)
    speakable = lambda chunk: [ch for ch in chunk if ch.isalnum()]  # noqa: E731
    position = 0
    for s in got:
        assert s.start >= position
        assert speakable(text[position : s.start]) == []
        assert s.text == " ".join(text[s.start : s.end].split())
        position = s.end
    assert speakable(text[position:]) == []
    assert speakable("".join(s.text for s in got)) == speakable(text)


# ---------------------------------------------------------------------------- CLI
def test_cli_segment_prints_one_json_object_per_sentence():
    text = "# Title\n¿Cómo está, Sra. López? Bien. Hay 1.234,5 kg.\n"
    for extra in ([], ["--chunk", "3"]):
        proc = subprocess.run(
            [sys.executable, "-m", "voicebus", "segment", "--language", "es", *extra],
            input=text.encode(),
            capture_output=True,
            timeout=60,
            check=True,
        )
        lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert [o["text"] for o in lines] == ["Title", "¿Cómo está, Sra. López?", "Bien.", "Hay 1.234,5 kg."]
        assert lines[0]["kind"] == "heading" and all({"start", "end", "lag"} <= o.keys() for o in lines)


def test_an_inline_phoneme_span_is_kept_and_never_ends_an_utterance():
    from voicebus.gate.markdown import speakable_text

    assert speakable_text("Read **[Kokoro](/kˈOkəɹO/)** and [the docs](https://x.io/a.b) or [x](/a/b/).") == (
        "Read [Kokoro](/kˈOkəɹO/) and the docs or x.")
    text = "Try [e.g. this](/ˈi ʤˈi. ðɪs!/) now. [A](/ˈA/)? Yes. [Unclosed and. More [X](/y Z./). Ok."
    want = ["Try [e.g. this](/ˈi ʤˈi. ðɪs!/) now.", "[A](/ˈA/)?", "Yes.", "[Unclosed and.", "More [X](/y Z./).", "Ok."]
    for size in (1, 2, 7):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert [s.text for s in feed_all(text, pieces)] == want, size


@pytest.mark.parametrize("limit", [40, 47, 53, 61])
def test_the_buffer_bound_never_cuts_inside_a_phoneme_span(limit):
    text = "word " * 8 + "[New York City](/nˈu jˈɔɹk sˈɪti/) and more words here and [a b](/x y/) more words"
    for size in (1, 3):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got = [s.text for s in feed_all(text, pieces, max_buffer_chars=limit)]
        assert all(t.count("[") == t.count("](/") == t.count("/)") for t in got), got
        assert " ".join(got) == text.strip()


# ---------------------------------------------------------------------------- fr, it, hi, ja, zh
def _streamed_cases() -> list:
    """The streamed cases of `voicebus bench segment` (pipeline/ops/bench/data/streamed-cases.json):
    per language, text, its sentences and the pieces a multilingual tokenizer cuts it into."""
    from voicebus.ops.bench.segment import STREAMED_CASES

    sets = json.loads(STREAMED_CASES.read_text(encoding="utf-8"))
    return [pytest.param(lang, case, id=f"{lang}-{i}")
            for lang, named in sets.items() for cases in named.values() for i, case in enumerate(cases)]


STREAMED = _streamed_cases()


def test_every_new_language_has_a_streamed_set_of_at_least_20_cases():
    per_language = {}
    for param in STREAMED:
        lang, case = param.values
        per_language[lang] = per_language.get(lang, 0) + 1
        assert "".join(case["tokens"]) == case["text"]
    assert set(per_language) == {"fr", "it", "hi", "ja", "zh"} and min(per_language.values()) >= 20


@pytest.mark.parametrize("lang, case", STREAMED)
def test_streamed_cases_by_character_and_by_tokenizer_piece(lang, case):
    text = case["text"]
    for pieces in (list(text), case["tokens"]):
        got = [text[s.start : s.end].strip() for s in feed_all(text, pieces, lang)]
        assert got == case["sentences"], pieces[:3]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("« Tu viens ? » demanda-t-elle. Oui.", ["« Tu viens ? » demanda-t-elle.", "Oui."]),
        ("Il a dit\u00a0: «\u00a0Non\u00a0!\u00a0» Puis rien.", ["Il a dit\u00a0: «\u00a0Non\u00a0!\u00a0»", "Puis rien."]),
        ("Il a vu M. Durand et Mme. Roy. Ils vont bien.", ["Il a vu M. Durand et Mme. Roy.", "Ils vont bien."]),
        ("Né en 63 av. J.-C. Il régna longtemps.", ["Né en 63 av. J.-C.", "Il régna longtemps."]),
        ("Voir l'art. 5 et le chap. 2. Fin.", ["Voir l'art. 5 et le chap. 2.", "Fin."]),
        ("Il pèse 1.250,5 kg. Lourd.", ["Il pèse 1.250,5 kg.", "Lourd."]),
    ],
)
def test_french(text, expected):
    assert raw_spans(text, "fr") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Il Sig. Bruni e la Dott.ssa Galli. Poi noi.", ["Il Sig. Bruni e la Dott.ssa Galli.", "Poi noi."]),
        ("Frutta, ad es. mele, ecc. Il resto no.", ["Frutta, ad es. mele, ecc.", "Il resto no."]),
        ("Nel XV sec. Firenze fiorì. Bene.", ["Nel XV sec. Firenze fiorì.", "Bene."]),
        ("«Vieni?» chiese. «Sì.» Andò.", ["«Vieni?» chiese.", "«Sì.»", "Andò."]),
    ],
)
def test_italian(text, expected):
    assert raw_spans(text, "it") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("मैं घर जा रहा हूँ। तुम कहाँ हो? वाह!", ["मैं घर जा रहा हूँ।", "तुम कहाँ हो?", "वाह!"]),
        ("डॉ. शर्मा आए।फिर गए॥ बस।", ["डॉ. शर्मा आए।", "फिर गए॥", "बस।"]),
        ("दूरी 25 कि.मी. है। ठीक है।", ["दूरी 25 कि.मी. है।", "ठीक है।"]),
    ],
)
def test_hindi(text, expected):
    assert raw_spans(text, "hi") == expected


@pytest.mark.parametrize(
    "lang, text, expected",
    [
        ("ja", "晴れです。雨です！本当？！はい。", ["晴れです。", "雨です！", "本当？！", "はい。"]),
        ("ja", "「行く。」と言った。「うん。」『そう！』", ["「行く。」と言った。", "「うん。」", "『そう！』"]),
        ("ja", "すごい!本当?Yahoo!ニュースだ。3.14です。", ["すごい!", "本当?", "Yahoo!ニュースだ。", "3.14です。"]),
        ("zh", "他说：“我来。”然后走了。（注：旧。）好吧？！", ["他说：“我来。”", "然后走了。", "（注：旧。）", "好吧？！"]),
        ("zh", "我想……算了。版本2.4.1已发布!快更新?", ["我想……算了。", "版本2.4.1已发布!", "快更新?"]),
        ("zh", "去看《摔跤吧！爸爸》好吗？好！", ["去看《摔跤吧！爸爸》好吗？", "好！"]),  # a title's stop
    ],
)
def test_japanese_and_chinese_need_no_space_after_a_stop(lang, text, expected):
    assert raw_spans(text, lang) == expected


def test_a_cjk_or_danda_stop_is_released_at_the_next_character():
    for lang, first, rest in [("ja", "晴れです。", "雨"), ("zh", "好。", "走"), ("hi", "हूँ।", "तु")]:
        seg = StreamingSegmenter(lang)
        assert seg.feed(first) == []  # a closing quote or bracket could still follow
        (s,) = seg.feed(rest)
        assert (s.text, s.lag) == (first, len(rest))
    seg = StreamingSegmenter("ja")
    assert seg.feed("「行く。") == [] and seg.feed("」") == []
    assert seg.feed("と言った。") == []  # the quotative particle carries the sentence on
    assert [s.text for s in seg.flush()] == ["「行く。」と言った。"]


def test_new_languages_by_iso_and_kokoro_code_and_word_lists():
    for iso, kokoro in [("fr", "f"), ("it", "i"), ("hi", "h"), ("ja", "j"), ("zh", "z"), ("fr-FR", "f"), ("zh_CN", "z")]:
        assert StreamingSegmenter(iso)._rules is StreamingSegmenter(kokoro)._rules
    assert [s.text for s in feed_all("```\nx\n```", lang="ja")] == ["コードブロックは省略します。"]
    # a Devanagari vowel sign belongs to its word: किताब is one word, not three
    got = feed_all("मैंने कल बाज़ार से किताब खरीदी, और फिर घर आया।", lang="hi", first_clause_min_words=7)
    assert [s.kind for s in got] == ["sentence"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["。", "！", "？", "」", "「", "と", "日本", "中文", "。」", "《", "》", "!", "?", "3.14", "Inc.", " ",
                                 "।", "डॉ.", "हूँ", "«", "»", " ?", " » ", "\u00a0", "M.", "Mme", "l'art.", "Oui", "\n"]),
                max_size=30).map("".join),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=10), st.sampled_from(["fr", "it", "hi", "ja", "zh"]))
def test_any_split_gives_the_same_sentences_in_the_new_languages(text, cuts, lang):
    whole = feed_all(text, [text], lang)
    key = lambda ss: [(s.text, s.start, s.end, s.kind) for s in ss]  # noqa: E731
    assert key(feed_all(text, _split(text, cuts), lang)) == key(whole) == key(feed_all(text, list(text), lang))
