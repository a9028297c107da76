"""The aiokafka internals voicebus touches (`voicebus.kafka_compat`), on a real broker."""

from __future__ import annotations

import asyncio

import pytest

from voicebus.bus import ensure_topics, make_consumer
from voicebus.kafka_compat import check_aiokafka_internals
from tests.waiting import eventually

pytestmark = pytest.mark.kafka



def test_the_internals_exist():
    check_aiokafka_internals()


async def test_a_consumer_stopped_while_a_fetch_backs_off_still_stops(make_settings):
    """Before: ``stop()`` raised ``CancelledError`` (the cancelled fetch's own) when a fetch was
    waiting out its retry backoff, e.g. while the broker refused this user, and left the
    consumer's client open; a stage's shutdown died with it."""
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    consumer = make_consumer(settings, settings.control_topic, group_id=None)
    await consumer.start()
    await consumer.getmany(timeout_ms=100)
    backing_off = asyncio.create_task(asyncio.sleep(30))  # what a failed fetch awaits before its retry
    consumer._fetcher._pending_tasks.add(backing_off)
    await consumer.stop()
    assert backing_off.cancelled()


async def test_a_stop_that_is_itself_cancelled_still_raises(make_settings):
    settings = make_settings(partitions=1)
    await ensure_topics(settings)
    consumer = make_consumer(settings, settings.control_topic, group_id=None)
    await consumer.start()
    release = asyncio.Event()

    async def stubborn() -> None:  # a fetch that takes its time to end when cancelled
        try:
            await asyncio.sleep(30)
        finally:
            await release.wait()

    fetch = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    consumer._fetcher._pending_tasks.add(fetch)
    stopping = asyncio.create_task(consumer.stop())
    # the stop has reached the fetcher's close once that close has cancelled the pending fetch
    await eventually(lambda: fetch.cancelling(), what="stop() cancelled the pending fetch")
    stopping.cancel()
    release.set()
    try:
        await stopping
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("a cancelled stop returned as if it had finished")
    await consumer._client.close()
