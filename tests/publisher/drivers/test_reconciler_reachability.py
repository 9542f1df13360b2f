"""The reconciler records an engine's outage at its first evidence, on real local engines: a
failed probe alone (no traffic at all) takes the engine out of routing at once and writes one
``EngineUnreachable``; a face's report of a refused connection is recorded by the plane's own
loop within moments, however long its probes are apart; the failures the faces counted are
recorded against the outage once a probe confirmed it; the first probe that answers ends it
and the engine serves again.

Before, a failed probe only counted towards the suspension: the engine stayed routable, and
the log silent, for ``suspend_after_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, CleanRefusal, ErrorCode
from evlog.events import (
    DispatchFailures,
    EngineReachable,
    EngineSuspended,
    EngineUnreachable,
    TurnFailures,
)
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.reconciler import Reconciler
from tests.engines.faulty_engine import Delay, FaultyEngine, ServerError
from tests.publisher.drivers.test_reconciler import DeadActor
from tests.publisher.drivers.test_reconciler_health import (
    IDLE,
    Clock,
    log_after,
    published_on_two,
    reconciler_for,
    rig_reconciler,
)
from tests.publisher.plane_kit import FAST, PEFT_WARNINGS, adapter_copy, faulty_engines, open_plane
from tests.publisher.rollout_kit import Rig, rig
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


def refused(engine_id: str) -> AmbiguousReply:
    """What a gateway sees when the engine's port refuses the connection: nothing was sent."""
    return AmbiguousReply(
        ErrorCode.ENGINE_UNREACHABLE,
        "POST /generate: cannot connect: [Errno 111] Connection refused",
        engine_id=engine_id,
        dispatched=False,
    )


async def test_a_failed_probe_alone_takes_the_engine_out_of_routing_at_once(
    tmp_path: Path,
) -> None:
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock)
        seq = plane.ledger.state.last_seq
        engines[1].inject("incarnation", ServerError(), times=3)
        for second in range(3):  # three failed probes: one outage
            clock.now = float(second)
            await reconciler.health_check()
            assert plane.ledger.state.holders(v1.lora_name) == ("e0",)
            assert plane.ledger.state.routable_engines() == ("e0",)
        written = await log_after(plane, seq)
        assert [type(e) for e in written] == [EngineUnreachable]
        (outage,) = written
        assert isinstance(outage, EngineUnreachable)
        assert (outage.engine, outage.source, outage.reporter) == ("e1", "probe", "reconciler")
        assert outage.error.startswith("SERVER_ERROR")
        assert outage.incarnation == plane.ledger.state.engines["e1"].incarnation
        status = plane.ledger.status().engines[1]
        assert not status.routable and status.unreachable is not None
        assert status.unreachable.since == outage.at
        # the fourth probe answers: the outage ends, the engine serves what it held
        clock.now = 3.0
        await reconciler.health_check()
        ended = (await log_after(plane, seq))[1:]
        assert [type(e) for e in ended] == [EngineReachable]
        assert isinstance(ended[0], EngineReachable) and ended[0].since == outage.at
        assert plane.ledger.state.holders(v1.lora_name) == ("e0", "e1")
        assert not plane.ledger.state.engines["e1"].suspended


async def test_a_refused_connection_is_recorded_at_once_and_its_turns_counted(
    tmp_path: Path,
) -> None:
    """The plane's own loop, probing once an hour: a gateway's report of a refused connection
    records the outage (``source`` dispatch, dated when it was seen) within moments; the probe
    it triggers fails too, and the turns the gateway counted are recorded against it."""
    async with (
        faulty_engines(2) as engines,
        open_plane(
            engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE, suspend_after_s=None
        ) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v1 = plane.ledger.state.versions[1]
        seq = plane.ledger.state.last_seq
        engines[1].inject("incarnation", ServerError(), times=1000)  # it is really down
        life = plane.ledger.state.engines["e1"].incarnation
        reconciler = plane.reconciler
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation=life)
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation=life)
        reconciler.engine_trouble("e1", refused("e1"), session="s2", incarnation=life)
        await wait_for(
            "e1 out of the holders of v1",
            lambda: plane.ledger.state.holders(v1.lora_name) == ("e0",),
            timeout=5.0,
        )

        async def counted() -> bool:
            return any(isinstance(e, DispatchFailures) for e in await log_after(plane, seq))

        await wait_for("the failures recorded", counted, timeout=10.0)
        written = await log_after(plane, seq)
        kinds = [type(e) for e in written]
        assert kinds.count(EngineUnreachable) == 1, kinds
        assert EngineSuspended not in kinds
        outage = next(e for e in written if isinstance(e, EngineUnreachable))
        assert (outage.source, outage.reporter) == ("dispatch", "gateway")
        assert "Connection refused" in outage.error
        counts = next(e for e in written if isinstance(e, DispatchFailures))
        assert counts.since == outage.at
        assert counts.failures == (
            TurnFailures(session="s1", not_run=2),
            TurnFailures(session="s2", not_run=1),
        )


async def test_a_refused_connection_reported_before_the_loop_starts_is_recorded_at_its_start(
    tmp_path: Path,
) -> None:
    """A face may report before the health loop runs (a plane's first moments, a reconciler
    restarted): the report is kept, and the loop records it as it starts -- not at the next
    report, which may never come once routing avoids the engine."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        engines[1].inject("incarnation", ServerError(), times=1000)  # it is really down
        reconciler = Reconciler(
            plane.ledger,
            plane.fleet,
            plane.artifacts,
            timeouts=FAST,
            probe_interval_s=IDLE,  # no probe of its own within the test
            full_every_s=IDLE,
            suspend_after_s=None,
        )
        seq = plane.ledger.state.last_seq
        life = plane.ledger.state.engines["e1"].incarnation
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation=life)
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            await wait_for(
                "e1 out of the holders of v1",
                lambda: plane.ledger.state.holders(v1.lora_name) == ("e0",),
            )
            tg.cancel_scope.cancel()
        written = [e for e in await log_after(plane, seq) if isinstance(e, EngineUnreachable)]
        assert [(e.engine, e.source, e.reporter) for e in written] == [
            ("e1", "dispatch", "gateway")
        ]


async def test_a_report_about_an_earlier_life_opens_nothing(tmp_path: Path) -> None:
    """e1's failure is reported under a life the ledger no longer knows: nothing is recorded
    for e1. (e0's report, of its current life, is the sentinel that the reports were read.)"""
    async with published_on_two(tmp_path) as (_, plane, v1):
        seq = plane.ledger.state.last_seq
        reconciler = plane.reconciler
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation="old-life")
        life = plane.ledger.state.engines["e0"].incarnation
        reconciler.engine_trouble("e0", refused("e0"), session="s2", incarnation=life)

        async def e0_reported() -> bool:
            written = await events(plane.ledger, after=seq)
            return any(isinstance(e, EngineUnreachable) for e in written)

        await wait_for("e0's outage recorded", e0_reported, timeout=5.0)
        written = await events(plane.ledger, after=seq)
        assert [e for e in written if getattr(e, "engine", "") == "e1"] == []
        assert "e1" in plane.ledger.state.holders(v1.lora_name)


# --- what a report says, on a hand-driven clock --------------------------------------------


def hand_driven(r: Rig, clock: Clock, tmp_path: Path) -> Reconciler:
    """A reconciler whose loop wakes only when a report pokes it (probes an hour apart) and
    never suspends; ``clock`` is its own, the rig's ledger clock dates the events."""
    return rig_reconciler(
        r, clock, tmp_path, probe_interval_s=IDLE, full_every_s=IDLE, suspend_after_s=None
    )


def faulty(r: Rig, engine_id: str) -> FaultyEngine:
    engine = r.fleet[engine_id]
    assert isinstance(engine, FaultyEngine)
    return engine


def probing(
    r: Rig,
    tmp_path: Path,
    *,
    ledger: Any = None,
    timeouts: EngineTimeouts = FAST,
    suspend_after_s: float | None,
) -> Reconciler:
    """A reconciler of its own over the rig's fleet (and ledger, or a wrapper of it), its
    clock at zero."""
    return Reconciler(
        r.ledger if ledger is None else ledger,
        r.fleet,
        ArtifactStore(tmp_path / "artifacts"),
        timeouts=timeouts,
        clock=Clock(),
        suspend_after_s=suspend_after_s,
    )


async def test_a_report_is_dated_when_it_was_seen_and_only_unreachable_opens_an_outage(
    tmp_path: Path,
) -> None:
    """A refusal as not loaded says nothing of reachability: no outage. A refused connection
    reported without a life is about the life the ledger knows, dated ``age_s`` before the
    report (when it was made without one, or a negative one: when it was made)."""
    async with rig(engines=3, wrap=FaultyEngine) as r:
        await r.publish(1)
        reconciler = hand_driven(r, Clock(), tmp_path)
        seq = r.ledger.state.last_seq
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            reconciler.engine_trouble("e0", CleanRefusal(ErrorCode.NOT_LOADED, "not loaded"))
            await wait_for("the report acted on", lambda: reconciler.settled)
            assert of_type(await events(r.ledger, after=seq), EngineUnreachable) == []
            reconciler.engine_trouble("e1", refused("e1"), age_s=2.5)
            r.clock.now += 10.0
            reconciler.engine_trouble("e0", refused("e0"))
            reconciler.engine_trouble("e2", refused("e2"), age_s=-3.0)

            async def outages() -> list[EngineUnreachable]:
                return of_type(await events(r.ledger, after=seq), EngineUnreachable)

            async def all_recorded() -> bool:
                return len(await outages()) == 3

            await wait_for("the three outages recorded", all_recorded)
            tg.cancel_scope.cancel()
        state = r.ledger.state
        assert sorted((e.engine, e.incarnation, e.at, e.source) for e in await outages()) == [
            ("e0", state.engines["e0"].incarnation, 1010.0, "dispatch"),
            ("e1", state.engines["e1"].incarnation, 997.5, "dispatch"),
            ("e2", state.engines["e2"].incarnation, 1010.0, "dispatch"),
        ]


async def test_only_a_sessions_failures_are_counted_against_the_outage(tmp_path: Path) -> None:
    """A report that names no session counts no turn: the outage's ``DispatchFailures`` holds
    only the turns of the sessions that were named."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("incarnation", ServerError(), times=1000)  # it is really down
        reconciler = hand_driven(r, Clock(), tmp_path)
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            reconciler.engine_trouble("e1", refused("e1"))
            reconciler.engine_trouble("e1", refused("e1"), session="s1")

            async def counted() -> bool:
                return bool(of_type(await events(r.ledger), DispatchFailures))

            await wait_for("the failures recorded", counted)
            tg.cancel_scope.cancel()
        (counts,) = of_type(await events(r.ledger), DispatchFailures)
        assert counts.failures == (TurnFailures(session="s1", not_run=1),)


async def test_reports_wake_the_loop_at_most_once_per_probe_interval(tmp_path: Path) -> None:
    """Many reports about an engine before the next probe interval are one wake: the loop is
    poked again by a report exactly ``probe_interval_s`` after the one that woke it, not
    before."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        clock = Clock()
        reconciler = hand_driven(r, clock, tmp_path)
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            await wait_for("the loop waiting", lambda: reconciler.settled)
            reconciler.engine_trouble("e0", refused("e0"))
            assert not reconciler.settled  # woken
            await wait_for("the report acted on", lambda: reconciler.settled)
            wakes = reconciler.wakes
            clock.now = IDLE - 0.5
            reconciler.engine_trouble("e0", refused("e0"))
            assert reconciler.settled  # not woken again
            clock.now = IDLE
            reconciler.engine_trouble("e0", refused("e0"))
            assert not reconciler.settled
            await wait_for("the second wake done", lambda: reconciler.wakes == wakes + 1)
            tg.cancel_scope.cancel()


async def test_an_engine_in_the_fleet_but_not_in_the_ledger_is_reported_and_probed_harmlessly(
    tmp_path: Path,
) -> None:
    """An engine that left the ledger while its handle is still in the fleet: a report about it
    and a failed probe of it open nothing, suspend nothing, and take nothing down."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        await r.ledger.leave_engine("e1")
        faulty(r, "e1").inject("incarnation", ServerError(), times=1000)
        clock = Clock()
        reconciler = Reconciler(
            r.ledger,
            r.fleet,
            ArtifactStore(tmp_path / "artifacts"),
            timeouts=FAST,
            clock=clock,
            suspend_after_s=0.0,
        )
        seq = r.ledger.state.last_seq
        reconciler.engine_trouble("e1", refused("e1"), session="s1")
        for second in range(3):
            clock.now = float(second)
            await reconciler.health_check()
        async with anyio.create_task_group() as tg:  # and the loop, with its counts
            await tg.start(reconciler.run)
            reconciler.engine_trouble("e1", refused("e1"), session="s1")
            await wait_for("the report acted on", lambda: reconciler.settled)
            tg.cancel_scope.cancel()
        assert await events(r.ledger, after=seq) == []
        assert "e1" not in r.ledger.state.engines


async def test_a_gone_engine_the_ledger_no_longer_has_is_probed_harmlessly(
    tmp_path: Path,
) -> None:
    """The same when the probe proves the process gone for good (``ENGINE_GONE``, a dead
    engine actor): with no member there is nothing to suspend or count, nothing is written,
    and the pass goes on."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        await r.ledger.leave_engine("e1")
        r.fleet.replace(DeadActor(faulty(r, "e1")))  # type: ignore[arg-type]
        reconciler = probing(r, tmp_path, suspend_after_s=0.0)
        seq = r.ledger.state.last_seq
        await reconciler.health_check()
        assert await events(r.ledger, after=seq) == []


async def test_a_suspended_engine_found_gone_has_its_outage_recorded(tmp_path: Path) -> None:
    """A suspension is not an outage: an engine suspended for another cause (here by an
    operator), whose probe then proves its process gone, gets its ``EngineUnreachable`` like
    any other (status and incidents show it unreachable), and is not suspended twice."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        await r.ledger.suspend_engine("e1", cause="operator", detail="maintenance")
        r.fleet.replace(DeadActor(faulty(r, "e1")))  # type: ignore[arg-type]
        reconciler = probing(r, tmp_path, suspend_after_s=0.0)
        seq = r.ledger.state.last_seq
        await reconciler.health_check()
        written = await events(r.ledger, after=seq)
        assert [type(e) for e in written] == [EngineUnreachable]
        (outage,) = of_type(written, EngineUnreachable)
        assert outage.engine == "e1"
        assert outage.error.startswith("ENGINE_GONE"), outage.error
        assert r.ledger.state.engines["e1"].unreachable is not None


async def test_the_failures_of_each_engine_in_an_outage_are_recorded_and_no_others(
    tmp_path: Path,
) -> None:
    """One wake, three engines reported: e0 answers its probe (no outage: its counts are
    dropped), e1 is down but its report named no session (nothing to count), e2 is down and
    its session's turn is recorded against its outage."""
    async with rig(engines=3, wrap=FaultyEngine) as r:
        await r.publish(1)
        for down in ("e1", "e2"):
            faulty(r, down).inject("incarnation", ServerError(), times=1000)
        reconciler = hand_driven(r, Clock(), tmp_path)
        ambiguous = AmbiguousReply(ErrorCode.SERVER_ERROR, "503", engine_id="e0")
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            reconciler.engine_trouble("e0", ambiguous, session="s0")
            reconciler.engine_trouble("e1", refused("e1"))
            reconciler.engine_trouble("e2", refused("e2"), session="s2")

            async def counted() -> bool:
                return bool(of_type(await events(r.ledger), DispatchFailures))

            await wait_for("the failures recorded", counted)
            await wait_for("the wake done", lambda: reconciler.settled)
            tg.cancel_scope.cancel()
        recorded = of_type(await events(r.ledger), DispatchFailures)
        assert [(e.engine, e.failures) for e in recorded] == [
            ("e2", (TurnFailures(session="s2", not_run=1),))
        ]


async def test_a_probe_that_hangs_is_an_outage_naming_the_call_and_the_engine(
    tmp_path: Path,
) -> None:
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("incarnation", Delay(seconds=30.0))
        reconciler = Reconciler(
            r.ledger,
            r.fleet,
            ArtifactStore(tmp_path / "artifacts"),
            timeouts=EngineTimeouts(probe=1.0),
            clock=Clock(),
            suspend_after_s=None,
        )
        await reconciler.health_check()
        outages = of_type(await events(r.ledger), EngineUnreachable)
        assert [o.error for o in outages if o.engine == "e1"] == [
            "TIMEOUT: incarnation on e1: no reply within 1s"
        ]


class RestartLandsWithTheOutage:
    """The real ledger, but an engine's restart is recorded right after its outage: what a
    restart observed between a failed probe and the suspension that probe decides looks like
    (the ledger is shared: any pass may record it meanwhile)."""

    def __init__(self, ledger: Any, new_life: str) -> None:
        self._ledger = ledger
        self._new_life = new_life

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    async def report_unreachable(self, engine_id: str, life: str, **kwargs: Any) -> Any:
        outcome = await self._ledger.report_unreachable(engine_id, life, **kwargs)
        await self._ledger.observe_restart(engine_id, self._new_life)
        return outcome


async def test_a_suspension_for_failed_probes_is_for_the_life_that_failed_them(
    tmp_path: Path,
) -> None:
    """The probes failed in one life; the engine restarted before the suspension was
    recorded: the new life, which nothing has probed yet, is not suspended."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("incarnation", ServerError())
        reconciler = Reconciler(
            RestartLandsWithTheOutage(r.ledger, "new-life"),  # type: ignore[arg-type]
            r.fleet,
            ArtifactStore(tmp_path / "artifacts"),
            timeouts=FAST,
            clock=Clock(),
            suspend_after_s=0.0,
        )
        await reconciler.health_check()
        member = r.ledger.state.engines["e1"]
        assert member.incarnation == "new-life" and not member.suspended
        assert of_type(await events(r.ledger), EngineSuspended) == []


async def test_a_pass_that_reaches_an_engine_in_an_outage_ends_it(tmp_path: Path) -> None:
    """Any answer ends an outage, whichever pass got it: a pass over the engine (a full pass,
    a report's read) that reaches it records it reachable, and it serves again."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("incarnation", ServerError())
        reconciler = probing(r, tmp_path, suspend_after_s=None)
        await reconciler.health_check()
        assert r.ledger.state.engines["e1"].unreachable is not None
        seq = r.ledger.state.last_seq
        report = await reconciler.reconcile_engine("e1")
        assert report.errors == ()
        reachable = of_type(await events(r.ledger, after=seq), EngineReachable)
        assert [e.engine for e in reachable] == ["e1"]
        assert r.ledger.state.engines["e1"].unreachable is None
        assert r.ledger.state.routable_engines() == ("e0", "e1")


async def test_a_pass_whose_probe_hangs_gives_up_after_the_probe_timeout(tmp_path: Path) -> None:
    """A pass's own probe of the engine is bounded by the probe timeout, and its report names
    the call and the engine."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("incarnation", Delay(seconds=30.0))
        reconciler = probing(r, tmp_path, timeouts=EngineTimeouts(probe=1.0), suspend_after_s=None)
        with anyio.fail_after(20):  # far beyond the 1 s asked for, far below the delay
            report = await reconciler.reconcile_engine("e1")
        assert report.errors == ("e1: TIMEOUT: incarnation on e1: no reply within 1s",)


async def test_a_pass_whose_inventory_hangs_gives_up_after_the_inventory_timeout(
    tmp_path: Path,
) -> None:
    """The same for the pass's inventory read: bounded by the inventory timeout, named."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        faulty(r, "e1").inject("inventory", Delay(seconds=30.0))
        reconciler = probing(
            r, tmp_path, timeouts=EngineTimeouts(probe=1.0, inventory=1.0), suspend_after_s=None
        )
        with anyio.fail_after(20):  # far beyond the 1 s asked for, far below the delay
            report = await reconciler.reconcile_engine("e1")
        assert report.errors == ("e1: TIMEOUT: inventory on e1: no reply within 1s",)


class NeverTheSameLife:
    """A double of an engine restarting between every probe and inventory read: each
    inventory answers a life other than the one the probe just gave."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def inventory(self) -> Any:
        self.reads += 1
        inventory = await self._inner.inventory()
        return msgspec.structs.replace(inventory, incarnation=f"life-{self.reads}")


async def test_an_engine_changing_life_on_every_read_stops_the_pass(tmp_path: Path) -> None:
    """No inventory can be taken as evidence when the engine's life changed between the probe
    and the read, three times running: the pass stops with ``ENGINE_STOPPED``, naming the
    engine, and records nothing from the inventories."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        flaky = NeverTheSameLife(r.fleet["e1"])
        r.fleet.replace(flaky)
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        seq = r.ledger.state.last_seq
        report = await reconciler.reconcile_engine("e1")
        assert report.errors == (
            "e1: ENGINE_STOPPED: e1 changed incarnation on every read (3 tries)",
        )
        assert flaky.reads == 3
        assert await events(r.ledger, after=seq) == []


class LeavesRightAfterItsObservation:
    """The real ledger, but ``engine_id`` is recorded as left right after its inventory is:
    what a removal's leave landing in the middle of a pass over the engine looks like."""

    def __init__(self, ledger: Any, engine_id: str) -> None:
        self._ledger = ledger
        self._engine_id = engine_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    async def observe_inventory(self, engine_id: str, *args: Any, **kwargs: Any) -> Any:
        outcome = await self._ledger.observe_inventory(engine_id, *args, **kwargs)
        if engine_id == self._engine_id:
            await self._ledger.leave_engine(engine_id)
        return outcome


async def test_an_engine_that_left_after_its_inventory_was_observed_ends_the_pass_quietly(
    tmp_path: Path,
) -> None:
    """The leave is the removal's to handle: the rest of the pass finds no member to clean up
    or repair, and nothing in it fails unexpectedly."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        reconciler = probing(
            r, tmp_path, ledger=LeavesRightAfterItsObservation(r.ledger, "e1"), suspend_after_s=None
        )
        report = await reconciler.reconcile_engine("e1")
        assert "e1" not in r.ledger.state.engines
        assert not [e for e in report.errors if "unexpected" in e], report.errors


async def test_a_report_before_the_loop_runs_is_taken_without_error(tmp_path: Path) -> None:
    """A report of a refused connection can arrive before the health loop started (a face
    serving while the plane starts): it is taken like any other, not raised."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        reconciler = hand_driven(r, Clock(), tmp_path)
        reconciler.engine_trouble("e1", refused("e1"), session="s1")
        assert not reconciler.settled  # no loop yet
