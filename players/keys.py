"""The typed keys of the edge's aiohttp app, shared by the edge and the doors it mounts.

The edge (`voicebus.players.edge`) builds the app and fills these; its doors (the OpenAI-compatible
speech endpoint, the telephony bridge) read them. They live apart from the edge module so a door
never imports the module that mounts it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from aiohttp import web

from voicebus.settings import Settings
from voicebus.tracing import StageTracer
from voicebus.players.metrics import EdgeMetrics
from voicebus.players.router import SessionRouter

SETTINGS_KEY = web.AppKey("settings", Settings)
ROUTER_KEY = web.AppKey("router", SessionRouter)
METRICS_KEY = web.AppKey("metrics", EdgeMetrics)
LINK_KEY = web.AppKey("kafka_link", object)  # KafkaLink, or None without Kafka
REPORTS_KEY = web.AppKey("reports", deque)  # the latest playback reports, newest last
CLIENTS_KEY = web.AppKey("client_sockets", set)
HELLO_TIMEOUT_KEY = web.AppKey("hello_timeout_s", float)
TRACER_KEY = web.AppKey("tracer", StageTracer)
SENT_TRACES_KEY = web.AppKey("sent_traces", OrderedDict)  # (client, turn, sentence) -> (edge.send context, sent_at_us)
