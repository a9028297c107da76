"""Finding live processes by their command line: what the broker, cluster and registry tests use
to prove that a stop left no process behind."""

from __future__ import annotations

from pathlib import Path


def live_pids(*markers: bytes) -> list[int]:
    """Every live (not zombie) process whose command line holds all of `markers`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if all(marker in cmdline for marker in markers) and state != "Z":
            pids.append(int(entry.name))
    return pids


def kafka_pids_under(root: Path) -> list[int]:
    """Every live kafka.Kafka process whose data dir is `root` or below it."""
    return live_pids(b"kafka.Kafka", str(root).encode())
