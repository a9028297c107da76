"""`voicebus edge` (run the player edge) and `voicebus token` (print a signed session token and
the player URL, the token in its fragment: ``http://<edge>/#session=S&token=T``)."""

from __future__ import annotations

import argparse
import sys

from voicebus.logs import add_log_level_argument, configure_logging


def register(subparsers) -> None:
    edge = subparsers.add_parser("edge", help="run the player edge (WebSocket + web player + /metrics)")
    edge.add_argument("--host", help="listen address (default: VOICEBUS_EDGE_HOST)")
    edge.add_argument("--port", type=int, help="listen port (default: VOICEBUS_EDGE_PORT)")
    add_log_level_argument(edge, "INFO")
    edge.set_defaults(func=run_edge)

    token = subparsers.add_parser("token", help="print a signed session token and the player URL")
    token.add_argument("--session", required=True, help="the session the token lets its holder listen to")
    token.add_argument("--ttl", type=int, help="validity in seconds (default: VOICEBUS_TOKEN_TTL_S)")
    token.set_defaults(func=print_token)


def run_edge(args: argparse.Namespace, settings) -> int:
    from aiohttp import web

    from voicebus.players.edge import InsecureEdgeConfig, make_app

    configure_logging(args.log_level)
    settings = settings.replace(edge_host=args.host or settings.edge_host, edge_port=args.port or settings.edge_port)
    try:
        app = make_app(settings)
    except InsecureEdgeConfig as exc:
        print(f"voicebus edge: {exc}", file=sys.stderr)
        return 2
    host, port = settings.edge_host, settings.edge_port
    print(f"voicebus edge on http://{host}:{port}/ (bus {settings.bootstrap}, audio {settings.audio_topic})", flush=True)
    web.run_app(app, host=host, port=port, print=None)
    return 0


def print_token(args: argparse.Namespace, settings) -> int:
    from voicebus.players.auth import issue_token, player_url
    from voicebus.players.edge import InsecureEdgeConfig, check_exposure

    try:
        check_exposure(settings)  # the edge these settings describe would refuse this secret
    except InsecureEdgeConfig as exc:
        print(f"voicebus token: {exc}", file=sys.stderr)
        return 2
    token = issue_token(settings.edge_secret, args.session, args.ttl or settings.token_ttl_s)
    print(token)
    print(player_url(settings.edge_url, args.session, token))
    return 0
