"""Pipeline stages (gate, synthesis worker, edge) as owned operating-system processes, for the
benchmarks that must see a stage die, grow or come back (`voicebus bench hostile`, `voicebus
bench chaos`). This module is the one home of that mechanism.

`StageProcess` is one stage: its own command line (what a deployment runs), the settings passed
through the environment (`stage_env`: `Settings.to_env`), started in a process group of its own
and asked to die with this process (`voicebus.ops.daemon.popen_dying_with_parent`). `start`
launches it and waits for its readiness signal: a line it prints (the gate's and the worker's
``--announce`` line) or a probe that answers true (the edge's ``/healthz``, `healthz_probe`). Its
output is drained into a ring of recent lines (a full pipe would block the child). It tells
whether it exited by itself (`died`) and its resident memory (`rss_mb`, from
``/proc/<pid>/status``). `kill` is a crash (SIGKILL of its process group, reaped); `stop` a clean
shutdown (SIGTERM, SIGKILL when it does not exit, reaped); `restart` kills it and starts it again
(`start` after `kill` or `stop` does the same).

`StageProcesses` is the hostile benchmark's set: one gate, N workers and one edge started in that
order, each stage's Prometheus ``/metrics`` read by `metric` (the gate and workers get a
``--metrics-port`` of their own), stopped in reverse order. Chaos builds its own three
(`voicebus.ops.bench.chaos.make_stages`: its command lines). `PipelineStack` (pipeline/ops/runtime.py) is
the in-process variant the demo and bench ttfa use; `voicebus.ops.daemon.OwnedProcess` owns the
servers (Kafka, the schema registry) that have pid files and log files instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from voicebus.ops.daemon import free_port, popen_dying_with_parent, signal_group
from voicebus.lifecycle import Owned
from voicebus.settings import Settings

POLL_S = 0.1  # how often a start looks at its readiness signal

Probe = Callable[[], Awaitable[bool]]


class StageStartError(RuntimeError):
    """A stage process exited or did not become ready in time."""


def stage_env(settings: Settings) -> dict[str, str]:
    """The environment of a stage process: this one's, the settings (`Settings.to_env`) and
    unbuffered output (its lines arrive as they are printed)."""
    return {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}


def healthz_probe(url: str, timeout_s: float = 2.0) -> Probe:
    """A readiness probe: true once `url` answers 200."""
    async def probe() -> bool:
        import aiohttp

        try:
            async with aiohttp.ClientSession() as http, \
                    http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    return probe


class StageProcess:
    """One stage process this process owns. Ready when it prints a line starting with
    `ready_line`, or when `probe` answers true. Keeps its last `keep_lines` lines of output.
    Can be started again after `kill` or `stop` (`starts` counts the starts)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], *, ready_line: str | None = None,
                 probe: Probe | None = None, keep_lines: int = 300) -> None:
        if ready_line is None and probe is None:
            raise ValueError(f"stage {name}: a ready line or a probe tells when it is ready")
        self.name, self.cmd, self.env = name, cmd, env
        self.ready_line, self.probe = ready_line, probe
        self.proc: subprocess.Popen | None = None
        self.output: deque[str] = deque(maxlen=keep_lines)
        self.starts = 0
        self._ready = threading.Event()
        self._ended = False  # `kill` or `stop` ended the current process

    # --- start ---------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the process without waiting for it to be ready (`wait_ready`)."""
        if self.running():
            raise StageStartError(f"{self.name} is already running (pid {self.proc.pid})")
        ready = self._ready = threading.Event()  # a new one: an old pump can never mark this start ready
        self._ended = False
        self.starts += 1
        self.proc = popen_dying_with_parent(self.cmd, env=self.env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                            start_new_session=True)
        threading.Thread(target=self._pump, args=(self.proc, ready), daemon=True,
                         name=f"stage-{self.name}-out").start()

    def _pump(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                self.output.append(line.rstrip())
                if self.ready_line is not None and line.startswith(self.ready_line):
                    ready.set()

    async def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the launched process is ready; `StageStartError` if it exits or `timeout` passes."""
        assert self.proc is not None, "launch first"
        deadline = time.monotonic() + timeout
        while True:
            if self._ready.is_set() or (self.probe is not None and await self.probe()):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise StageStartError(f"{self.name} did not get ready (exit {self.proc.poll()}):\n{self.tail(40)}")
            await asyncio.sleep(POLL_S)

    async def start(self, timeout: float = 180.0) -> None:
        """Launch and wait until ready."""
        self.launch()
        await self.wait_ready(timeout)

    # --- end -----------------------------------------------------------------------------------------
    async def kill(self) -> None:
        """A crash: SIGKILL of its process group (no clean shutdown), then reap."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self._ended = True
        signal_group(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)

    async def stop(self, timeout: float = 20.0) -> None:
        """A clean shutdown: SIGTERM of its process group, SIGKILL if it has not exited after
        `timeout`, then reap."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self._ended = True
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)

    async def restart(self, timeout: float = 180.0, while_down: Callable[[], Awaitable[Any]] | None = None) -> None:
        """`kill`, then (after `while_down`, if given) `start` again."""
        await self.kill()
        if while_down is not None:
            await while_down()
        await self.start(timeout)

    # --- what it tells -------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self) -> bool:
        """The process exited by itself (neither `kill` nor `stop` ended it)."""
        return self.proc is not None and self.proc.poll() is not None and not self._ended

    def rss_mb(self) -> float:
        """Resident memory now, MB (0 once it exited)."""
        if not self.running():
            return 0.0
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.output)[-n:])


def log_level_args(log_level: str | None) -> list[str]:
    """``--log-level LEVEL`` for a stage's command line; none for None (the stage's own default)."""
    return [] if log_level is None else ["--log-level", log_level]


class StageProcesses(Owned):
    """One gate, ``workers`` synthesis workers (the tiny seeded model unless ``tiny=False``) and
    one edge, each its own process. Use as ``async with``; `settings` then names the edge's port.
    `log_level`: every stage's (None: WARNING for the gate, the worker's and edge's own INFO);
    `env`: more environment for every stage."""

    def __init__(self, settings: Settings, *, workers: int = 1, tiny: bool = True,
                 start_timeout_s: float = 180.0, log_level: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.settings = settings.replace(edge_port=settings.edge_port or free_port(settings.edge_host))
        self.extra_env = dict(env or {})  # on top of `stage_env`, for every stage
        self.workers = workers
        self.tiny = tiny
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.stages: list[StageProcess] = []
        self.metrics_urls: dict[str, str] = {}  # stage -> its Prometheus /metrics

    @property
    def edge_url(self) -> str:
        return self.settings.edge_url

    async def start(self) -> None:
        from voicebus.gate.app import READY_LINE
        from voicebus.synthesis.cli import WORKER_READY_LINE

        env = {**stage_env(self.settings), **self.extra_env}
        py = sys.executable
        host = self.settings.edge_host
        gate_port = free_port(host)
        self.metrics_urls["gate"] = f"http://{host}:{gate_port}/metrics"
        gate = StageProcess("gate", [py, "-m", "voicebus.gate.cli", "--announce", "--log-level",
                                     self.log_level or "WARNING", "--metrics-port", str(gate_port)],
                            env, ready_line=READY_LINE)
        worker_ports = [free_port(host) for _ in range(self.workers)]
        workers = [StageProcess(f"worker-{i}" if self.workers > 1 else "worker",
                                [py, "-m", "voicebus.synthesis.cli", "--announce", "--worker-id", f"bench-worker-{i}",
                                 "--metrics-port", str(worker_ports[i]), *(["--tiny"] if self.tiny else []),
                                 *log_level_args(self.log_level)],
                                env, ready_line=WORKER_READY_LINE)
                   for i in range(self.workers)]
        for worker, port in zip(workers, worker_ports):
            self.metrics_urls[worker.name] = f"http://{host}:{port}/metrics"
        self.metrics_urls["edge"] = self.edge_url + "/metrics"  # loopback clients only: this one
        edge = StageProcess("edge", [py, "-m", "voicebus", "edge", "--host", self.settings.edge_host,
                                     "--port", str(self.settings.edge_port), *log_level_args(self.log_level)], env,
                            probe=healthz_probe(self.edge_url + "/healthz"))
        deadline = time.monotonic() + self.start_timeout_s
        for stage in (gate, *workers):  # the edge last: it serves only once there is something to hear
            self.stages.append(stage)
            stage.launch()
        for stage in (gate, *workers):
            await stage.wait_ready(deadline - time.monotonic())
        self.stages.append(edge)
        await edge.start(self.start_timeout_s)

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
        """Stop every stage, the last started first."""
        for stage in reversed(self.stages):
            await stage.stop()
        self.stages.clear()
