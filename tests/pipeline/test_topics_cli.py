"""`voicebus topics --create`: every fixed topic created on the broker, the compacted ones compacted."""

import argparse
import asyncio

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from voicebus.topics import compacted_topics, fixed_topics
from voicebus.topics_cli import run

pytestmark = [pytest.mark.kafka]


async def test_topics_create_makes_every_fixed_topic_with_its_cleanup_policy(make_settings):
    settings = make_settings(partitions=2)
    assert await asyncio.to_thread(run, argparse.Namespace(create=True), settings) == 0
    assert settings.agents_topic in compacted_topics(settings)
    assert settings.gate_changelog_topic in compacted_topics(settings)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        described = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(fixed_topics(settings))}
        assert described == {name: 2 for name in fixed_topics(settings)}
        resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in fixed_topics(settings)]
        policies = {}
        for response in await admin.describe_configs(resources):
            for resource in response.resources:
                name = resource[3]
                policies[name] = {entry[0]: entry[1] for entry in resource[4]}["cleanup.policy"]
    finally:
        await admin.close()
    assert {n for n, p in policies.items() if p == "compact"} == compacted_topics(settings)
