"""The chaos run: real processes under seeded faults keep every promise.

A fixed set of seeds (``--slow``: twenty, a minute each, about thirty minutes), each a whole
cluster of real ``loraledger`` processes (``tests/chaos/run.py``); the checker
(``tests/chaos/checker.py``) must find no violation of any invariant. Each run prints its
schedule first and its summary (processes, operations, faults by kind, violations by
invariant): a failure is rerun with ``python -m tests.chaos.run --seed N --duration S``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run
from tests.publisher.rollout_kit import ENGINE_WARNINGS

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
SEEDS, DURATION_S = (1, 3), 30.0  # between them: every process kind and signal but freezes
SLOW_SEEDS, SLOW_DURATION_S = tuple(range(1, 21)), 60.0  # about thirty minutes


async def test_real_processes_under_seeded_faults_keep_every_promise(
    tmp_path: Path, slow: bool
) -> None:
    seeds, duration = (SLOW_SEEDS, SLOW_DURATION_S) if slow else (SEEDS, DURATION_S)
    failed: dict[int, dict[str, int]] = {}
    for seed in seeds:
        summary = await run(seed, duration, tmp_path / f"seed-{seed}")
        if any(summary["violations"].values()):
            failed[seed] = summary["violations"]
    print(f"\nseeds {list(seeds)}, {duration:g} s each")
    assert not failed, f"violations by seed (rerun one with its seed): {failed}"
