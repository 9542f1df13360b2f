"""A deterministic place to run real asyncio code: virtual time, no threads, seeded randomness.

:func:`run_simulated` runs a coroutine on :class:`VirtualTimeLoop` with three substitutions,
each undone when it returns, and nothing else changed:

* **Time.** The loop's clock (``loop.time()``, hence ``anyio.sleep``, ``fail_after``,
  ``move_on_after`` and ``anyio.current_time``) is virtual: it starts at 0 and jumps straight
  to the next timer whenever no callback is ready. Hours of timeouts, lease TTLs and probe
  intervals cost microseconds, and a wall-clock hiccup (a slow CI machine, a GC pause) can
  never reorder two events. Code that wants wall time gets ``EPOCH + loop.time()`` from the
  caller (the ledger's ``clock``).
* **Threads.** ``anyio.to_thread.run_sync`` runs the function inline, after a checkpoint, on
  the loop's thread. Worker threads finish in an order the OS picks, so a run with threads is
  not a function of its seed; inline, the real code (model steps, checksums, artifact writes)
  still runs, in the order the single-threaded loop reaches it. (Nothing in the simulated
  code calls back into the loop from a worker thread.)
* **Randomness.** ``os.urandom`` -- which every ``uuid.uuid4()`` (engine incarnations,
  adapter ids, request ids, transport owners) and every event id draw from -- returns bytes
  from a ``random.Random(seed)``. Ids are then a function of the seed, and so is the whole
  log, byte for byte.

If every task is blocked and no timer is scheduled, nothing could ever happen again: the loop
raises :class:`SimulationDeadlock` instead of waiting forever.

Why not a library: ``looptime`` fakes loop time the same way, but the thread and randomness
substitutions are what make runs reproducible, and they are ours to keep small; this module is
the whole mechanism (about 60 lines of code).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import selectors
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio.lowlevel
import anyio.to_thread

T = TypeVar("T")
EPOCH = 1_750_000_000.0  # the simulated wall clock starts here (a fixed, plausible time)


class SimulationDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: the simulated system hung."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real file descriptors without blocking (the loop's self-pipe is the only one in
    a simulation) and advances virtual time by the timeout the loop asked to sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        loop = self.loop
        assert loop is not None
        if timeout is None:
            raise SimulationDeadlock(f"every task waits and no timer is set (t={loop.now:.3f})")
        loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        # Land exactly on the earliest timer, so float rounding never leaves it unfired.
        scheduled = self._scheduled  # type: ignore[attr-defined]
        target = scheduled[0]._when if scheduled else self.now + seconds
        self.now = max(self.now, target)


async def _inline(
    func: Callable[..., T],
    *args: Any,
    abandon_on_cancel: bool = False,
    cancellable: bool | None = None,
    limiter: Any = None,
) -> T:
    await anyio.lowlevel.checkpoint()
    return func(*args)


@contextlib.contextmanager
def _substituted(seed: int) -> Iterator[None]:
    rng = random.Random(seed)
    saved = (os.urandom, anyio.to_thread.run_sync)
    os.urandom = rng.randbytes
    anyio.to_thread.run_sync = _inline  # type: ignore[assignment]
    try:
        yield
    finally:
        os.urandom, anyio.to_thread.run_sync = saved


def run_simulated(main: Callable[[], Awaitable[T]], *, seed: int) -> T:
    """Run ``main()`` to completion on a fresh virtual-time loop, deterministically."""
    loop = VirtualTimeLoop()
    try:
        with _substituted(seed):
            return loop.run_until_complete(main())
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def sim_clock() -> float:
    """The simulated wall clock (for the ledger, the gateway): ``EPOCH`` + virtual time."""
    return EPOCH + asyncio.get_running_loop().time()
