"""PortalHost: keep an async context manager open for the whole life of a Ray actor.

The ledger, the control plane and the local engine all own a task group (the writer, the
drivers, the engine's jobs), so each must live inside an ``async with`` that some task keeps
open. A Ray actor has no such task: its methods are independent calls, and a background
``asyncio.create_task`` from ``__init__`` would be owned by nobody (its failure unobserved,
its cancellation undefined).

So the actor holds an anyio blocking portal (a private event loop thread) as a context manager,
and enters the hosted context manager *inside* that portal; the portal's task group is the
structured owner of everything the hosted object starts. ``__init__`` opens it (so Ray's own
actor restarts reopen it: a restarted ledger actor replays its log in ``__init__``), actor
methods reach it with :meth:`PortalHost.call` (one thread hop each way, measured to cost about
as much as Ray's own async-actor dispatch, i.e. little next to a Ray round trip), and
:meth:`PortalHost.close` exits it in order (snapshots, drains) before the actor goes away.

Crash-only: if the hosted object dies on its own (its task group failed, e.g. the ledger
writer stopped on a broken invariant), the portal stops; the next call then ends the process
(``on_dead``) so Ray restarts the actor from the durable log instead of leaving a zombie that
answers every call with an error.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager
from typing import Any, Generic, NoReturn, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from publisher.core.errors import Code, LedgerError
from publisher.logs import get_logger

T = TypeVar("T")
R = TypeVar("R")

log = get_logger("loraledger.ray")

DEAD_EXIT_STATUS = 70  # EX_SOFTWARE: an unexpected death, so Ray's max_restarts applies


def exit_process(reason: str) -> None:
    """Default ``on_dead``: end the actor's process so Ray restarts it (an intended exit,
    ``ray.actor.exit_actor``, would not be restarted)."""
    log.critical("ray.hosted_object_died", reason=reason, pid=os.getpid())
    os._exit(DEAD_EXIT_STATUS)


class PortalHost(Generic[T]):
    """``factory()`` builds the async context manager (on the portal's loop, where it will
    live); its entered value is :attr:`value`."""

    def __init__(
        self,
        factory: Callable[[], AbstractAsyncContextManager[T]],
        *,
        name: str = "hosted object",
        on_dead: Callable[[str], None] | None = exit_process,
    ) -> None:
        self.name = name
        self._on_dead = on_dead
        self._stack = ExitStack()
        self._closed = False
        self._stopped = False  # the hosted context exited (on close, or on its own)
        try:
            portal: BlockingPortal = self._stack.enter_context(start_blocking_portal())
            manager = self._watched(portal.call(factory))
            self.value: T = self._stack.enter_context(portal.wrap_async_context_manager(manager))
        except BaseException:
            self._stack.close()
            raise
        self._portal = portal

    async def call(self, func: Callable[..., Awaitable[R]], *args: Any) -> R:
        """Run ``func(*args)`` on the hosted loop and await its result from the caller's
        (asyncio) loop. Cancelling the caller cancels the call in the portal."""
        if self._closed:
            raise LedgerError(Code.LEDGER_CLOSED, f"the {self.name} was closed")
        if self._stopped:
            self._died("its context exited on its own")
        try:
            return await self._portal.call_async(func, *args)
        except RuntimeError as exc:
            if self._closed or not self._stopped:
                raise
            self._died(str(exc))

    def _died(self, detail: str) -> NoReturn:
        reason = f"the {self.name} stopped: {detail}"
        if self._on_dead is not None:
            self._on_dead(reason)
        raise LedgerError(Code.LEDGER_CLOSED, reason)

    @asynccontextmanager
    async def _watched(self, manager: AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
        try:
            async with manager as value:
                yield value
        finally:
            self._stopped = True

    def close(self) -> None:
        """Exit the hosted context manager, then stop the portal (blocking: call it from a
        worker thread of an async actor). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stack.close()
