"""Reclaim never unloads a version with a request in flight on that engine.

The real reclaim driver (``publisher.drivers.reclaim.ReclaimDriver``, swept by the test) with the
gateway as its in-flight source, and the real reconciler reading the driver's counts.

* At claim time: a long generation on v1 runs (frozen between tokens on the real local engine)
  while v1 is retired (v2 committed) and released (its worker's lease expires: a dead worker).
  The binding no longer pins v1, so only the gateway's in-flight evidence stands between v1
  and its unload: no claim while the request runs, and -- the driver sweeping all along while
  it finishes -- no unload is sent before the engine returned the generation.
* After its caller gave up: a turn cancelled (or timed out, or whose reply was lost) may
  still run on the engine. The gateway aborts it there and counts it until the engine
  confirms its end; an engine that cannot be asked keeps the count until its incarnation
  ends, or a worker's renewal asks again and it answers.
* At unload time: a request can start *after* a rightful claim (a worker whose lease expired
  without its noticing still holds its binding; a remote worker's renewal reports a request
  only after the claim). The driver's unload and the reconciler's fenced unload of the
  reclaiming version both wait for it, on an engine whose unload drains and on one whose
  unload does not (vLLM's: nothing on the engine side would wait).
* After a controller restart: the owners' counts were only in the previous controller's
  memory, so no claim until each owner renewed (or its lease ended).
* The controller's own requests: the reconciler's canary on a retired version (a path engine's
  check of what it serves) is in flight like a turn, and holds off the reclaim until it ends.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import SamplingParams
from evlog.errors import LoraLedgerError
from evlog.events import ReclaimClaimed
from evlog.memory import MemoryStore
from projections.registry import VersionState
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.reclaim import ReclaimDriver
from publisher.drivers.reconciler import Reconciler
from publisher.gateway import Served
from publisher.sessions import RolloutWorker
from tests.publisher.ray.kit import create
from tests.publisher.rollout_kit import (
    ENGINE_WARNINGS,
    PROMPT,
    KeepsRunning,
    NonDraining,
    Recording,
    Rig,
    rig,
)
from tests.support.ledger import publish
from tests.support.runs import Clock
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


async def test_the_unload_waits_for_the_generation_in_flight() -> None:
    async with rig(timeout=30, wrap=Recording) as r:
        driver = r.reclaimer()
        await r.publish(1)
        v1 = r.names[1]
        served: list[tuple[Served, float]] = []
        for engine in r.local.values():
            engine.pause_generation()
        async with (
            anyio.create_task_group() as tg,
            RolloutWorker.open(r.ledger, r.gateway, owner="w1", ttl_s=10.0) as w,
        ):
            s = w.session("long")

            async def run() -> None:
                result = await s.generate(PROMPT, LONG)
                served.append((result, time.monotonic()))

            tg.start_soon(run)
            await wait_for(
                "one request in flight", lambda: sum(r.gateway.inflight_counts().values()) == 1
            )
            ((busy, _),) = r.gateway.inflight_counts()
            # v2 commits: v1 is RETIRED. The worker dies (its lease expires): released.
            await r.publish(2)
            r.clock.advance(60.0)
            assert [x.owner for x in await r.ledger.expire_leases()] == ["w1"]
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert r.ledger.state.versions[1].bound == 0  # nothing pins v1 any more

            # Only the in-flight evidence blocks the reclaim, as long as the request runs.
            # (bounded: a wrongly granted claim would wait forever on the engine's drain)
            for _ in range(3):
                with anyio.fail_after(5):
                    assert await driver.sweep() == []
                await anyio.sleep(0.02)
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert await claims(r) == []
            busy_reports = [x for x in driver.evidence(1) if x.count]
            assert [(x.reporter, x.engine, x.count) for x in busy_reports] == [("gw", busy, 1)]
            with pytest.raises(LoraLedgerError) as info:  # and the decider would refuse it too
                await r.ledger.claim_reclaim(1, driver.evidence(1))
            assert info.value.code == Code.REQUESTS_IN_FLIGHT
            assert r.local[busy].refcount(v1) == 1
            assert all(v1 in e.loaded_adapters() for e in r.local.values())

            async def sweep_until_reclaimed() -> None:
                while r.ledger.state.versions[1].state is not VersionState.RECLAIMED:
                    with anyio.fail_after(5):
                        await driver.sweep()
                    await anyio.sleep(0.002)

            # The generation goes on while the driver sweeps, every few milliseconds.
            tg.start_soon(sweep_until_reclaimed)
            for engine in r.local.values():
                engine.continue_generation()
            await wait_for("the long generation served", lambda: bool(served))

        (result, _) = served[0]
        assert result.version_id == 1 and result.lora_name == v1
        assert result.generation.lora_name == v1
        assert len(result.generation.token_ids) == 40  # it ran to the end, not aborted
        assert r.gateway.inflight_counts() == {}

        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED
        (ended,) = r.fleet[busy].generated_at  # type: ignore[attr-defined]
        for member in r.fleet:  # Recording wrappers, typed as the fleet's Engine
            # no unload was even sent before the engine had returned the generation
            assert ended < member.unload_started[v1]  # type: ignore[attr-defined]
            assert member.unloaded_under_requests == []  # type: ignore[attr-defined]
            assert v1 not in member.loaded_adapters()  # type: ignore[attr-defined]
        (claim,) = await claims(r)
        assert {x.engine: x.count for x in claim.evidence if x.reporter == "gw"} == {
            "e0": 0,
            "e1": 0,
        }


@pytest.mark.parametrize("engine_kind", [Recording, NonDraining], ids=["drains", "no-drain"])
async def test_a_request_dispatched_after_the_claim_is_never_unloaded_under(
    tmp_path: Path, engine_kind: type[Recording]
) -> None:
    async with rig(timeout=60, wrap=engine_kind) as r:
        driver = r.reclaimer()
        reconciler = Reconciler(
            r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"), inflight=driver.inflight
        )
        await r.publish(1)
        v1 = r.names[1]
        await r.ledger.register_owner("w1", ttl_s=10.0)
        stale = await r.ledger.bind("s", "w1")
        await r.publish(2)
        r.clock.advance(60.0)
        assert [x.owner for x in await r.ledger.expire_leases()] == ["w1"]  # w1 has not noticed
        # Nothing pins v1 and nothing runs on it: the claim is right, and granted.
        evidence = driver.evidence(1)
        assert not any(x.count for x in evidence)
        await r.ledger.claim_reclaim(1, evidence)
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMING

        served: list[Served] = []
        for engine in r.local.values():
            engine.pause_generation()
        async with anyio.create_task_group() as tg:

            async def late_request() -> None:
                # w1 still holds its binding; the gateway sends it to a holder of v1
                served.append(await r.gateway.generate(stale, PROMPT, LONG))

            tg.start_soon(late_request)
            await wait_for(
                "the late request in flight", lambda: sum(r.gateway.inflight_counts().values()) == 1
            )
            ((busy, _),) = r.gateway.inflight_counts()
            (idle,) = set(r.local) - {busy}
            # Sweeps and a reconciler pass while it runs. Bounded: on a draining engine an
            # unload sent under the request would wait for it (the generation is frozen).
            for _ in range(3):
                with anyio.move_on_after(5):
                    await driver.sweep()
                if idle in r.ledger.state.versions[1].confirmed:
                    break
            with anyio.move_on_after(5):
                await reconciler.reconcile_engine(busy)
            member = r.fleet[busy]
            assert member.unloaded_under_requests == []  # type: ignore[attr-defined]
            assert v1 not in member.unload_started  # type: ignore[attr-defined]
            assert r.local[busy].refcount(v1) == 1 and v1 in r.local[busy].loaded_adapters()
            v = r.ledger.state.versions[1]
            assert v.state is VersionState.RECLAIMING and set(v.confirmed) == {idle}
            for e in r.local.values():
                e.continue_generation()

        (result,) = served
        assert result.version_id == 1 and result.generation.lora_name == v1
        assert len(result.generation.token_ids) == 40  # ran to the end on v1
        assert await driver.sweep() == [1]
        (ended,) = member.generated_at  # type: ignore[attr-defined]
        assert ended < member.unload_started[v1]  # type: ignore[attr-defined]
        assert member.unloaded_under_requests == []  # type: ignore[attr-defined]
        assert all(v1 not in e.loaded_adapters() for e in r.local.values())


async def test_an_in_flight_report_that_arrives_after_the_claim_holds_the_unload(
    tmp_path: Path,
) -> None:
    """A remote worker's request on v1, reported by its next lease renewal only after the
    claim: neither the driver nor the reconciler unloads v1 on that engine until it is over."""
    async with rig(wrap=Recording) as r:
        driver = r.reclaimer()
        reconciler = Reconciler(
            r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"), inflight=driver.inflight
        )
        await r.publish(1)
        v1 = r.names[1]
        await r.ledger.register_owner("w2", ttl_s=600.0)
        await r.publish(2)
        await r.ledger.claim_reclaim(1, driver.evidence(1))  # w2 reported nothing so far
        r.ledger.renew_lease("w2", {("e0", 1): 1})  # ... and now: a request on e0
        await driver.sweep()
        await reconciler.reconcile_engine("e0")
        await reconciler.reconcile_engine("e1")
        assert v1 not in r.fleet["e0"].unload_started  # type: ignore[attr-defined]
        assert v1 in r.local["e0"].loaded_adapters() and v1 not in r.local["e1"].loaded_adapters()
        v = r.ledger.state.versions[1]
        assert v.state is VersionState.RECLAIMING and set(v.confirmed) == {"e1"}
        r.ledger.renew_lease("w2", {})  # it finished
        assert await driver.sweep() == [1]
        assert v1 not in r.local["e0"].loaded_adapters()


async def claims(r: Rig) -> list[ReclaimClaimed]:
    return [rec.event async for rec in r.store.iterate() if isinstance(rec.event, ReclaimClaimed)]


# --- a request whose caller gave up: counted until the engine confirms its end --------------


async def retire_v1(r: Rig) -> Any:
    """v1 published and bound to session ``s`` of owner ``w1``; returns the binding. The
    caller then retires v1 with :func:`release_v1`."""
    await r.publish(1)
    await r.ledger.register_owner("w1", ttl_s=10.0)
    return await r.ledger.bind("s", "w1")


async def release_v1(r: Rig) -> None:
    """v2 commits (v1 RETIRED) and w1's lease expires: nothing but in-flight evidence keeps
    v1 from being reclaimed."""
    await r.publish(2)
    r.clock.advance(60.0)
    assert [x.owner for x in await r.ledger.expire_leases()] == ["w1"]
    assert r.ledger.state.versions[1].bound == 0


async def start_turn(r: Rig, bound: Any, tg: anyio.abc.TaskGroup) -> tuple[anyio.CancelScope, str]:
    """A long turn of ``bound`` started in ``tg``, once it is counted in flight; returns the
    scope that cancels its caller and the engine it runs on."""
    caller = anyio.CancelScope()

    async def turn() -> None:
        with caller:
            await r.gateway.generate(bound, PROMPT, LONG)

    tg.start_soon(turn)
    await wait_for("the turn in flight", lambda: sum(r.gateway.inflight_counts().values()) == 1)
    ((busy, _),) = r.gateway.inflight_counts()
    return caller, busy


async def test_a_cancelled_turn_keeps_its_version_until_the_engine_confirms_the_abort() -> None:
    """A turn cancelled by its caller (a client disconnect, ``close_session(cancel=True)``) on
    an engine that keeps generating until its abort lands, and whose unload does not drain:
    the gateway aborts the request at the engine and counts it until the engine confirms, so
    reclaim claims nothing meanwhile and never unloads v1 under it; the count ends at the
    confirmation. Before: the count ended when the caller was cancelled, the sweep claimed v1
    at once and unloaded it on the engine still generating on it."""
    async with rig(timeout=60, wrap=KeepsRunning) as r:
        driver = r.reclaimer()
        bound = await retire_v1(r)
        v1 = r.names[1]
        for engine in r.local.values():
            engine.pause_generation()  # the generation runs, frozen between tokens
        async with anyio.create_task_group() as tg:
            caller, busy = await start_turn(r, bound, tg)
            member = r.fleet[busy]
            assert isinstance(member, KeepsRunning)
            await release_v1(r)
            caller.cancel()  # the caller is gone; the engine has not heard of it yet
            await wait_for(
                "the cancel handled", lambda: bool(member.aborts) or not r.gateway.inflight_counts()
            )
            assert member.running == 1 and r.local[busy].refcount(v1) == 1
            for _ in range(3):
                with anyio.fail_after(5):
                    assert await driver.sweep() == []
            assert r.gateway.inflight(busy, 1) == 1
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert await claims(r) == []
            assert member.unload_started == {}

            member.abort_lands.set()  # the abort reaches the request; the engine confirms
            await wait_for("the count ended", lambda: r.gateway.inflight_counts() == {})
            assert member.running == 0 and r.local[busy].refcount(v1) == 0
            for engine in r.local.values():
                engine.continue_generation()

        while r.ledger.state.versions[1].state is not VersionState.RECLAIMED:
            with anyio.fail_after(5):
                await driver.sweep()
        for m in r.fleet:
            assert m.unloaded_under_requests == []  # type: ignore[attr-defined]
        assert isinstance(member, KeepsRunning)
        assert member.aborts == [member.calls[0]["request_id"]]


async def test_a_count_the_engine_cannot_confirm_is_held_until_its_incarnation_ends() -> None:
    """The engine cannot be asked (its abort fails): the count is held -- across sweeps and
    later asks -- and not leaked: when the engine's life ends (the reconciler records a new
    incarnation, as after a restart) the held count goes, and v1 can be reclaimed."""
    async with rig(timeout=60, wrap=KeepsRunning) as r:
        r.gateway.abort_timeout_s = 0.5
        driver = r.reclaimer()
        bound = await retire_v1(r)
        for engine in r.local.values():
            engine.pause_generation()
            r.fleet[engine.engine_id].unconfirmable = True  # type: ignore[attr-defined]
        async with anyio.create_task_group() as tg:
            caller, busy = await start_turn(r, bound, tg)
            await release_v1(r)
            caller.cancel()
        # the caller's cancellation returned (bounded by abort_timeout_s); the count did not
        assert r.gateway.inflight_counts() == {(busy, 1): 1}
        assert r.gateway.unconfirmed == 1
        assert await r.gateway.confirm_ends() == 1  # asked again: still no answer
        assert await driver.sweep() == []
        assert await claims(r) == []

        # The engine restarts: its old life's requests are gone with it.
        for engine in r.local.values():
            engine.abort_all()
            engine.continue_generation()
        await r.ledger.observe_restart(busy, "a-new-life")
        assert r.gateway.inflight_counts() == {}
        assert r.gateway.unconfirmed == 0
        assert await r.gateway.confirm_ends() == 0
        assert [x.count for x in driver.evidence(1) if x.engine == busy] == [0]


async def test_a_held_count_ends_when_a_worker_renewal_finds_the_engine_answering() -> None:
    """A rollout worker's turn, cancelled while the engine could not be asked: the worker's
    own tally (what its lease renewals carry to the ledger) holds the request too, and both
    counts end once the engine answers again -- asked with the worker's next renewal, no
    caller involved."""
    async with rig(timeout=60, wrap=KeepsRunning) as r:
        r.gateway.abort_timeout_s = 0.2
        await r.publish(1)
        for engine in r.local.values():
            engine.pause_generation()
            r.fleet[engine.engine_id].unconfirmable = True  # type: ignore[attr-defined]
        async with (
            RolloutWorker.open(r.ledger, r.gateway, owner="w1", ttl_s=10.0, renew_every=0.05) as w,
            anyio.create_task_group() as tg,
        ):
            caller = anyio.CancelScope()

            async def turn() -> None:
                with caller:
                    await w.session("s").generate(PROMPT, LONG)

            tg.start_soon(turn)
            await wait_for("the turn in flight", lambda: bool(w.inflight.counts()))
            ((busy, _),) = w.inflight.counts()
            member = r.fleet[busy]
            assert isinstance(member, KeepsRunning)
            caller.cancel()
            await wait_for("the count held", lambda: r.gateway.unconfirmed == 1)
            assert w.inflight.counts() == {(busy, 1): 1}
            assert r.ledger.inflight_evidence(1)  # the renewals carry it to the ledger
            assert sum(x.count for x in r.ledger.inflight_evidence(1)) == 1

            member.unconfirmable = False
            member.abort_lands.set()
            await wait_for("the renewal's ask ended it", lambda: not w.inflight.counts())
            assert r.gateway.inflight_counts() == {} and member.running == 0
            await wait_for(
                "the ledger told",
                lambda: sum(x.count for x in r.ledger.inflight_evidence(1)) == 0,
            )
            for engine in r.local.values():
                engine.continue_generation()


# --- the controller's own requests: canaries ------------------------------------------------


class PathEngine(Recording):
    """A real local engine that reports SGLang's kind: a path engine, whose held versions the
    reconciler checks with a canary generation (a ``local`` engine names its digest itself)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.kind = "sglang"


async def test_a_canary_running_on_a_retired_version_holds_off_its_reclaim(
    tmp_path: Path,
) -> None:
    """v1 is retired and no session is bound to it: only the canary the reconciler is asking
    on it stands between v1 and its unload. No claim while the canary runs; once it answered,
    v1 is reclaimed with no unload sent under it."""
    async with rig(timeout=60, wrap=PathEngine) as r:
        reconciler = Reconciler(
            r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"), canary_every_s=300.0
        )
        driver = ReclaimDriver(r.ledger, r.fleet, sources=[r.gateway, reconciler])
        await r.publish(1)
        v1 = r.names[1]
        await r.publish(2)  # v1 RETIRED, unbound: reclaimable but for requests in flight
        assert r.ledger.state.versions[1].bound == 0
        r.local["e0"].pause_generation()
        async with anyio.create_task_group() as tg:
            tg.start_soon(reconciler.reconcile_engine, "e0")  # asks v1's canary first
            await wait_for("v1's canary running on e0", lambda: r.local["e0"].refcount(v1) == 1)
            for _ in range(3):
                with anyio.fail_after(5):
                    assert await driver.sweep() == []
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert [(x.reporter, x.engine, x.count) for x in driver.evidence(1) if x.count] == [
                ("canaries", "e0", 1)
            ]
            r.local["e0"].continue_generation()
        await driver.sweep()
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED
        for member in r.fleet:  # PathEngine wrappers, typed as the fleet's Engine
            assert member.unloaded_under_requests == []  # type: ignore[attr-defined]


async def test_the_control_plane_counts_its_canaries_in_reclaim_evidence(tmp_path: Path) -> None:
    """The plane wires the reconciler's canaries into its reclaim driver (when it asks any)."""
    async with ControlPlane.open(
        MemoryStore(),
        Fleet(),
        deployment="dep",
        prefix="agent",
        capacity=4,
        artifact_root=tmp_path / "artifacts",
        canary_every_s=300.0,
    ) as plane:
        assert "canaries" in {x.reporter for x in plane.reclaimer.evidence(1)}


# --- after a controller restart: counts unknown are not zero ---------------------------------


async def test_after_a_restart_reclaim_waits_until_every_owner_reported_its_requests() -> None:
    """v1 is retired, no session bound, and w1 still runs a request on it when the controller
    restarts: the new controller knows w1's lease but not its count. No claim until w1
    renewed (its count then holds v1); v1 is claimed once w1 says it is idle."""
    store, clock = MemoryStore(), Clock(1000.0)
    async with Ledger.open(store, clock=clock) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("w1", ttl_s=30.0)
        ledger.renew_lease("w1", {("e0", 1): 1})  # a request running on v1
        await publish(ledger, 2)  # v1 RETIRED, unbound: only the count holds it
    async with Ledger.open(store, clock=clock) as ledger:  # the controller restarted
        driver = ReclaimDriver(ledger, Fleet())
        assert await driver.sweep() == []
        assert ledger.state.versions[1].state is VersionState.RETIRED
        assert ledger.inflight_unheard() == ["w1"]
        ledger.renew_lease("w1", {("e0", 1): 1})  # its first renewal: still running
        await driver.sweep()
        assert ledger.state.versions[1].state is VersionState.RETIRED
        ledger.renew_lease("w1", {})  # the request ended
        await driver.sweep()
        assert ledger.state.versions[1].state is VersionState.RECLAIMING  # claimed


async def test_an_owner_that_never_renews_after_a_restart_holds_reclaim_until_its_lease_ends() -> (
    None
):
    store, clock = MemoryStore(), Clock(1000.0)
    async with Ledger.open(store, clock=clock) as ledger:
        await create(ledger)
        await ledger.register_owner("w1", ttl_s=30.0)
    async with Ledger.open(store, clock=clock) as ledger:
        assert ledger.inflight_unheard() == ["w1"]
        clock.now = 1031.0
        assert [x.owner for x in await ledger.expire_leases()] == ["w1"]
        assert ledger.inflight_unheard() == []
