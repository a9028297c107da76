"""Word lists the streaming segmenter uses to tell an abbreviation's period from a sentence stop.

Owns, per language (English, Spanish, Portuguese), four lowercase sets without the final period:

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

_BY_CODE = {
    "en": ENGLISH,
    "a": ENGLISH,  # Kokoro: American English
    "b": ENGLISH,  # Kokoro: British English
    "es": SPANISH,
    "e": SPANISH,  # Kokoro: Spanish
    "pt": PORTUGUESE,
    "p": PORTUGUESE,  # Kokoro: Brazilian Portuguese
}


class UnsupportedLanguage(ValueError):
    """The segmenter has no rules for this language code."""


def rules_for(language: str) -> LanguageRules:
    """Rules for a language code: en/es/pt, a region form (en-US, pt-BR) or Kokoro's a/b/e/p."""
    code = (language or "").strip().lower().replace("_", "-")
    rules = _BY_CODE.get(code) or _BY_CODE.get(code.split("-")[0])
    if rules is None:
        raise UnsupportedLanguage(
            f"no segmentation rules for language {language!r}; use one of en, es, pt (or a, b, e, p)"
        )
    return rules
