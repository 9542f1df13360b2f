"""The one wait of the suite fails saying what it waited for, and takes async conditions."""

from __future__ import annotations

import anyio
import pytest

from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio


async def test_a_condition_that_never_holds_fails_naming_what_was_awaited() -> None:
    with pytest.raises(TimeoutError, match=r"gave up waiting for v1 reclaimed after 0\.05 s"):
        await wait_for("v1 reclaimed", lambda: False, timeout=0.05)


async def test_a_condition_is_asked_until_it_holds_plain_or_async() -> None:
    asked: list[int] = []

    def third_time() -> bool:
        asked.append(1)
        return len(asked) == 3

    await wait_for("the third ask", third_time)
    assert len(asked) == 3

    ready = anyio.Event()

    async def is_ready() -> bool:
        return ready.is_set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for, "the event", is_ready)
        await anyio.sleep(0.01)
        ready.set()
