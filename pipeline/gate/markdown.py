"""Markdown as LLMs write it, turned into speakable text.

Owns `speakable_text(raw)`: the text of one utterance (its block marker, such as ``## `` or ``- ``
or ``1. ``, already cut off by the segmenter) with inline markup removed: emphasis markers
(``**``, ``__``, ``*``, ``_``, ``~~``) around words, backticks of inline code (the code itself is
kept), link and image syntax (the label is kept, the address dropped; a link whose address is
``/phonemes/`` is an inline phoneme span, ``[Kokoro](/kˈOkəɹO/)``, and is kept whole for the
worker to speak), table pipes and HTML line breaks; whitespace collapsed. Text with no letter or digit left (a rule ``---``, a table separator,
a lone ``...``) is empty: nothing to say.
"""

from __future__ import annotations

import re

from voicebus.schemas.contract import PHONEME_SPAN

_IMAGE = re.compile(r"!\[([^\]\n]*)\]\([^)\n]*\)")
_LINK = re.compile(r"\[([^\]\n]+)\]\([^)\n]*\)")
_HTML_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
# Emphasis markers hug a word on one side and not on the other; "2 * 3" keeps its star and
# snake_case names keep their underscores.
_EMPHASIS_OPEN = re.compile(r"(?:(?<=[\s(\[\"'“‘«¿¡])|^)(?:\*{1,3}|_{1,3}|~~)(?=[^\s*_~])")
_EMPHASIS_CLOSE = re.compile(r"(?<=[^\s*_~])(?:\*{1,3}|_{1,3}|~~)(?=[\s.,;:!?)\]\"'”’»…]|$)")
_ATX_CLOSING = re.compile(r"\s+#+\s*$")


def _link(m: "re.Match[str]") -> str:
    """A link's label; an inline phoneme span whole."""
    return m.group(0) if PHONEME_SPAN.fullmatch(m.group(0)) else m.group(1)


def speakable_text(raw: str, *, heading: bool = False) -> str:
    """The words of `raw` as they should be spoken (see the module docstring); "" if none."""
    text = _IMAGE.sub(r"\1", raw)
    text = _LINK.sub(_link, text)
    text = _HTML_BREAK.sub(" ", text)
    text = text.replace("`", "").replace("|", " ")
    text = _EMPHASIS_OPEN.sub("", text)
    text = _EMPHASIS_CLOSE.sub("", text)
    if heading:
        text = _ATX_CLOSING.sub("", text)
    text = " ".join(text.split())
    if not any(ch.isalnum() for ch in text):
        return ""
    return text
