"""`voicebus.ops.bench.stages.StageProcess`, the one stage-process mechanism of the benchmarks (chaos
and hostile), on real child processes (small Python programs standing in for a stage): ready by
a line or by a probe, a start that fails says why, `kill` takes the whole process group and
reaps, `stop` escalates to SIGKILL, `restart` brings a new process, `died` tells an exit by
itself from one this process caused."""

from __future__ import annotations

import os
import signal
import sys
import uuid

import pytest

from voicebus.ops.bench.stages import StageProcess, StageStartError, healthz_probe
from voicebus.ops.daemon import free_port
from tests.processes import live_pids
from tests.waiting import eventually

READY = "stage ready"


def stage(name: str, code: str, **kwargs) -> StageProcess:
    return StageProcess(name, [sys.executable, "-c", code], dict(os.environ), **kwargs)


def sleeper(marker: str, before: str = "") -> str:
    """A child that (after `before`) starts a grandchild in its group, says it is ready, and waits."""
    return (f"import subprocess, sys, time\n{before}\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
            f"print({READY!r}, flush=True)\ntime.sleep(600)\n")


async def test_kill_takes_the_process_group_reaps_it_and_a_restart_is_a_new_ready_process():
    marker = f"--stage-test-{uuid.uuid4().hex}"
    st = stage("s", sleeper(marker), ready_line=READY)
    try:
        await st.start(timeout=60)
        first = st.pid
        assert st.running() and st.starts == 1 and st.rss_mb() > 0
        await eventually(lambda: live_pids(marker.encode()), what="the grandchild runs")
        await st.kill()
        assert st.proc.returncode == -signal.SIGKILL  # reaped: a crash, no clean shutdown
        assert not st.running() and not st.died() and st.rss_mb() == 0.0
        await eventually(lambda: not live_pids(marker.encode()), what="the grandchild went with its group")
        await st.restart(timeout=60)
        assert st.running() and st.pid != first and st.starts == 2
        await st.restart(timeout=60)  # a restart of a running stage kills it first
        assert st.starts == 3 and st.output.count(READY) == 3
    finally:
        await st.stop()
    assert st.proc.returncode == -signal.SIGTERM and not st.died()
    await eventually(lambda: not live_pids(marker.encode()), what="no grandchild left behind")


async def test_stop_kills_a_stage_that_ignores_sigterm():
    code = sleeper(f"--stage-test-{uuid.uuid4().hex}", before="import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    st = stage("stubborn", code, ready_line=READY)
    await st.start(timeout=60)
    await st.stop(timeout=0.5)
    assert st.proc.returncode == -signal.SIGKILL and not st.died()


async def test_a_stage_that_exits_before_it_is_ready_fails_its_start_with_its_output_and_counts_as_died():
    st = stage("broken", "print('config is wrong', flush=True); raise SystemExit(3)", ready_line=READY)
    with pytest.raises(StageStartError, match=r"broken did not get ready \(exit 3\):\n(.|\n)*config is wrong"):
        await st.start(timeout=60)
    assert st.died()


async def test_a_stage_killed_from_outside_counts_as_died():
    st = stage("victim", f"import time; print({READY!r}, flush=True); time.sleep(600)", ready_line=READY)
    try:
        await st.start(timeout=60)
        os.kill(st.pid, signal.SIGKILL)  # the kernel's OOM killer, say: not this process's kill
        await eventually(st.died, what="the stage seen dead")
        assert st.rss_mb() == 0.0
    finally:
        await st.kill()
    assert st.died(), "a kill after the fact does not hide that it died by itself"


async def test_a_probe_tells_when_a_stage_without_a_ready_line_serves():
    port = free_port()
    code = ("import http.server\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200 if self.path == '/healthz' else 404); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    st = stage("server", code, probe=healthz_probe(f"http://127.0.0.1:{port}/healthz"))
    try:
        await st.start(timeout=60)
        assert st.running()
    finally:
        await st.stop()
    assert not await healthz_probe(f"http://127.0.0.1:{port}/healthz")()


def test_a_stage_needs_a_readiness_signal():
    with pytest.raises(ValueError):
        StageProcess("x", [sys.executable, "-c", "pass"], {})
