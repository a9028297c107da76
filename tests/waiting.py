"""The one way tests wait: poll something they can observe until it holds, or fail saying what.

Tests never sleep a fixed time to let something happen; they wait for its observable effect (a
committed offset, a log line, a consumer-group state, a record on a topic) with `eventually`
(async) or `eventually_sync` (a test thread waiting on a child process).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """What a test waited for did not happen in time."""


def _timed_out(what: str, timeout_s: float, last: Any, detail: Callable[[], str] | None) -> WaitTimeout:
    more = f"; {detail()}" if detail is not None else ""
    return WaitTimeout(f"{what}: not true after {timeout_s:.1f} s (last value {last!r}){more}")


async def eventually(
    probe: Callable[[], T | Awaitable[T]], *, timeout_s: float = 30.0, interval_s: float = 0.05,
    what: str = "condition", detail: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` (sync or async) until it returns something truthy; return that value.
    ``detail`` says, when the wait fails, what was seen by then (it is called only then)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        last = probe()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s, last, detail)
        await asyncio.sleep(interval_s)


def eventually_sync(
    probe: Callable[[], T], *, timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition",
    detail: Callable[[], str] | None = None,
) -> T:
    """`eventually` for synchronous tests (e.g. waiting on a subprocess's output file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s, last, detail)
        time.sleep(interval_s)
