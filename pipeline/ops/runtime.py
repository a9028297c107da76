"""A whole pipeline on one machine, for the demo and the end-to-end benchmarks.

`PipelineStack` owns everything it starts and stops it in reverse order: the Kafka broker (a
local one unless `settings.bootstrap` already answers; none with ``start_broker=False``, what a
command given ``--bootstrap`` asks), the topics, one or more *lanes* (a gate
worker subprocess + a synthesis worker in this process, sharing one loaded engine), and the edge
(aiohttp, in this process). A lane is a `Settings` variant: the TTFA benchmark runs an
incremental and a buffered lane side by side, each with its own text topics, gate group and
synthesis topic, both publishing to the one audio topic the edge serves (`buffered_lane` derives
the buffered one from a settings object; the demo console runs both lanes too). `edge_setup`, when
given, is called with the edge app before it starts serving, so a caller can add routes to it
(the demo console: `voicebus.players.console`).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from voicebus.ops.cluster import ensure_local_kafka
from voicebus.bus import ensure_topics
from voicebus.lifecycle import Owned
from voicebus.settings import Settings
from voicebus.topics import fixed_topics, text_topic


class StackError(RuntimeError):
    """A component of the pipeline failed to start."""


def buffered_lane(settings: Settings) -> Settings:
    """`settings` as a buffered hand-off lane beside it: gate_mode buffered, its own text topics
    (a prefix the incremental gate's pattern does not match), synthesis topic, gate app id and
    changelog; control, audio and playback topics shared, so one edge serves both lanes and a
    barge-in reaches both."""
    app_id = settings.gate_app_id + "-buffered"
    return settings.replace(
        gate_mode="buffered",
        text_topic_prefix=settings.text_topic_prefix.rstrip(".") + "-buffered.",
        synthesis_topic=settings.synthesis_topic + "-buffered",
        gate_app_id=app_id,
        gate_changelog_topic=f"{app_id}-gate_sessions-changelog",
    )


@dataclass
class Lane:
    name: str
    settings: Settings
    gate: subprocess.Popen | None = None
    worker: Any = None  # voicebus.synthesis.worker.SynthesisWorker
    gate_output: list[str] = field(default_factory=list)


class PipelineStack(Owned):
    def __init__(self, settings: Settings, engine: Any, lanes: dict[str, Settings] | None = None,
                 *, edge: bool = True, gate_log_level: str = "WARNING", agent_ids: tuple[str, ...] = (),
                 edge_setup: Callable[[web.Application, "PipelineStack"], None] | None = None,
                 start_broker: bool = True) -> None:
        self._base = settings
        self._engine = engine
        self._lane_settings = lanes or {"main": settings}
        self._with_edge = edge
        self._gate_log_level = gate_log_level
        self._start_broker = start_broker
        self._agent_ids = agent_ids
        self._edge_setup = edge_setup
        self._exit = contextlib.ExitStack()
        self._edge_runner: web.AppRunner | None = None
        self.settings: Settings = settings
        self.lanes: dict[str, Lane] = {}
        self.undrained = ""  # what the last `drained` look found still in flight
        self.edge_app: web.Application | None = None

    @property
    def edge_url(self) -> str:
        return self.settings.edge_url

    async def start(self, progress=None) -> None:
        step = progress or (lambda message: None)
        if self._with_edge:  # refuse an exposed edge (voicebus.players.edge.InsecureEdgeConfig) before starting anything
            from voicebus.players.edge import check_exposure

            check_exposure(self._base)
        step("Kafka broker")
        self.settings = await asyncio.to_thread(self._exit.enter_context,
                                                ensure_local_kafka(self._base, start=self._start_broker))
        bootstrap = self.settings.bootstrap
        for name, lane_settings in self._lane_settings.items():
            self.lanes[name] = Lane(name, lane_settings.replace(bootstrap=bootstrap))
        step("topics")
        for lane in self.lanes.values():
            # The known agents' text topics exist before the gate starts, so it reads them from its
            # first fetch; a topic that appears later is read once the gate's discovery finds it
            # (the agent registry), so that agent's first events may reach the gate after events
            # other agents produced later.
            await ensure_topics(lane.settings, [*fixed_topics(lane.settings),
                                                *(text_topic(lane.settings, a) for a in self._agent_ids)])
        step("gate workers")
        for lane in self.lanes.values():
            await self._start_gate(lane)
        step("synthesis workers")
        from voicebus.synthesis.worker import SynthesisWorker

        for lane in self.lanes.values():
            lane.worker = SynthesisWorker(lane.settings, self._engine, worker_id=f"{lane.name}-worker")
            await lane.worker.start()
        await self._wait_assigned()
        if self._with_edge:
            step("edge")
            from voicebus.players.edge import make_app

            self.edge_app = make_app(self.settings)
            if self._edge_setup is not None:
                self._edge_setup(self.edge_app, self)
            self._edge_runner = web.AppRunner(self.edge_app)
            await self._edge_runner.setup()
            await web.TCPSite(self._edge_runner, self.settings.edge_host, self.settings.edge_port).start()
            if self.settings.edge_port == 0:  # "any free port": from now on the settings say which
                self.settings = self.settings.replace(edge_port=self._edge_runner.addresses[0][1])

    async def stop(self) -> None:
        if self._edge_runner is not None:
            await self._edge_runner.cleanup()
            self._edge_runner = None
        for lane in self.lanes.values():
            if lane.worker is not None:
                await lane.worker.stop()
                lane.worker = None
            if lane.gate is not None:
                lane.gate.terminate()
                try:
                    await asyncio.to_thread(lane.gate.wait, 20)
                except subprocess.TimeoutExpired:
                    lane.gate.kill()
                    await asyncio.to_thread(lane.gate.wait)
                lane.gate = None
        await asyncio.to_thread(self._exit.close)

    async def drained(self) -> bool:
        """One look: has everything sent into the pipeline so far gone all the way through? Each
        lane's gate has applied every text record (its stored positions at its text topics' ends),
        each worker has settled every request (its group's commits at the synthesis topic's end:
        it publishes nothing more of them), and the edge has routed every audio record, with no
        frame left in a client's outbox. Tests poll it instead of waiting a quiet interval; what
        the edge has sent may still be on the socket (a client's ping round trip settles that).
        When it is not, `undrained` says which stage holds what."""
        from voicebus.bus import committed_offsets, end_offsets, topics_matching
        from voicebus.gate.app import stored_positions
        from voicebus.topics import worker_group_id
        from voicebus.topics import text_topic_pattern

        def behind(ends: dict, done: dict) -> dict:
            # keys: aiokafka's TopicPartition, a named tuple, equal to (topic, partition) tuples
            return {f"{tp[0]}[{tp[1]}]": (done.get(tp, 0), end) for tp, end in ends.items() if done.get(tp, 0) < end}

        self.undrained = ""
        for name, lane in self.lanes.items():
            s = lane.settings
            text_ends = await end_offsets(s, await topics_matching(s, text_topic_pattern(s)))
            if late := behind(text_ends, await stored_positions(s)):
                self.undrained = f"lane {name}: the gate's stored positions (at, end): {late}"
                return False
            if late := behind(await end_offsets(s, [s.synthesis_topic]), await committed_offsets(s, worker_group_id(s))):
                hand = f"; its worker holds: {lane.worker.in_hand()}" if lane.worker is not None else ""
                self.undrained = f"lane {name}: the workers' commits (at, end): {late}{hand}"
                return False
        if self.edge_app is not None:
            from voicebus.players.edge import LINK_KEY, ROUTER_KEY

            link = self.edge_app[LINK_KEY]
            if link is not None:
                late = behind(await end_offsets(self.settings, [self.settings.audio_topic]), await link.routed())
                if late:
                    self.undrained = f"the edge's routed audio (at, end): {late}"
                    return False
            if waiting := self.edge_app[ROUTER_KEY].outbox_sizes():
                self.undrained = f"frames wait in client outboxes: {waiting}"
                return False
        return True

    async def _start_gate(self, lane: Lane, timeout: float = 90.0) -> None:
        from voicebus.gate.app import READY_LINE
        from voicebus.gate.cli import start_gate_subprocess

        lane.gate = start_gate_subprocess(lane.settings, stderr=subprocess.STDOUT, log_level=self._gate_log_level)
        assigned = threading.Event()

        def pump(stream) -> None:  # drains the child's output so it never blocks on a full pipe
            for line in stream:
                lane.gate_output.append(line.rstrip())
                del lane.gate_output[:-200]
                if line.startswith(READY_LINE):
                    assigned.set()

        threading.Thread(target=pump, args=(lane.gate.stdout,), daemon=True, name=f"gate-{lane.name}-out").start()
        deadline = time.monotonic() + timeout
        while not assigned.is_set():
            if lane.gate.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(lane.gate_output[-30:])
                raise StackError(f"gate worker of lane {lane.name!r} did not get its partitions:\n{tail}")
            await asyncio.sleep(0.1)

    async def _wait_assigned(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(lane.worker.assigned for lane in self.lanes.values()):
            if time.monotonic() > deadline:
                raise StackError("synthesis workers got no partitions")
            await asyncio.sleep(0.05)
