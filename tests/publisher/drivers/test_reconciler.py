"""Reconciler: fleet changes as ledger events (join + repair, leave, start-up), strays of this
deployment unloaded (and only those), drift found by the periodic full pass."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, Candidate, CleanRefusal, ErrorCode
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import running_server
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from evlog.events import (
    EngineJoined,
    EngineLeft,
    EngineRepaired,
    EngineRestarted,
    EngineSuspended,
    InventoryObserved,
    VersionReclaimed,
    VersionRestored,
)
from evlog.memory import MemoryLog, MemoryStore
from projections.registry import VersionState
from publisher.core.outcomes import Allocated
from publisher.drivers.adapter_copy import aiter_buckets, plan_buckets
from tests.engines.faulty_engine import Delay, FaultyEngine
from tests.publisher.plane_kit import (
    GREEDY,
    LIMITS,
    PEFT_WARNINGS,
    PROMPT,
    adapter_copy,
    faulty_engines,
    local_engines,
    names,
    open_plane,
)
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

IDLE = 3600.0


async def load_managed(engine: LocalEngine, name: str, seed: int) -> None:
    """Put a managed (prepare/transfer/load) adapter on an engine behind the ledger's back."""
    config, tensors = make_adapter(seed)
    manifest = build_manifest(config, tensors)
    candidate = Candidate(lora_name=name, digest=manifest.digest, attempt=1, manifest=manifest)
    await engine.prepare(candidate)
    await engine.transfer(candidate, aiter_buckets(plan_buckets(tensors)))
    await engine.load(candidate)


async def test_only_strays_of_this_deployment_are_unloaded(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "foreign")
    config, tensors = make_adapter(50)
    foreign_dir = store.put(build_manifest(config, tensors), tensors)
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE) as plane,
    ):
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        stray = "agent@dep-99-0123456789abcdef"  # our prefix, unknown to the ledger
        other = "agent@other-1-0123456789abcdef"  # another deployment's name
        await load_managed(engines[0], stray, 51)
        await load_managed(engines[0], other, 52)
        await engines[0].load_ordinary("someone-else", str(foreign_dir))
        report = await plane.reconciler.reconcile()
        assert report.unloaded == (f"e0:{stray}",)
        assert await names(engines[0]) == {v1.lora_name, other, "someone-else"}
        observed = [e for e in of_type(await events(plane.ledger), InventoryObserved)]
        first_e0 = next(e for e in observed if e.engine == "e0" and stray in e.adapters)
        assert other not in first_e0.adapters and "someone-else" not in first_e0.adapters
        assert plane.ledger.state.engines["e0"].strays == ()


async def test_the_periodic_full_pass_finds_drift_nobody_reported(tmp_path: Path) -> None:
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.02, full_reconcile_s=0.1) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        stray = "agent@dep-77-0123456789abcdef"
        await load_managed(engines[1], stray, 53)
        passes = plane.reconciler.passes
        await wait_for("two more reconciler passes", lambda: plane.reconciler.passes > passes + 1)
        assert stray not in await names(engines[1])


async def test_a_joined_engine_is_repaired_before_it_is_routable(tmp_path: Path) -> None:
    async with (
        local_engines(2) as engines,
        LocalEngine("e2", limits=LIMITS) as newcomer,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("w", ttl_s=600)
        await ledger.bind("pinned", "w")
        v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
        seq = ledger.state.last_seq
        report = await plane.add_engine(newcomer)
        assert report.joined == ("e2",) and report.repaired == ("e2",)
        assert sorted(report.restored) == ["e2:1", "e2:2"]
        assert {v1.lora_name, v2.lora_name} <= await names(newcomer)
        log = await events(ledger, after=seq)
        kinds = [type(e) for e in log]
        assert kinds[0] is EngineJoined and kinds[-1] is EngineRepaired
        assert kinds.count(VersionRestored) == 2
        assert ledger.state.holders(v1.lora_name) == ("e0", "e1", "e2")  # type: ignore[arg-type]
        g = await newcomer.generate(PROMPT, v1.lora_name, GREEDY)
        ref = await engines[0].generate(PROMPT, v1.lora_name, GREEDY)
        assert g.token_ids == ref.token_ids  # the same bytes, restored from the artifact store


async def test_a_repair_restores_every_missing_version_past_the_held_ones(
    tmp_path: Path,
) -> None:
    """e1 was out (suspended) while v2 was published: it still holds v1 (pinned by a session,
    so needed too) and lacks v2. Its repair skips what it holds and restores the rest."""
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("w", ttl_s=600)
        await ledger.bind("pinned", "w")  # v1 stays needed after v2
        await ledger.suspend_engine("e1", cause="unhealthy", detail="out for a while")
        v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert v2.lora_name not in await names(engines[1])
        report = await plane.reconciler.reconcile_engine("e1")
        assert report.restored == ("e1:2",) and report.repaired == ("e1",), report
        assert v2.lora_name in await names(engines[1])


async def test_a_fatal_candidate_on_an_engine_outside_its_fleet_is_unloaded_first(
    tmp_path: Path,
) -> None:
    """A FAILED_FATAL attempt resolves only when no member holds its candidate, so an engine
    that joined after the attempt and holds the name must be cleaned (attempt-fenced) too, or
    publication stays blocked behind the fatal entry."""
    async with (
        local_engines(2) as engines,
        LocalEngine("e2", limits=LIMITS) as newcomer,
        open_plane(engines, tmp_path, capacity=3, probe_interval_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v2 = await ledger.allocate(2, "ab" * 32)
        assert isinstance(v2, Allocated)
        await ledger.fail_attempt(2, v2.attempt, clean=False, code="X", reason="lost reply")
        await load_managed(newcomer, v2.lora_name, 54)
        report = await plane.add_engine(newcomer)
        assert report.unloaded == (f"e2:{v2.lora_name}",)
        assert v2.lora_name not in await names(newcomer)
        report = await plane.reconciler.reconcile()  # e0 and e1 prove absence
        assert report.resolved == (2,)
        assert ledger.state.versions[2].state is VersionState.FAILED_RETRYABLE
        assert ledger.state.blocked_by() == []


async def test_a_fatal_candidate_an_engine_never_staged_is_cleaned_fenced(tmp_path: Path) -> None:
    """The candidate's name is on a joining engine that never staged it (loaded there by path,
    behind the ledger's back): its cleanup is still fenced by the attempt, so a late duplicate
    of that attempt's prepare is refused there afterwards."""
    store = ArtifactStore(tmp_path / "by-hand")
    config, tensors = make_adapter(54)
    manifest = build_manifest(config, tensors)
    by_hand = store.put(manifest, tensors)
    async with (
        local_engines(2) as engines,
        LocalEngine("e2", limits=LIMITS) as newcomer,
        open_plane(engines, tmp_path, capacity=3, probe_interval_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v2 = await ledger.allocate(2, manifest.digest)
        assert isinstance(v2, Allocated)
        await ledger.fail_attempt(2, v2.attempt, clean=False, code="X", reason="lost reply")
        await newcomer.load_ordinary(v2.lora_name, str(by_hand))
        report = await plane.add_engine(newcomer)
        assert report.unloaded == (f"e2:{v2.lora_name}",)
        late = Candidate(
            lora_name=v2.lora_name, digest=manifest.digest, attempt=v2.attempt, manifest=manifest
        )
        with pytest.raises(CleanRefusal) as refused:
            await newcomer.prepare(late)
        assert refused.value.code == ErrorCode.STALE_ATTEMPT


async def test_a_stray_of_a_reclaimed_version_an_engine_never_staged_is_cleaned_fenced(
    tmp_path: Path,
) -> None:
    """The same for a stray of a known version (here reclaimed): its cleanup is fenced by the
    version's last attempt, which is over, so a late duplicate of that attempt's prepare is
    refused there afterwards."""
    snap = adapter_copy(1)
    store = ArtifactStore(tmp_path / "by-hand")
    config, tensors = make_adapter(1)
    by_hand = store.put(build_manifest(config, tensors), tensors)
    async with (
        local_engines(2) as engines,
        LocalEngine("e2", limits=LIMITS) as newcomer,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(snap, version_id=1)
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        await wait_for(
            "v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        assert v1.lora_name is not None and v1.attempt is not None
        await newcomer.load_ordinary(v1.lora_name, str(by_hand))
        report = await plane.add_engine(newcomer)
        assert f"e2:{v1.lora_name}" in report.unloaded
        late = Candidate(
            lora_name=v1.lora_name, digest=snap.digest, attempt=v1.attempt, manifest=snap.manifest
        )
        with pytest.raises(CleanRefusal) as refused:
            await newcomer.prepare(late)
        assert refused.value.code == ErrorCode.STALE_ATTEMPT


async def test_a_leaving_engine_completes_a_reclaim_waiting_only_for_it(tmp_path: Path) -> None:
    async with local_engines(2) as inner:
        engines: list[Any] = [inner[0], FaultyEngine(inner[1])]
        engines[1].inject("unload", Delay(seconds=60))  # e1 never answers the reclaim
        async with open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane:
            ledger = plane.ledger
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            await plane.publisher.publish(adapter_copy(2), version_id=2)
            await wait_for(
                "e0's unload of v1 confirmed", lambda: "e0" in ledger.state.versions[1].confirmed
            )
            assert ledger.state.versions[1].state is VersionState.RECLAIMING
            await plane.remove_engine("e1")
            assert ledger.state.versions[1].state is VersionState.RECLAIMED
            log = await events(ledger)
            left = next(i for i, e in enumerate(log) if isinstance(e, EngineLeft))
            assert isinstance(log[left + 1], VersionReclaimed)
            assert "e1" not in plane.fleet


async def test_a_reclaim_is_fenced_even_on_an_engine_that_never_staged_the_name(
    tmp_path: Path,
) -> None:
    """Before an engine's inventory counts for a reclaim, the reconciler unloads the name
    fenced by the version's attempt, whether or not the engine holds it: an engine that never
    staged the name (here: restarted while the controller was down) must refuse a late
    duplicate of that attempt's prepare afterwards, or the reclaimed name could come back."""
    log = MemoryLog()
    snap = adapter_copy(1)
    async with faulty_engines(2) as engines:
        engines[1].inject("unload", Delay(seconds=IDLE))  # e1 never confirms the reclaim
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            v1 = await plane.publisher.publish(snap, version_id=1)
            await plane.publisher.publish(adapter_copy(2), version_id=2)
            await wait_for(
                "e0's unload of v1 confirmed",
                lambda: "e0" in plane.ledger.state.versions[1].confirmed,
            )
    async with (
        local_engines(2) as fresh,  # new lives: neither ever staged v1's name
        open_plane(fresh, tmp_path, store=MemoryStore(log), probe_interval_s=IDLE) as plane,
    ):
        assert plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        assert v1.lora_name is not None and v1.attempt is not None
        late = Candidate(
            lora_name=v1.lora_name, digest=snap.digest, attempt=v1.attempt, manifest=snap.manifest
        )
        with pytest.raises(CleanRefusal) as refused:
            await fresh[1].prepare(late)
        assert refused.value.code == ErrorCode.STALE_ATTEMPT


async def test_engines_without_a_handle_leave_at_start(tmp_path: Path) -> None:
    log = MemoryLog()
    async with local_engines(2) as engines:
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        async with open_plane(engines[:1], tmp_path, store=MemoryStore(log)) as plane:
            assert plane.started is not None and plane.started.left == ("e1",)
            assert plane.ledger.state.routable_engines() == ("e0",)
            v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
            assert plane.ledger.state.versions[2].fleet == ("e0",)
            assert v2.lora_name not in await names(engines[1])


class DeadActor:
    """What the Ray proxy of an engine actor that died for good answers (a double: a Ray actor
    cannot die here): every call is refused before it is sent, ``ENGINE_GONE``."""

    def __init__(self, engine: LocalEngine, code: str = ErrorCode.ENGINE_GONE) -> None:
        self.engine_id, self.kind, self.transport = engine.engine_id, engine.kind, "staged"
        self.capabilities = engine.capabilities
        self.code = code

    def __getattr__(self, name: str) -> Any:
        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise AmbiguousReply(self.code, "engine actor is gone", engine_id=self.engine_id)

        return refused


async def test_an_engine_gone_for_good_is_suspended_at_its_first_failed_probe(
    tmp_path: Path,
) -> None:
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.05, suspend_after_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        plane.fleet.replace(DeadActor(engines[0]))  # type: ignore[arg-type]
        await wait_for("e0 suspended", lambda: ledger.state.engines["e0"].suspended, timeout=10)
        suspended = of_type(await events(ledger), EngineSuspended)
        assert [(e.engine, e.cause) for e in suspended] == [("e0", "unhealthy")]
        # at the first failure: gone for no time at all, and why
        assert suspended[0].detail.startswith("gone for 0.0 s: ENGINE_GONE"), suspended[0].detail
        assert ledger.state.routable_engines() == ("e1",)


async def test_an_unreachable_engine_waits_for_suspend_after_s(tmp_path: Path) -> None:
    """The counter-case: a lost connection proves nothing about the process, so failed probes
    are counted for ``suspend_after_s`` before the engine is suspended."""
    async with (
        local_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.05, suspend_after_s=IDLE) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        plane.fleet.replace(DeadActor(engines[0], ErrorCode.CONNECTION_LOST))  # type: ignore[arg-type]
        passes, wakes = plane.reconciler.passes, plane.reconciler.wakes
        # ten probes of the unreachable engine, however long a loaded machine takes for them
        await wait_for("ten probes", lambda: plane.reconciler.wakes >= wakes + 10)
        assert not plane.ledger.state.engines["e0"].suspended
        assert plane.reconciler.passes == passes  # probes only, no full pass meanwhile


async def test_a_replaced_handle_is_a_restart_repaired_before_it_serves(tmp_path: Path) -> None:
    async with (
        local_engines(2) as engines,
        LocalEngine("e0", limits=LIMITS) as successor,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        seq = ledger.state.last_seq
        report = await plane.replace_engine(successor)
        assert (report.restarted, report.restored, report.repaired) == (
            ("e0",),
            ("e0:1",),
            ("e0",),
        )
        assert plane.fleet["e0"] is successor
        kinds = [type(e) for e in await events(ledger, after=seq)]
        assert kinds == [EngineRestarted, VersionRestored, EngineRepaired]
        assert ledger.state.engines["e0"].incarnation == await successor.incarnation()
        assert v1.lora_name in await names(successor)


async def test_a_restart_behind_another_address_moves_the_recorded_endpoint(
    tmp_path: Path,
) -> None:
    """A server that came back behind another address (a new handle, or serve restarted with
    a new ``--engine`` URL) is recorded there with its restart: gateway processes started
    without ``--engine`` read each engine's endpoint from the ledger's status."""
    async with (
        running_server("e0", limits=LIMITS) as (_, old_url),
        running_server("e0", limits=LIMITS) as (_, new_url),
        contextlib.AsyncExitStack() as handles,
    ):
        old, new = LocalHTTPEngine(old_url, "e0"), LocalHTTPEngine(new_url, "e0")
        handles.push_async_callback(old.aclose)
        handles.push_async_callback(new.aclose)
        async with open_plane([old], tmp_path, probe_interval_s=IDLE) as plane:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            assert [e.endpoint for e in plane.ledger.status().engines] == [old_url]
            report = await plane.replace_engine(new)
            assert (report.restarted, report.repaired) == (("e0",), ("e0",))
            assert [e.endpoint for e in plane.ledger.status().engines] == [new_url]
            [restart] = of_type(await events(plane.ledger), EngineRestarted)
            assert (restart.endpoint, restart.kind) == (new_url, None)  # the kind is the same


async def test_an_engine_held_out_is_neither_probed_nor_reconciled_until_let_in(
    tmp_path: Path,
) -> None:
    """An engine being removed stays in the fleet while it drains, but no pass touches it: no
    probe, no reconcile; let in again, it is read like any other."""
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        reconciler = plane.reconciler
        reconciler.hold_out("e1")
        probes = engines[1].count()
        await reconciler.health_check()
        report = await reconciler.reconcile()
        assert report.engines == ("e0",)
        assert engines[1].count() == probes
        reconciler.let_in("e1")
        report = await reconciler.reconcile()
        assert sorted(report.engines) == ["e0", "e1"]
        assert engines[1].count() > probes
