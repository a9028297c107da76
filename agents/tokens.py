"""Splitting text into LLM-like tokens: word pieces that carry their leading spaces.

Used by `voicebus say` and by the corpus builder (`voicebus.agents.corpus`) so text that did not come from
a model still streams the way a model streams it. Joining the pieces gives the text back exactly.
"""

from __future__ import annotations

import re

# A run of whitespace (newlines included) followed by a word, or by a punctuation run, or the
# trailing whitespace: every character of any string falls in exactly one match.
_PIECE = re.compile(r"\s*[\w']+|\s*[^\w\s]+|\s+\Z")


def split_like_llm(text: str, max_word_chars: int = 7) -> list[str]:
    """Word pieces of `text`: short words whole with their leading space, long words cut into
    chunks of at most `max_word_chars` letters (as BPE vocabularies split rare words)."""
    pieces: list[str] = []
    for match in _PIECE.finditer(text):
        piece = match.group(0)
        stripped = piece.lstrip()
        lead = piece[: len(piece) - len(stripped)]
        if len(stripped) <= max_word_chars or not stripped[0].isalnum():
            pieces.append(piece)
            continue
        chunks = [stripped[i : i + max_word_chars] for i in range(0, len(stripped), max_word_chars)]
        pieces.append(lead + chunks[0])
        pieces.extend(chunks[1:])
    return pieces
