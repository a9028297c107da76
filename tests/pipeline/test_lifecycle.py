"""`voicebus.lifecycle.Owned`: ``async with`` starts and stops, and a failed start is stopped too."""

from __future__ import annotations

import pytest

from voicebus.lifecycle import Owned


class Recorder(Owned):
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail:
            raise RuntimeError("half started")

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_async_with_starts_then_stops_and_gives_the_owner():
    owner = Recorder()
    async with owner as entered:
        assert entered is owner and owner.calls == ["start"]
    assert owner.calls == ["start", "stop"]


async def test_a_start_that_fails_is_stopped_before_the_failure_goes_on():
    owner = Recorder(fail=True)
    with pytest.raises(RuntimeError, match="half started"):
        async with owner:
            pytest.fail("the body must not run")
    assert owner.calls == ["start", "stop"]
