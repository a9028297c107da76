"""`voicebus edge` (run the player edge) and `voicebus token` (print a signed session token and
the player URL)."""

from __future__ import annotations

import argparse
from urllib.parse import urlencode


def register(subparsers) -> None:
    edge = subparsers.add_parser("edge", help="run the player edge (WebSocket + web player + /metrics)")
    edge.add_argument("--host", help="listen address (default: VOICEBUS_EDGE_HOST)")
    edge.add_argument("--port", type=int, help="listen port (default: VOICEBUS_EDGE_PORT)")
    edge.set_defaults(func=run_edge)

    token = subparsers.add_parser("token", help="print a signed session token and the player URL")
    token.add_argument("--session", required=True, help="the session the token lets its holder listen to")
    token.add_argument("--ttl", type=int, help="validity in seconds (default: VOICEBUS_TOKEN_TTL_S)")
    token.set_defaults(func=print_token)


def run_edge(args: argparse.Namespace, settings) -> int:
    import logging

    from aiohttp import web

    from players.edge import make_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = args.host or settings.edge_host, args.port or settings.edge_port
    print(f"voicebus edge on http://{host}:{port}/ (bus {settings.bootstrap}, audio {settings.audio_topic})", flush=True)
    web.run_app(make_app(settings), host=host, port=port, print=None)
    return 0


def print_token(args: argparse.Namespace, settings) -> int:
    from players.auth import issue_token

    token = issue_token(settings.edge_secret, args.session, args.ttl or settings.token_ttl_s)
    print(token)
    print(f"http://{settings.edge_host}:{settings.edge_port}/?{urlencode({'session': args.session, 'token': token})}")
    return 0
