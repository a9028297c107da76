"""One rate limit for everything that takes requests from outside: a token bucket (pure; the clock
is passed in). The edge limits each player's cancels, reports and pings with it; the codec its
lookups of schema ids the registry does not know."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TokenBucket:
    """A token bucket (pure; the clock is passed in): `take` spends one token if there is one.
    Refills at `rate_per_s` up to `burst` tokens."""

    rate_per_s: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.stamp = float(self.burst), self.clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.stamp) * self.rate_per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
