"""The chaos checker catches planted bugs in real runs (``tests/chaos/plants.py``: a test-only
engine wrapper, or a patched copy of the gateway's source; the code under test is unchanged):
a run carrying a known bug must end with violations of the invariant that bug breaks.

* ``default`` -- every request served on the newest default, not its session's version:
  pinning;
* ``resend`` -- a dispatch that failed after it was sent (its engine SIGKILLed mid-stream) is
  tried on another holder: at most once (seed 214 SIGKILLs engines three times, each while
  it runs a request);
* ``release-on-restart`` -- the gateway registers as an ordinary worker, so its restart
  releases the sessions it bound: continuity (seed 434 SIGKILLs or restarts ``gw-a`` five
  times, so one of them finds sessions it bound still open);
* ``answer-before-commit`` -- the ledger in ``serve`` answers a batch 0.3 s before it appends
  it: durability (seed 1097 SIGKILLs ``serve`` at 9.8 s and 16.1 s, while binds and a
  publication are being acknowledged; a kill must land in the 0.3 s window, so a rerun of a
  seed may miss it: the least certain of the five).
* ``unload-ignores-inflight`` -- the reclaim driver in ``serve`` decides on no in-flight
  evidence: a version whose last session was released while its turn still streams (every
  second session of each client, whatever the seed) is unloaded under that turn: safe reclaim.

Each is a whole cluster run (1-2 minutes on two loaded cores), so they run under ``--slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run
from tests.publisher.rollout_kit import ENGINE_WARNINGS

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
DURATION_S = 25.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plant", "seed", "invariant"),
    [
        ("default", 6, "pinning"),
        ("resend", 214, "at_most_once"),
        ("release-on-restart", 434, "continuity"),
        ("answer-before-commit", 1097, "durability"),
        ("unload-ignores-inflight", 1, "safe_reclaim"),
    ],
)
async def test_the_checker_catches_a_planted_bug_in_a_real_run(
    tmp_path: Path, plant: str, seed: int, invariant: str, slow: bool
) -> None:
    if not slow:
        pytest.skip("each planted run is a whole cluster (1-2 min): they run under --slow")
    summary = await run(seed, DURATION_S, tmp_path, plant=plant)
    assert summary["violations"][invariant] > 0, summary
