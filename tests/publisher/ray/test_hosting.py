"""PortalHost, without Ray: the hosted context manager lives on the portal's own loop for the
host's whole life, calls reach it from another event loop, closing exits it in order, and a
hosted object that dies on its own is reported (crash-only: ``on_dead``) instead of leaving a
zombie that answers every call with an error."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest

from evlog.errors import LoraLedgerError
from publisher.core.errors import Code
from publisher.ray.hosting import PortalHost

pytestmark = pytest.mark.anyio


class Service:
    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls = 0
        self.closed = False
        self.cancelled = False
        self.boom = anyio.Event()
        self.started = anyio.Event()

    async def where(self) -> int:
        self.calls += 1
        return threading.get_ident()

    async def hang(self) -> None:
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise

    async def explode(self) -> None:
        self.boom.set()


@asynccontextmanager
async def serving() -> AsyncIterator[Service]:
    """Like the ledger: a task group that lives as long as the context, with a background
    task that can fail (as the ledger's writer would on a broken invariant)."""
    service = Service()

    async def background() -> None:
        await service.boom.wait()
        raise RuntimeError("the writer broke")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(background)
            yield service
            tg.cancel_scope.cancel()
    finally:
        service.closed = True


async def test_the_hosted_object_lives_on_the_portal_loop_until_closed() -> None:
    host = await anyio.to_thread.run_sync(lambda: PortalHost(serving, on_dead=None))
    service = host.value
    here = threading.get_ident()
    assert service.thread != here
    assert await host.call(service.where) == service.thread
    assert await host.call(service.where) == service.thread
    assert service.calls == 2 and not service.closed
    await anyio.to_thread.run_sync(host.close)
    assert service.closed
    with pytest.raises(LoraLedgerError) as closed:
        await host.call(service.where)
    assert closed.value.code == Code.LEDGER_CLOSED
    await anyio.to_thread.run_sync(host.close)  # idempotent


async def test_cancelling_the_caller_cancels_the_call_in_the_portal() -> None:
    host = await anyio.to_thread.run_sync(lambda: PortalHost(serving, on_dead=None))
    service = host.value
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(host.call, service.hang)
            with anyio.fail_after(5):
                while not service.started.is_set():  # noqa: ASYNC110 -- another loop's Event
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            while not service.cancelled:  # noqa: ASYNC110 -- set on the portal's loop
                await anyio.sleep(0.01)
        assert await host.call(service.where) == service.thread  # still serving
    finally:
        await anyio.to_thread.run_sync(host.close)


async def test_a_hosted_object_that_dies_on_its_own_is_reported() -> None:
    deaths: list[str] = []
    host = await anyio.to_thread.run_sync(lambda: PortalHost(serving, on_dead=deaths.append))
    service: Any = host.value
    await host.call(service.explode)
    with anyio.fail_after(5):
        while not service.closed:  # noqa: ASYNC110 -- the context exits on the portal's loop
            await anyio.sleep(0.01)
    with pytest.raises(LoraLedgerError) as dead:
        await host.call(service.where)
    assert dead.value.code == Code.LEDGER_CLOSED
    assert len(deaths) == 1 and "stopped" in deaths[0]
    # the original failure is not lost: it resurfaces when the host is closed
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="the writer broke")):
        await anyio.to_thread.run_sync(host.close)
