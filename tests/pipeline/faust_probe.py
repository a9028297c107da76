"""A tiny faust-streaming app run by tests/pipeline/test_faust_on_kafka.py in a subprocess:
an agent reads raw events from a source topic, counts them per key in a Table (with a changelog
topic), and writes "<key>=<count>" for every event to a sink topic.

    python tests/pipeline/faust_probe.py BOOTSTRAP APP_ID SOURCE_TOPIC SINK_TOPIC
"""

from __future__ import annotations

import sys


def build_app(bootstrap: str, app_id: str, source_topic: str, sink_topic: str, datadir: str):
    import faust

    app = faust.App(
        app_id, broker=f"kafka://{bootstrap}", store="memory://", web_enabled=False,
        topic_partitions=1, topic_replication_factor=1, datadir=datadir,
        consumer_auto_offset_reset="earliest",
        # the group timing the gate runs with (pipeline/gate/app.py): faust's defaults (60 s)
        # would keep a stopped worker that did not leave cleanly in the group for a minute, and
        # the restarted one waits for it before it gets the partition
        broker_session_timeout=10.0, broker_heartbeat_interval=2.0, broker_rebalance_timeout=10.0,
    )
    source = app.topic(source_topic, key_serializer="raw", value_serializer="raw", partitions=1)
    sink = app.topic(sink_topic, key_serializer="raw", value_serializer="raw", partitions=1)
    counts = app.Table("counts", default=int, partitions=1)

    @app.agent(source)
    async def count(stream):
        async for event in stream.events():
            key = event.key.decode()
            counts[key] += 1
            await sink.send(key=event.key, value=f"{key}={counts[key]}".encode())

    return app


if __name__ == "__main__":
    bootstrap, app_id, source_topic, sink_topic, datadir = sys.argv[1:6]
    app = build_app(bootstrap, app_id, source_topic, sink_topic, datadir)
    sys.argv = [sys.argv[0], "worker", "--loglevel", "info"]
    app.main()
