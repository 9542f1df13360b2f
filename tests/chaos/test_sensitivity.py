"""The chaos checker catches planted bugs in real runs: a run whose engines carry a known bug
(``tests/chaos/recording_engine.py``'s ``--plant``, a test-only wrapper: the code under test
is unchanged) must end with violations of the invariant that bug breaks.

* ``default``: every request served on the adapter loaded last (the newest default) instead
  of its session's version -- pinning;
* ``unload-ignores-inflight``: an adapter's weights freed without waiting for its running
  requests -- safe reclaim.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run
from tests.publisher.rollout_kit import ENGINE_WARNINGS

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
SEED, DURATION_S = 3, 20.0


@pytest.mark.parametrize(
    ("plant", "invariant"),
    [("default", "pinning"), ("unload-ignores-inflight", "safe_reclaim")],
)
async def test_the_checker_catches_a_planted_bug_in_a_real_run(
    tmp_path: Path, plant: str, invariant: str
) -> None:
    summary = await run(SEED, DURATION_S, tmp_path, plant=plant)
    assert summary["violations"][invariant] > 0, summary
