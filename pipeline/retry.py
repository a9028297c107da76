"""Retries with backoff: the one policy the stages' retry loops share, built on tenacity.

- `Backoff(initial_s, max_s)`: the wait after each failure in a row, ``initial_s`` doubling up to
  ``max_s``, without jitter (each stage retries its own request; nothing is contended). It is a
  tenacity wait strategy, and `Backoff.after` gives the same wait to a loop that counts its
  failures itself (a commit loop that starts the doubling again after a success).
- `retrying(...)`: a tenacity `AsyncRetrying` for ``async for attempt in retrying(...): with
  attempt: ...``, with the bounds the stages use: a number of attempts, a deadline, a stop
  condition, or none (until it succeeds). A failure that is not retried, or the last one, is
  raised as it is; ``on_retry`` (a log line, a metric) runs before each wait.

The sleep and the clock are injectable, so tests run a backoff without waiting.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, stop_any, stop_never,
                      wait_fixed)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

__all__ = ["Backoff", "retrying"]


class Backoff(wait_base):
    """Doubling waits, capped, no jitter: ``initial_s`` after the first failure, then twice the
    previous wait, never more than ``max_s``."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if initial_s < 0 or max_s < 0:
            raise ValueError(f"a backoff needs waits >= 0, not {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s

    def after(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (1: the first)."""
        if failures < 1:
            raise ValueError(f"a wait follows at least one failure, not {failures}")
        try:
            return min(self.max_s, self.initial_s * 2.0 ** (failures - 1))
        except OverflowError:  # a very long run of failures: long past the cap
            return self.max_s

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.after(retry_state.attempt_number)

    def __repr__(self) -> str:
        return f"Backoff({self.initial_s!r}, {self.max_s!r})"


class _Deadline(stop_base):
    """Stops once ``clock()`` has reached ``seconds`` after this object was made."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.at = clock() + seconds

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.clock() >= self.at


class _When(stop_base):
    """Stops once ``condition()`` holds."""

    def __init__(self, condition: Callable[[], bool]) -> None:
        self.condition = condition

    def __call__(self, retry_state: RetryCallState) -> bool:
        return bool(self.condition())


def retrying(*, wait: wait_base | float,
             retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
             retry_if: Callable[[BaseException], bool] | None = None,
             attempts: int | None = None,
             deadline_s: float | None = None,
             stop: Callable[[], bool] | None = None,
             on_retry: Callable[[BaseException, int, float], None] | None = None,
             sleep: Callable[[float], Awaitable[None]] | None = None,
             clock: Callable[[], float] = time.monotonic) -> AsyncRetrying:
    """Attempts of one operation, for ``async for attempt in retrying(...): with attempt: ...``.

    A failure is retried when it is one of ``retry_on`` and ``retry_if(error)`` holds, if given
    (never one that is no `Exception`: a cancellation, an interrupt), after ``wait`` (a `Backoff`,
    any tenacity wait, or seconds), unless a bound is reached: ``attempts`` attempts made,
    ``deadline_s`` seconds passed on ``clock`` since this call, or ``stop()`` true (an
    ``asyncio.Event``'s ``is_set``, a job's flag). The bounds are checked when an attempt fails;
    none given, it is retried until it succeeds. A failure not retried, and the last one, is
    raised as it is. ``on_retry(error, attempt, wait_s)`` runs before each wait (``attempt`` is
    the number of the one that failed, from 1). The attempts of one call are iterated once.
    """
    stops = []
    if attempts is not None:
        stops.append(stop_after_attempt(attempts))
    if deadline_s is not None:
        stops.append(_Deadline(deadline_s, clock))
    if stop is not None:
        stops.append(_When(stop))

    def retried(error: BaseException) -> bool:
        return isinstance(error, Exception) and isinstance(error, retry_on) and (retry_if is None or retry_if(error))

    def before_sleep(state: RetryCallState) -> None:
        assert on_retry is not None and state.outcome is not None
        on_retry(state.outcome.exception(), state.attempt_number, state.upcoming_sleep)

    return AsyncRetrying(
        wait=wait if isinstance(wait, wait_base) else wait_fixed(wait),
        retry=retry_if_exception(retried),
        stop=stop_any(*stops) if stops else stop_never,
        before_sleep=before_sleep if on_retry is not None else None,
        sleep=sleep if sleep is not None else asyncio.sleep,
        reraise=True)
