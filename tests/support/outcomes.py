"""Calls started in a task group whose outcome the test reads afterwards, success or failure.

A test that signals a process while requests run needs each request's outcome (its reply, or
the error its caller saw) without one failure cancelling the others, which is what an
exception escaping a task does to its task group."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

from anyio.abc import TaskGroup

T = TypeVar("T")
Args = TypeVarTuple("Args")


def keep_outcome(
    tg: TaskGroup,
    outcomes: list[T | Exception],
    call: Callable[[*Args], Awaitable[T]],
    *args: *Args,
) -> None:
    """Start ``call(*args)`` in ``tg``; append its result, or the exception it raised, to
    ``outcomes`` (in the order the calls end)."""

    async def run() -> None:
        try:
            outcomes.append(await call(*args))
        except Exception as exc:
            outcomes.append(exc)

    tg.start_soon(run)
