"""Regression tests for the defects the fault matrix found, one per defect, named after it.

Each one failed before its fix (checked by reverting the fix in a scratch worktree)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from engines.local.engine import LocalEngine
from engines.local.server import serve

pytestmark = pytest.mark.anyio


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
