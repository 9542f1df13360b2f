"""kill -9 of the whole control plane at every event boundary, and inside write statements.

For every seq ``k`` of a clean run of the scenario (bootstrap, publications, pinned sessions
bound and released, reclaims; the ``--slow`` scenario adds an engine restart and a third
version), the ledger's process is SIGKILLed right after the COMMIT that stored ``k`` and, in a
second run, inside the write statement that would have stored it; a second life finishes the
scenario and :func:`tests.fault.crash_points.judge` checks the log and the engines. Each life's
answers are judged against the file as *its* end left it (read before the next life starts):
the second life re-runs the scenario and would recreate an outcome the first one lost.

CI runs every ``k`` of the compact scenario; ``--slow`` every ``k`` of the full one. One point
alone: ``LORALEDGER_CRASH_POINT=during:17 pytest tests/fault/test_crash_points.py [--slow]``.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import anyio
import pytest

from tests.fault.conftest import record_figure
from tests.fault.crash_points import crash_point

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
CONCURRENT_POINTS = 3  # the children mostly wait on engines and fsync: 2 cores keep up


async def test_every_crash_point_recovers(tmp_path: Path, slow: bool) -> None:
    scenario = "full" if slow else "compact"
    only = os.environ.get("LORALEDGER_CRASH_POINT")
    if only:
        mode, at = only.split(":")
        points = [(mode, int(at))]
    else:
        reference = await crash_point(scenario, "none", 0, tmp_path / "reference")
        points = [(m, k) for m in ("after", "during") for k in range(1, reference.events + 1)]
    failures: list[str] = []
    limiter = anyio.CapacityLimiter(CONCURRENT_POINTS)

    async def one(mode: str, k: int) -> None:
        async with limiter:
            try:
                await crash_point(scenario, mode, k, tmp_path / f"{mode}-{k}")
            except (AssertionError, ExceptionGroup):
                failures.append(
                    f"{mode}:{k}: {traceback.format_exc()[-4000:]}\n"
                    f"  rerun: LORALEDGER_CRASH_POINT={mode}:{k} pytest {__file__}"
                    + (" --slow" if slow else "")
                )

    async with anyio.create_task_group() as tg:
        for mode, k in points:
            tg.start_soon(one, mode, k)
    survived = len(points) - len(failures)
    record_figure(
        "crash points survived",
        f"{survived}/{len(points)} ({scenario} scenario: after and during each of its events)",
    )
    assert not failures, "\n".join(sorted(failures)[:5])
