"""`Owned`: the one ``async with`` of the things that start processes, clients or tasks and must
stop them: the synthesis worker, the SDK's publisher and heard follower, the listener, a pipeline
stack, a bench's stage processes, a chaos run.

A subclass writes `start` and `stop`; its `stop` must release whatever a `start` that failed half
way had started. ``async with`` then stops it on the way out, and also when `start` itself fails,
before the failure goes on up: nothing started is left behind.
"""

from __future__ import annotations

from typing import Any, TypeVar

O = TypeVar("O", bound="Owned")


class Owned:
    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: O) -> O:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
