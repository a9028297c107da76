"""tests/waiting.py, the one way tests wait: a failed wait says what it waited for and what was seen."""

import pytest

from tests.waiting import WaitTimeout, eventually, eventually_sync


async def test_a_failed_wait_names_what_it_waited_for_and_what_was_seen_then():
    seen = []
    calls = []

    def detail():
        calls.append(len(seen))
        return f"{len(seen)} seen"

    with pytest.raises(WaitTimeout, match=r"^the answer: not true after 0\.1 s \(last value 0\); \d+ seen$"):
        await eventually(lambda: seen.append(1) or 0, timeout_s=0.1, interval_s=0.01, what="the answer",
                         detail=detail)
    assert calls == [len(seen)], "detail is asked once, when the wait fails"
    assert await eventually(lambda: 7, what="x", detail=lambda: pytest.fail("not asked on success")) == 7


def test_the_sync_wait_says_the_same():
    with pytest.raises(WaitTimeout, match=r"^a file: not true after 0\.0 s \(last value None\); nothing yet$"):
        eventually_sync(lambda: None, timeout_s=0.01, interval_s=0.005, what="a file", detail=lambda: "nothing yet")
