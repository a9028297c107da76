"""`voicebus topics`: print the topic map as a markdown table (the README's table);
`voicebus topics --create`: create every fixed topic on the configured broker (idempotent);
`voicebus topics grow --partitions N`: add partitions to a drained deployment's topics
(`voicebus.topics_grow`)."""

from __future__ import annotations

import asyncio

from voicebus.topics import fixed_topics, topic_map


def register(subparsers) -> None:
    p = subparsers.add_parser("topics", help="print the topic map as a markdown table (--create: create the topics; "
                                             "grow --partitions N: add partitions once drained)")
    p.add_argument("action", nargs="?", choices=["grow"],
                   help="grow: once the deployment is drained (the agents stopped at a turn boundary), grow every "
                        "session-keyed topic to --partitions together (docs/kafka.md, \"Adding partitions\")")
    p.add_argument("--partitions", type=int, help="with grow: the new partition count, above the current one")
    p.add_argument("--quiet-s", type=float, default=5.0,
                   help="with grow: seconds without a record on any session-keyed topic that count as drained (default 5)")
    p.add_argument("--wait-s", type=float, default=300.0,
                   help="with grow: how long to wait for the drain before giving up, nothing changed (default 300)")
    p.add_argument("--create", action="store_true",
                   help="create every fixed topic (control, synthesis, audio, playback, dead letters, agent "
                        "registry, gate changelog) with VOICEBUS_PARTITIONS partitions, if missing; on a "
                        "SASL bus also grant each role its ACLs (run it as the admin principal)")
    p.add_argument("--agent", action="append", default=[], metavar="ID[=PRINCIPAL]",
                   help="with --create on a SASL bus: the agent ID may write its own text topic "
                        "(principal User:ID unless named); repeat for each agent")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    if getattr(args, "action", None) == "grow":
        return _grow(args, settings)
    if getattr(args, "create", False):
        from voicebus.bus import ensure_topics

        asyncio.run(ensure_topics(settings))
        for name in fixed_topics(settings):
            print(f"{name}: ready")
        if settings.kafka_security_protocol.startswith("SASL_"):
            from voicebus.acls import role_acls
            from voicebus.bus import create_acls

            agents = dict(_agent_principal(a) for a in args.agent)
            acls = role_acls(settings, agents)
            asyncio.run(create_acls(settings, acls))
            print(f"ACLs: {len(acls)} granted to the gate, worker and edge"
                  + (f" and agent(s) {', '.join(agents)}" if agents else ""))
        return 0
    print("| topic | key | schema | producer | consumer | cleanup, retention |")
    print("|---|---|---|---|---|---|")
    for t in topic_map(settings):
        print(f"| `{t.name}` | {t.key} | {t.schema} | {t.producer} | {t.consumer} | {t.retention.describe()} |")
    return 0


def _grow(args, settings) -> int:
    import sys

    from voicebus.topics_grow import GrowthError, grow_partitions

    if not args.partitions:
        print("voicebus topics grow: --partitions N is required", file=sys.stderr)
        return 2
    try:
        asyncio.run(grow_partitions(settings, args.partitions, quiet_s=args.quiet_s, wait_s=args.wait_s))
    except GrowthError as exc:
        print(f"voicebus topics grow: {exc}", file=sys.stderr)
        return 1
    return 0


def _agent_principal(spec: str) -> tuple[str, str]:
    agent_id, _, principal = spec.partition("=")
    return agent_id, principal or f"User:{agent_id}"
