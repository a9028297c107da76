"""`voicebus demo` stops what it started when the pipeline cannot come up."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from voicebus.cli import build_parser
from voicebus.ops.demo import run_demo

pytestmark = pytest.mark.kafka


def _children() -> list[tuple[int, str]]:
    """(pid, command line) of this process's live children."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue  # it ended while we looked
    return found


def test_an_edge_that_cannot_listen_stops_the_gate_and_worker_already_started(make_settings, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = make_settings(edge_port=busy.getsockname()[1])
        args = build_parser().parse_args(["demo", "--tiny", "--conversations", "support", "--out", str(tmp_path)])
        with pytest.raises(OSError):
            run_demo(args, settings)
    left = [pid for pid, cmd in _children() if "voicebus.gate.cli" in cmd]
    for pid in left:  # only when the assertion below fails: leave no process behind
        os.kill(pid, signal.SIGKILL)
    assert not left  # the gate process was stopped
