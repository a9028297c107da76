"""Owned server processes: launched in their own group, found through the pid file only while
the command line is theirs, stopped or killed leaving nothing behind."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from voicebus.ops.daemon import COMPLETE_MARK, MavenFetchError, OwnedProcess, alive, maven_fetch
from tests.processes import live_pids


def _sleeper(tmp_path: Path, marker: str) -> list[str]:
    # a marker argument the process ignores: how a server's command line is recognised
    return [sys.executable, "-c", "import time, sys; time.sleep(120)", marker]


def test_launch_find_by_pid_file_and_stop(tmp_path: Path):
    marker = f"--voicebus-test={tmp_path}"
    owned = OwnedProcess(tmp_path / "x.pid", [marker.encode()])
    pid = owned.launch(_sleeper(tmp_path, marker), tmp_path / "x.log", tmp_path)
    assert os.getpgid(pid) == pid  # its own group: it outlives a CLI `start`
    other = OwnedProcess(tmp_path / "x.pid", [marker.encode()])  # another process, as the CLI's `stop`
    assert other.pid() == pid
    assert other.stop(timeout=5)
    assert not live_pids(marker.encode())
    assert not (tmp_path / "x.pid").exists()
    assert owned.exited() is not None


def test_a_recycled_pid_is_not_trusted(tmp_path: Path):
    (tmp_path / "x.pid").write_text(f"{os.getpid()}\n")  # alive, but not the server
    owned = OwnedProcess(tmp_path / "x.pid", [b"--voicebus-not-this-one"])
    assert owned.pid() is None
    assert not owned.stop() and alive(os.getpid())


def test_kill_is_a_crash_and_returns_once_gone(tmp_path: Path):
    marker = f"--voicebus-test={tmp_path}"
    owned = OwnedProcess(tmp_path / "x.pid", [marker.encode()])
    pid = owned.launch(_sleeper(tmp_path, marker), tmp_path / "x.log", tmp_path)
    assert owned.kill() == pid
    assert owned.exited() == -signal.SIGKILL
    assert owned.kill() is None


def test_a_failed_fetch_leaves_nothing_that_looks_complete(tmp_path: Path):
    pom = tmp_path / "pom.xml"
    pom.write_text("<project>not a pom</project>")
    with pytest.raises(MavenFetchError, match="could not resolve"):
        maven_fetch(tmp_path / "out" / "1.0", pom, [], "nothing", lambda download, staging: None)
    assert not (tmp_path / "out" / "1.0").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".1.0.lock"]


def test_a_complete_folder_is_used_without_running_maven(tmp_path: Path):
    target = tmp_path / "out" / "1.0"
    target.mkdir(parents=True)
    (target / COMPLETE_MARK).write_text("1.0\n")
    assert maven_fetch(target, tmp_path / "absent-pom.xml", [], "x", lambda d, s: None) == target  # complete: no Maven run


def test_a_server_launched_from_a_thread_that_ends_keeps_running(tmp_path: Path):
    """A broker restarted from `asyncio.to_thread` died when the executor retired that thread
    (PR_SET_PDEATHSIG follows the forking thread, not the process): bench chaos's broker_leader
    fault left the test session's 3-node cluster with 2 nodes once its module's event loop
    closed. A server asked to die with its parent must outlive the thread that launched it."""
    import subprocess
    import threading

    marker = f"--voicebus-test={tmp_path}"
    owned = OwnedProcess(tmp_path / "x.pid", [marker.encode()], die_with_parent=True)
    launched: list[int] = []
    thread = threading.Thread(target=lambda: launched.append(
        owned.launch(_sleeper(tmp_path, marker), tmp_path / "x.log", tmp_path)))
    thread.start()
    thread.join()
    try:
        # what must *not* happen is the parent-death SIGTERM, which comes within milliseconds of
        # the thread's end; 2 s without it is the observation
        with pytest.raises(subprocess.TimeoutExpired):
            owned._proc.wait(timeout=2)
        assert alive(launched[0])
    finally:
        owned.kill()
    assert not live_pids(marker.encode())
