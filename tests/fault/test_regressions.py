"""Regression tests for the defects the fault matrix found, one per defect, named after it.

Each one failed before its fix (checked by reverting the fix in a scratch worktree)."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from engines.artifacts import ArtifactError, ArtifactStore
from engines.contract import Candidate, CleanRefusal, ErrorCode
from engines.local.engine import LocalEngine, resolve_under
from engines.local.server import serve
from evlog.errors import LoraLedgerError
from evlog.memory import MemoryStore
from projections.registry import VersionState
from publisher import commands as c
from publisher.errors import Code
from publisher.fleet import Fleet
from publisher.ledger import Ledger
from publisher.plane import ControlPlane
from publisher.publication import PublicationOutcome
from tests.engines.faulty_engine import (
    Delay,
    Drop,
    Duplicate,
    FaultyEngine,
    Refuse,
    ServerError,
    Swallow,
)
from tests.fault.simloop import run_simulated, sim_clock
from tests.publisher.plane_kit import adapter_copy, faulty_engines, names, open_plane
from tests.support.log import events
from tests.support.waiting import wait_for


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


@pytest.mark.anyio
async def test_regression_ill_typed_command_stopped_the_ledger_writer() -> None:
    """``Forget(sessions=None)`` (a Python caller's mistake; struct constructors do not check
    types) raised a TypeError inside the decider, which stopped the ledger's single writer:
    every later command of every caller got LEDGER_CLOSED. It is now refused with a code and
    the ledger goes on."""
    async with Ledger.open(MemoryStore()) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        await ledger.register_owner("w", ttl_s=60)
        seq = ledger.state.last_seq
        with pytest.raises(LoraLedgerError) as refused:
            await ledger.execute(c.Forget(sessions=None))  # type: ignore[arg-type]
        assert refused.value.code == Code.INVALID_INPUT
        assert ledger.state.last_seq == seq
        assert (await ledger.release("s1", "w")).released is False  # still serving


@pytest.mark.anyio
async def test_regression_ill_typed_value_was_stored_in_an_event_that_no_longer_decodes() -> None:
    """``join_engine(..., endpoint=5)`` was accepted and stored as ``EngineJoined(endpoint=5)``;
    the payload then failed its own schema on every read, so the log could no longer be
    replayed (CORRUPT_RECORD at that seq, forever). It is now refused before anything is
    written."""
    store = MemoryStore()
    async with Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        with pytest.raises(LoraLedgerError) as refused:
            await ledger.join_engine("e0", "i1", endpoint=5)  # type: ignore[arg-type]
        assert refused.value.code == Code.INVALID_INPUT
        await ledger.join_engine("e0", "i1", endpoint="http://127.0.0.1:1")
    assert [r.type for r in await store.read()][-1] == "EngineJoined"


def test_regression_nul_byte_in_an_adapter_path_escaped_as_a_bare_valueerror(
    tmp_path: Path,
) -> None:
    """An engine-supplied adapter path with a NUL byte made ``Path.resolve`` raise a bare
    ``ValueError`` out of ``ArtifactStore.resolve`` and the local engine's path check (which a
    publication then took for an ambiguous engine failure). Both now refuse it with
    ``PATH_OUTSIDE_STORE``."""
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ArtifactError) as refused:
        store.resolve("abc\x00def")
    assert refused.value.code == "PATH_OUTSIDE_STORE"
    for root in (None, store.root):
        with pytest.raises(CleanRefusal) as clean:
            resolve_under(root, "x\x00y")
        assert clean.value.code == ErrorCode.PATH_OUTSIDE_STORE


@pytest.mark.anyio
async def test_regression_renewal_with_a_negative_inflight_count_was_accepted() -> None:
    """``POST /owners/{owner}/renew`` (and ``Ledger.renew_lease``) accepted a count of -7
    requests in flight: the reclaim driver sums every reporter's counts, so it could cancel
    another worker's running request (an unload under it), or hold a version forever. It is
    now refused and nothing is renewed."""
    async with Ledger.open(MemoryStore()) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        await ledger.register_owner("w", ttl_s=60)
        for bad in ({("e0", 1): -7}, {("e0", 0): 1}, {("", 1): 1}, {("e0", 1): True}):
            with pytest.raises(LoraLedgerError) as refused:
                ledger.renew_lease("w", bad)
            assert refused.value.code == Code.INVALID_INPUT
        assert ledger.inflight_evidence(1)[0].count == 0
        ledger.renew_lease("w", {("e0", 1): 2})
        assert ledger.inflight_evidence(1)[0].count == 2


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


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_a_failed_restore_fenced_the_committed_attempt_out_forever(
    tmp_path: Path,
) -> None:
    """Found by the simulation (--slow, 7 seeds of 3000): an engine restarted, the reconciler's
    restore of the default version lost its load reply, and the cleanup of that failed restore
    was attempt-fenced -- the engine then refused every later restore of that (committed,
    never-changing) attempt as STALE_ATTEMPT, so the engine was never routable again (with
    one engine, nothing could be served). The cleanup of a restore is not fenced now."""
    async with (
        faulty_engines(1, artifact_root=tmp_path / "artifacts") as (e0,),
        open_plane([e0], tmp_path) as plane,
    ):
        published = await plane.publisher.publish(adapter_copy(1), version_id=1)
        name = published.lora_name
        e0.inject("load", Drop())  # the restore's load runs; its reply is lost
        await _restart_e0_until_it_serves(plane, e0, name)
        assert name in await names(e0)


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


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_a_late_duplicate_prepare_staged_a_reclaimed_name_again(
    tmp_path: Path,
) -> None:
    """Found by the simulation (--slow, seed 1601): a restarted engine's restore of v1 staged
    v1's name and never loaded it; v1 was then retired and reclaimed, and the reclaim's
    unfenced unload dropped the staging area but fenced nothing, so a late duplicate of the
    restore's prepare opened a new staging area for the reclaimed name (memory nobody would
    ever free). The reclaim unload is attempt-fenced now: that duplicate is refused."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        ledger = plane.ledger
        v1, fresh, late = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        await plane.publisher.publish(adapter_copy(2), version_id=2)  # e1 only; v1 retires
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=20,
        )
        assert fresh.staged() == []

        with pytest.raises(CleanRefusal) as refused:
            await fresh.prepare(late)  # the late duplicate of the restore's prepare
        assert refused.value.code in {ErrorCode.STALE_ATTEMPT, ErrorCode.NAME_RECLAIMED}
        assert fresh.staged() == []


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_a_late_duplicate_of_a_restore_cleanup_unloaded_the_default(
    tmp_path: Path,
) -> None:
    """Found by the simulation (--slow, seeds 1739 and 1912): after a failed restore that a
    fresh inventory proved absent, the reconciler sent an *unfenced* unload to drop what the
    restore had staged. The next restore succeeded, and then a late duplicate of that unload
    unregistered the version -- the default, with sessions bound to it (NAME_RECLAIMED on
    their next turn). A failed restore is not cleaned up by any unload now."""
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


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_an_ambiguous_reclaim_resolved_by_absence_left_a_staged_candidate(
    tmp_path: Path,
) -> None:
    """Found by the simulation (--slow, seed 2893): a restarted engine's restore of v1 staged
    its bytes and lost the reply; v1 was retired, and its reclaim unload on that engine was
    ambiguous (a 503). The reconciler resolved the reclaim from the inventory (v1 absent) and
    never unloaded, so the staged bytes stayed in the engine's memory for good. An ambiguous
    reclaim now gets an attempt-fenced unload before the inventory is taken as evidence."""
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
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=20,
        )
        recorded = [type(e).__name__ for e in await events(ledger)]
        assert "ReclaimAmbiguous" in recorded
        assert v1.lora_name not in fresh.staged()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_a_reclaim_confirmed_by_absence_before_its_unload_left_staged_bytes(
    tmp_path: Path,
) -> None:
    """Found by review of the fixes above: while a version is being reclaimed, an inventory
    without its name confirms the reclaim on that engine, and the reclaim driver then skips
    it. When the reconciler read the inventory before the driver's unload arrived (a slow
    unload; or a controller crash after the claim, since the reconciler runs first at start),
    the version was RECLAIMED with a failed restore's bytes still staged under its name.
    The reconciler now unloads (attempt-fenced) every version being reclaimed before its
    inventory counts as evidence."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        ledger = plane.ledger
        v1, fresh, _ = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        e0.inject("unload", Delay(seconds=1.0), times=10_000)  # unloads reach e0 late
        await plane.publisher.publish(adapter_copy(2), version_id=2)  # on e1; v1 retires
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=20,
        )
        assert fresh.staged() == []  # RECLAIMED only once a fenced unload reached e0


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning")
async def test_regression_a_swallowed_reclaim_unload_left_a_failed_restores_staging(
    tmp_path: Path,
) -> None:
    """Found by the simulation (--slow, seed 1585): a restarted engine's restore of v1 staged
    v1's bytes and failed (left on purpose: the reclaim's fenced unload is what drops them).
    v1 was then retired, and the reclaim's unload on that engine was answered but never
    carried out (a swallowed call). The answer confirmed the reclaim, v1 became RECLAIMED, and
    no later pass could see the staging -- an inventory listed adapters only -- so the bytes
    stayed in the engine for good. Inventories now report staged names, and the reconciler
    unloads (attempt-fenced) what is staged for a version that is over."""
    async with (
        faulty_engines(2, artifact_root=tmp_path / "artifacts") as (e0, e1),
        open_plane([e0, e1], tmp_path) as plane,
    ):
        ledger = plane.ledger
        v1, fresh, late = await _v1_staged_on_a_restarted_e0(plane, e0)
        assert fresh.staged() == [v1.lora_name]

        e0.inject("unload", Swallow(), times=10_000)  # e0 answers every unload, does nothing
        await plane.publisher.publish(adapter_copy(2), version_id=2)  # on e1; v1 retires
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=20,
        )
        assert "e0" in ledger.state.versions[1].confirmed  # by the swallowed unload's answer
        assert fresh.staged() == [v1.lora_name]  # the unload never reached e0

        e0.clear()  # the engine behaves again: the reconciler's next full pass cleans up
        await plane.reconciler.reconcile()
        assert fresh.staged() == []
        with pytest.raises(CleanRefusal) as refused:
            await fresh.prepare(late)  # fenced: nothing can stage the reclaimed name again
        assert refused.value.code == ErrorCode.STALE_ATTEMPT
