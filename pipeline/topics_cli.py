"""`voicebus topics`: print the topic map as a markdown table (the README's table);
`voicebus topics --create`: create every fixed topic on the configured broker (idempotent)."""

from __future__ import annotations

import asyncio

from voicebus.topics import fixed_topics, topic_map


def register(subparsers) -> None:
    p = subparsers.add_parser("topics", help="print the topic map as a markdown table (--create: create the topics)")
    p.add_argument("--create", action="store_true",
                   help="create every fixed topic (control, synthesis, audio, playback, dead letters, agent "
                        "registry, gate changelog) with VOICEBUS_PARTITIONS partitions, if missing")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    if getattr(args, "create", False):
        from voicebus.bus import ensure_topics

        asyncio.run(ensure_topics(settings))
        for name in fixed_topics(settings):
            print(f"{name}: ready")
        return 0
    print("| topic | key | schema | producer | consumer | cleanup, retention |")
    print("|---|---|---|---|---|---|")
    for t in topic_map(settings):
        print(f"| `{t.name}` | {t.key} | {t.schema} | {t.producer} | {t.consumer} | {t.retention.describe()} |")
    return 0
