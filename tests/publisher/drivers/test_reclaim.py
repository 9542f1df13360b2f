"""ReclaimDriver: a RETIRED version is reclaimed as soon as no binding and no in-flight request
(this process's sources, remote workers' lease reports) can use it -- not before, and without
waiting for the next publication; the evidence is recorded; artifacts go only after RECLAIMED;
an interrupted reclaim is resumed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from engines.local.engine import LocalEngine
from evlog.events import (
    EngineUnloaded,
    InFlight,
    InventoryObserved,
    ReclaimAmbiguous,
    ReclaimClaimed,
    SessionReleased,
    VersionReclaimed,
)
from evlog.memory import MemoryLog, MemoryStore
from projections.registry import VersionRecord, VersionState
from publisher.core.ledger import Ledger
from tests.publisher.plane_kit import PEFT_WARNINGS, adapter_copy, local_engines, names, open_plane
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


class Gauge:
    """An in-flight source as a gateway reports it: one count per (engine, version)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        return [
            InFlight(
                reporter="gw", engine=engine, count=self.counts.get((engine, version_id), 0), at=0.0
            )
            for engine in ("e0", "e1")
        ]


async def test_in_flight_requests_hold_the_reclaim_until_they_finish(tmp_path: Path) -> None:
    gauge = Gauge()
    async with local_engines(2) as engines, open_plane(engines, tmp_path) as plane:
        plane.add_inflight_source(gauge)
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        gauge.counts[("e1", 1)] = 1  # a request on v1 still running on e1
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        sweeps = plane.reclaimer.sweeps
        await wait_for(  # several chances
            "five more reclaim sweeps", lambda: plane.reclaimer.sweeps >= sweeps + 5
        )
        assert plane.ledger.state.versions[1].state is VersionState.RETIRED
        for e in engines:
            assert v1.lora_name in await names(e)
        gauge.counts[("e1", 1)] = 0
        await wait_for(
            "v1 reclaimed", lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        claim = of_type(await events(plane.ledger), ReclaimClaimed)[0]
        assert {(x.reporter, x.engine, x.count) for x in claim.evidence} == {
            ("gw", "e0", 0),
            ("gw", "e1", 0),
        }
        for e in engines:
            assert v1.lora_name not in await names(e)


async def test_remote_workers_in_flight_reports_count_too(tmp_path: Path) -> None:
    async with local_engines(2) as engines, open_plane(engines, tmp_path) as plane:
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("remote", ttl_s=600)
        ledger.renew_lease("remote", {("e0", 1): 2})
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        sweeps = plane.reclaimer.sweeps
        await wait_for("five more reclaim sweeps", lambda: plane.reclaimer.sweeps >= sweeps + 5)
        assert ledger.state.versions[1].state is VersionState.RETIRED
        ledger.renew_lease("remote", {})
        await wait_for(
            "v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        claim = of_type(await events(ledger), ReclaimClaimed)[0]
        assert [(x.reporter, x.count) for x in claim.evidence] == [("remote", 0)]


async def test_a_dead_workers_lease_expiry_unpins_and_reclaims(tmp_path: Path) -> None:
    now = [1000.0]
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, clock=lambda: now[0], lease_check_s=0.02) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("dead", ttl_s=5)
        await ledger.bind("pinned", "dead")
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        await anyio.sleep(0.1)
        assert ledger.state.versions[1].state is VersionState.RETIRED
        now[0] += 10  # the worker stopped renewing
        await wait_for(
            "v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        log = await events(ledger)
        released = of_type(log, SessionReleased)[0]
        assert (released.session, released.cause) == ("pinned", "lease_expired")


async def test_artifacts_are_deleted_only_once_reclaimed(tmp_path: Path) -> None:
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, delete_artifacts_after_s=0.0) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("w", ttl_s=600)
        await ledger.bind("s", "w")
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        await anyio.sleep(0.2)
        assert plane.artifacts.contains(v1.digest)  # RETIRED and bound: kept
        await ledger.release("s", "w")
        await wait_for("v1's artifact deleted", lambda: v1.digest in plane.reclaimer.deleted)
        assert not plane.artifacts.contains(v1.digest)
        assert plane.artifacts.contains(ledger.state.versions[2].digest)
        log = await events(ledger)
        assert of_type(log, VersionReclaimed)[0].version_id == 1


async def test_a_shared_digest_keeps_its_artifact(tmp_path: Path) -> None:
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, delete_artifacts_after_s=0.0) as plane,
    ):
        same = adapter_copy(1)
        await plane.publisher.publish(same, version_id=1)
        await plane.publisher.publish(same, version_id=2)  # another id, the same bytes
        await wait_for(
            "v1 reclaimed", lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        await plane.reclaimer.sweep()
        assert plane.artifacts.contains(same.digest)  # v2 still serves from it


async def _v1_reclaim_left_after_e0(
    engines: Sequence[LocalEngine], tmp_path: Path, log: MemoryLog, *, ambiguous: str = ""
) -> VersionRecord:
    """v1 published, bound, retired by v2; then a controller released the session, claimed
    v1's reclaim, unloaded it from e0 only, recorded that (and, when ``ambiguous`` gives a
    reason, marked e0's unload ambiguous after it) and died. v1 as it was published."""
    async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
        await plane.ledger.register_owner("w", ttl_s=600)
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        await plane.ledger.bind("s", "w")
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        v1 = plane.ledger.state.versions[1]
    async with Ledger.open(MemoryStore(log)) as ledger:
        await ledger.release("s", "w")
        await ledger.claim_reclaim(1)
        receipt = await engines[0].unload(v1.lora_name, attempt=v1.attempt)
        await ledger.record_unloaded(1, "e0", receipt.incarnation)
        if ambiguous:
            await ledger.mark_reclaim_ambiguous(1, "e0", ambiguous)
        assert ledger.state.versions[1].state is VersionState.RECLAIMING
    return v1


async def test_an_interrupted_reclaim_is_resumed_by_the_next_controller(tmp_path: Path) -> None:
    log = MemoryLog()
    async with local_engines(2) as engines:
        v1 = await _v1_reclaim_left_after_e0(engines, tmp_path, log)
        assert v1.lora_name in await names(engines[1])
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            await wait_for(
                "v1 reclaimed",
                lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED,
            )
            for e in engines:
                assert v1.lora_name not in await names(e)
            claims = of_type(await events(plane.ledger), ReclaimClaimed)
            assert len(claims) == 1  # resumed, not claimed again


async def test_an_ambiguous_unload_is_settled_only_by_the_engine_it_names(tmp_path: Path) -> None:
    """A reclaim marked ambiguous on e0 after e0 had proven the name gone (a reconciler's
    unload racing the driver's, whose reply was lost) completes only once e0 proves it again:
    the next controller's reconciler gets that proof from e0 before the slot is freed. Before,
    e1's confirmation alone completed it, on e0's proof from before the mark."""
    log = MemoryLog()
    async with local_engines(2) as engines:
        lost = "a racing unload's reply was lost"
        v1 = await _v1_reclaim_left_after_e0(engines, tmp_path, log, ambiguous=lost)
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            await wait_for(
                "v1 reclaimed",
                lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED,
            )
            story = await events(plane.ledger)
            for e in engines:
                assert v1.lora_name not in await names(e)
        marked = next(i for i, e in enumerate(story) if isinstance(e, ReclaimAmbiguous))
        done = next(i for i, e in enumerate(story) if isinstance(e, VersionReclaimed))
        proofs_from_e0 = [
            e
            for e in story[marked + 1 : done]
            if (isinstance(e, EngineUnloaded) and e.engine == "e0")
            or (
                isinstance(e, InventoryObserved)
                and e.engine == "e0"
                and v1.lora_name not in e.adapters
            )
        ]
        assert proofs_from_e0, story[marked:]
