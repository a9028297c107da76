"""What a sentence says, written out before a G2P reads it: numbers with separators, prices,
times of day, ordinals and abbreviations, per Kokoro language code (`SpokenText`).

espeak-ng (through phonemizer), cutlet and jieba read the marks in written numbers and
abbreviations as punctuation: phonemizer hands espeak the text between punctuation marks, so
"Son 1.000 personas" was said uno, a full stop, cero cero cero, and "El Sr. López" señor, a
full stop (the model's sentence end: a fall and a pause), López; in Portuguese "Sr." was spelled
out, S R. English is not written out here: misaki reads numbers and abbreviations itself.

Which periods end a sentence is the gate's to say (`voicebus.gate.abbreviations`); this module
says how a few abbreviations are read, and keeps a period wherever it may end one.
"""

from __future__ import annotations

import re

# Kokoro code -> (decimal separator, how it is said, the other mark between digits and how it is
# said where it does not group thousands, the characters that group thousands)
NUMBER_FORMATS = {
    "e": (",", "coma", ".", "punto", "."),
    "f": (",", "virgule", ".", "point", ".\u00a0\u202f"),
    "i": (",", "virgola", ".", "punto", "."),
    "p": (",", "vírgula", ".", "ponto", "."),
    "h": (".", "दशमलव", None, None, ","),
    "j": (".", "点", None, None, ","),
    "z": (None, None, None, None, ","),  # cn2an, in misaki's G2P, reads 2.5 itself
}

# Kokoro code -> {currency symbol: (its name for one, for more)}; Japanese and Mandarin write the
# currency after the number as a word (円, 元) already
CURRENCIES = {
    "e": {"$": ("dólar", "dólares"), "US$": ("dólar", "dólares"), "€": ("euro", "euros"),
          "£": ("libra", "libras"), "R$": ("real", "reales"), "₹": ("rupia", "rupias")},
    "f": {"$": ("dollar", "dollars"), "US$": ("dollar", "dollars"), "€": ("euro", "euros"),
          "£": ("livre", "livres"), "R$": ("réal", "réais"), "₹": ("roupie", "roupies")},
    "i": {"$": ("dollaro", "dollari"), "US$": ("dollaro", "dollari"), "€": ("euro", "euro"),
          "£": ("sterlina", "sterline"), "R$": ("real", "real"), "₹": ("rupia", "rupie")},
    "p": {"$": ("dólar", "dólares"), "US$": ("dólar", "dólares"), "€": ("euro", "euros"),
          "£": ("libra", "libras"), "R$": ("real", "reais"), "₹": ("rupia", "rupias")},
    "h": {"$": ("डॉलर", "डॉलर"), "US$": ("डॉलर", "डॉलर"), "€": ("यूरो", "यूरो"), "£": ("पाउंड", "पाउंड"),
          "₹": ("रुपया", "रुपये")},
}
_SYMBOL = r"US\$|R\$|\$|€|£|₹"
_AMOUNT = r"\d(?:[\d.,\u00a0\u202f]*\d)?"
# a symbol before its amount ($5, R$ 10,50) or after it (5 €, 5 $)
_PRICE = re.compile(rf"(?<![\w$])({_SYMBOL})\s?({_AMOUNT})|(?<![\d.,])({_AMOUNT})\s?({_SYMBOL})(?!\w)")

# Kokoro code -> how a time of day (hours, minutes) is said; the minutes are left out at :00
TIMES = {
    "e": lambda h, m: f"{h} y {m}" if m else f"{h}",
    "f": lambda h, m: ("une heure" if h == 1 else f"{h} heures") + (f" {m}" if m else ""),
    "i": lambda h, m: f"{h} e {m}" if m else f"{h}",
    "p": lambda h, m: f"{h} e {m}" if m else f"{h}",
    "h": lambda h, m: f"{h} बजकर {m} मिनट" if m else f"{h} बजे",
    "j": lambda h, m: f"{h}時{m}分" if m else f"{h}時",
    "z": lambda h, m: f"{h}点{m}分" if m else f"{h}点",
}
# a time of day: 9:05, 10:30, 23:59 (not 10:30:15, 2:1 or 1:30:00); in Hindi with the बजे after
# it, which the spoken form says itself
_TIME = re.compile(r"(?<![\d:.,])([01]?\d|2[0-3]):([0-5]\d)(?![\d:])(\s*बजे)?")

# Kokoro code -> (an ordinal as written, as espeak-ng reads it): 1.º and 2.ª with a period (the
# spelling the RAE recommends) were uno, a full stop, o (Portuguese: "ordinal masculino");
# espeak reads 1º and 2ª. French 2e was deux, e; espeak reads 2ème.
_DOTTED_ORDINAL = (re.compile(r"(?<=\d)\.(?=[ºª])"), "")  # 1.º -> 1º
ORDINALS = {
    "e": _DOTTED_ORDINAL,
    "p": _DOTTED_ORDINAL,
    "i": _DOTTED_ORDINAL,
    "f": (re.compile(r"(?<![\d.,])([2-9]|[1-9]\d+)e\b"), r"\1ème"),
}

# Kokoro code -> {abbreviation as written, lower case, without its final period: what is said}.
# Titles are written out before any word; abbreviations of a word that counts (page, number,
# article) only before a digit; etc. and the like only before a lower-case word or a digit
# (before a capital their period may end the sentence).
TITLES = {
    "e": {"sr": "señor", "sra": "señora", "srta": "señorita", "sres": "señores", "sras": "señoras",
          "dr": "doctor", "dra": "doctora", "prof": "profesor", "profa": "profesora", "ing": "ingeniero",
          "lic": "licenciado", "licda": "licenciada", "ud": "usted", "uds": "ustedes", "av": "avenida"},
    "f": {"m": "monsieur", "mm": "messieurs", "mme": "madame", "mmes": "mesdames", "mlle": "mademoiselle",
          "dr": "docteur", "pr": "professeur", "me": "maître", "av": "avenue"},
    "i": {"sig": "signor", "sig.ra": "signora", "sig.na": "signorina", "sigg": "signori", "dott": "dottor",
          "dott.ssa": "dottoressa", "prof": "professor", "prof.ssa": "professoressa", "ing": "ingegner",
          "avv": "avvocato", "geom": "geometra"},
    "p": {"sr": "senhor", "sra": "senhora", "srta": "senhorita", "srs": "senhores", "sras": "senhoras",
          "dr": "doutor", "dra": "doutora", "prof": "professor", "profa": "professora", "eng": "engenheiro",
          "av": "avenida"},
    "h": {"डॉ": "डॉक्टर", "प्रो": "प्रोफ़ेसर"},
}
NUMERIC = {
    "e": {"pág": "página", "págs": "páginas", "núm": "número", "art": "artículo", "tel": "teléfono", "cap": "capítulo"},
    "f": {"p": "page", "tél": "téléphone", "art": "article", "chap": "chapitre"},
    "i": {"pag": "pagina", "pagg": "pagine", "art": "articolo", "tel": "telefono", "cap": "capitolo", "n": "numero"},
    "p": {"pág": "página", "págs": "páginas", "núm": "número", "art": "artigo", "tel": "telefone", "cap": "capítulo"},
}
GENERAL = {
    "e": {"etc": "etcétera", "aprox": "aproximadamente"},
    "f": {"etc": "et cetera", "env": "environ"},
    "i": {"ecc": "eccetera", "ca": "circa"},
    "p": {"etc": "etcétera", "aprox": "aproximadamente"},
}


def _abbreviations(table: dict[str, str], following: str) -> re.Pattern | None:
    """One pattern for ``table``'s abbreviations, each a whole word with its period (in any
    case), followed by what ``following`` allows (a lookahead)."""
    if not table:
        return None

    def alternatives(names) -> str:
        return "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True)) or "(?!)"

    # a name with a period inside (Dott.ssa, Sig.ra) is written without one at its end
    dotted = alternatives(name for name in table if "." in name)
    plain = alternatives(name for name in table if "." not in name)
    return re.compile(rf"(?<![\w.])(?:((?i:{dotted}))\.?|((?i:{plain}))\.)(?={following})")


class SpokenText:
    """A G2P for one Kokoro language code that reads ``text`` as `spoken` writes it out.

    - **Numbers.** Thousands separators in groups of three (Hindi's lakh grouping too) are
      dropped, and a decimal separator between two runs of digits is said as the language says
      it (`NUMBER_FORMATS`); in Spanish, French, Italian and Portuguese a point between two runs
      of digits that does not group thousands is read as a point (2.5 in Mexican Spanish: dos
      punto cinco). A chain of marks between digits that is not a number (a date, 12.05.2026; a
      list, 1,2,3; a version, 2.14.1) is left as it was.
    - **Prices.** A currency symbol is said by its name, after the amount as speech has it:
      $5 is cinco dólares (was dólar cinco), 5 € cinco euros (was euro), R$ 10 dez reais (was
      erre dólar dez), ₹500 पाँच सौ रुपये (the rupee was dropped) (`CURRENCIES`).
    - **Times of day.** 10:30 is said as the language says a time (diez y treinta, dix heures
      trente, 10時30分, `TIMES`), not two numbers with the colon's pause between them.
    - **Ordinals.** 1.º, 2.ª (es, it, pt) and 2e (fr) in the forms espeak-ng reads as ordinals
      (`ORDINALS`).
    - **Abbreviations.** A title before a word (Sr., Mme, Dott.ssa, डॉ.), a page or number
      before a digit (pág. 4), etc. before a lower-case word or a digit, is written out
      (`TITLES`, `NUMERIC`, `GENERAL`); elsewhere its period may end the sentence and is kept.
    """

    def __init__(self, g2p, lang_code: str):
        self.g2p = g2p
        decimal, said, other, other_said, grouping = NUMBER_FORMATS[lang_code]
        groups = "[" + re.escape(grouping) + "]"
        lakh = r"\d{1,2}(?:,\d{2})+,\d{3}|" if lang_code == "h" else ""
        self.thousands = re.compile(rf"(?<![\d.,])(?:{lakh}\d{{1,3}}(?:{groups}\d{{3}})+)(?!\d|{groups}\d)")
        self.grouping = re.compile(groups)
        self.separators = [(re.compile(rf"(?<![\d.,])(\d+){re.escape(mark)}(\d+)(?!\d|[.,]\d)"), rf"\1 {word} \2")
                           for mark, word in ((decimal, said), (other, other_said)) if mark]
        self.time = TIMES[lang_code]
        self.currencies = CURRENCIES.get(lang_code, {})
        self.ordinals = ORDINALS.get(lang_code)
        self.words = {name: word for table in (TITLES, NUMERIC, GENERAL) for name, word in table.get(lang_code, {}).items()}
        # (pattern, a one-letter name only with a capital): "5 m. de large" is metres, not monsieur
        self.abbreviations = [(pattern, capital) for pattern, capital in (
            (_abbreviations(TITLES.get(lang_code, {}), r"\s+\S"), True),
            (_abbreviations(NUMERIC.get(lang_code, {}), r"\s*\d"), False),
            (_abbreviations(GENERAL.get(lang_code, {}), r"\s+[a-zà-ÿ\d]|\s*[,;:]"), False),
        ) if pattern is not None]

    def spoken(self, text: str) -> str:
        """``text`` with its prices, times, ordinals, numbers and abbreviations as the G2P is to
        read them."""
        if self.currencies:
            text = _PRICE.sub(self._price, text)
        text = _TIME.sub(lambda m: self.time(int(m[1]), int(m[2])), text)
        if self.ordinals:
            text = self.ordinals[0].sub(self.ordinals[1], text)
        text = self.thousands.sub(lambda m: self.grouping.sub("", m[0]), text)
        for mark, word in self.separators:
            text = mark.sub(word, text)
        for pattern, capital in self.abbreviations:
            text = pattern.sub(lambda m: self._word(m[1] or m[2], m[0], capital), text)
        return text

    def _price(self, m: re.Match) -> str:
        symbol, amount = (m[1], m[2]) if m[1] else (m[4], m[3])
        if symbol not in self.currencies:
            return m[0]
        one, more = self.currencies[symbol]
        return f"{amount} {one if amount == '1' else more}"

    def _word(self, name: str, written: str, capital: bool) -> str:
        return written if capital and len(name) == 1 and name.islower() else self.words[name.lower()]

    def __call__(self, text: str, *args, **kwargs):
        return self.g2p(self.spoken(text), *args, **kwargs)
