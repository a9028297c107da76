"""`voicebus.synthesis.spoken`: numbers, prices, times, ordinals and abbreviations written out, and
what is left alone."""

from __future__ import annotations

import pytest

from voicebus.synthesis.spoken import SpokenText


@pytest.mark.parametrize("code, written, said", [
    ("e", "Vale 1.250,75 euros.", "Vale 1250 coma 75 euros."),
    ("e", "En 1.234.567 casos.", "En 1234567 casos."),
    ("e", "Versión 2.5.", "Versión 2 punto 5."),
    ("f", "1\u202f234,5 m et 10.000 €.", "1234 virgule 5 m et 10000 euros."),
    ("p", "Custa R$ 1.234,56.", "Custa 1234 vírgula 56 reais."),
    ("h", "1,00,000 और 1,000 और 2.5", "100000 और 1000 और 2 दशमलव 5"),
    ("j", "1,000人で2.5キロ", "1000人で2 点 5キロ"),
    ("z", "12,345,678元", "12345678元"),
    ("e", "el sr. López y la Sra. Díaz, Ud. también", "el señor López y la señora Díaz, usted también"),
    ("e", "Compré pan, leche, etc. y me fui.", "Compré pan, leche, etcétera y me fui."),
    ("i", "la Sig.ra Verdi, il dott. Neri, pag. 4, n. 5", "la signora Verdi, il dottor Neri, pagina 4, numero 5"),
    ("f", "M. Dupont, Mme Martin, p. 4", "monsieur Dupont, Mme Martin, page 4"),
    ("e", "A las 10:30, a las 9:05 y a las 10:00.", "A las 10 y 30, a las 9 y 5 y a las 10."),
    ("f", "À 10:30 et 1:05.", "À 10 heures 30 et une heure 5."),
    ("h", "10:30 बजे और 9:00 बजे।", "10 बजकर 30 मिनट और 9 बजे।"),
    ("j", "10:30に", "10時30分に"),
    ("z", "9:05见", "9点5分见"),
    ("e", "Cuesta $5, 1 € o US$ 1.250,50.", "Cuesta 5 dólares, 1 euro o 1250 coma 50 dólares."),
    ("p", "Custa R$ 10 ou R$1.", "Custa 10 reais ou 1 real."),
    ("f", "Il coûte 5 € ou 5 $.", "Il coûte 5 euros ou 5 dollars."),
    ("h", "यह ₹500 का है।", "यह 500 रुपये का है।"),
    ("e", "El 1.º de mayo, la 2.ª vez, el 3º piso.", "El 1º de mayo, la 2ª vez, el 3º piso."),
    ("f", "Le 1er mai, la 2e fois, au 21e siècle.", "Le 1er mai, la 2ème fois, au 21ème siècle."),
])
def test_numbers_and_abbreviations_are_written_out(code, written, said):
    assert SpokenText(None, code).spoken(written) == said


@pytest.mark.parametrize("code, text", [
    ("e", "El 12.05.2026 y 1,2,3."),  # a date, a list: no number with separators
    ("p", "Ligue 555.123.4567 ou instale a 2.14.1."),  # a phone number, a version
    ("z", "重2.5公斤。"),  # cn2an reads Mandarin's decimals itself
    ("e", "Tiene 12345 casos, 3 de ellos."),
    ("e", "Compré pan, etc. Luego me fui."),  # before a capital etc.'s period may end the sentence
    ("e", "Llegó el Sr."),  # a title at the end: its period ends the text
    ("f", "Un mur de 5 m. de large."),  # metres, not monsieur: a one-letter title takes a capital
    ("e", "Vea la pág. siguiente."),  # a page abbreviation before a word, not a number
    ("e", "En 16:9, a las 10:30:15, 2:1."),  # a ratio, a time with seconds, a score: no time of day
    ("e", "El $HOME y A$5."),  # a variable, another dollar: no price to say
    ("j", "5円です。"),  # Japanese and Mandarin write the currency as a word
])
def test_what_is_no_number_or_abbreviation_of_a_word_is_left_as_written(code, text):
    assert SpokenText(None, code).spoken(text) == text


def test_the_g2p_reads_what_is_written_out():
    heard = []
    g2p = SpokenText(lambda text, *args: heard.append((text, args)) or ("ok", None), "e")
    assert g2p("Son 1.000.", "more") == ("ok", None)
    assert heard == [("Son 1000.", ("more",))]
