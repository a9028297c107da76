"""The stages' retry policy (voicebus.retry): the backoff's waits and caps, and the bounds of a
retried operation (attempts, deadline, stop), run on a fake sleep and clock (pure tests)."""

from __future__ import annotations

import asyncio

import pytest
from tenacity import wait_incrementing

from voicebus.retry import Backoff, retrying


class Transient(Exception):
    pass


class Fatal(Exception):
    pass


class FakeTime:
    """A clock that only the fake sleep moves; every wait is recorded."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


async def run(attempts_of, fail_times: int, error: type[Exception] = Transient) -> int:
    """Attempts of ``attempts_of`` where the first ``fail_times`` raise ``error``; how many ran."""
    tries = 0
    async for attempt in attempts_of:
        with attempt:
            tries += 1
            if tries <= fail_times:
                raise error(f"failure {tries}")
    return tries


def test_the_backoff_doubles_from_its_first_wait_up_to_its_cap():
    backoff = Backoff(0.1, 2.0)
    assert [backoff.after(n) for n in range(1, 8)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert Backoff(0.1, 5.0).after(10_000) == 5.0  # far past the cap: no overflow
    assert Backoff(0.3, 0.2).after(1) == 0.2  # the cap holds from the first wait
    with pytest.raises(ValueError):
        backoff.after(0)
    with pytest.raises(ValueError):
        Backoff(-1.0, 1.0)


async def test_a_failure_is_retried_with_the_backoff_until_the_operation_succeeds():
    time, seen = FakeTime(), []
    attempts = retrying(wait=Backoff(0.1, 0.5), retry_on=Transient, sleep=time.sleep, clock=time.clock,
                        on_retry=lambda exc, attempt, wait_s: seen.append((str(exc), attempt, wait_s)))
    assert await run(attempts, fail_times=5) == 6
    assert time.waits == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert [(e, a) for e, a, _ in seen] == [(f"failure {n}", n) for n in range(1, 6)]
    assert [w for _, _, w in seen] == time.waits  # what a log line says is what is waited


async def test_a_success_at_once_never_waits():
    time = FakeTime()
    assert await run(retrying(wait=Backoff(0.1, 1.0), sleep=time.sleep), fail_times=0) == 1
    assert time.waits == []


async def test_a_failure_not_retried_is_raised_at_once():
    time = FakeTime()
    with pytest.raises(Fatal, match="failure 1"):
        await run(retrying(wait=Backoff(0.1, 1.0), retry_on=Transient, sleep=time.sleep), fail_times=3, error=Fatal)
    assert time.waits == []
    retried_if = retrying(wait=Backoff(0.1, 1.0), retry_if=lambda exc: "1" not in str(exc), sleep=time.sleep)
    with pytest.raises(Transient, match="failure 1"):
        await run(retried_if, fail_times=3)


async def test_a_cancellation_is_never_retried():
    time = FakeTime()
    with pytest.raises(asyncio.CancelledError):
        await run(retrying(wait=Backoff(0.1, 1.0), retry_on=BaseException, retry_if=lambda exc: True,
                           sleep=time.sleep), fail_times=1, error=asyncio.CancelledError)
    with pytest.raises(asyncio.CancelledError):
        await run(retrying(wait=Backoff(0.1, 1.0), sleep=time.sleep), fail_times=1, error=asyncio.CancelledError)
    assert time.waits == []


async def test_the_last_of_its_attempts_raises_its_own_error():
    time, seen = FakeTime(), []
    attempts = retrying(wait=Backoff(0.1, 1.0), retry_on=Transient, attempts=3, sleep=time.sleep,
                        on_retry=lambda exc, attempt, wait_s: seen.append(attempt))
    with pytest.raises(Transient, match="failure 3"):
        await run(attempts, fail_times=10)
    assert time.waits == pytest.approx([0.1, 0.2]) and seen == [1, 2]  # no wait after the last


async def test_past_its_deadline_a_failure_is_raised():
    time = FakeTime()
    attempts = retrying(wait=Backoff(0.1, 1.0), deadline_s=2.0, sleep=time.sleep, clock=time.clock)
    with pytest.raises(Transient, match="failure 6"):
        await run(attempts, fail_times=100)
    # failures at 0, 0.1, 0.3, 0.7 and 1.5 s are before the deadline: each is retried; the one
    # after the last wait fails past it and is raised
    assert time.waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])
    assert time.now - 100.0 == pytest.approx(2.5)


async def test_the_deadline_counts_from_the_call_and_ends_the_retries_once_reached():
    time = FakeTime()
    attempts = retrying(wait=0.5, deadline_s=1.0, sleep=time.sleep, clock=time.clock)
    time.now += 0.6  # spent before the first attempt (a client starting)
    with pytest.raises(Transient):
        await run(attempts, fail_times=100)
    assert time.waits == [0.5] and time.now - 100.0 == pytest.approx(1.1)


async def test_a_stop_condition_makes_the_failure_final():
    time, stopping = FakeTime(), asyncio.Event()

    async def sleep(seconds: float) -> None:
        await time.sleep(seconds)
        if len(time.waits) == 2:
            stopping.set()  # the stage stops during the second wait

    attempts = retrying(wait=Backoff(0.1, 1.0), stop=stopping.is_set, sleep=sleep)
    with pytest.raises(Transient, match="failure 3"):
        await run(attempts, fail_times=100)
    assert time.waits == pytest.approx([0.1, 0.2])


async def test_a_tenacity_wait_and_plain_seconds_are_waits_too():
    time = FakeTime()
    await run(retrying(wait=wait_incrementing(start=0.1, increment=0.1, max=0.3), sleep=time.sleep), fail_times=4)
    assert time.waits == pytest.approx([0.1, 0.2, 0.3, 0.3])
    time.waits.clear()
    await run(retrying(wait=0.2, sleep=time.sleep), fail_times=2)
    assert time.waits == [0.2, 0.2]


async def test_a_return_inside_an_attempt_ends_the_retries_with_its_value():
    async def send() -> str:
        async for attempt in retrying(wait=Backoff(0.1, 1.0)):
            with attempt:
                return "sent"
        return "not reached"

    assert await send() == "sent"
