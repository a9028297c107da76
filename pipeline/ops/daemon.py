"""Servers the project runs itself as operating-system processes, and the Maven fetch of their jars.

This module owns what the local Kafka nodes (`voicebus.ops.broker`, `voicebus.ops.cluster`) and the local schema registry
(`voicebus.ops.registry_server`) have in common, so each of those says only what is its own (its
command line, its configuration, how to tell that it answers):

* `OwnedProcess`: one server process launched in its own process group (so it outlives a CLI
  ``start``), optionally asked to die with its parent (a test session killed without finalizers
  must not leave a broker behind), with a pid file that another process (the CLI's ``status`` /
  ``stop``) uses to find it. A pid is trusted only while ``/proc/<pid>/cmdline`` still carries the
  server's marker: pids are recycled. `stop` sends SIGTERM, then SIGKILL, and reaps; `kill` is a
  crash (SIGKILL, no controlled shutdown).
* `maven_fetch`: resolve artifacts with the machine's Maven into a staging folder under a lock
  file, then rename the finished folder into place, so concurrent callers (several test sessions)
  never use a half-copied one and a killed fetch leaves nothing that looks complete.
* `popen_dying_with_parent`: every child asked to die with this process is forked from one
  thread that lives as long as the process (see its docstring for why).
* `free_port`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

COMPLETE_MARK = ".complete"


class DaemonError(RuntimeError):
    """A server process could not be launched, found or stopped."""


class MavenFetchError(DaemonError):
    """Maven is missing or could not resolve (or we could not install) the artifacts."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OwnedProcess:
    """The process of one server: launched here or found through its pid file.

    `marker`: bytes that only this server's command line holds (e.g. its data dir), checked
    against ``/proc/<pid>/cmdline`` before any signal is sent to a pid read from the file.
    """

    def __init__(self, pid_file: Path, markers: Sequence[bytes], die_with_parent: bool = False) -> None:
        self.pid_file = Path(pid_file)
        self.markers = tuple(markers)
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen | None = None

    def launch(self, cmd: Sequence[str], log_file: Path, cwd: Path, keep_fds: Sequence[int] = ()) -> int:
        """Start `cmd` without waiting for it to answer; its output goes to `log_file`. `keep_fds`
        are inherited by the process (a `state_lock`: the server holds it while it runs)."""
        with open(log_file, "ab") as out:
            popen = popen_dying_with_parent if self.die_with_parent else subprocess.Popen
            self._proc = popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               cwd=cwd, start_new_session=True, pass_fds=tuple(keep_fds))
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self._proc.pid

    def exited(self) -> int | None:
        """The exit code of the process this object launched, or None while it runs (or if
        another process launched it)."""
        return self._proc.poll() if self._proc is not None else None

    def launched_and_exited(self) -> int | None:
        """During a start: the exit code if the process launched here has already died (its pid
        file is then removed), else None."""
        code = self.exited()
        if code is not None:
            self.forget()
        return code

    def pid(self) -> int | None:
        """The pid of the live server (launched here or found by the pid file), or None."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        pid = self._read_pid()
        return pid if pid is not None and self.is_ours(pid) else None

    def is_ours(self, pid: int) -> bool:
        if not alive(pid):
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return all(marker in cmdline for marker in self.markers)

    def signal(self, sig: int) -> int | None:
        """Send `sig` to the server's process group without waiting; its pid, or None."""
        pid = self.pid()
        if pid is not None:
            signal_group(pid, sig)
        return pid

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM (a clean shutdown), SIGKILL after `timeout`; True if one was stopped."""
        pid = self.pid()
        if pid is None:
            self.forget()
            return False
        signal_group(pid, signal.SIGTERM)
        if not self._wait_gone(pid, timeout):
            signal_group(pid, signal.SIGKILL)
            self._wait_gone(pid, 10.0)
        self.forget()
        return True

    def kill(self, timeout: float = 10.0) -> int | None:
        """SIGKILL (a crash); returns the pid once the process is gone, None if none ran."""
        pid = self.pid()
        if pid is None:
            self.forget()
            return None
        signal_group(pid, signal.SIGKILL)
        if not self._wait_gone(pid, timeout):
            raise DaemonError(f"process {pid} survived SIGKILL for {timeout:.0f} s")
        self.forget()
        return pid

    def forget(self) -> None:
        """Drop the pid file and reap a child that has exited."""
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0)

    def _wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not alive(pid):
                return True
            time.sleep(0.05)
        return False

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None


@contextlib.contextmanager
def state_lock(path: Path, what: str):
    """An exclusive lock on `path` (created if missing), or `DaemonError` at once when another
    process holds it; yields its file descriptor. A server launched inside with the descriptor in
    `OwnedProcess.launch`'s ``keep_fds`` keeps the lock for as long as it runs, so two processes
    can never set up and run servers from one state directory at once."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DaemonError(f"{what} is in use by another process (its lock {path} is held)") from None
        yield fd
    finally:
        os.close(fd)


def maven_fetch(
    target: Path,
    pom: Path,
    goal_args: Sequence[str],
    what: str,
    install: Callable[[Path, Path], None],
) -> Path:
    """Resolve artifacts with ``mvn -f pom dependency:copy-dependencies`` and install them into
    `target` (idempotent). ``install(download_dir, staging_dir)`` checks what Maven brought and
    builds the finished folder in `staging_dir` (raising `MavenFetchError` when it is wrong); the
    staging folder is renamed to `target` only once complete."""
    if (target / COMPLETE_MARK).exists():
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MavenFetchError("Maven (`mvn`) is not on PATH; install it (Debian: apt-get install maven)")
    if not pom.exists():
        raise MavenFetchError(f"{pom} is missing: it ships with the repository")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / COMPLETE_MARK).exists():
            return target  # another process fetched it while we waited
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            download, staging = work / "download", work / "staging"
            staging.mkdir()
            cmd = [mvn, "-q", "-B", "-f", str(pom), *goal_args, "dependency:copy-dependencies", f"-DoutputDirectory={download}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=target.parent)
            if proc.returncode != 0:
                out = (proc.stdout + proc.stderr)[-3000:]
                raise MavenFetchError(f"mvn could not resolve {what} (exit {proc.returncode}):\n{out}")
            install(download, staging)
            (staging / COMPLETE_MARK).write_text(target.name + "\n")
            if target.exists():
                shutil.rmtree(target)  # an incomplete leftover from a killed fetch
            staging.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def terminate_when_parent_dies() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it when its parent dies. Use it through
    `popen_dying_with_parent`: "parent" is the forking *thread*."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen_dying_with_parent(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` of a child that Linux SIGTERMs when this process dies.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a
    child forked from a worker thread (`asyncio.to_thread`, an executor) was killed as soon as the
    executor retired that thread, e.g. when the event loop that owned it closed. (bench chaos
    restarted a killed broker from `asyncio.to_thread`; the broker died with the test module's
    loop, and the next tests found a 3-node cluster of 2.) So every such child is forked from one
    spawner thread that lives until the process exits."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voicebus-spawner")
    return _spawner.submit(subprocess.Popen, args, preexec_fn=terminate_when_parent_dies, **kwargs).result()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait() is missing
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, sig)  # started with start_new_session: the group id is the pid
        except PermissionError:
            os.kill(pid, sig)
