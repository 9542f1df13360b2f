"""The reclaim driver's loop and its edges, on real local engines and a real ledger: a closed or
fenced ledger stops the driver; an unload that hangs becomes an ambiguous reclaim when its
timeout runs out; a refusal to record an unload pokes the reconciler only when the engine
restarted; artifact directories go a grace period after *their own* reclaim, and only with a
store and a grace period configured; a ledger decision that lands between a sweep's read of the
state and an unload task's first step (the version reclaimed or made ambiguous, the engine
removed, suspended or confirmed) stops that unload.

Written from the reclaim mutation campaign's open survivors (``python -m tests.mutation.campaign
reclaim``, RELIABILITY.md "Mutation testing").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, ErrorCode
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from evlog.errors import LoraLedgerError
from evlog.events import EngineUnloaded, InFlight, ReclaimAmbiguous
from evlog.memory import MemoryStore
from evlog.record import Pending
from projections.registry import RegistryState, VersionState
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.reclaim import ReclaimDriver
from tests.publisher.drivers.test_reclaim_answers import Pokes, Unloads, e1_is
from tests.publisher.rollout_kit import ENGINE_WARNINGS, Clock, Rig, rig
from tests.support.log import events_of
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class Gated(Unloads):
    """Unloads for real once the test opens its gate: the unload is in flight meanwhile."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner)
        self.started = anyio.Event()
        self.gate = anyio.Event()

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        self.started.set()
        await self.gate.wait()
        return await self.inner.unload(lora_name, attempt=attempt)


class Hangs(Unloads):
    """An engine whose unload never answers (a leaked reference under SGLang's draining
    unload, docs/engines.md): only the caller's timeout ends the call."""

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        await anyio.sleep_forever()


def _gated(r: Rig, engine: str) -> Gated:
    wrapped = r.fleet[engine]
    assert isinstance(wrapped, Gated)
    return wrapped


async def _stopped_with(driver: ReclaimDriver) -> LoraLedgerError:
    """Run the driver until it stops (it must, within seconds) and return why."""
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        await driver.run()
    stops = info.value.subgroup(lambda e: isinstance(e, LoraLedgerError))
    assert stops is not None, info.value
    leaves = list(_leaves(stops))
    assert len(leaves) == 1, leaves
    assert isinstance(leaves[0], LoraLedgerError)
    return leaves[0]


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


async def _retired(r: Rig) -> str:
    """v1 published, then retired by v2: reclaimable (nothing bound, nothing in flight)."""
    await r.publish(1)
    await r.publish(2)
    return r.names[1]


# --- the loop stops with its ledger -----------------------------------------------------------


async def test_a_fenced_controller_stops_its_driver_before_unloading_anything() -> None:
    """v1 is RECLAIMING (e0 confirmed, e1 still owes its unload) and v2 reclaimable when a
    second controller takes the log over: the fenced driver's claim of v2 is refused as FENCED,
    which stops it there -- it does not go on to send v1's unload to e1."""
    async with rig(wrap=e1_is(Unloads)) as r:
        name = await _retired(r)
        await r.ledger.claim_reclaim(1)
        receipt = await r.local["e0"].unload(name)
        await r.ledger.record_unloaded(1, "e0", receipt.incarnation)
        await r.publish(3)  # v2 retired too
        assert r.ledger.state.reclaimable() == [2]
        async with Ledger.open(r.store):  # a second controller takes the log over
            driver = ReclaimDriver(r.ledger, r.fleet, sources=[r.gateway], tick_s=0.05)
            stop = await _stopped_with(driver)
        assert stop.code == Code.FENCED
        assert [e.unloads for e in r.fleet if isinstance(e, Unloads)] == [[], []]


class GatedTimesOut(Gated):
    """Once the gate opens, the unload's reply is lost: an ambiguous unload."""

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        self.started.set()
        await self.gate.wait()
        raise AmbiguousReply(ErrorCode.TIMEOUT, "no reply in 5 s", engine_id=self.engine_id)


@pytest.mark.parametrize(
    "e1_kind", [Gated, GatedTimesOut], ids=["record refused", "ambiguity refused"]
)
async def test_a_ledger_closed_under_a_running_driver_stops_it(e1_kind: type[Gated]) -> None:
    """The ledger closes while e1's unload is in flight: recording its answer (a receipt, or
    the ambiguity of a lost reply) is refused with LEDGER_CLOSED, which ends the driver instead
    of a retry every tick."""
    async with rig(
        wrap=lambda engine: (e1_kind if engine.engine_id == "e1" else Gated)(engine)
    ) as r:
        await _retired(r)
        pokes = Pokes()
        async with anyio.create_task_group() as tg:
            async with Ledger.open(r.store) as ledger:  # this controller's own ledger
                driver = ReclaimDriver(
                    ledger,
                    r.fleet,
                    tick_s=0.05,
                    on_restart=pokes.on_restart,
                    on_ambiguous=pokes.on_ambiguous,
                )
                stopped: list[LoraLedgerError] = []

                async def run() -> None:
                    stopped.append(await _stopped_with(driver))

                tg.start_soon(run)
                _gated(r, "e0").gate.set()
                await _gated(r, "e1").started.wait()
                await wait_for(
                    "e0's unload of v1 confirmed",
                    lambda: "e0" in ledger.state.versions[1].confirmed,
                )
            _gated(r, "e1").gate.set()  # answers after the ledger closed
        assert [s.code for s in stopped] == [Code.LEDGER_CLOSED]
        assert (pokes.restart, pokes.ambiguous) == (0, 0)
        assert _gated(r, "e1").unloads == [(r.names[1], 1)]  # sent once, not again every tick


# --- unload answers at their edges ------------------------------------------------------------


async def test_an_unload_that_hangs_becomes_ambiguous_when_its_timeout_runs_out() -> None:
    async with rig(wrap=e1_is(Hangs)) as r:
        name = await _retired(r)
        pokes = Pokes()
        driver = ReclaimDriver(
            r.ledger,
            r.fleet,
            sources=[r.gateway],
            timeouts=EngineTimeouts(unload=0.2),
            on_ambiguous=pokes.on_ambiguous,
        )
        with anyio.fail_after(10):
            assert await driver.sweep() == []
        v1 = r.ledger.state.versions[1]
        assert (v1.state, v1.ambiguous, list(v1.confirmed)) == (
            VersionState.RECLAIMING,
            True,
            ["e0"],
        )
        marked = [(e.engine, e.reason) for e in await events_of(r.store, ReclaimAmbiguous)]
        assert len(marked) == 1 and marked[0][0] == "e1"
        assert marked[0][1].startswith("TIMEOUT"), marked
        assert pokes.ambiguous == 1
        assert r.fleet["e1"].unloads == [(name, v1.attempt)]  # type: ignore[attr-defined]


def _not_recorded(logs: list[MutableMapping[str, Any]]) -> list[tuple[str, str]]:
    """(engine, refusal code) of each unload whose record the ledger refused, as logged."""
    return [(x["engine"], x["code"]) for x in logs if x["event"] == "reclaim.unload_not_recorded"]


async def test_a_refused_record_pokes_the_reconciler_only_for_a_restart() -> None:
    """e1 leaves the fleet while its unload is in flight: recording the unload is refused
    (e1 is no member any more), which is not a restart; e0's proof then completes the reclaim."""
    async with rig(wrap=lambda engine: Gated(engine)) as r:
        await _retired(r)
        pokes = Pokes()
        driver = pokes.driver(r)
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(driver.sweep)
                await _gated(r, "e0").started.wait()
                await _gated(r, "e1").started.wait()
                await r.ledger.leave_engine("e1")
                _gated(r, "e1").gate.set()
                await wait_for(
                    "e1's unload record refused",
                    lambda: _not_recorded(logs) == [("e1", Code.UNKNOWN_ENGINE)],
                )
                _gated(r, "e0").gate.set()
        v1 = r.ledger.state.versions[1]
        assert v1.state is VersionState.RECLAIMED
        assert [e.engine for e in await events_of(r.store, EngineUnloaded)] == ["e0"]
        assert (pokes.restart, pokes.ambiguous) == (0, 0)


# --- a ledger decision between the sweep's filter and an unload's first step ----------------
#
# A sweep reads the ledger's state, picks what to unload (every engine of a RECLAIMING,
# unambiguous version that has not confirmed) and starts one task per unload; each task's first
# step checks the state again. The two reads differ when a ledger decision lands in between:
# the writer decides a batch the moment it takes it while the previous batch's COMMIT is still
# in flight (pipelining), so a command queued just before the sweep runs is decided after the
# sweep's filter and before the unload tasks' first steps. Each case below stages exactly that:
# a COMMIT is held in flight (``HeldStore``), the sweep is started, and the decision's commands
# are queued before it runs.


class HeldStore(MemoryStore):
    """A real memory log whose appends wait at ``gate`` while ``holding``; ``held`` is set as
    soon as one waits there (a COMMIT in flight, for as long as the test says)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.held = anyio.Event()
        self.gate = anyio.Event()

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        if self.holding:
            self.held.set()
            await self.gate.wait()
        return await super().append(batch, expected_seq=expected_seq)


class Releases(Unloads):
    """Unloads for real, first releasing the COMMIT the test held: the driver records the unload
    next, and that record queues behind the held COMMIT."""

    def __init__(self, inner: LocalEngine, store: HeldStore) -> None:
        super().__init__(inner)
        self.store = store

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        self.store.gate.set()
        return await self.inner.unload(lora_name, attempt=attempt)


class Watch:
    """The driver's in-flight source: one request in flight on v2 (RETIRED, so the sweep asks
    about it while it decides what to claim, in the same step as its filter), none on v1 (an
    unload task asks right after its first check). Each question records whether the staged
    decision had landed in the ledger by then."""

    def __init__(self, ledger: Ledger, landed: Callable[[RegistryState], bool]) -> None:
        self.ledger = ledger
        self.landed = landed
        self.asked: list[tuple[int, bool]] = []

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        self.asked.append((version_id, self.landed(self.ledger.state)))
        count = 1 if version_id == 2 else 0
        return [InFlight(reporter="watch", engine="e0", count=count, at=0.0)]


async def _confirm(r: Rig, engine: str) -> None:
    """``engine`` unloaded v1 and the ledger recorded it (an earlier sweep's work)."""
    receipt = await r.local[engine].unload(r.names[1])
    await r.ledger.record_unloaded(1, engine, receipt.incarnation)


async def _unloaded_by_hand(r: Rig, engine: str) -> None:
    """``engine`` dropped v1 already; its proof is what the staged decision records."""
    await r.local[engine].unload(r.names[1])


async def _nothing(r: Rig) -> None:
    return None


def _incarnation(s: RegistryState, engine: str) -> str:
    return s.engines[engine].incarnation


@dataclass(frozen=True)
class Between:
    """A decision landing between the sweep's filter and the unload tasks' first steps: what
    happened before the sweep, the commands decided in that window (one batch), how to see that
    they landed, which engines the driver must still send v1's unload to, and v1's end state."""

    before: Callable[[Rig], Awaitable[None]]
    commands: Callable[[RegistryState], list[c.Command]]
    landed: Callable[[RegistryState], bool]
    unloaded: list[str]
    final: tuple[VersionState, bool]  # v1's state, ambiguous


BETWEEN = {
    # e1 suspended (which completes v1: e0 had confirmed, e1 owes the drop) and resumed in one
    # batch (a failed health check and an operator's resumption queued during one COMMIT): e1 is
    # an active, unconfirmed member again, but v1 is RECLAIMED -- the driver has nothing to do.
    "reclaimed": Between(
        before=lambda r: _confirm(r, "e0"),
        commands=lambda s: [
            c.SuspendEngine(engine="e1", cause="unhealthy"),
            c.ResumeEngine(engine="e1", cause="unhealthy"),
        ],
        landed=lambda s: s.versions[1].state is VersionState.RECLAIMED,
        unloaded=[],
        final=(VersionState.RECLAIMED, False),
    ),
    # The reclaim is marked ambiguous: nothing is unloaded until an inventory decides.
    "ambiguous": Between(
        before=_nothing,
        commands=lambda s: [
            c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason="TIMEOUT: reply lost")
        ],
        landed=lambda s: s.versions[1].ambiguous,
        unloaded=[],
        final=(VersionState.RECLAIMING, True),
    ),
    # An operator removes e1: it is no member any more (e0's proof completes v1).
    "removed": Between(
        before=_nothing,
        commands=lambda s: [c.RemoveEngine(engine="e1")],
        landed=lambda s: "e1" not in s.engines,
        unloaded=["e0"],
        final=(VersionState.RECLAIMED, False),
    ),
    # e1 is suspended: it owes the drop and its repair unloads it; an unload sent to a sick
    # engine could only hang or fail and make the reclaim ambiguous.
    "suspended": Between(
        before=_nothing,
        commands=lambda s: [c.SuspendEngine(engine="e1", cause="unhealthy")],
        landed=lambda s: s.engines["e1"].suspended,
        unloaded=["e0"],
        final=(VersionState.RECLAIMED, False),
    ),
    # e1's proof that it dropped v1 is recorded: it is not asked again.
    "confirmed": Between(
        before=lambda r: _unloaded_by_hand(r, "e1"),
        commands=lambda s: [
            c.RecordUnloaded(version_id=1, engine="e1", incarnation=_incarnation(s, "e1"))
        ],
        landed=lambda s: "e1" in s.versions[1].confirmed,
        unloaded=["e0"],
        final=(VersionState.RECLAIMED, False),
    ),
}


@pytest.mark.parametrize("case", BETWEEN.values(), ids=BETWEEN.keys())
async def test_a_decision_landing_after_the_sweep_read_the_state_stops_that_unload(
    case: Between,
) -> None:
    store = HeldStore()
    async with rig(store=store, wrap=lambda engine: Releases(engine, store)) as r:
        await r.publish(1)
        await r.publish(2)
        await r.publish(3)  # v1 and v2 RETIRED
        await r.ledger.claim_reclaim(1)  # v1 RECLAIMING: e0 and e1 owe their unload proofs
        await case.before(r)
        commands = case.commands(r.ledger.state)
        assert not case.landed(r.ledger.state)
        watch = Watch(r.ledger, case.landed)
        driver = ReclaimDriver(r.ledger, r.fleet, sources=[watch])
        outcomes: list[Any] = []

        async def sweep() -> None:
            try:
                await driver.sweep()
            finally:
                store.gate.set()  # nothing unloaded (or the sweep failed): no COMMIT to wait for

        store.holding = True
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.ledger.register_owner, "w")  # its COMMIT stays in flight ...
            await store.held.wait()
            assert r.ledger.queue_statistics().tasks_waiting_receive == 1  # ... the writer idle
            tg.start_soon(sweep)  # runs next: it reads the state before the decision ...
            # ... which is queued now, and decided at once, right after the sweep's filter
            outcomes.extend(await r.ledger.execute_many(commands))
        assert not [o for o in outcomes if isinstance(o, LoraLedgerError)], outcomes
        # The interleaving happened: the sweep's filter read the state before the decision
        # (v2's question comes in the same step), every unload task after it.
        assert watch.asked[0] == (2, False), watch.asked
        assert all(landed for _version, landed in watch.asked[1:]), watch.asked
        assert [e.engine_id for e in r.fleet if isinstance(e, Unloads) and e.unloads] == (
            case.unloaded
        )
        v1 = r.ledger.state.versions[1]
        assert (v1.state, v1.ambiguous) == case.final


async def test_a_suspended_member_is_not_sent_the_unload_it_owes() -> None:
    """Unlike the other checks of an unload task, this one is no repeat of the sweep's filter:
    the sweep starts a task for every member that has not confirmed, suspended or not, so a
    suspension that landed long before the sweep is stopped here too."""
    async with rig(wrap=lambda engine: Unloads(engine)) as r:
        await _retired(r)
        await r.ledger.claim_reclaim(1)
        await r.ledger.suspend_engine("e1", cause="unhealthy")
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMING  # e0 owes its proof
        assert await r.reclaimer().sweep() == [1]
        assert [e.engine_id for e in r.fleet if isinstance(e, Unloads) and e.unloads] == ["e0"]
        assert r.names[1] in r.ledger.state.engines["e1"].owes  # its repair drops it


# --- artifact collection ----------------------------------------------------------------------


def _artifacts(root: Path, *seeds: int) -> tuple[ArtifactStore, dict[int, str]]:
    """A store holding the adapters the rig publishes for ``seeds``, by seed -> digest."""
    store = ArtifactStore(root)
    digests = {}
    for seed in seeds:
        config, tensors = make_adapter(seed)
        manifest = build_manifest(config, tensors)
        store.put(manifest, tensors)
        digests[seed] = manifest.digest
    return store, digests


async def test_an_artifact_goes_a_grace_period_after_its_own_reclaim(tmp_path: Path) -> None:
    artifacts, digest = _artifacts(tmp_path, 1, 2, 3)
    clock = Clock(1_000.0)
    async with rig() as r:
        await r.ledger.register_owner("w", ttl_s=600)
        await r.publish(1)
        await r.ledger.bind("s", "w")
        await r.publish(2)
        driver = ReclaimDriver(
            r.ledger,
            r.fleet,
            sources=[r.gateway],
            artifacts=artifacts,
            delete_artifacts_after_s=10.0,
            clock=clock,
        )
        assert await driver.sweep() == []  # v1 retired but bound: seen, not reclaimed
        clock.advance(100.0)
        await r.ledger.release("s", "w")
        assert await driver.sweep() == [1]
        assert artifacts.contains(digest[1])  # the grace period starts at the reclaim
        clock.advance(9.5)
        await driver.sweep()
        assert artifacts.contains(digest[1])
        clock.advance(0.5)  # exactly the grace period
        await driver.sweep()
        assert not artifacts.contains(digest[1])
        # v2, reclaimed later, gets its own grace period, not the one of v1
        await r.publish(3)
        assert await driver.sweep() == [2]
        assert artifacts.contains(digest[2])
        clock.advance(10.0)
        await driver.sweep()
        assert not artifacts.contains(digest[2])
        assert artifacts.contains(digest[3])  # the default
        assert driver.deleted == {digest[1], digest[2]}


async def test_a_digest_still_live_keeps_its_artifact_and_holds_back_no_other(
    tmp_path: Path,
) -> None:
    artifacts, digest = _artifacts(tmp_path, 1, 2)
    clock = Clock(1_000.0)
    async with rig() as r:
        driver = ReclaimDriver(
            r.ledger,
            r.fleet,
            sources=[r.gateway],
            artifacts=artifacts,
            delete_artifacts_after_s=10.0,
            clock=clock,
        )
        await r.publish(1, seed=1)
        await r.publish(2, seed=2)
        assert await driver.sweep() == [1]
        await r.publish(3, seed=1)  # the bytes of v1 again, under a new version
        assert await driver.sweep() == [2]
        clock.advance(10.0)
        await driver.sweep()
        assert artifacts.contains(digest[1])  # v3 serves from it: kept past its grace period
        assert not artifacts.contains(digest[2])  # checked after v1, deleted all the same
        assert driver.deleted == {digest[2]}


@pytest.mark.parametrize("with_store", [True, False], ids=["no grace period", "no store"])
async def test_artifacts_are_kept_without_a_store_or_a_grace_period(
    tmp_path: Path, with_store: bool
) -> None:
    artifacts, digest = _artifacts(tmp_path, 1)
    clock = Clock(1_000.0)
    async with rig() as r:
        driver = ReclaimDriver(
            r.ledger,
            r.fleet,
            sources=[r.gateway],
            artifacts=artifacts if with_store else None,
            delete_artifacts_after_s=None if with_store else 0.0,
            clock=clock,
        )
        await _retired(r)
        assert await driver.sweep() == [1]
        clock.advance(1e6)
        assert await driver.sweep() == []
        assert artifacts.contains(digest[1]) and driver.deleted == set()


async def test_the_driver_ticks_at_the_documented_default() -> None:
    """docs/operations.md: without a ledger event, a sweep runs every 0.5 s by default (in-flight
    counts fall without one); the plane passes its ``reclaim_tick_s``, of the same default."""
    async with rig() as r:
        assert ReclaimDriver(r.ledger, r.fleet).tick_s == 0.5
