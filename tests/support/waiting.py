"""Waiting for a condition: the one polling loop of the test suite.

A test waits for what it needs to be true (a version reclaimed, a request in flight), never for
a fixed time: a sleep is either too short on a loaded machine or wastes time everywhere else.
Some states have no event to await (a ledger projection, an engine's counters, a remote status),
so they are polled; when the condition never holds, the test fails saying what it waited for
instead of a bare timeout.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import anyio


async def wait_for(
    what: str,
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 10.0,
    every: float = 0.002,
) -> None:
    """Poll ``condition`` (plain or async) every ``every`` seconds until it holds.

    ``what`` says what is awaited, in words ("v1 reclaimed"): it is the failure message when
    ``timeout`` seconds (of the event loop's clock) pass first. The condition is asked at once,
    so a condition that already holds costs no sleep.
    """
    with anyio.move_on_after(timeout):
        while True:
            held = condition()
            if inspect.isawaitable(held):
                held = await held
            if held:
                return
            await anyio.sleep(every)
    raise TimeoutError(f"gave up waiting for {what} after {timeout:g} s")
