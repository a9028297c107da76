"""Text to phonemes per language: one model-less `kokoro.KPipeline` per Kokoro language code,
built with nothing to download (`build_g2p`).

Which language a request speaks is the contract's (`voicebus.schemas.contract.kokoro_code`);
this module only builds the G2P for a Kokoro code.
"""

from __future__ import annotations

import logging
import re

REPO_ID = "hexgrad/Kokoro-82M"  # only used by kokoro for naming; nothing is downloaded

def build_g2p(lang_code: str):
    """A quiet `KPipeline` (G2P only) for one Kokoro language code, built with nothing to
    download: misaki's English G2P normally fetches the spaCy model ``en_core_web_sm`` at run
    time; here it gets the installed one (`voicebus.synthesis.weights.load_spacy_english`).
    Spanish, French, Hindi, Italian and Portuguese go through espeak-ng (the data bundled with
    ``espeakng-loader``), Japanese through misaki's cutlet G2P on the bundled UniDic-lite
    dictionary (`_offline_japanese_g2p`), Mandarin through misaki's jieba + pypinyin G2P."""
    from kokoro import KPipeline

    if lang_code in "ab":
        from misaki import en, espeak

        g2p = _offline_english_g2p(british=lang_code == "b", fallback=espeak.EspeakFallback(british=lang_code == "b"))
        assert isinstance(g2p, en.G2P)
    elif lang_code == "j":
        g2p = _offline_japanese_g2p()
    elif lang_code == "z":
        _quiet_jieba()
        return KPipeline(lang_code=lang_code, repo_id=REPO_ID, model=False)
    else:
        pipeline = KPipeline(lang_code=lang_code, repo_id=REPO_ID, model=False)
        if lang_code == "h":
            pipeline.g2p = _DandaAsStop(pipeline.g2p)
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
