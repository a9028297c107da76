"""Reading what reached the real broker, for the agents' Kafka tests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from voicebus.bus import ensure_topics, make_consumer
from voicebus.codecs import Codec
from tests.waiting import eventually


@dataclass
class Received:
    topic: str
    key: bytes
    type: str
    value: dict
    received_at: float  # time.monotonic()


class TopicReader:
    """Consumes `topics` from the beginning in the background; `wait_for(pred)` returns what
    arrived once `pred(received)` holds."""

    def __init__(self, settings, topics: list[str]) -> None:
        self.settings = settings
        self.topics = topics
        self.received: list[Received] = []
        self._codec = Codec()
        self._consumer = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "TopicReader":
        await ensure_topics(self.settings, self.topics)
        self._consumer = make_consumer(self.settings, *self.topics, auto_offset_reset="earliest")
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        await self._consumer.stop()

    async def _run(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=50)
            now = time.monotonic()
            for tp, messages in batch.items():
                for m in messages:
                    decoded = self._codec.decode(m.value)
                    self.received.append(Received(tp.topic, m.key, decoded.type, decoded.value, now))

    async def wait_for(self, done: Callable[[list[Received]], bool], timeout_s: float = 20.0) -> list[Received]:
        await eventually(lambda: done(self.received), timeout_s=timeout_s, interval_s=0.02,
                         what=f"records on {', '.join(self.topics)}", detail=lambda: f"got {len(self.received)} records")
        return list(self.received)


def count_kind(kind: str, n: int = 1) -> Callable[[list[Received]], bool]:
    return lambda got: sum(r.value.get("kind") == kind for r in got) >= n
