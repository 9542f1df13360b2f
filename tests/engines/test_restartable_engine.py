"""The restartable host of ``engines.testing``: a restart never waits for a life that will not
come -- concurrent restarts each get a life of their own, and once a restart failed, the next
one is refused at once instead of waiting forever."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from engines.local.engine import LocalEngine
from engines.testing import RestartableEngine

pytestmark = pytest.mark.anyio

# A hang guard, not a timing: each test below waited forever before its fix.
HANG_GUARD_S = 120


async def test_concurrent_restarts_each_wait_for_their_own_life(anyio_backend: str) -> None:
    """Regression: restarts from two tasks at once (two Restart faults on concurrent calls, as
    the seeded simulation draws them) shared one wake-up slot; the second overwrote the first's,
    and the first waited forever."""
    async with RestartableEngine(lambda: LocalEngine("e0")) as host:
        first = await host.incarnation()
        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.restart)
                tg.start_soon(host.restart)
        assert host.lives == 3  # one full restart each
        assert await host.incarnation() != first


async def test_a_restart_after_a_failed_restart_is_refused(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Regression: once a restart failed (the next life did not start), the host was gone, and a
    second restart waited forever for a life that could not come."""
    starts: list[int] = []

    def factory() -> LocalEngine:
        starts.append(1)
        if len(starts) == 1:
            return LocalEngine("e0")
        return LocalEngine("e0", model_dir=tmp_path / "no-such-model")  # a real failed start

    async with RestartableEngine(factory) as host:
        with anyio.fail_after(HANG_GUARD_S):
            with pytest.raises(RuntimeError, match="did not come back"):
                await host.restart()
            with pytest.raises(RuntimeError, match="not running"):
                await host.restart()
        assert host.lives == 1 and len(starts) == 2
