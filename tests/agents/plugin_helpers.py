"""What the framework plugins' tests share: one whole pipeline per test module (the real broker,
the real gate, a synthesis worker on the tiny kokoro engine, the real edge) and the cancels that
reached the control topic."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from voicebus.ops.daemon import free_port
from voicebus.ops.runtime import PipelineStack
from voicebus.synthesis.engine import SynthesisEngine
from tests.agents.bus_helpers import TopicReader
from tests.conftest import _settings_factory


@contextlib.asynccontextmanager
async def module_stack(kafka_broker, tmp_path_factory, seed: int) -> AsyncIterator[PipelineStack]:
    """A pipeline for the tests of one module (their sessions apart), with a reader of its
    control topic from the start (`stack.control`)."""
    make = _settings_factory(kafka_broker.bootstrap, kafka_broker.port, kafka_broker.controller_port, tmp_path_factory)
    settings = make(edge_port=free_port(), worker_max_in_flight=2)
    async with PipelineStack(settings, SynthesisEngine.tiny(seed=seed)) as stack:
        async with TopicReader(stack.settings, [stack.settings.control_topic]) as control:
            stack.control = control
            yield stack


def cancels_of(stack: PipelineStack, session_id: str) -> list[dict]:
    """The CANCELs of a session that reached the control topic so far."""
    return [r.value for r in stack.control.received
            if r.value.get("session_id") == session_id and r.value.get("action") == "CANCEL"]
