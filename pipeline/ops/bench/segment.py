"""`voicebus bench segment`: accuracy, release lag and cost of the streaming segmenter.

Scores sentence-boundary cases (``--cases``, repeatable; by default the two files shipped in the
package, see the README beside them: pySBD's golden rules for en, es, fr, it, hi, ja and zh,
``voicebus/ops/bench/data/pysbd-golden-rules.json``, and voicebus's own streamed cases for French,
Italian, Hindi, Japanese and Mandarin, ``streamed-cases.json``) as whole cases right per set,
streamed two ways (tokens: the case's own ``tokens`` where it lists them, a multilingual
tokenizer's pieces, else word-sized tokens with their spaces; and one character at a time), beside
pySBD 0.3.4 in batch (``clean=False``, whole text) and the plain regex ``(?<=[.!?])\\s+``. A case is
right when the raw spans of the released sentences, stripped, equal its sentences in order (raw
spans, because list markers and emphasis are cut from the speakable text but are part of the case).
Then: release lag p50/p95 over the sentences released before the end of the turn, µs per fed
piece (median of ``--repeat`` runs), and a sweep of ``first_clause_min_words`` over the shipped
conversation corpus (how soon the first utterance is released, and how long it is). Last, the
speculative release (docs/gate.md): every text through the gate core with ``speculative_release``
on, word-token feed: how many sentences went out tentative and were confirmed (each released one
token interval sooner), and how many tentative ones were retracted (withdrawn or replaced).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

from voicebus.latency import percentile
from voicebus.ops.bench.cli import data_path
from voicebus.schemas.contract import TextEventKind

DEFAULT_CASES = data_path("pysbd-golden-rules.json")  # pySBD 0.3.4's cases (MIT), shipped in the package
STREAMED_CASES = data_path("streamed-cases.json")  # fr, it, hi, ja, zh, with tokenizer pieces
NAIVE_SPLIT = re.compile(r"(?<=[.!?])\s+")
CLAUSE_SWEEP = (0, 4, 6, 8, 10, 12, 16)


def _stream(text: str, pieces: list[str], lang: str, min_words: int = 0):
    from voicebus.gate.segmenter import StreamingSegmenter

    seg = StreamingSegmenter(lang, first_clause_min_words=min_words)
    released = []
    piece_starts: list[int] = []
    piece_lags: list[int] = []  # pieces that began at or after a sentence's end before its release
    for piece in pieces:
        piece_starts.append(seg.fed)
        for sentence in seg.feed(piece):
            released.append(sentence)
            piece_lags.append(sum(1 for start in piece_starts if start >= sentence.end))
    before_flush = len(released)
    released += seg.flush()
    return released, before_flush, piece_lags


def _pieces(case: dict, mode: str) -> list[str]:
    """The pieces a case is fed in: one character at a time, or its tokens (the pieces a
    tokenizer cut it into, where the case lists them; word-sized tokens else)."""
    from voicebus.gate.cli import word_tokens

    text = case["text"]
    if mode == "char":
        return list(text)
    return list(case["tokens"]) if case.get("tokens") else word_tokens(text)


def load_cases(paths: list[Path]) -> dict:
    """The cases of every file, merged: {language: {set name: [case, ...]}}."""
    cases: dict = {}
    for path in paths:
        for lang, sets in json.loads(path.read_text(encoding="utf-8")).items():
            cases.setdefault(lang, {}).update(sets)
    return cases


def _score_sets(cases: dict, repeat: int) -> tuple[list[list[str]], dict]:
    import pysbd

    rows = []
    lags: dict[str, list[int]] = {"token": [], "char": []}
    piece_lags: dict[str, list[int]] = {"token": [], "char": []}
    pieces_total = {"token": 0, "char": 0}
    for lang, sets in cases.items():
        batch = pysbd.Segmenter(language=lang, clean=False)
        for set_name, set_cases in sets.items():
            right = {"token": 0, "char": 0, "pysbd": 0, "regex": 0}
            for case in set_cases:
                text, expected = case["text"], case["sentences"]
                for mode in ("token", "char"):
                    pieces = _pieces(case, mode)
                    pieces_total[mode] += len(pieces)
                    released, before_flush, in_pieces = _stream(text, pieces, lang)
                    piece_lags[mode] += in_pieces
                    got = [text[s.start : s.end].strip() for s in released]
                    right[mode] += got == expected
                    lags[mode] += [s.lag for s in released[:before_flush]]
                right["pysbd"] += [s.strip() for s in batch.segment(text) if s.strip()] == expected
                right["regex"] += [s.strip() for s in NAIVE_SPLIT.split(text) if s.strip()] == expected
            n = len(set_cases)
            rows.append(
                [f"{lang}/{set_name}", str(n)] + [f"{right[k]}/{n}" for k in ("token", "char", "pysbd", "regex")]
            )
    cost = {}
    for mode in ("token", "char"):
        runs = []
        all_pieces = [
            (lang, _pieces(case, mode)) for lang, sets in cases.items() for cs in sets.values() for case in cs
        ]
        count = sum(len(p) for _, p in all_pieces)
        for _ in range(repeat):
            t0 = time.perf_counter()
            for lang, pieces in all_pieces:
                _stream("", pieces, lang)
            runs.append((time.perf_counter() - t0) * 1e6 / count)
        cost[mode] = statistics.median(runs)
    return rows, {"lags": lags, "piece_lags": piece_lags, "cost_us": cost}


def _corpus_turns() -> list[tuple[str, str]]:
    """(language, text) of every agent turn in the shipped conversation corpus."""
    from voicebus.agents.corpus import CORPUS_DIR

    turns: dict[tuple[str, str, str], list[str]] = {}
    langs: dict[tuple[str, str, str], str] = {}
    for path in sorted(CORPUS_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if event.get("type") == "text" and event.get("kind") == TextEventKind.TOKEN:
                key = (path.name, event["session_id"], event["turn_id"])
                turns.setdefault(key, []).append(event["text"])
                langs[key] = event.get("language") or "en"
    return [(langs[k][:2], "".join(v)) for k, v in turns.items()]


def _clause_sweep(turns: list[tuple[str, str]]) -> list[list[str]]:
    from voicebus.gate.cli import word_tokens
    from voicebus.gate.segmenter import StreamingSegmenter

    rows = []
    for min_words in CLAUSE_SWEEP:
        first_tokens, first_words, rest_words, clauses = [], [], [], 0
        for lang, text in turns:
            pieces = word_tokens(text)
            seg = StreamingSegmenter(lang, first_clause_min_words=min_words)
            for index, piece in enumerate(pieces, 1):
                released = seg.feed(piece)
                if released:
                    first = released[0]
                    break
            else:
                index, first = len(pieces), (seg.flush() or [None])[0]
            if first is None:
                continue
            first_tokens.append(index)
            first_words.append(len(first.text.split()))
            if first.kind == "clause":
                clauses += 1
                rest_words.append(len(text[first.end :].split(".")[0].split()))
        rows.append(
            [
                str(min_words) + (" (off)" if min_words == 0 else ""),
                f"{statistics.median(first_tokens):.0f}",
                f"{percentile(first_tokens, 95):.0f}",
                f"{statistics.median(first_words):.0f}",
                f"{min(first_words)}",
                f"{clauses}/{len(first_tokens)}",
                f"{statistics.median(rest_words):.0f}" if rest_words else "-",
            ]
        )
    return rows


def _speculation(texts: list[tuple[str, str, str]]) -> list[list[str]]:
    """Per group: sentences spoken, tentative releases, confirmed, retracted (withdrawn or
    replaced), through `GateSession` with speculative release on (word-token feed)."""
    from voicebus.gate.cli import word_tokens
    from voicebus.gate.core import GateConfig, GateSession
    from voicebus.schemas.messages import TextEvent

    config = GateConfig(speculative_release=True, first_clause_min_words=0)
    groups: dict[str, dict[str, int]] = {}
    for group, lang, text in texts:
        g = groups.setdefault(group, {"texts": 0, "spoken": 0, "tentative": 0, "confirmed": 0, "retracted": 0})
        g["texts"] += 1
        session = GateSession("s", config)
        events = [TextEvent(session_id="s", turn_id="t", agent_id="a", seq=i, kind=TextEventKind.TOKEN,
                            text=piece, language=lang, produced_at_us=i)
                  for i, piece in enumerate(word_tokens(text))]
        events.append(dataclasses.replace(events[-1], seq=len(events), kind=TextEventKind.END_OF_TURN, text="")
                      if events else TextEvent(session_id="s", turn_id="t", agent_id="a", seq=0,
                                               kind=TextEventKind.END_OF_TURN, language=lang, produced_at_us=0))
        held: set[int] = set()
        for i, event in enumerate(events):
            for r in session.apply(event, i):
                seq = r.sentence_seq
                if r.tentative:
                    if r.text:
                        g["tentative"] += 1
                        held.add(seq)
                    else:
                        g["retracted"] += 1
                        held.discard(seq)
                    continue
                if seq in held:
                    held.discard(seq)
                    g["confirmed" if not r.text else "retracted"] += 1
                    g["spoken"] += 1  # its text, or the replacement's
                elif r.text:
                    g["spoken"] += 1
    rows = []
    total = {"texts": 0, "spoken": 0, "tentative": 0, "confirmed": 0, "retracted": 0}
    for name, g in list(groups.items()) + [("all", total)]:
        if name != "all":
            for k in total:
                total[k] += g[k]
        spoken, tentative = max(1, g["spoken"]), max(1, g["tentative"])
        rows.append([name, str(g["texts"]), str(g["spoken"]), str(g["tentative"]),
                     f"{g['confirmed']} ({100 * g['confirmed'] / spoken:.0f}%)",
                     f"{g['retracted']} ({100 * g['retracted'] / tentative:.1f}%)",
                     f"{30 * g['confirmed'] / spoken:.0f} / {100 * g['confirmed'] / spoken:.0f}"])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def run_segment_bench(args: argparse.Namespace, settings) -> int:
    paths = [Path(p) for p in args.cases or (DEFAULT_CASES, STREAMED_CASES)]
    for path in paths:
        if not path.is_file():
            print(f"voicebus bench segment: no cases file at {path} (see --cases)")
            return 2
    cases = load_cases(paths)
    rows, figures = _score_sets(cases, args.repeat)
    print("Whole cases right (streamed: tokens / one char at a time; pySBD 0.3.4 batch clean=False; regex (?<=[.!?])\\s+)")
    print(_table(["set", "cases", "stream-token", "stream-char", "pysbd-batch", "regex"], rows))
    print()
    for mode in ("token", "char"):
        lags = figures["lags"][mode]
        print(
            f"release lag ({mode} feed, {len(lags)} sentences released before end of turn): "
            f"p50 {percentile(lags, 50):.0f} chars, p95 {percentile(lags, 95):.0f} chars "
            f"(in pieces: p50 {percentile(figures['piece_lags'][mode], 50):.0f}, "
            f"p95 {percentile(figures['piece_lags'][mode], 95):.0f}); "
            f"cost {figures['cost_us'][mode]:.1f} µs per {mode} (median of {args.repeat})"
        )
    if not args.no_clause_sweep:
        print()
        turns = _corpus_turns() + [
            (lang, case["text"]) for lang, sets in cases.items() for cs in sets.values() for case in cs
        ]
        print(
            f"first_clause_min_words sweep over {len(turns)} texts (conversation corpus turns and the "
            "cases above; word-token feed):"
        )
        print(
            _table(
                ["min words", "tokens to 1st p50", "p95", "1st words p50", "min", "clause used", "words left p50"],
                _clause_sweep(turns),
            )
        )
    print()
    texts = [(f"corpus/{lang}", lang, text) for lang, text in _corpus_turns()] + [
        (f"{lang}/{name}", lang, case["text"]) for lang, sets in cases.items() for name, cs in sets.items() for case in cs
    ]
    print("speculative release (gate core, word tokens): sentences spoken, released tentative, confirmed (% of "
          "spoken: each released one token sooner), retracted (% of tentative: synthesized for nothing), "
          "mean saving per spoken sentence in ms at 33 / 10 tokens/s")
    print(_table(["texts", "n", "sentences", "tentative", "confirmed", "retracted", "ms saved 33/10 tok/s"],
                 _speculation(texts)))
    return 0


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "segment", help="segmenter accuracy vs pySBD, release lag, µs per token, first-clause sweep"
    )
    p.add_argument("--cases", type=Path, action="append", metavar="PATH",
                   help="sentence-boundary cases JSON, repeatable (default: pySBD 0.3.4's golden rules and "
                        "voicebus's streamed cases, both shipped with voicebus)")
    p.add_argument("--repeat", type=int, default=5, help="timing runs; the median is printed (default 5)")
    p.add_argument("--no-clause-sweep", action="store_true", help="skip the first_clause_min_words sweep")
    p.set_defaults(func=run_segment_bench)
