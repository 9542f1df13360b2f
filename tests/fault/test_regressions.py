"""Regression tests for the defects the fault matrix found, one per defect, named after it.

Each one failed before its fix (checked by reverting the fix in a scratch worktree)."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from engines.local.engine import LocalEngine
from engines.local.server import serve
from evlog.memory import MemoryStore
from publisher.fleet import Fleet
from publisher.plane import ControlPlane
from tests.fault.simloop import run_simulated, sim_clock


@pytest.mark.anyio
async def test_regression_serve_cancelled_left_its_listener_registered() -> None:
    """``serve()`` ended by cancelling its scope (how a structured-concurrency block ends)
    used to skip uvicorn's shutdown: the listener stayed registered with the event loop while
    its socket was closed, so the next server of that loop whose socket reused the file
    descriptor accepted TCP connections and never answered them (found by the crash-point
    harness: fresh engines per crash point hung on their first request)."""
    async with LocalEngine("e0") as engine:
        for _ in range(4):
            with anyio.CancelScope() as scope:
                async with serve(engine) as url:
                    async with httpx.AsyncClient(trust_env=False) as client:
                        response = await client.get(f"{url}/health", timeout=5)
                    assert response.status_code == 200
                    scope.cancel()
            assert scope.cancelled_caught


def test_regression_plane_timers_ran_on_the_wall_clock(tmp_path: Path) -> None:
    """The reconciler's full-pass period (and the reclaim driver's artifact grace) read
    ``time.monotonic`` while every sleep and timeout of the plane read the event loop's
    clock. On a virtual-time loop (the deterministic simulation) 95 simulated seconds passed in
    a few real milliseconds, so no full pass ever ran and a stray nobody reported stayed on
    its engine forever. Now every timer of the plane reads the loop's clock."""

    async def main() -> int:
        async with (
            LocalEngine("e0") as engine,
            ControlPlane.open(
                MemoryStore(),
                Fleet([engine]),
                deployment="dep",
                prefix="agent",
                capacity=2,
                artifact_root=tmp_path / "artifacts",
                full_reconcile_s=30.0,
                clock=sim_clock,
            ) as plane,
        ):
            before = plane.reconciler.passes
            await anyio.sleep(95.0)
            return plane.reconciler.passes - before

    assert run_simulated(main, seed=1) >= 3  # one full pass per 30 simulated seconds
