"""The local engine's life: what it is built from, how it starts and stops, and the jobs it owns.

:class:`EngineLifecycle` is the base of :class:`~engines.local.engine.LocalEngine`'s rooms
(:mod:`~engines.local.residency`, :mod:`~engines.local.managed_path`,
:mod:`~engines.local.sglang_path`, :mod:`~engines.local.generation`), which are mixins over it:
they share one task group, one name table and one lock order, so that state is declared here
once and each room holds only its behaviour.

* **Engine-owned jobs.** State-changing work (install, unregister + drain) always runs in the
  engine's task group (:meth:`EngineLifecycle._submit`) and callers only *wait* for it, so a
  caller that is cancelled or disconnects can neither cancel a drain nor leave a half-installed
  adapter behind -- without any shielding. Stopping the engine cancels the jobs one by one; their
  waiters get ``ENGINE_STOPPED``.
* **Lock order.** ``_compat_lock`` (SGLang's ``lora_update_lock``, taken by the ordinary path
  only) is always taken before ``_control_lock`` (one control-plane mutation of the name table
  at a time), never the other way round.
* **Model work** goes through :mod:`engines.local.scheduler` (worker threads behind a limiter of
  one, one prefill or one token per call): the event loop never blocks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self, TypeVar

import anyio
import torch

from engines.contract import AmbiguousReply, EngineError, ErrorCode, Transport
from engines.local.admission import ServingLimits
from engines.local.model import ModelRunner
from engines.local.name_table import NameTable
from engines.local.scheduler import Scheduler
from engines.local.tinymodel import SERVED_NAME, ensure_tiny_model

T = TypeVar("T")


class _Outcome:
    """Result slot of an engine-owned job; waiters never own the work."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.value: Any = None


class EngineLifecycle:
    """The engine's state, its start and stop, and the jobs it runs (module docstring). Not used
    on its own: :class:`~engines.local.engine.LocalEngine` is the engine."""

    def __init__(
        self,
        engine_id: str = "local",
        *,
        model_dir: str | os.PathLike[str] | None = None,
        limits: ServingLimits | None = None,
        artifact_root: str | os.PathLike[str] | None = None,
        transport: Transport = "staged",
        threads: int = 1,
        prefix_cache_entries: int = 64,
        implicit_reload: bool = True,
        served_model_name: str = SERVED_NAME,
    ) -> None:
        self.engine_id = engine_id
        self.transport: Transport = transport
        self.limits = limits or ServingLimits()
        self.artifact_root = Path(artifact_root).resolve() if artifact_root else None
        self.implicit_reload = implicit_reload
        self.served_model_name = served_model_name
        self._model_dir = Path(model_dir) if model_dir else None
        self._threads = threads
        self._prefix_cache_entries = prefix_cache_entries
        self._incarnation = uuid.uuid4().hex
        self.startup_time = time.time()
        # names and residency (name_table, residency)
        self._names = NameTable()
        self._freed: dict[str, anyio.Event] = {}  # adapter id -> set once physically freed
        # the model and its worker, set when the engine starts
        self._runner: ModelRunner | None = None
        self._module_shapes: dict[str, tuple[int, int]] = {}
        self._scheduler: Scheduler | None = None
        # the task group of engine-owned jobs, and whether the engine stopped
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._job_scopes: set[anyio.CancelScope] = set()
        # requests by id (generation): set once the request ended and gave its adapter back;
        # and ids aborted before they started, refused if they arrive later (bounded, oldest out)
        self._live: dict[str, anyio.Event] = {}
        self._aborted: dict[str, None] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        model_dir = self._model_dir
        if model_dir is None:
            model_dir = await anyio.to_thread.run_sync(ensure_tiny_model)
        torch.set_num_threads(self._threads)
        runner = await anyio.to_thread.run_sync(
            functools.partial(
                ModelRunner, Path(model_dir), prefix_cache_entries=self._prefix_cache_entries
            )
        )
        self._runner = runner
        self._module_shapes = runner.module_shapes()
        self._scheduler = Scheduler(runner, self.engine_id)
        self._control_lock = anyio.Lock()  # one control-plane mutation at a time
        self._compat_lock = anyio.Lock()  # SGLang's lora_update_lock (ordinary path only)
        self._stack = contextlib.AsyncExitStack()
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self.startup_time = time.time()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Stop: pending drains and jobs are cancelled (their waiters get ENGINE_STOPPED) and
        in-flight generations end with ENGINE_STOPPED at their next token."""
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        # Cancel the jobs one by one, never the task group's own scope: that scope also covers
        # the task that entered the engine (the caller's code inside ``async with``).
        for scope in list(self._job_scopes):
            scope.cancel()

    @property
    def model_dir(self) -> Path:
        return self._require_runner().model_dir

    def _require_runner(self) -> ModelRunner:
        if self._runner is None or self._tg is None or self._closed:
            raise AmbiguousReply(
                ErrorCode.ENGINE_STOPPED,
                f"engine {self.engine_id} is not running",
                engine_id=self.engine_id,
            )
        return self._runner

    def _require_scheduler(self) -> Scheduler:
        self._require_runner()
        assert self._scheduler is not None
        return self._scheduler

    async def _submit(self, job: Callable[[], Awaitable[T]]) -> T:
        """Run ``job`` in the engine's task group and wait for it. Cancelling the waiter does
        not cancel the job: state changes are never left half-done by a vanished caller."""
        self._require_runner()
        assert self._tg is not None
        outcome = _Outcome()

        async def run() -> None:
            finished = False
            try:
                with anyio.CancelScope() as scope:
                    self._job_scopes.add(scope)
                    try:
                        outcome.value = await job()
                    except Exception as exc:
                        outcome.error = exc
                    finished = True
            finally:
                self._job_scopes.discard(scope)
                if not finished:  # cancelled by aclose() or by whoever stops the engine
                    outcome.error = AmbiguousReply(
                        ErrorCode.ENGINE_STOPPED,
                        f"engine {self.engine_id} stopped before the operation finished",
                        engine_id=self.engine_id,
                    )
                outcome.done.set()

        self._tg.start_soon(run)
        await outcome.done.wait()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[no-any-return]

    def _tag(self, exc: EngineError) -> EngineError:
        exc.engine_id = self.engine_id
        return exc

    # --- identity and state --------------------------------------------------------------------

    async def incarnation(self) -> str:
        self._require_runner()
        return self._incarnation

    @property
    def incarnation_id(self) -> str:
        return self._incarnation
