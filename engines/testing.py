"""A restartable in-process engine, for tests and the demo only.

:class:`RestartableEngine` hosts an engine made by a factory (e.g. ``lambda: LocalEngine("e0")``)
in a task of its own and replaces it with a fresh process life on
:meth:`RestartableEngine.restart`: the old life ends (its in-flight requests fail with
``ENGINE_STOPPED``), the new one has a new incarnation and holds nothing, exactly as a restarted
server. The demo uses it to restart an engine mid-story; the tests put the fault-injecting
wrapper (``tests/engines/faulty_engine.py``) around it. A real deployment never needs it: its
engines are separate servers whose restarts are real.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from engines.contract import (
    Bucket,
    Candidate,
    EngineCapabilities,
    Generation,
    Inventory,
    Receipt,
    SamplingParams,
    UnloadReceipt,
    ends_requests,
)


class RestartableEngine:
    """An engine hosted in its own task, restartable from any task.

    ``factory()`` must return an async context manager yielding a started engine (a
    ``LocalEngine`` is one). Use as ``async with RestartableEngine(factory) as engine:``; the
    attributes of the current process life are reachable through :attr:`current`.
    """

    def __init__(self, factory: Callable[[], contextlib.AbstractAsyncContextManager[Any]]) -> None:
        self._factory = factory
        self._current: Any = None
        # created inside the event loop (an anyio Event needs a running backend)
        self._stop: anyio.Event | None = None
        self._up: anyio.Event | None = None
        self._restarting: anyio.Lock | None = None
        self._closing = False
        self._ended = False  # the host task is gone: no life will ever come up again
        self._failed: BaseException | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.lives = 0

    async def __aenter__(self) -> RestartableEngine:
        self._restarting = anyio.Lock()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._host)
        except BaseException:
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        if self._stop is not None:
            self._stop.set()
        assert self._tg is not None
        await self._tg.__aexit__(None, None, None)

    async def _host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await self._lives(task_status)
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            # However the host ends (closing, a restart that failed to start, a life that failed
            # to end), a restart waiting for the next life must wake: it reports the failure.
            self._ended = True
            if self._up is not None:
                self._up.set()

    async def _lives(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        while not self._closing:
            try:
                life = self._factory()
                engine = await life.__aenter__()
            except Exception as exc:
                if self.lives == 0:
                    raise  # the first start failed: ``async with`` reports it
                self._failed = exc  # a restart failed: ``restart()`` reports it
                return
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_exit(life)  # leaves this life as ``async with`` would
                self._current = engine
                stop = self._stop = anyio.Event()
                self.lives += 1
                if self.lives == 1:
                    task_status.started()
                elif self._up is not None:
                    self._up.set()
                await stop.wait()

    async def restart(self) -> None:
        """End the current process life and wait until the next one is up.

        Restarts from several tasks at once run one after another, each a full restart that
        waits for its own next life (a shared wake-up slot let a second caller take the first
        one's, which then waited forever). Raises ``RuntimeError`` when the engine is closing
        or cannot come back (a restart failed earlier): it never waits for a life that will not
        come."""
        assert self._restarting is not None, "the engine is not running"
        async with self._restarting:
            if self._closing or self._ended:
                raise RuntimeError(f"the engine is not running: {self._failed!r}")
            up = self._up = anyio.Event()
            lives = self.lives
            assert self._stop is not None, "the engine is not running"
            self._stop.set()
            await up.wait()
            if self.lives == lives:
                raise RuntimeError(f"the engine did not come back: {self._failed!r}")

    @property
    def current(self) -> Any:
        return self._current

    @property
    def engine_id(self) -> str:
        return self._current.engine_id  # type: ignore[no-any-return]

    @property
    def kind(self) -> str:
        return self._current.kind  # type: ignore[no-any-return]

    @property
    def transport(self) -> Any:
        return self._current.transport

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._current.capabilities  # type: ignore[no-any-return]

    async def incarnation(self) -> str:
        return await self._current.incarnation()  # type: ignore[no-any-return]

    async def inventory(self) -> Inventory:
        return await self._current.inventory()  # type: ignore[no-any-return]

    async def prepare(self, candidate: Candidate) -> Receipt:
        return await self._current.prepare(candidate)  # type: ignore[no-any-return]

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        await self._current.transfer(candidate, buckets)

    async def load(self, candidate: Candidate) -> Receipt:
        return await self._current.load(candidate)  # type: ignore[no-any-return]

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        return await self._current.unload(lora_name, attempt=attempt)  # type: ignore[no-any-return]

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        **kwargs: Any,
    ) -> Generation:
        return await self._current.generate(prompt, lora_name, params, **kwargs)  # type: ignore[no-any-return]

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """The current life's answer (a request of an earlier life ended with it)."""
        ender = ends_requests(self._current)
        return False if ender is None else await ender.abort_request(request_id, lora_name)

    async def aclose(self) -> None:
        """The host owns the engine's life; closing happens when the ``async with`` ends."""
