"""Text to phonemes per language: one model-less `kokoro.KPipeline` per Kokoro language code,
built with nothing to download (`build_g2p`).

Which language a request speaks is the contract's (`voicebus.schemas.contract.kokoro_code`);
this module only builds the G2P for a Kokoro code.
"""

from __future__ import annotations

import logging
import re

from voicebus.synthesis.spoken import SpokenText

REPO_ID = "hexgrad/Kokoro-82M"  # only used by kokoro for naming; nothing is downloaded

def build_g2p(lang_code: str):
    """A quiet `KPipeline` (G2P only) for one Kokoro language code, built with nothing to
    download: misaki's English G2P normally fetches the spaCy model ``en_core_web_sm`` at run
    time; here it gets the installed one (`voicebus.synthesis.weights.load_spacy_english`).
    Spanish, French, Hindi, Italian and Portuguese go through espeak-ng (the data bundled with
    ``espeakng-loader``), Japanese through misaki's cutlet G2P on the bundled UniDic-lite
    dictionary (`_offline_japanese_g2p`), Mandarin through misaki's jieba + pypinyin G2P with
    the tone changes of speech (`MandarinG2P`). Every language but English (misaki reads
    numbers and abbreviations itself) reads the text as `voicebus.synthesis.spoken` writes it
    out."""
    from kokoro import KPipeline

    if lang_code in "ab":
        from misaki import en, espeak

        g2p = _offline_english_g2p(british=lang_code == "b", fallback=espeak.EspeakFallback(british=lang_code == "b"))
        assert isinstance(g2p, en.G2P)
    elif lang_code == "j":
        g2p = SpokenText(_offline_japanese_g2p(), lang_code)
    elif lang_code == "z":
        g2p = SpokenText(MandarinG2P(), lang_code)
    else:
        pipeline = KPipeline(lang_code=lang_code, repo_id=REPO_ID, model=False)
        if lang_code == "h":
            pipeline.g2p = _DandaAsStop(pipeline.g2p)
        pipeline.g2p = SpokenText(pipeline.g2p, lang_code)
        return pipeline
    # KPipeline's constructor would build misaki's G2P itself (English: downloading spaCy;
    # Japanese: importing pyopenjtalk, which the cutlet G2P never calls); these are all the
    # attributes it sets for a model-less pipeline.
    pipeline = KPipeline.__new__(KPipeline)
    pipeline.repo_id = REPO_ID
    pipeline.lang_code = lang_code
    pipeline.model = None
    pipeline.voices = {}
    pipeline.g2p = g2p
    return pipeline


class _DandaAsStop:
    """espeak-ng's Hindi G2P with the danda (``।``, ``॥``) read as a full stop: espeak drops
    it, and with it the sentence's final fall and the pause before the next one."""

    def __init__(self, g2p):
        self.g2p = g2p

    def __call__(self, text: str):
        return self.g2p(re.sub(r"\s*[।॥]+", ".", text))


def _offline_japanese_g2p():
    """misaki's Japanese G2P as kokoro builds it (``JAG2P()``: the cutlet romanizer to IPA) on
    fugashi with the UniDic-lite dictionary bundled in its wheel. misaki's ``ja`` extra names
    ``unidic``, whose dictionary is downloaded at run time, and ``pyopenjtalk`` (built from
    source, its dictionary downloaded at first use), which ``misaki.ja`` imports but the cutlet
    G2P never calls: both are left out."""
    from misaki.cutlet import HEPBURN, Cutlet

    cutlet = Cutlet.__new__(Cutlet)  # the attributes Cutlet.__init__ sets, its tagger offline
    cutlet.tagger = unidic_lite_tagger()
    cutlet.table = dict(HEPBURN)
    cutlet.exceptions = {}
    return cutlet


def unidic_lite_tagger():
    """A fugashi (MeCab) tagger on the UniDic-lite dictionary bundled in its wheel: fugashi's
    default tagger takes ``unidic`` first where it is installed, downloaded or not."""
    import os

    import unidic_lite
    from fugashi import Tagger

    return Tagger(f'-d "{unidic_lite.DICDIR}" -r "{os.path.join(unidic_lite.DICDIR, "mecabrc")}"')


class MandarinG2P:
    """misaki's Mandarin G2P as Kokoro-82M v1.0 takes it (``ZHG2P()``: numbers to characters,
    jieba's words, pypinyin's syllables, each to IPA with its tone mark, words apart by spaces),
    with the tone changes every speaker makes and a dictionary's readings leave out: 一 and 不
    rise before a fourth tone (一定 yí dìng, 不是 bú shì), 一 falls before the others (一天
    yì tiān), a third tone before a third rises (往左拐 wǎng zuó guǎi), reduplications and
    particles go neutral (妹妹 mèimei). The rules are misaki's own (`misaki.tone_sandhi`, from
    PaddleSpeech), which its Kokoro 1.1 front end applies and its v1.0 path does not; without
    them the model says 一所 as yī suǒ, and Whisper base hears 衣索.

    The words and syllables are misaki's (jieba's words, apart by spaces: the model was trained
    on them); the rules read a part of speech and whole words, so the tones they change are
    found on jieba's tagged words, merged as the rules expect (一 and 不 with the word after
    them, runs of third tones), and only those tones are put on misaki's syllables."""

    def __init__(self):
        from misaki.tone_sandhi import ToneSandhi

        _quiet_jieba()
        self.sandhi = ToneSandhi()

    def __call__(self, text: str) -> tuple[str, None]:
        import cn2an
        from misaki.zh import ZHG2P

        if not text.strip():
            return "", None
        text = ZHG2P.map_punctuation(cn2an.transform(text, "an2cn"))
        # Han runs are spoken word by word; the rest (punctuation, Latin) is kept as it is
        spoken = (" ".join(self.word_phonemes(run)) if _HAN.match(run) else run for run in _HAN_OR_NOT.findall(text))
        return "".join(spoken).replace(chr(815), ""), None  # misaki drops the IPA's "non-syllabic" mark too

    def word_phonemes(self, han: str):
        """The IPA of each word of a run of Han characters, its tones as spoken."""
        import jieba
        from misaki.zh import ZHG2P
        from pypinyin import Style, lazy_pinyin

        tones = self.spoken_tones(han)
        at = 0
        for word in jieba.lcut(han, cut_all=False):
            syllables = lazy_pinyin(word, style=Style.TONE3, neutral_tone_with_five=True)
            if len(syllables) == len(word):  # one syllable per character
                syllables = [s[:-1] + tones[at + i] if at + i in tones and s[-1:].isdigit() else s
                             for i, s in enumerate(syllables)]
            at += len(word)
            yield "".join(ZHG2P.py2ipa(s) for s in syllables)

    def spoken_tones(self, han: str) -> dict[int, str]:
        """{character index: tone digit, 5 neutral} of the characters of ``han`` (Han only) whose
        tone the rules change."""
        import jieba.posseg
        from pypinyin import Style, lazy_pinyin

        words = self.sandhi.pre_merge_for_modify([(w.word, w.flag) for w in jieba.posseg.lcut(han)])
        if "".join(word for word, _ in words) != han:
            return {}  # the merges only join neighbours; should one not, no tone is placed wrong
        changed, at = {}, 0
        for word, part in words:
            written = lazy_pinyin(word, style=Style.FINALS_TONE3, neutral_tone_with_five=True)
            if len(written) == len(word):
                spoken = self.sandhi.modified_tone(word, part, list(written))
                changed.update({at + i: s[-1] for i, (w, s) in enumerate(zip(written, spoken))
                                if w[-1:] != s[-1:] and s[-1:].isdigit()})
            at += len(word)
        return changed


_HAN = re.compile("[\u4e00-\u9fff]")
_HAN_OR_NOT = re.compile("[\u4e00-\u9fff]+|[^\u4e00-\u9fff]+")


def _quiet_jieba() -> None:
    """jieba logs its dictionary load (from its own wheel, cached in the temp dir) at INFO."""
    import jieba

    jieba.setLogLevel(logging.WARNING)


def _offline_english_g2p(british: bool, fallback):
    from misaki import en

    from voicebus.synthesis.weights import load_spacy_english

    g2p = en.G2P.__new__(en.G2P)
    # the attributes misaki's G2P.__init__ sets, with the packaged spaCy model
    g2p.version = None
    g2p.british = british
    g2p.nlp = load_spacy_english(enable=["tok2vec", "tagger"])
    g2p.lexicon = en.Lexicon(british)
    g2p.fallback = fallback
    g2p.unk = ""
    return g2p
