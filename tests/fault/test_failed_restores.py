"""A failed restore never costs an engine its versions: after an engine restart, a restore that
fails (a lost reply, a duplicate landing late) leaves the committed attempt loadable, and no
clean-up of it can unload the version later.

Both rules were broken once, each seen by the deterministic simulation (``--slow`` seeds) and
pinned here on real restartable local engines behind the fault injector; RELIABILITY.md
("Defects the matrix found") tells the story of each.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from publisher.drivers.plane import ControlPlane
from tests.engines.faulty_engine import Drop, Duplicate, FaultyEngine
from tests.publisher.plane_kit import adapter_copy, faulty_engines, names, open_plane
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
]


async def _restart_e0_until_it_serves(
    plane: ControlPlane, e0: FaultyEngine, name: str | None
) -> None:
    """Restart e0 and wait until the ledger sees its new incarnation repaired: routable and
    holding ``name`` again (the reconciler's restore, through whatever faults were injected)."""
    before = plane.ledger.state.engines["e0"].incarnation
    await e0.inner.restart()  # type: ignore[attr-defined]

    def repaired() -> bool:
        member = plane.ledger.state.engines["e0"]
        return member.incarnation != before and member.routable and name in member.holds

    await wait_for("e0's new life to be repaired, holding v1", repaired, timeout=20)


async def test_a_restore_whose_load_reply_was_lost_leaves_the_committed_attempt_loadable(
    tmp_path: Path,
) -> None:
    """The reconciler's restore of the default version loses its load reply; the next restore
    must still be accepted. Before the fix (found by the simulation, 7 seeds of 3000), the
    clean-up of the failed restore was attempt-fenced: the engine then refused every later
    restore of that committed, never-changing attempt as STALE_ATTEMPT, so it was never
    routable again (with one engine, nothing could be served). The clean-up is not fenced."""
    async with (
        faulty_engines(1, artifact_root=tmp_path / "artifacts") as (e0,),
        open_plane([e0], tmp_path) as plane,
    ):
        published = await plane.publisher.publish(adapter_copy(1), version_id=1)
        name = published.lora_name
        e0.inject("load", Drop())  # the restore's load runs; its reply is lost
        await _restart_e0_until_it_serves(plane, e0, name)
        assert name in await names(e0)


async def test_nothing_unloads_the_default_after_a_failed_restore(tmp_path: Path) -> None:
    """A restore fails after a fresh inventory proved the name absent, the next one succeeds,
    and every unload is duplicated late: the default stays loaded. Before the fix (found by
    the simulation, seeds 1739 and 1912), the reconciler sent an *unfenced* unload to drop what
    the failed restore had staged, and a late duplicate of it unregistered the default under
    bound sessions (NAME_RECLAIMED on their next turn). A failed restore is cleaned up by no
    unload at all now."""
    async with (
        faulty_engines(1, artifact_root=tmp_path / "artifacts") as (e0,),
        open_plane([e0], tmp_path) as plane,
    ):
        published = await plane.publisher.publish(adapter_copy(1), version_id=1)
        name = published.lora_name
        e0.inject("transfer", Drop())  # the first restore's transfer runs; its reply is lost
        e0.inject("unload", Duplicate(delay=1.0), times=10)  # any unload lands again, late
        await _restart_e0_until_it_serves(plane, e0, name)
        await anyio.sleep(1.5)  # past every late duplicate
        assert name in await names(e0)
        assert e0.count("unload") == 0
