"""Sharded edges in tests: several edges of one group, in this process (aiohttp test servers on
ports chosen up front, so each publishes its real URL) or as `voicebus edge` child processes
(what a SIGKILL test kills), and waiting until their shares have settled."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from voicebus.settings import Settings
from voicebus.topics import partition_of
from voicebus.players.edge import LINK_KEY, make_app
from tests.conftest import distinct_free_ports
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


def edge_settings_at(settings: Settings, port: int, name: str) -> Settings:
    return settings.replace(edge_port=port, edge_id=name, edge_public_url=f"ws://127.0.0.1:{port}/ws")


@contextlib.asynccontextmanager
async def inprocess_edge(settings: Settings, port: int, name: str):
    """One edge app of the group on 127.0.0.1:`port`; yields (app, client)."""
    app = make_app(edge_settings_at(settings, port, name))
    async with TestClient(TestServer(app, host="127.0.0.1", port=port)) as client:
        yield app, client


def shares_settled(links, partitions: int) -> bool:
    """Every partition is owned by exactly one of `links`, and each one's directory says so."""
    owned = [set(link.owned) for link in links]
    if sum(len(o) for o in owned) != partitions or set().union(*owned) != set(range(partitions)):
        return False
    for link in links:
        for p in range(partitions):
            claim = link.directory.owner(p)
            if claim is None or p not in next(o for o, lk in zip(owned, links) if lk.edge_id == claim.edge_id):
                return False
    return True


async def wait_settled(apps, partitions: int, timeout_s: float = 60.0) -> None:
    links = [app[LINK_KEY] for app in apps]
    await eventually(lambda: shares_settled(links, partitions), timeout_s=timeout_s,
                     what=f"{len(links)} edges share {partitions} partitions and agree on who owns which")


def session_on(partitions: int, wanted: set[int], prefix: str = "S") -> str:
    """A session id whose partition is in `wanted`."""
    for i in range(10_000):
        sid = f"{prefix}{i}"
        if partition_of(sid, partitions) in wanted:
            return sid
    raise AssertionError(f"no session id hashes to {wanted}")


class EdgeProcess:
    """`voicebus edge` as a child process that the test owns (kill or terminate, then wait)."""

    def __init__(self, settings: Settings, port: int, name: str, log_path: Path) -> None:
        self.settings = edge_settings_at(settings, port, name)
        self.port, self.name = port, name
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, **self.settings.to_env(), "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "voicebus", "edge"], env=env, cwd=str(ROOT),
                                     stdout=self._log, stderr=subprocess.STDOUT)

    async def shard(self) -> dict | None:
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(self.url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    body = await response.json()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        return body.get("shard") if body.get("kafka") == "ready" else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


async def wait_processes_settled(edges: list[EdgeProcess], partitions: int, timeout_s: float = 90.0) -> dict:
    """Until every edge answers and their /healthz shares agree; returns {edge name: owned partitions}."""
    async def probe():
        shards = [await e.shard() for e in edges]
        if any(s is None for s in shards):
            return None
        owned = {s["edge_id"]: set(s["owned"]) for s in shards}
        if sorted(p for o in owned.values() for p in o) != list(range(partitions)):
            return None
        for s in shards:
            if any(owner is None or int(p) not in owned.get(owner, ()) for p, owner in s["owners"].items()):
                return None
        return owned

    return await eventually(probe, timeout_s=timeout_s, interval_s=0.2,
                            what=f"edges {[e.name for e in edges]} share {partitions} partitions")


def free_ports(n: int) -> list[int]:
    return distinct_free_ports(n)
