"""`voicebus topics`: print the topic map as a markdown table (the README's table)."""

from __future__ import annotations

from pipeline.topics import topic_map


def register(subparsers) -> None:
    p = subparsers.add_parser("topics", help="print the topic map as a markdown table")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    print("| topic | key | schema | producer | consumer | cleanup, retention |")
    print("|---|---|---|---|---|---|")
    for t in topic_map(settings):
        print(f"| `{t.name}` | {t.key} | {t.schema} | {t.producer} | {t.consumer} | {t.retention.describe()} |")
    return 0
