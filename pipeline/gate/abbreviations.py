"""Word lists the streaming segmenter uses to tell an abbreviation's period from a sentence stop.

Owns, per language (English, Spanish, Portuguese, French, Italian, Hindi, Japanese, Mandarin), four
lowercase sets without the final period:

- ``titles``: words that always precede a name (Dr. Naser, Mt. Fuji, Srta. Ledesma): a period after
  one never ends a sentence unless a line break or the end of the turn follows.
- ``numeric``: words that usually precede a number (p. 55, No. 103, art. 4, Mar. 23): before a digit
  the period is not a stop; before a capital it is.
- ``general``: other abbreviations (etc., Co., a.m., aprox.): before a lowercase word or a digit the
  period is not a stop; before a capitalised word it is a stop only if that word is a common
  sentence starter (``starters``), as in "the U.S. How" against "the U.S. Government".
- ``starters``: words that commonly open a sentence in that language.

Dotted acronyms (U.S.A., e.g., p.m.) and initials (Jonas E. Smith) are recognised by shape in the
segmenter, so they need no entry here.

Besides the word lists, a language's rules name the marks of its script: sentence stops beyond
``. ! ? …`` (the Devanagari danda ``।``, the full-width ``。！？``), which of them end a sentence
whatever follows (``final_stops``: no space comes between Japanese or Chinese sentences), the
closing and opening quotes and brackets of its script (``「」『』【】``), the closing quotes its
typography writes after a space (French ``« Oui ! »``), and for Japanese the characters that carry
a quotation on after its closing bracket (``「行きます。」と言った``: the quotative particle).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LanguageRules:
    code: str
    titles: frozenset[str]
    numeric: frozenset[str]
    general: frozenset[str]
    starters: frozenset[str]
    code_placeholder: str
    """What a fenced code block becomes: a short spoken placeholder (code is never read out)."""
    doubled_letter_plurals: bool = False
    """Spanish writes plural abbreviations by doubling letters (EE. UU., FF. AA.)."""
    stops: str = ""
    """Sentence stops of the language's script, besides ``. ! ? …``."""
    final_stops: str = ""
    """Stops that end a sentence whatever follows them (after any closing quote or bracket), a
    glued character included: the next sentence may start right after the mark."""
    glued_exclamations: bool = False
    """``!`` and ``?`` after a character of the script end a sentence even when the next
    character is glued to them (``すごい!本当?``); after an ASCII character they keep the space
    rule (``Yahoo!ニュース``)."""
    closers: str = ""
    """Closing quotes and brackets of the script, besides ``CLOSERS``."""
    openers: str = ""
    """Opening quotes and brackets of the script, besides ``OPENERS``."""
    spaced_closers: str = ""
    """Closing quotes written after a space (``« Tu viens ? »``): they still close the stop's
    cluster, and a space after an opening quote is part of the opening."""
    quote_continuers: str = ""
    """Characters that, right after a stop's closing quote or bracket, carry the sentence on
    (Japanese ``」と言った``, ``」って``)."""
    title_brackets: str = ""
    """Pairs of brackets that enclose a title (Chinese 《摔跤吧！爸爸》): no stop inside an open
    one ends a sentence at once."""
    elision: bool = False
    """An elided article or preposition is glued to the word with an apostrophe (French l'art.,
    Italian l'Avv.): the word after the apostrophe is the one looked up."""


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_COMMON_TITLES = "dr dra mt st prof"
_COMMON_NUMERIC = (
    "no nos nº n° nro núm num nr p pp pg pág págs art arts párr párrf cap caps vol vols fig figs "
    "ch chap sec secs eq tel ext op ed ca approx aprox"
)
_EN_MONTHS_DAYS = "jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun"
_ES_MONTHS_DAYS = "ene feb mar abr may jun jul ago sep sept set oct nov dic lun mié jue vie sáb dom"
_PT_MONTHS_DAYS = "jan fev mar abr mai jun jul ago set out nov dez seg ter qua qui sex sáb dom"
_FR_MONTHS_DAYS = "janv févr fév avr juil juill sept oct nov déc lun mar mer jeu ven sam dim"
_IT_MONTHS_DAYS = "gen feb mar apr mag giu lug ago set sett ott nov dic lun mer gio ven sab dom"
# Latin-script abbreviations that English, and text quoted from it, brings into any language.
_LATIN_GENERAL = "etc vs e.g i.e a.m p.m"

ENGLISH = LanguageRules(
    code="en",
    titles=_words(
        _COMMON_TITLES
        + " mr mrs ms messrs mmes rev hon sen rep gov gen col capt lt sgt maj cmdr adm fr pres supt"
    ),
    numeric=_words(_COMMON_NUMERIC + " " + _EN_MONTHS_DAYS),
    general=_words(
        "etc vs co corp inc ltd llc plc jr sr bros dept est misc min max hr hrs mins secs ave blvd rd "
        "ln univ assn al cf viz ibid ph.d e.g i.e a.m p.m u.s u.k u.n mph ft lb lbs oz pt qt yd yds "
        "gal mm cm km kg mg ml approx govt intl natl"
    ),
    starters=_words(
        "a an the this that these those there here it its i i'm he she we you they me my our your his "
        "her their what when where why who whom whose how which but and or so if then also however "
        "in on at for as after before while during since because although though yes no not please "
        "let let's now today tomorrow yesterday one some many all each every both thanks thank "
        "meanwhile still next first finally instead otherwise maybe perhaps do does did is are was "
        "were will would can could should may might must have has had"
    ),
    code_placeholder="Code block omitted.",
)

SPANISH = LanguageRules(
    code="es",
    titles=_words(
        _COMMON_TITLES + " sr sra srta sres sras lic licda ing arq profa mtro mtra dña sto sta fray"
    ),
    numeric=_words(_COMMON_NUMERIC + " " + _ES_MONTHS_DAYS),
    general=_words(
        "etc admón aprox avda av dpto depto ej p.ej ud uds vd vds hs hrs min máx mín cía sta sto "
        "cra dcha izq izda cód ref col pza sig ss atte att pje apdo ee uu e.g i.e a.m p.m a.c d.c"
    ),
    starters=_words(
        "el la lo los las un una unos unas este esta esto estos estas ese esa eso esos esas aquel "
        "yo tú él ella nosotros nosotras ellos ellas usted ustedes mi mis tu tus su sus nuestro "
        "pero y o entonces si cuando donde dónde cómo como qué que quién cuál por para en con hoy "
        "mañana ayer también además sin no sí hay es son fue era luego después antes así aquí allí "
        "gracias"
    ),
    code_placeholder="Bloque de código omitido.",
    doubled_letter_plurals=True,
)

PORTUGUESE = LanguageRules(
    code="pt",
    titles=_words(_COMMON_TITLES + " sr sra srta sres dra profa eng exmo exma sto sta d"),
    numeric=_words(_COMMON_NUMERIC + " " + _PT_MONTHS_DAYS),
    general=_words(
        "etc aprox av ex p.ex pág cia ltda vs obs ref tel hs min máx mín dept depto e.g i.e a.m p.m "
        "a.c d.c"
    ),
    starters=_words(
        "o a os as um uma uns umas este esta isto estes estas esse essa isso aquele aquela eu tu "
        "ele ela nós eles elas você vocês meu minha seu sua nosso mas e ou então se quando onde como "
        "que quem qual por para em no na nos nas com hoje amanhã ontem também além sem não sim há "
        "é são foi era depois antes assim aqui ali obrigado obrigada"
    ),
    code_placeholder="Bloco de código omitido.",
)

FRENCH = LanguageRules(
    code="fr",
    titles=_words(_COMMON_TITLES + " m mm mme mmes mlle mlles mgr pr ste sr vve"),
    numeric=_words(_COMMON_NUMERIC + " " + _FR_MONTHS_DAYS + " env chap t tt al réf"),
    general=_words(
        _LATIN_GENERAL + " cf ex p.ex c.-à-d c.à.d av apr j.-c n.b p.-s bd boul fg pl coll dir éd éds "
        "trad cie sté ets min max qqn qqch resp hab ibid id op cit suiv sq sqq adj tél"
    ),
    starters=_words(
        "le la les l un une des du de d ce cet cette ces c ça cela ceci il elle ils elles on je tu "
        "nous vous mais et ou donc car ni si s quand où comment pourquoi qui que qu quoi quel quelle "
        "quels quelles puis ensuite alors enfin aujourd'hui demain hier oui non merci voici voilà "
        "bonjour pour par dans en au aux avec sans après avant depuis pendant cependant pourtant "
        "toutefois ainsi mon ma mes ton ta tes son sa ses notre nos votre vos leur leurs tout tous "
        "toute toutes chaque plusieurs certains y est sont était"
    ),
    code_placeholder="Bloc de code omis.",
    elision=True,
    spaced_closers="»›",
    closers="›",
    openers="‹",
)

ITALIAN = LanguageRules(
    code="it",
    titles=_words(
        _COMMON_TITLES + " sig sigg dott avv ing arch geom rag dir on "
        "sen mons gen col cav comm egr gent spett"
    ),
    # sec. is secolo (XV sec.), which is followed by a capital as often as not
    numeric=_words(_COMMON_NUMERIC + " " + _IT_MONTHS_DAYS + " n nn pag pagg artt capp voll tab") - {"sec", "secs"},
    general=_words(
        _LATIN_GENERAL + " ecc es p.es cfr vd v fr ss sgg segg a.c d.c s.p.a s.r.l spa srl c.a c.so "
        "p.za v.le ca sec min max tel ibid id op cit"
    ),
    starters=_words(
        "il lo la i gli le l un uno una questo questa questi queste quello quella quelli quelle io tu "
        "lui lei noi voi loro egli ella esso essa ma e ed o oppure però quindi dunque allora poi se "
        "quando dove come perché chi che cosa quale quali oggi domani ieri anche inoltre non sì no ci "
        "c è sono era fu grazie ecco in nel nella per con da dal dalla su sul dopo prima mentre anzi "
        "infatti tuttavia invece mio mia tuo tua suo sua nostro vostro ogni tutti tutto alcuni molti"
    ),
    code_placeholder="Blocco di codice omesso.",
    elision=True,
    spaced_closers="»›",
    closers="›",
    openers="‹",
)

HINDI = LanguageRules(
    code="hi",
    titles=_words(_COMMON_TITLES + " mr mrs ms डॉ श्री श्रीमती सुश्री प्रो कु स्व"),
    numeric=_words(_COMMON_NUMERIC + " पृ पृष्ठ क्र सं अनु नं"),
    general=_words(_LATIN_GENERAL + " ई ई.पू कि.मी कि.ग्रा से.मी मि.ली रु लि प्रा उ.प्र म.प्र"),
    starters=_words(
        "यह वह ये वे मैं हम आप तुम उसने उन्होंने मैंने हमने आपने इस उस इन उन इसके उसके इसलिए लेकिन "
        "परंतु किंतु और या तो फिर अब आज कल क्या क्यों कैसे कहाँ कब कौन जब अगर यदि हाँ नहीं धन्यवाद "
        "मेरा मेरी हमारा हमारी आपका आपकी वहाँ यहाँ एक"
    ),
    code_placeholder="कोड ब्लॉक छोड़ दिया गया।",
    stops="।॥",
    final_stops="।॥",
)

# Japanese and Chinese put no space between sentences: a full-width stop ends one at once.
_CJK_CLOSERS = "」』”’）】〕〉》］｝"
_CJK_OPENERS = "「『“‘（【〔〈《［｛"


def _unspaced(code: str, code_placeholder: str, quote_continuers: str) -> LanguageRules:
    """Rules of a language written without spaces between words or sentences (Japanese,
    Chinese): full-width stops, CJK brackets and quotes, the Latin abbreviations of Latin words
    in its text."""
    return LanguageRules(
        code=code,
        titles=_words(_COMMON_TITLES + " mr mrs ms"),
        numeric=_words(_COMMON_NUMERIC),
        general=_words(_LATIN_GENERAL + " inc co ltd corp jr sr"),
        starters=frozenset(),
        code_placeholder=code_placeholder,
        stops="。！？",
        final_stops="。！？",
        glued_exclamations=True,
        closers=_CJK_CLOSERS,
        openers=_CJK_OPENERS,
        quote_continuers=quote_continuers,
        title_brackets="《》〈〉",
    )


JAPANESE = _unspaced("ja", "コードブロックは省略します。", quote_continuers="とっ、，")
CHINESE = _unspaced("zh", "代码块已省略。", quote_continuers="，、")

_BY_CODE = {
    "en": ENGLISH,
    "a": ENGLISH,  # Kokoro: American English
    "b": ENGLISH,  # Kokoro: British English
    "es": SPANISH,
    "e": SPANISH,  # Kokoro: Spanish
    "pt": PORTUGUESE,
    "p": PORTUGUESE,  # Kokoro: Brazilian Portuguese
    "fr": FRENCH,
    "f": FRENCH,  # Kokoro: French
    "it": ITALIAN,
    "i": ITALIAN,  # Kokoro: Italian
    "hi": HINDI,
    "h": HINDI,  # Kokoro: Hindi
    "ja": JAPANESE,
    "j": JAPANESE,  # Kokoro: Japanese
    "zh": CHINESE,
    "z": CHINESE,  # Kokoro: Mandarin Chinese
}


class UnsupportedLanguage(ValueError):
    """The segmenter has no rules for this language code."""


def rules_for(language: str) -> LanguageRules:
    """Rules for a language code: en/es/pt/fr/it/hi/ja/zh, a region form (en-US, pt-BR, zh-CN) or
    Kokoro's a/b/e/p/f/i/h/j/z."""
    code = (language or "").strip().lower().replace("_", "-")
    rules = _BY_CODE.get(code) or _BY_CODE.get(code.split("-")[0])
    if rules is None:
        raise UnsupportedLanguage(
            f"no segmentation rules for language {language!r}; use one of en, es, pt, fr, it, hi, ja, zh "
            "(or a, b, e, p, f, i, h, j, z)"
        )
    return rules
