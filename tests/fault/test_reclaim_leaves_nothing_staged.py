"""A reclaimed version leaves nothing staged on any engine, and nothing can stage its name again.

A restore that fails after an engine restart can leave a version's bytes staged (prepared,
never loaded) on purpose: the version's reclaim drops them with an attempt-fenced unload, and
the fence refuses any late message for that attempt afterwards. Each test stages v1 that way,
retires v1 by publishing v2, and checks the staging is gone once v1 is RECLAIMED, whatever
happened to the reclaim's unload (late, ambiguous, swallowed) or to a late ``prepare``.

Each rule was broken once, seen by the deterministic simulation (``--slow`` seeds) or by
reviewing the fixes, and pinned here on real restartable local engines behind the fault
injector; RELIABILITY.md ("Defects the matrix found") tells the story of each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.contract import Candidate, CleanRefusal, ErrorCode
from engines.local.engine import LocalEngine
from projections.registry import VersionState
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationOutcome
from tests.engines.faulty_engine import Delay, Drop, FaultyEngine, Refuse, ServerError, Swallow
from tests.publisher.plane_kit import adapter_copy, faulty_engines, open_plane
from tests.support.log import events
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
]


async def _v1_staged_on_a_restarted_e0(
    plane: ControlPlane, e0: FaultyEngine
) -> tuple[PublicationOutcome, LocalEngine, Candidate]:
    """Publish v1, restart e0 with every restore refused (e0 stays unroutable), and stage
    v1 on the fresh engine as a failed restore's prepare leaves it: its bytes never loaded.
    Returns v1, the fresh engine and that prepare's candidate."""
    ledger = plane.ledger
    v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
    before = ledger.state.engines["e0"].incarnation
    e0.inject("prepare", Refuse(), times=10_000)
    await e0.inner.restart()  # type: ignore[attr-defined]
    await wait_for(
        "e0's restart to be recorded",
        lambda: ledger.state.engines["e0"].incarnation != before,
        timeout=20,
    )
    fresh: LocalEngine = e0.inner.current  # type: ignore[attr-defined]
    candidate = Candidate(
        lora_name=v1.lora_name,  # type: ignore[arg-type]  # published: named
        digest=v1.digest,
        attempt=ledger.state.versions[1].attempt,
        manifest=adapter_copy(1).manifest,
    )
    await fresh.prepare(candidate)
    return v1, fresh, candidate


async def _v1_reclaimed(plane: ControlPlane) -> None:
    ledger = plane.ledger
    await wait_for(
        "v1 reclaimed",
        lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
        timeout=20,
    )


async def test_a_late_prepare_cannot_stage_a_reclaimed_name_again(tmp_path: Path) -> None:
    """Once v1 is reclaimed, a late duplicate of a restore's ``prepare`` for it is refused.
    Before the fix (found by the simulation, seed 1601), the reclaim's unload was unfenced: it
    dropped the staging area but fenced nothing, so that late duplicate opened a new staging
    area for the reclaimed name (memory nobody would ever free). The reclaim unload carries
    the version's attempt now."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        v1, fresh, late = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        await plane.publisher.publish(adapter_copy(2), version_id=2)  # e1 only; v1 retires
        await _v1_reclaimed(plane)
        assert fresh.staged() == []

        with pytest.raises(CleanRefusal) as refused:
            await fresh.prepare(late)  # the late duplicate of the restore's prepare
        assert refused.value.code in {ErrorCode.STALE_ATTEMPT, ErrorCode.NAME_RECLAIMED}
        assert fresh.staged() == []


async def test_an_ambiguous_reclaim_resolved_by_absence_drops_the_staged_bytes(
    tmp_path: Path,
) -> None:
    """v1's reclaim unload never reaches e0 (503s), and e0's inventory then proves v1 absent:
    the staged bytes are dropped before that absence resolves the reclaim. Before the fix
    (found by the simulation, seed 2893), the reconciler resolved the reclaim from the
    inventory and never unloaded, so the staged bytes stayed in the engine's memory for good.
    An ambiguous reclaim gets an attempt-fenced unload before the inventory is evidence."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        before = ledger.state.engines["e0"].incarnation
        e0.inject("transfer", Drop(), times=10_000)  # restores stage their bytes, never load
        await e0.inner.restart()  # type: ignore[attr-defined]
        fresh = e0.inner.current  # type: ignore[attr-defined]
        await wait_for(
            "the failed restore to stage v1 on the fresh e0",
            lambda: v1.lora_name in fresh.staged(),
            timeout=20,
        )
        assert ledger.state.engines["e0"].incarnation != before

        e0.inject("unload", ServerError(), times=3)  # the first unloads never reach e0
        await plane.publisher.publish(adapter_copy(2), version_id=2)  # on e1; v1 retires
        await _v1_reclaimed(plane)
        recorded = [type(e).__name__ for e in await events(ledger)]
        assert "ReclaimAmbiguous" in recorded
        assert v1.lora_name not in fresh.staged()


async def test_a_reclaim_is_confirmed_by_absence_only_after_its_fenced_unload(
    tmp_path: Path,
) -> None:
    """While v1 is being reclaimed, an inventory without its name confirms the reclaim on that
    engine (and the reclaim driver then skips it): the reconciler must unload first. Before the
    fix (found by reviewing the fixes of the other tests here), when the reconciler read the
    inventory before the driver's slow unload arrived (or after a controller crash that
    followed the claim: the reconciler runs first at start), v1 became RECLAIMED with a failed
    restore's bytes still staged under its name. The reconciler now unloads, attempt-fenced,
    every version being reclaimed before its inventory counts as evidence."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        v1, fresh, _ = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        e0.inject("unload", Delay(seconds=1.0), times=10_000)  # unloads reach e0 late
        await plane.publisher.publish(adapter_copy(2), version_id=2)  # on e1; v1 retires
        await _v1_reclaimed(plane)
        assert fresh.staged() == []  # RECLAIMED only once a fenced unload reached e0


async def test_staging_left_by_a_swallowed_reclaim_unload_is_found_and_dropped(
    tmp_path: Path,
) -> None:
    """e0 answers v1's reclaim unload but never carries it out (a swallowed call): the answer
    confirms the reclaim, yet the next reconciler pass finds the staging (inventories list
    staged names) and drops it with a fenced unload, after which nothing can stage v1's name
    again. Before the fix (found by the simulation, seed 1585), an inventory listed adapters
    only, so no later pass could see the staging and the bytes stayed in the engine for good."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        ledger = plane.ledger
        v1, fresh, late = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        e0.inject("unload", Swallow(), times=10_000)  # e0 answers every unload, does nothing
        await plane.publisher.publish(adapter_copy(2), version_id=2)  # on e1; v1 retires
        await _v1_reclaimed(plane)
        assert "e0" in ledger.state.versions[1].confirmed  # by the swallowed unload's answer
        assert fresh.staged() == [v1.lora_name]  # the unload never reached e0

        e0.clear()  # the engine behaves again: the reconciler's next full pass cleans up
        await plane.reconciler.reconcile()
        assert fresh.staged() == []
        with pytest.raises(CleanRefusal) as refused:
            await fresh.prepare(late)  # fenced: nothing can stage the reclaimed name again
        assert refused.value.code == ErrorCode.STALE_ATTEMPT
