"""Gate, synthesis worker and edge as owned operating-system processes, for benchmarks that must
see a stage die or grow (`voicebus bench hostile`).

`StageProcesses` starts each stage with its own command line (what a deployment runs), the
settings passed through the environment (`Settings.to_env`), each child asked to die with this
process (`pipeline.daemon.terminate_when_parent_dies`). It waits for each stage's readiness
signal: the gate's ``--announce`` line, the worker's ``--announce`` line, the edge's
``/healthz``. It drains each child's output into a ring of recent lines (a full pipe would block
the child), and tells for each stage whether it is still alive (`died`) and its resident memory
(`rss_mb`, from ``/proc/<pid>/status``), and reads each stage's Prometheus ``/metrics``
(`metric`: the gate and workers get a ``--metrics-port`` of their own). `stop` terminates them in reverse order, kills one that
does not exit, and reaps every one. `PipelineStack` (pipeline/runtime.py) is the in-process
variant the demo and bench ttfa use.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.daemon import free_port, terminate_when_parent_dies
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


class StageStartError(RuntimeError):
    """A stage process exited or did not become ready in time."""


@dataclass
class StageProcess:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    output: list[str] = field(default_factory=list)
    ready_line: str | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    def launch(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                     preexec_fn=terminate_when_parent_dies)
        threading.Thread(target=self._pump, daemon=True, name=f"{self.name}-out").start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            del self.output[:-300]
            if self.ready_line is not None and line.startswith(self.ready_line):
                self._ready.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def died(self) -> bool:
        """The process exited (by itself: `stop` has not been called)."""
        return self.proc is not None and self.proc.poll() is not None

    def rss_mb(self) -> float:
        """Resident memory now, MB (0 once it exited)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.output[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StageProcesses:
    """One gate, ``workers`` synthesis workers (the tiny seeded model unless ``tiny=False``) and
    one edge, each its own process. Use as ``async with``; `settings` then names the edge's port."""

    def __init__(self, settings: Settings, *, workers: int = 1, tiny: bool = True,
                 start_timeout_s: float = 180.0, loglevel: str = "WARNING") -> None:
        self.settings = settings.replace(edge_port=settings.edge_port or free_port(settings.edge_host))
        self.workers = workers
        self.tiny = tiny
        self.start_timeout_s = start_timeout_s
        self.loglevel = loglevel
        self.stages: list[StageProcess] = []
        self.metrics_urls: dict[str, str] = {}  # stage -> its Prometheus /metrics

    @property
    def edge_url(self) -> str:
        return f"http://{self.settings.edge_host}:{self.settings.edge_port}"

    async def __aenter__(self) -> "StageProcesses":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        from pipeline.gate.app import READY_LINE
        from pipeline.synthesis.cli import WORKER_READY_LINE

        env = {**os.environ, **self.settings.to_env(), "PYTHONUNBUFFERED": "1"}
        py = sys.executable
        host = self.settings.edge_host
        gate_port = free_port(host)
        self.metrics_urls["gate"] = f"http://{host}:{gate_port}/metrics"
        gate = StageProcess("gate", [py, "-m", "pipeline.gate.app", "--announce", "--loglevel", self.loglevel,
                                     "--metrics-port", str(gate_port)], ready_line=READY_LINE)
        worker_ports = [free_port(host) for _ in range(self.workers)]
        workers = [StageProcess(f"worker-{i}" if self.workers > 1 else "worker",
                                [py, "-m", "pipeline.synthesis.worker", "--announce", "--worker-id", f"bench-worker-{i}",
                                 "--metrics-port", str(worker_ports[i]), *(["--tiny"] if self.tiny else [])],
                                ready_line=WORKER_READY_LINE)
                   for i in range(self.workers)]
        for worker, port in zip(workers, worker_ports):
            self.metrics_urls[worker.name] = f"http://{host}:{port}/metrics"
        self.metrics_urls["edge"] = self.edge_url + "/metrics"  # loopback clients only: this one
        edge = StageProcess("edge", [py, "-m", "pipeline", "edge", "--host", self.settings.edge_host,
                                     "--port", str(self.settings.edge_port)])
        for stage in (gate, *workers):  # the edge last: it serves only once there is something to hear
            self.stages.append(stage)
            stage.launch(env)
        await self._wait_ready([gate, *workers])
        self.stages.append(edge)
        edge.launch(env)
        await self._wait_healthz(edge)

    async def _wait_ready(self, stages: Sequence[StageProcess]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for stage in stages:
            while not stage._ready.is_set():
                if stage.died() or time.monotonic() > deadline:
                    raise StageStartError(f"{stage.name} did not become ready:\n{stage.tail()}")
                await asyncio.sleep(0.1)

    async def _wait_healthz(self, edge: StageProcess) -> None:
        import aiohttp

        deadline = time.monotonic() + self.start_timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if edge.died() or time.monotonic() > deadline:
                    raise StageStartError(f"edge did not answer /healthz:\n{edge.tail()}")
                try:
                    async with http.get(self.edge_url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.2)

    async def metric(self, stage: str, name: str, labels: dict[str, str] | None = None) -> float:
        """The sum of the samples `name` (with these labels) that `stage`'s /metrics shows now."""
        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families

        async with aiohttp.ClientSession() as http:
            async with http.get(self.metrics_urls[stage], timeout=aiohttp.ClientTimeout(total=5)) as response:
                text = await response.text()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()))

    def by_name(self) -> dict[str, StageProcess]:
        return {stage.name: stage for stage in self.stages}

    def died(self) -> list[str]:
        return [stage.name for stage in self.stages if stage.died()]

    def rss_mb(self) -> dict[str, float]:
        return {stage.name: stage.rss_mb() for stage in self.stages}

    async def stop(self) -> None:
        for stage in reversed(self.stages):
            await asyncio.to_thread(stage.stop)
        self.stages.clear()
