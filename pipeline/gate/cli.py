"""Command line of the sentence gate: `voicebus segment` (the streaming segmenter on stdin).

`register(subparsers)` is a plain function that adds this domain's subcommands.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Iterator, TextIO

LANGUAGES = ("en", "es", "pt", "fr", "it", "hi", "ja", "zh")
_WORD_TOKEN = re.compile(r"\s*\S+|\s+")


def word_tokens(text: str) -> list[str]:
    """Split text the way LLM tokens arrive: word-sized pieces, each with its leading spaces.
    Joined, the pieces give back `text` exactly."""
    return _WORD_TOKEN.findall(text)


def _pieces(stream: TextIO, chunk: int | None) -> Iterator[str]:
    """Read `stream` as it arrives: `chunk` characters at a time, or word-sized tokens per line."""
    if chunk:
        while piece := stream.read(chunk):
            yield piece
        return
    for line in stream:
        yield from word_tokens(line)


def _sentence_json(sentence) -> str:
    return json.dumps(
        {
            "text": sentence.text,
            "kind": sentence.kind,
            "start": sentence.start,
            "end": sentence.end,
            "lag": sentence.lag,
        },
        ensure_ascii=False,
    )


def run_segment(args: argparse.Namespace, settings) -> int:
    from voicebus.gate.segmenter import StreamingSegmenter

    if args.chunk is not None and args.chunk < 1:
        print("voicebus segment: --chunk must be at least 1", file=sys.stderr)
        return 2
    min_words = settings.first_clause_min_words if args.first_clause_min_words is None else args.first_clause_min_words
    segmenter = StreamingSegmenter(args.language, first_clause_min_words=min_words)
    stdin = sys.stdin
    if hasattr(stdin, "reconfigure"):
        stdin.reconfigure(encoding="utf-8")
    out = sys.stdout
    for piece in _pieces(stdin, args.chunk):
        for sentence in segmenter.feed(piece):
            print(_sentence_json(sentence), file=out, flush=True)
    for sentence in segmenter.flush():
        print(_sentence_json(sentence), file=out, flush=True)
    return 0


def register(subparsers) -> None:
    seg = subparsers.add_parser(
        "segment",
        help="split UTF-8 text on stdin into speakable sentences, streamed (one JSON per line)",
        description="Feed stdin to the streaming segmenter and print each released sentence as "
        'one JSON object per line: {"text", "kind", "start", "end", "lag"}.',
    )
    seg.add_argument("--language", "--lang", dest="language", choices=LANGUAGES, default="en",
                     help="language of the text (default en)")
    seg.add_argument(
        "--chunk",
        type=int,
        default=None,
        metavar="N",
        help="feed N characters at a time (default: word-sized tokens with their spaces)",
    )
    seg.add_argument(
        "--first-clause-min-words",
        type=int,
        default=None,
        metavar="N",
        help="release a long first sentence early at a clause mark once it has N words "
        "(default: the setting first_clause_min_words; 0 disables)",
    )
    seg.set_defaults(func=run_segment)

    # `voicebus gate`: one gate worker (aiokafka) until stopped; see pipeline/gate/app.py.
    from voicebus.gate.app import add_worker_arguments, gate_command

    gate = subparsers.add_parser(
        "gate", help="run a gate worker: agents' text topics in, synthesis requests out",
    )
    add_worker_arguments(gate)
    gate.set_defaults(func=gate_command)
