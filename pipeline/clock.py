"""Wall-clock timestamps in epoch microseconds, the unit of every `*_at_us` field on the bus."""

import time


def now_us() -> int:
    return time.time_ns() // 1000
