"""The reconciler's health decisions, on real local engines: an outage and a suspension are one
event each however many probes fail, restores back off without writing an event per retry,
and a suspended engine is routable again only once a repair proved what it holds; a
generation refused as not loaded gets that engine's inventory read at once.

Each test drives its own :class:`Reconciler` over the plane's ledger with a clock it sets
(``Clock``), one ``health_check`` per simulated probe: the plane's own health loop is idle (one
probe an hour) and never suspends (``suspend_after_s=None``), so every decision here is the
tested reconciler's. Engine faults come from :class:`~tests.engines.faulty_engine.FaultyEngine`
(the injection wrapper around a real, restartable local engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import (
    Candidate,
    CleanRefusal,
    ErrorCode,
    Generation,
    Inventory,
    InventoryEntry,
    SamplingParams,
    Transport,
)
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from engines.testing import RestartableEngine
from evlog.events import (
    AdapterLost,
    CanaryRecorded,
    EngineReachable,
    EngineRestarted,
    EngineSuspended,
    EngineUnreachable,
    Event,
    InFlight,
    InventoryObserved,
    ServedContentMismatch,
    VersionRestored,
)
from projections.registry import VersionRecord, VersionState
from publisher.drivers.adapter_copy import aiter_buckets, plan_buckets
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationError
from publisher.drivers.reconciler import (
    CANARY_PARAMS,
    CANARY_PROMPT,
    Reconciler,
    served_digests,
)
from publisher.gateway import DispatchError, Gateway, LocalView
from publisher.gateway.affinity import rendezvous
from tests.engines.faulty_engine import Delay, Drop, FaultyEngine, Restart, ServerError
from tests.publisher.drivers.test_reconciler import load_managed
from tests.publisher.plane_kit import (
    FAST,
    LIMITS,
    PEFT_WARNINGS,
    adapter_copy,
    faulty_engines,
    local_engines,
    open_plane,
)
from tests.publisher.rollout_kit import Recording, Rig, rig
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

IDLE = 3600.0
# How long a test waits for what a report does "at once": far inside IDLE (nothing else could
# act within it), far beyond what a loaded machine needs (the suite runs under contention).
AT_ONCE_S = IDLE / 60
SUSPEND_AFTER_S = 10.0


class Clock:
    """The reconciler's clock, moved by the test (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def host(engine: FaultyEngine) -> RestartableEngine:
    """The restartable local engine behind the fault wrapper."""
    inner = engine.inner
    assert isinstance(inner, RestartableEngine)
    return inner


def not_loaded(v: VersionRecord) -> CleanRefusal:
    """What a gateway reports when an engine refuses a generation of ``v`` as not loaded."""
    return CleanRefusal(ErrorCode.NOT_LOADED, f"{v.lora_name} is not loaded")


def reconciler_for(
    plane: ControlPlane,
    clock: Clock,
    *,
    restore_backoff_s: float = 1.0,
    restore_backoff_max_s: float = 60.0,
) -> Reconciler:
    return Reconciler(
        plane.ledger,
        plane.fleet,
        plane.artifacts,
        timeouts=FAST,
        clock=clock,
        full_every_s=IDLE,
        suspend_after_s=SUSPEND_AFTER_S,
        restore_backoff_s=restore_backoff_s,
        restore_backoff_max_s=restore_backoff_max_s,
    )


@contextlib.asynccontextmanager
async def published_on_two(
    tmp_path: Path,
) -> AsyncIterator[tuple[list[FaultyEngine], ControlPlane, VersionRecord]]:
    """Two engines behind fault wrappers, v1 published on both; the plane's own health loop
    idle and never suspending (the test drives its own reconciler)."""
    async with (
        faulty_engines(2) as engines,
        open_plane(
            engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE, suspend_after_s=None
        ) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        yield engines, plane, plane.ledger.state.versions[1]


async def log_after(plane: ControlPlane, seq: int) -> list[Event]:
    return await events(plane.ledger, after=seq)


async def test_probes_failing_for_the_configured_time_suspend_the_engine_once(
    tmp_path: Path,
) -> None:
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock)
        engines[1].inject("incarnation", ServerError(), times=1000)
        seq = plane.ledger.state.last_seq
        for second in range(int(SUSPEND_AFTER_S)):  # failing, not yet for long enough
            clock.now = float(second)
            await reconciler.health_check()
        # out of routing since the first failure (one outage), not suspended yet
        assert [type(e) for e in await log_after(plane, seq)] == [EngineUnreachable]
        assert not plane.ledger.state.engines["e1"].suspended
        for second in range(int(SUSPEND_AFTER_S), 40):  # 30 more failed probes
            clock.now = float(second)
            await reconciler.health_check()
        written = await log_after(plane, seq)
        assert len(written) == 2, written  # one outage, one suspension: not one per probe
        suspended = written[1]
        assert isinstance(suspended, EngineSuspended)
        assert (suspended.engine, suspended.cause) == ("e1", "unhealthy")
        assert "probes failed for 10.0 s" in suspended.detail
        assert plane.ledger.state.holders(v1.lora_name) == ("e0",)


async def test_an_answer_to_a_full_pass_ends_a_run_of_failed_probes(tmp_path: Path) -> None:
    """Probes fail for a while (not yet long enough to suspend); the engine comes back as a new
    process and a full pass -- not a probe -- is the first to reach it, and repairs it. That
    answer ends the failure run: a single failed probe afterwards is the start of a new run, not
    the continuation of the old one that would suspend the healthy engine at once."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock)
        sick = engines[1]
        sick.inject("incarnation", ServerError(), times=int(SUSPEND_AFTER_S))
        for second in range(int(SUSPEND_AFTER_S)):  # failing for 9 s: not suspended yet
            clock.now = float(second)
            await reconciler.health_check()
        assert plane.ledger.state.engines["e1"].routable
        await host(sick).restart()
        clock.now = SUSPEND_AFTER_S
        report = await reconciler.reconcile()  # the full pass sees the new life and repairs it
        assert report.restarted == ("e1",) and report.repaired == ("e1",), report
        seq = plane.ledger.state.last_seq
        sick.inject("incarnation", ServerError())  # one blip of the new life
        clock.now += 1.0
        await reconciler.health_check()  # out of routing until it answers again
        assert plane.ledger.state.holders(v1.lora_name) == ("e0",)
        clock.now += SUSPEND_AFTER_S  # long after the old run: a new one, nothing to suspend
        await reconciler.health_check()
        assert [type(e) for e in await log_after(plane, seq)] == [
            EngineUnreachable,
            EngineReachable,
        ]
        assert not plane.ledger.state.engines["e1"].suspended
        assert plane.ledger.state.holders(v1.lora_name) == ("e0", "e1")


async def test_a_probe_that_answers_ends_a_run_of_failed_probes(tmp_path: Path) -> None:
    """Probes fail for 9 s (not yet long enough to suspend), then one answers: a failure long
    after that starts a new run, and does not suspend the engine as the old run's tenth
    second would."""
    async with published_on_two(tmp_path) as (engines, plane, _):
        clock = Clock()
        reconciler = reconciler_for(plane, clock)
        engines[1].inject("incarnation", ServerError(), times=int(SUSPEND_AFTER_S))
        for second in range(int(SUSPEND_AFTER_S)):
            clock.now = float(second)
            await reconciler.health_check()
        clock.now = SUSPEND_AFTER_S
        await reconciler.health_check()  # it answers
        engines[1].inject("incarnation", ServerError())
        clock.now = 2 * SUSPEND_AFTER_S
        await reconciler.health_check()  # one failure of a new run
        assert not plane.ledger.state.engines["e1"].suspended


async def test_an_engine_answering_again_is_routable_only_after_its_repair(tmp_path: Path) -> None:
    """Suspended while unreachable; it comes back as a new process (it lost every adapter) and
    cannot reload the default for a while: it stays out of routing, each failed restore
    writes nothing, and retries back off; once the reload goes through it is repaired."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock, restore_backoff_s=1.0, restore_backoff_max_s=8.0)
        sick = engines[1]
        sick.inject("incarnation", ServerError(), times=1000)
        for second in range(12):
            clock.now = float(second)
            await reconciler.health_check()
        assert plane.ledger.state.engines["e1"].suspended
        # it comes back as a new process, and every load fails for now (ambiguous 5xx)
        sick.clear()
        await host(sick).restart()
        sick.inject("load", ServerError(), times=1000)
        loads = sick.count("load")
        seq = plane.ledger.state.last_seq
        for second in range(12, 72):  # a minute of probes, one a second
            clock.now = float(second)
            await reconciler.health_check()
            assert "e1" not in plane.ledger.state.holders(v1.lora_name)
        written = await log_after(plane, seq)
        # the restart and what its first inventory proved: nothing per failed restore
        assert [type(e) for e in written] in (
            [EngineRestarted],
            [EngineRestarted, InventoryObserved],
        )
        tries = sick.count("load") - loads
        # backing off 1, 2, 4, 8, 8, ... s: about 10 tries in 60 s, not 60
        assert 5 <= tries <= 12, tries
        assert plane.ledger.state.engines["e1"].suspended
        # the engine loads again: the next retry restores the default, then the repair
        sick.clear()
        clock.now += 8.0
        await reconciler.health_check()
        state = plane.ledger.state
        assert state.engines["e1"].routable and not state.engines["e1"].suspended
        assert state.holders(v1.lora_name) == ("e0", "e1")
        kinds = [type(e).__name__ for e in await log_after(plane, seq)]
        assert kinds[-2:] == ["VersionRestored", "EngineRepaired"], kinds
        assert (await sick.inventory()).names() >= {v1.lora_name}


async def test_a_routable_engine_whose_reload_keeps_failing_is_suspended_once(
    tmp_path: Path,
) -> None:
    """A lost adapter whose reload fails ambiguously: retried with back-off, then (after the
    configured number of tries) the engine is suspended to be repaired as a whole -- one
    ``AdapterLost``, one ``EngineSuspended``, nothing per retry."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock, restore_backoff_s=1.0, restore_backoff_max_s=4.0)
        sick = engines[1]
        # the engine loses the default without a fence (an eviction), and every reload fails
        # before it reaches the engine (an ambiguous 5xx)
        await host(sick).current.unload(v1.lora_name)
        sick.inject("prepare", ServerError(), times=1000)
        seq = plane.ledger.state.last_seq
        for second in range(30):
            clock.now = float(second)
            reconciler.engine_trouble("e1", not_loaded(v1))  # a gateway saw it refuse, each second
            await reconciler.health_check({"e1"})
        written = await log_after(plane, seq)
        kinds = [type(e) for e in written]
        assert kinds.count(AdapterLost) == 1 and kinds.count(EngineSuspended) == 1, kinds
        assert len(written) <= 3, kinds  # the loss (+ its inventory), the suspension
        suspended = next(e for e in written if isinstance(e, EngineSuspended))
        assert suspended.cause == "lost_adapter"
        assert suspended.detail.startswith("version 1 lost and not restored after 3 tries: ")
        assert plane.ledger.state.holders(v1.lora_name) == ("e0",)


@pytest.mark.parametrize("failures_in_new_life", [0, 1])
async def test_a_restarted_engine_owes_nothing_to_its_previous_lifes_back_off(
    tmp_path: Path, failures_in_new_life: int
) -> None:
    """The restore back-off belongs to one life of the engine. e1 loses the default and every
    reload fails: it is suspended (``lost_adapter``) and its retries back off to the longest
    wait. Then it is restarted -- a new, empty, healthy process: the first repair pass restores
    the default and makes it routable, with no waiting out the old life's minute; and a new
    life whose first reload fails waits the first delay (1 s), not the old life's longest."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock, restore_backoff_s=1.0, restore_backoff_max_s=60.0)
        sick = engines[1]
        await host(sick).current.unload(v1.lora_name)  # an eviction: no fence
        sick.inject("prepare", ServerError(), times=1000)
        for second in range(64):  # tries at 0, 1, 3, 7, 15, 31 and 63 s; the next waits 60 s
            clock.now = float(second)
            await reconciler.health_check({"e1"})
        state = plane.ledger.state
        assert state.engines["e1"].suspended and state.engines["e1"].suspend_cause == "lost_adapter"
        prepares = sick.count("prepare")
        for second in range(64, 70):  # the old life is backing off: no try for a while
            clock.now = float(second)
            await reconciler.health_check()
        assert sick.count("prepare") == prepares
        # the operator restarts it: a new process, every adapter gone, loads working again
        # (but for ``failures_in_new_life`` ambiguous failures)
        sick.clear()
        await host(sick).restart()
        if failures_in_new_life:
            sick.inject("prepare", ServerError(), times=failures_in_new_life)
        seq = plane.ledger.state.last_seq
        for _ in range(failures_in_new_life):
            await reconciler.health_check()  # fails once; the next try is 1 s away
            assert "e1" not in plane.ledger.state.holders(v1.lora_name)
            clock.now += 1.0
        await reconciler.health_check()
        state = plane.ledger.state
        assert state.engines["e1"].routable and not state.engines["e1"].suspended
        assert state.holders(v1.lora_name) == ("e0", "e1")
        kinds = [type(e).__name__ for e in await log_after(plane, seq)]
        assert kinds[0] == "EngineRestarted", kinds
        assert kinds[-2:] == ["VersionRestored", "EngineRepaired"], kinds
        assert (await sick.inventory()).names() >= {v1.lora_name}
        assert sick.count("prepare") > prepares + failures_in_new_life


async def test_a_suspect_reported_by_a_gateway_is_read_at_once(tmp_path: Path) -> None:
    """The health loop of the plane, not a hand-driven one: an hour between probes and full
    passes, yet a reported refusal gets the engine's inventory read and the loss recorded."""
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v1 = plane.ledger.state.versions[1]
        await host(engines[1]).current.unload(v1.lora_name, attempt=1)
        await wait_for("the health loop settled", lambda: plane.reconciler.settled)
        assert "e1" in plane.ledger.state.holders(v1.lora_name)  # nobody looked yet
        plane.reconciler.engine_trouble("e1", not_loaded(v1))
        await wait_for(
            "e1 dropped from the holders of v1",
            lambda: "e1" not in plane.ledger.state.holders(v1.lora_name),
            timeout=AT_ONCE_S,
        )
        # the pass that recorded the loss goes on (a restore try, a suspension) and may read
        # the inventory again: count from the moment the loop is back to waiting
        await wait_for("the health loop settled", lambda: plane.reconciler.settled)
        lost = [e for e in await events(plane.ledger) if isinstance(e, AdapterLost)]
        assert [(e.engine, e.version_id) for e in lost] == [("e1", 1)]
        # one incident however many refusals are reported meanwhile; an engine outside the
        # fleet is ignored, not an error
        # ... and a flood of reports wakes the loop once per probe interval, not once each
        # (counted once the first pass is over: its restore fails and ends in a suspension)
        await wait_for("e1 suspended", lambda: plane.ledger.state.engines["e1"].suspended)
        seq = plane.ledger.state.last_seq
        reads = engines[1].count("inventory")
        for _ in range(20):  # each report acted on (or not) before the next is made
            plane.reconciler.engine_trouble("e1", not_loaded(v1))
            plane.reconciler.engine_trouble("e9", not_loaded(v1))
            await wait_for("the health loop settled", lambda: plane.reconciler.settled)
        written = await events(plane.ledger, after=seq)
        assert not [e for e in written if isinstance(e, AdapterLost)], written
        assert engines[1].count("inventory") == reads


async def test_a_missing_adapter_and_an_engine_failure_both_reach_the_reconciler_through_one_hook(
    tmp_path: Path,
) -> None:
    """A gateway wired the way ``serve`` wires it (``on_engine_trouble`` = the plane's
    reconciler), the plane's probes and full passes an hour apart, suspension at the first
    failed probe: a refusal for a lost adapter gets that engine's inventory read at once (the
    loss recorded, routing moves), and an ambiguous failure on another engine gets it probed at
    once (the failed probe suspends it). Nothing else would have looked within the hour."""
    async with (
        faulty_engines(2) as engines,
        open_plane(
            engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE, suspend_after_s=0.0
        ) as plane,
    ):
        gateway = Gateway(
            plane.fleet,
            LocalView(plane.ledger),
            on_engine_trouble=plane.reconciler.engine_trouble,
        )
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v1 = plane.ledger.state.versions[1]
        await plane.ledger.register_owner("w", ttl_s=600.0)
        # 1. e1 loses the version behind the ledger's back; a turn there is refused
        await host(engines[1]).current.unload(v1.lora_name, attempt=v1.attempt)
        bound = await plane.ledger.bind(going_to("e1", ["e0", "e1"]), "w")
        with pytest.raises(DispatchError) as refused:
            await gateway.generate(bound, "hello")
        assert refused.value.details["engine_code"] in (
            ErrorCode.NOT_LOADED,
            ErrorCode.NAME_RECLAIMED,
        )
        await wait_for(
            "e1 dropped from the holders of v1",
            lambda: "e1" not in plane.ledger.state.holders(v1.lora_name),
            timeout=AT_ONCE_S,
        )
        lost = [e for e in await events(plane.ledger) if isinstance(e, AdapterLost)]
        assert [(e.engine, e.version_id) for e in lost] == [("e1", 1)]
        # 2. e0 stops answering (its probes fail too); a turn there fails ambiguously
        engines[0].inject("generate", ServerError())
        engines[0].inject("incarnation", ServerError(), times=1000)
        await wait_for("the health loop settled", lambda: plane.reconciler.settled)
        assert plane.ledger.state.engines["e0"].routable  # nobody has looked yet
        bound = await plane.ledger.bind("on-e0", "w")
        with pytest.raises(DispatchError) as failed:
            await gateway.generate(bound, "hello")
        assert failed.value.details["engine"] == "e0"
        await wait_for(
            "e0 suspended", lambda: plane.ledger.state.engines["e0"].suspended, timeout=AT_ONCE_S
        )
        suspended = [e for e in await events(plane.ledger) if isinstance(e, EngineSuspended)]
        assert ("e0", "unhealthy") in [(e.engine, e.cause) for e in suspended]


def going_to(engine_id: str, holders: list[str]) -> str:
    """A session id whose first choice (rendezvous) among ``holders`` is ``engine_id``."""
    return next(f"s{i}" for i in range(1000) if rendezvous(f"s{i}", holders) == engine_id)


# --- canaries: what a path engine serves under a version's name -----------------------------


class PathEngine(Recording):
    """A real local engine reporting SGLang's kind (a path engine: no digest of what it loaded,
    so the reconciler asks each held version's canary), recording every generation it is asked
    (prompt, name, parameters); ``other_answers`` are token ids it answers instead, in order
    (other weights under the name), one per generation; ``on_ask``, when set, runs as each
    generation reaches it, before the engine answers (what the test does meanwhile, or a
    failure it raises)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.kind = "sglang"
        self.asked: list[tuple[Any, str | None, SamplingParams]] = []
        self.other_answers: list[tuple[int, ...]] = []
        self.on_ask: Callable[[str | None], Awaitable[None]] | None = None

    async def generate(
        self, prompt: Any, lora_name: str | None, params: SamplingParams, **kwargs: Any
    ) -> Generation:
        self.asked.append((prompt, lora_name, params))
        if self.on_ask is not None:
            await self.on_ask(lora_name)
        out = await super().generate(prompt, lora_name, params, **kwargs)
        if self.other_answers:
            return msgspec.structs.replace(out, token_ids=self.other_answers.pop(0))
        return out


def rig_reconciler(r: Rig, clock: Clock, tmp_path: Path, **options: Any) -> Reconciler:
    """A reconciler of its own over a rig's ledger and fleet: its clock, an empty artifact
    store, the fast engine timeouts."""
    store = ArtifactStore(tmp_path / "artifacts")
    return Reconciler(r.ledger, r.fleet, store, timeouts=FAST, clock=clock, **options)


def canary_reconciler(r: Rig, clock: Clock, every: float | None, tmp_path: Path) -> Reconciler:
    return rig_reconciler(r, clock, tmp_path, canary_every_s=every)


async def canary_answer(r: Rig, engine_id: str, name: str) -> str:
    """What the version's canary is, asked of the real engine directly."""
    out = await r.local[engine_id].generate(CANARY_PROMPT, name, CANARY_PARAMS)
    return ",".join(str(t) for t in out.token_ids)


async def test_a_path_engine_answers_each_held_versions_canary_once_per_period(
    tmp_path: Path,
) -> None:
    """The canary is the fixed prompt, greedy, on the version's own name; the first answer of
    the engine's life is the baseline, recorded as the engine gave it; it is asked again only
    ``canary_every_s`` after the last answer (not at every pass), and while it runs it is a
    request in flight on that version and engine (reclaim's evidence), at zero afterwards."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        await r.publish(2)
        clock = Clock()
        reconciler = canary_reconciler(r, clock, 10.0, tmp_path)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        await reconciler.reconcile_engine("e0")
        assert engine.asked == [
            (CANARY_PROMPT, r.names[1], CANARY_PARAMS),
            (CANARY_PROMPT, r.names[2], CANARY_PARAMS),
        ]
        baselines = {
            (e.engine, e.version_id, e.answer)
            for e in of_type(await events(r.ledger), CanaryRecorded)
        }
        assert baselines == {
            ("e0", 1, await canary_answer(r, "e0", r.names[1])),
            ("e0", 2, await canary_answer(r, "e0", r.names[2])),
        }
        clock.now = 5.0
        assert reconciler.inflight_evidence(1) == [
            InFlight(reporter="canaries", engine="*", count=0, at=5.0)
        ]
        asked = len(engine.asked)
        clock.now = 9.5  # not yet due: neither a probe nor a pass asks it
        await reconciler.health_check()
        await reconciler.reconcile_engine("e0")
        assert len(engine.asked) == asked
        clock.now = 10.0  # due, exactly a period after the last answer: the probe reconciles
        await reconciler.health_check()
        assert len(engine.asked) == asked + 2
        # while a canary runs, it is in flight on its version and engine, and only there
        r.local["e0"].pause_generation()
        clock.now = 20.0
        async with anyio.create_task_group() as tg:
            tg.start_soon(reconciler.reconcile_engine, "e0")
            await wait_for("v1's canary running", lambda: r.local["e0"].refcount(r.names[1]) == 1)
            assert reconciler.inflight_evidence(1) == [
                InFlight(reporter="canaries", engine="e0", count=1, at=20.0)
            ]
            assert reconciler.inflight_evidence(2) == [
                InFlight(reporter="canaries", engine="*", count=0, at=20.0)
            ]
            r.local["e0"].continue_generation()
        assert reconciler.inflight_evidence(1) == [
            InFlight(reporter="canaries", engine="*", count=0, at=20.0)
        ]
        assert r.ledger.state.engines["e0"].mismatched == {}


async def test_only_an_other_answer_given_twice_is_a_content_mismatch(tmp_path: Path) -> None:
    """An answer that differs from the baseline is asked again at once: one that does not
    repeat is no evidence (nothing written); one the engine gives twice is the mismatch,
    recorded with both answers, and the engine leaves routing for the version."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        clock = Clock()
        reconciler = canary_reconciler(r, clock, 0.0, tmp_path)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        await reconciler.reconcile_engine("e0")
        baseline = r.ledger.state.engines["e0"].canaries[r.names[1]]
        seq = r.ledger.state.last_seq
        engine.other_answers = [(1, 2, 3)]  # once: the second ask gives the baseline again
        asked = len(engine.asked)
        await reconciler.reconcile_engine("e0")
        assert len(engine.asked) == asked + 2
        assert await events(r.ledger, after=seq) == []
        engine.other_answers = [(1, 2, 3), (1, 2, 3)]
        await reconciler.reconcile_engine("e0")
        found = of_type(await events(r.ledger, after=seq), ServedContentMismatch)
        assert [(e.engine, e.version_id, e.evidence, e.expected, e.seen) for e in found] == [
            ("e0", 1, "canary", baseline, "1,2,3")
        ]
        assert r.ledger.state.holders(r.names[1]) == ()
        # its restore keeps failing (this reconciler's store lacks the bytes): suspended,
        # saying why the version was missing
        for _ in range(3):
            clock.now += 100.0
            await reconciler.reconcile_engine("e0")
        (suspended,) = of_type(await events(r.ledger, after=seq), EngineSuspended)
        assert suspended.cause == "lost_adapter"
        assert suspended.detail.startswith(
            "version 1 served with other content and not restored after 3 tries: "
        ), suspended.detail
        assert "INVALID_ADAPTER" in suspended.detail  # and the last error, by its code


@pytest.mark.parametrize(("kind", "every"), [("local", 0.0), ("sglang", None)])
async def test_no_canary_for_an_engine_naming_its_digest_or_when_none_is_configured(
    tmp_path: Path, kind: str, every: float | None
) -> None:
    """A ``local`` engine reports the digest of what it loaded (the inventory's check holds),
    and ``canary_every_s=None`` asks none: no generation is sent by any pass."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        engine.kind = kind
        reconciler = canary_reconciler(r, Clock(), every, tmp_path)
        await reconciler.reconcile_engine("e0")
        await reconciler.health_check()
        assert engine.asked == []


# --- restores: what is sent, and what counts as restored -------------------------------------

BUCKET_BYTES = 1024  # smaller than the default: a restore's bytes go as several buckets


class Restoring:
    """A real local engine recording what a restore sends it: each prepared candidate, and how
    many buckets each transfer carried."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner = inner
        self.prepared: list[Candidate] = []
        self.buckets: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def prepare(self, candidate: Candidate) -> Any:
        self.prepared.append(candidate)
        return await self.inner.prepare(candidate)

    async def transfer(self, candidate: Candidate, buckets: Any) -> Any:
        sent = [b async for b in buckets]
        self.buckets.append(len(sent))
        return await self.inner.transfer(candidate, aiter_buckets(sent))


@pytest.mark.parametrize("transport", ["staged", "artifact"])
async def test_a_restore_sends_a_staged_engine_the_bytes_and_a_path_engine_the_directory(
    tmp_path: Path, transport: Transport
) -> None:
    """The version's committed candidate (name, digest, attempt) from the artifact store: a
    staged engine gets its bytes in buckets of the configured size and no path; a path engine
    gets the store's directory and no bytes. (Restored on an engine that joins.)"""
    async with local_engines(3, transport=transport) as engines:
        joining = Restoring(engines[2])
        async with open_plane(
            engines[:2],
            tmp_path,
            probe_interval_s=IDLE,
            full_reconcile_s=IDLE,
            suspend_after_s=None,
        ) as plane:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            v1 = plane.ledger.state.versions[1]
            plane.fleet.add(joining)  # a recording wrapper
            reconciler = Reconciler(
                plane.ledger,
                plane.fleet,
                plane.artifacts,
                timeouts=FAST,
                bucket_bytes=BUCKET_BYTES,
                full_every_s=IDLE,
                suspend_after_s=None,
            )
            report = await reconciler.reconcile_engine("e2")
            assert report.restored == ("e2:1",), report
            (candidate,) = joining.prepared
            assert (candidate.lora_name, candidate.digest, candidate.attempt) == (
                v1.lora_name,
                v1.digest,
                v1.attempt,
            )
            _, tensors = plane.artifacts.open(v1.digest)
            if transport == "staged":
                assert candidate.artifact_path is None
                assert joining.buckets == [len(plan_buckets(tensors, BUCKET_BYTES))]
                assert joining.buckets[0] > len(plan_buckets(tensors))
            else:
                assert candidate.artifact_path == str(plane.artifacts.path_for(v1.digest))
                assert joining.buckets == [0]
            assert plane.ledger.state.holders(v1.lora_name) == ("e0", "e1", "e2")


async def test_a_restore_whose_load_reply_was_lost_counts_once_the_inventory_shows_it(
    tmp_path: Path,
) -> None:
    """The load ran but its reply was lost: a fresh inventory of the same life, listing the
    name with the version's digest, proves the restore (recorded in the same pass, no second
    load)."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        reconciler = reconciler_for(plane, Clock())
        sick = engines[1]
        await host(sick).restart()  # a new process: it lost every adapter
        sick.inject("load", Drop())
        loads = sick.count("load")
        report = await reconciler.reconcile_engine("e1")
        assert report.restarted == ("e1",) and report.restored == ("e1:1",), report
        assert sick.count("load") == loads + 1
        assert plane.ledger.state.holders(v1.lora_name) == ("e0", "e1")


async def test_a_restore_answered_by_another_life_of_the_engine_is_not_recorded(
    tmp_path: Path,
) -> None:
    """The engine restarts just before the restore's prepare reaches it: the restore ran in a
    life the pass did not inspect, so it proves nothing for the life the ledger knows: no
    ``VersionRestored`` is written for that life."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        reconciler = reconciler_for(plane, Clock())
        sick = engines[1]
        await host(sick).restart()  # a new process: it lost every adapter
        sick.inject("prepare", Restart())  # ... and another, as the restore begins
        seq = plane.ledger.state.last_seq
        report = await reconciler.reconcile_engine("e1")
        assert report.restarted == ("e1",) and report.restored == (), report
        assert of_type(await log_after(plane, seq), VersionRestored) == []
        assert plane.ledger.state.holders(v1.lora_name) == ("e0",)


# --- what a probe reconciles ---------------------------------------------------------------


async def test_a_probe_reconciles_an_engine_still_holding_a_stray(tmp_path: Path) -> None:
    """A stray of this deployment whose unload failed stays on the engine's record: the next
    probe (no report, no full pass) reconciles the engine again and unloads it."""
    async with published_on_two(tmp_path) as (engines, plane, _):
        reconciler = reconciler_for(plane, Clock())
        sick = engines[1]
        stray = "agent@dep-99-0123456789abcdef"  # our prefix, unknown to the ledger
        await load_managed(host(sick).current, stray, 51)
        sick.inject("unload", ServerError())
        report = await reconciler.reconcile_engine("e1")
        assert report.unloaded == ()  # not gone: reported as an error
        assert [e.split(": SERVER_ERROR")[0] for e in report.errors] == [f"e1: unload {stray}"]
        assert stray in plane.ledger.state.engines["e1"].strays
        await reconciler.health_check()
        assert stray not in (await sick.inventory()).names()
        assert stray not in plane.ledger.state.engines["e1"].strays


async def test_a_probe_reconciles_a_routable_engine_lacking_a_needed_version(
    tmp_path: Path,
) -> None:
    """e1 lost the default (recorded): it stays routable for the rest, and every probe -- no
    report, no full pass -- retries the reload (backing off) until the tries run out and the
    engine is suspended."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock, restore_backoff_s=1.0, restore_backoff_max_s=1.0)
        sick = engines[1]
        await host(sick).current.unload(v1.lora_name)
        sick.inject("prepare", ServerError(), times=1000)
        await reconciler.health_check({"e1"})  # a gateway's report: the loss recorded
        member = plane.ledger.state.engines["e1"]
        assert member.routable and v1.lora_name not in member.holds
        prepares = sick.count("prepare")  # its first reload failed
        for second in (1, 2):  # probes only: the second and third tries
            clock.now = float(second)
            await reconciler.health_check()
        assert sick.count("prepare") == prepares + 2
        assert plane.ledger.state.engines["e1"].suspend_cause == "lost_adapter"


async def test_restores_back_off_from_one_second_doubling_up_to_a_minute_by_default(
    tmp_path: Path,
) -> None:
    """The back-off the control plane runs with (it passes none of its own): a failing reload
    is tried again 1 s later, then 2, 4, ... s, never more than 60 s apart."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = Reconciler(
            plane.ledger, plane.fleet, plane.artifacts, timeouts=FAST, clock=clock
        )
        sick = engines[1]
        await host(sick).current.unload(v1.lora_name)
        sick.inject("prepare", ServerError(), times=1000)
        await reconciler.health_check({"e1"})  # the loss recorded, the first try fails
        tries = sick.count("prepare")
        for second in (1, 3, 7, 15, 31, 63, 123):  # each try due exactly then, none before
            clock.now = second - 0.01
            await reconciler.health_check()
            assert sick.count("prepare") == tries, second
            clock.now = float(second)
            await reconciler.health_check()
            assert sick.count("prepare") == tries + 1, second
            tries += 1


async def test_a_reconciler_with_no_in_flight_source_fences_and_confirms_a_reclaim(
    tmp_path: Path,
) -> None:
    """Built without an in-flight source (none counted), the reconciler unloads a version
    being reclaimed, fenced, before the engine's inventory counts for it, and the reclaim
    completes on the inventories it reads."""
    async with rig(engines=2) as r:
        await r.publish(1)
        await r.publish(2)  # v1 retired, unbound
        driver = r.reclaimer()
        await r.ledger.claim_reclaim(1, driver.evidence(1))
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMING
        reconciler = Reconciler(r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"))
        report = await reconciler.reconcile()
        assert report.reclaimed == (1,), report
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED
        assert all(r.names[1] not in e.loaded_adapters() for e in r.local.values())


async def test_a_restore_confirmation_that_hangs_is_bounded_by_the_inventory_timeout(
    tmp_path: Path,
) -> None:
    """The load's reply was lost and the inventory that should decide never answers: the
    restore fails after ``timeouts.inventory`` (5 s here; the engine is not waited for) and
    counts nothing."""
    async with published_on_two(tmp_path) as (engines, plane, _):
        sick = engines[1]
        await host(sick).restart()  # a new process: it lost every adapter
        reconciler = Reconciler(
            plane.ledger,
            plane.fleet,
            plane.artifacts,
            timeouts=FAST,
            clock=Clock(),
            suspend_after_s=None,
        )
        sick.inject("load", Drop())
        # the pass's own read, then the confirmation's
        sick.inject("inventory", Delay(seconds=60.0), call=sick.count("inventory") + 2)
        with anyio.fail_after(30):
            report = await reconciler.reconcile_engine("e1")
        assert report.restored == (), report
        assert any("restore version 1" in e for e in report.errors), report


async def test_a_probe_reconciles_an_engine_whose_word_a_reclaim_still_needs(
    tmp_path: Path,
) -> None:
    """e2 joined after v1 was published (not in its fleet, never held it); v1 is being
    reclaimed, blocking publications (an unload's reply was lost): a probe reconciles e2
    too, whose inventory proves v1 absent, and the reclaim completes without waiting for a
    full pass."""
    async with rig(engines=2) as r, LocalEngine("e2") as joining:
        store = ArtifactStore(tmp_path / "artifacts")
        for version_id in (1, 2):
            config, tensors = make_adapter(version_id)
            store.put(build_manifest(config, tensors), tensors)
        await r.publish(1)
        await r.publish(2)  # v1 retired, unbound
        r.fleet.add(joining)
        reconciler = Reconciler(r.ledger, r.fleet, store, timeouts=FAST)
        report = await reconciler.reconcile_engine("e2")
        assert report.joined == ("e2",) and report.repaired == ("e2",), report
        await r.ledger.claim_reclaim(1, r.reclaimer().evidence(1))
        # its unload's reply was lost somewhere: the reclaim now blocks publications
        await r.ledger.mark_reclaim_ambiguous(1, "e0", "the unload's reply was lost")
        await reconciler.health_check()
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED


async def test_a_probe_reconciles_the_fleet_of_a_fatal_candidate(tmp_path: Path) -> None:
    """v2's load on e1 lost its reply (fatal, blocking publications): the next probe -- no
    report, no full pass -- reads the engines of its fleet, unloads the candidate and
    resolves it."""
    async with published_on_two(tmp_path) as (engines, plane, _):
        engines[1].inject("load", Drop())
        engines[1].inject("unload", ServerError())  # and its cleanup never arrives
        with pytest.raises(PublicationError):
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert plane.ledger.state.blocked_by() == [2]
        name = plane.ledger.state.versions[2].lora_name
        await reconciler_for(plane, Clock()).health_check()
        assert plane.ledger.state.blocked_by() == []
        assert name not in (await engines[1].inventory()).names()


async def test_a_stray_unload_that_hangs_is_bounded_by_the_cleanup_timeout(tmp_path: Path) -> None:
    """The engine never answers the unload of a stray: the pass gives up after
    ``cleanup_timeout`` (shorter than the unload timeout), reports it, and goes on."""
    async with published_on_two(tmp_path) as (engines, plane, _):
        sick = engines[1]
        stray = "agent@dep-99-0123456789abcdef"  # our prefix, unknown to the ledger
        await load_managed(host(sick).current, stray, 51)
        sick.inject("unload", Delay(seconds=60.0))
        reconciler = Reconciler(
            plane.ledger,
            plane.fleet,
            plane.artifacts,
            timeouts=FAST,
            cleanup_timeout=0.5,
            clock=Clock(),
            suspend_after_s=None,
        )
        with anyio.fail_after(15):
            report = await reconciler.reconcile_engine("e1")
        assert report.unloaded == ()
        assert [e.split(": TIMEOUT")[0] for e in report.errors] == [f"e1: unload {stray}"]


async def test_a_canary_that_hangs_gives_up_after_a_probe_and_an_inventory_timeout(
    tmp_path: Path,
) -> None:
    """The engine never answers the canary: the pass gives up after the probe and inventory
    timeouts together, records no baseline, and no longer counts the canary in flight."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        reconciler = Reconciler(
            r.ledger,
            r.fleet,
            ArtifactStore(tmp_path / "artifacts"),
            timeouts=FAST,  # the canary's bound: 2 + 5 s
            clock=Clock(),
            canary_every_s=0.0,
        )
        r.local["e0"].pause_generation()
        try:
            with anyio.fail_after(20):
                await reconciler.reconcile_engine("e0")
        finally:
            r.local["e0"].continue_generation()
        assert r.ledger.state.engines["e0"].canaries == {}
        assert [x.count for x in reconciler.inflight_evidence(1)] == [0]


class HeldCalls:
    """A real engine whose ``method`` calls wait until the test lets them through: the test,
    not the clock, decides how long the call takes (a double of a slow engine, around the
    fault wrapper of a real one)."""

    def __init__(self, inner: Any, method: str) -> None:
        self._inner = inner
        self._method = method
        self.calls = 0
        self.release = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            await self.release.wait()
            return await attr(*args, **kwargs)

        return held


# No engine call gives up on its own here: the test releases the held ones itself.
UNHURRIED = EngineTimeouts(probe=IDLE, inventory=IDLE)


def unhurried_reconciler(r: Rig, clock: Clock, tmp_path: Path, **options: Any) -> Reconciler:
    store = ArtifactStore(tmp_path / "artifacts")
    return Reconciler(r.ledger, r.fleet, store, timeouts=UNHURRIED, clock=clock, **options)


async def test_two_passes_over_one_engine_never_run_at_once(tmp_path: Path) -> None:
    """A pass reads, cleans and repairs an engine from one inventory: a second pass over the
    same engine (a report's, a probe's, the full pass's) waits until the first ended, or both
    would act on the same reading (two restores, an unload racing a load)."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        e0 = r.fleet["e0"]
        assert isinstance(e0, FaultyEngine)
        held = HeldCalls(e0, "inventory")
        r.fleet.replace(held)
        reconciler = unhurried_reconciler(r, Clock(), tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reconciler.reconcile_engine, "e0")
            await wait_for("the first pass reading e0's inventory", lambda: held.calls == 1)
            probes = e0.count("incarnation")
            tg.start_soon(reconciler.reconcile_engine, "e0")
            await anyio.wait_all_tasks_blocked()
            assert e0.count("incarnation") == probes  # the second pass has not begun
            assert held.calls == 1
            held.release.set()
        assert held.calls == 2  # it ran once the first had ended


async def test_a_pass_held_up_on_one_engine_does_not_hold_up_another(tmp_path: Path) -> None:
    """Passes over different engines run side by side: an engine slow to answer must not
    delay the pass over another, or one hung engine would stall the whole fleet's repairs for
    its timeouts. (The rig bounds the test: a pass that waited would fail it.)"""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        held = HeldCalls(r.fleet["e1"], "inventory")
        r.fleet.replace(held)
        reconciler = unhurried_reconciler(r, Clock(), tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reconciler.reconcile_engine, "e1")
            await wait_for("e1's pass reading its inventory", lambda: held.calls == 1)
            report = await reconciler.reconcile_engine("e0")  # while e1's pass is held
            assert report.engines == ("e0",) and report.errors == ()
            held.release.set()


async def test_the_loop_is_not_settled_while_a_wake_is_at_work(tmp_path: Path) -> None:
    """``settled`` (what callers wait for: every report so far acted on) stays false from a
    wake's start to its end: a probe still under way has not acted on anything yet."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        held = HeldCalls(r.fleet["e1"], "incarnation")
        r.fleet.replace(held)
        reconciler = unhurried_reconciler(
            r, Clock(), tmp_path, probe_interval_s=IDLE, full_every_s=IDLE, suspend_after_s=None
        )
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            reconciler.poke()
            await wait_for("the wake's probe of e1 under way", lambda: held.calls == 1)
            assert not reconciler.settled
            held.release.set()
            await wait_for("the wake done", lambda: reconciler.settled)
            assert reconciler.wakes == 1
            tg.cancel_scope.cancel()


async def test_the_full_pass_comes_exactly_full_every_s_after_the_last(tmp_path: Path) -> None:
    """A wake is a full pass (every engine read, ``passes`` counted once) when
    ``full_every_s`` has passed since the last one, to the second; a probe round before."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        clock = Clock()
        reconciler = rig_reconciler(
            r, clock, tmp_path, probe_interval_s=IDLE, full_every_s=10.0, suspend_after_s=None
        )
        async with anyio.create_task_group() as tg:
            await tg.start(reconciler.run)
            clock.now = 9.5
            reconciler.poke()
            await wait_for("the first wake done", lambda: reconciler.wakes == 1)
            assert reconciler.passes == 0  # a probe round
            clock.now = 10.0
            reconciler.poke()
            await wait_for("the second wake done", lambda: reconciler.wakes == 2)
            assert reconciler.passes == 1
            tg.cancel_scope.cancel()


async def reclaiming_v1(r: Rig) -> None:
    """v1 retired by v2 and claimed for reclaim: every engine still holds it."""
    await r.publish(1)
    await r.publish(2)  # v1 retired, unbound
    await r.ledger.claim_reclaim(1, r.reclaimer().evidence(1))
    assert r.ledger.state.versions[1].state is VersionState.RECLAIMING


async def test_a_reclaim_is_not_unloaded_under_a_request_in_flight_on_that_engine(
    tmp_path: Path,
) -> None:
    """The reconciler's fenced unload of a version being reclaimed waits, on each engine, for
    the requests counted in flight there (the reclaim driver's next tick takes it after the
    drain); an engine with none is cleaned at once."""
    async with rig(engines=2) as r:
        await reclaiming_v1(r)
        counts = {("e0", 1): 1}  # one request of v1 running on e0
        reconciler = Reconciler(
            r.ledger,
            r.fleet,
            ArtifactStore(tmp_path / "artifacts"),
            timeouts=FAST,
            inflight=lambda engine_id, version_id: counts.get((engine_id, version_id), 0),
        )
        await reconciler.reconcile()
        assert r.names[1] in r.local["e0"].loaded_adapters()
        assert r.names[1] not in r.local["e1"].loaded_adapters()
        assert dict(r.ledger.state.versions[1].confirmed).keys() == {"e1"}


async def test_a_reclaims_failed_unload_is_reported_and_its_inventory_not_taken(
    tmp_path: Path,
) -> None:
    """The fenced unload of a version being reclaimed failed on e0: the pass reports it,
    naming the engine and the name, and stops there -- no inventory of e0 counts for the
    reclaim until that unload went through."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await reclaiming_v1(r)
        e0 = r.fleet["e0"]
        assert isinstance(e0, FaultyEngine)
        e0.inject("unload", ServerError())
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        seq = r.ledger.state.last_seq
        report = await reconciler.reconcile_engine("e0")
        assert [e.split(": SERVER_ERROR")[0] for e in report.errors] == [f"e0: unload {r.names[1]}"]
        assert of_type(await events(r.ledger, after=seq), InventoryObserved) == []
        assert "e0" not in r.ledger.state.versions[1].confirmed


async def test_an_unexpected_error_in_one_engines_pass_is_reported_not_raised(
    tmp_path: Path,
) -> None:
    """A bug (here in the in-flight source the reconciler consults) must not take the health
    loop down: the pass reports it for its engine, naming the error, and returns."""

    def broken(engine_id: str, version_id: int) -> int:
        raise RuntimeError(f"no count for {engine_id}")

    async with rig(engines=2) as r:
        await reclaiming_v1(r)
        reconciler = Reconciler(
            r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"), timeouts=FAST, inflight=broken
        )
        report = await reconciler.reconcile_engine("e0")
        assert report.errors == ("e0: unexpected RuntimeError: no count for e0",)


async def test_a_name_an_engine_owes_is_dropped_before_its_inventory_counts(
    tmp_path: Path,
) -> None:
    """e1 was suspended while v1 was reclaimed (completed on e0's proof alone): e1 owes v1's
    drop. Its next pass unloads the name, fenced, before its inventory is recorded: the ledger
    never records an inventory of e1 still holding it (a load in flight from before the
    suspension could otherwise land after the proof)."""
    async with rig(engines=2) as r:
        await reclaiming_v1(r)
        await r.ledger.suspend_engine("e1", cause="operator")
        assert await r.reclaimer().sweep() == [1]
        assert r.names[1] in r.ledger.state.engines["e1"].owes
        seq = r.ledger.state.last_seq
        reconciler = Reconciler(
            r.ledger, r.fleet, ArtifactStore(tmp_path / "artifacts"), timeouts=FAST
        )
        await reconciler.reconcile_engine("e1")
        observed = of_type(await events(r.ledger, after=seq), InventoryObserved)
        assert [e.engine for e in observed] and all(r.names[1] not in e.adapters for e in observed)
        assert r.ledger.state.engines["e1"].owes == {}
        assert r.names[1] not in r.local["e1"].loaded_adapters()


async def test_a_name_an_engine_owes_waits_for_the_requests_in_flight_on_it(
    tmp_path: Path,
) -> None:
    """e1 owes v1's drop (reclaimed while it was suspended), but a request of v1 is still
    counted in flight on e1: no part of the pass unloads the name under it -- neither the
    fenced drop of what e1 owes nor the stray cleanup after its inventory, which sees the
    name present. Once the count drains, the next pass drops it and the debt ends."""
    async with rig(engines=2) as r:
        await reclaiming_v1(r)
        await r.ledger.suspend_engine("e1", cause="operator")
        assert await r.reclaimer().sweep() == [1]
        counts = {("e1", 1): 1}  # one request of v1 still running on e1
        reconciler = rig_reconciler(
            r, Clock(), tmp_path, inflight=lambda engine, version: counts.get((engine, version), 0)
        )
        report = await reconciler.reconcile_engine("e1")
        assert r.names[1] in r.local["e1"].loaded_adapters()
        assert r.names[1] in r.ledger.state.engines["e1"].owes
        assert report.unloaded == ()
        counts.clear()  # the request ended
        await reconciler.reconcile_engine("e1")
        assert r.names[1] not in r.local["e1"].loaded_adapters()
        assert r.ledger.state.engines["e1"].owes == {}


async def test_an_engine_that_left_while_a_pass_read_it_is_not_joined_again(
    tmp_path: Path,
) -> None:
    """A pass was probing e1 when e1 was held out and recorded as left: the pass stops there.
    Joining it again would make an engine the fleet is removing routable."""
    async with rig(engines=2, wrap=FaultyEngine) as r:
        await r.publish(1)
        held = HeldCalls(r.fleet["e1"], "incarnation")
        r.fleet.replace(held)
        reconciler = unhurried_reconciler(r, Clock(), tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reconciler.reconcile_engine, "e1")
            await wait_for("the pass probing e1", lambda: held.calls == 1)
            reconciler.hold_out("e1")
            await r.ledger.leave_engine("e1")
            held.release.set()
        assert "e1" not in r.ledger.state.engines


async def test_an_engines_kind_is_recorded_at_its_join_and_at_a_restart(tmp_path: Path) -> None:
    """The kind the ledger records (a path engine's held versions answer canaries, a local
    engine's do not) is the handle's: at the join, and again when a restart comes back
    behind a handle of another kind."""
    async with (
        rig(engines=1) as r,
        LocalEngine("e1", limits=LIMITS) as first,
        LocalEngine("e1", limits=LIMITS) as second,
    ):
        await r.publish(1)
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        r.fleet.add(PathEngine(first))
        await reconciler.reconcile_engine("e1")
        assert r.ledger.state.engines["e1"].kind == "sglang"
        r.fleet.replace(second)  # a new process, behind a local engine's handle
        report = await reconciler.reconcile_engine("e1")
        assert report.restarted == ("e1",)
        assert r.ledger.state.engines["e1"].kind == "local"


class NewLifeAfterUnload:
    """A double of an engine whose process is replaced right after it answers an unload:
    from then on its probe and its inventory answer a new life (the real engine underneath
    serves on)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.life: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def unload(self, *args: Any, **kwargs: Any) -> Any:
        receipt = await self._inner.unload(*args, **kwargs)
        self.life = "next-life"
        return receipt

    async def incarnation(self) -> str:
        real: str = await self._inner.incarnation()
        return self.life or real

    async def inventory(self) -> Any:
        inventory = await self._inner.inventory()
        if self.life is None:
            return inventory
        return msgspec.structs.replace(inventory, incarnation=self.life)


@pytest.mark.parametrize("cleanup", ["reclaim fence", "stray"])
async def test_a_restart_seen_by_the_read_after_a_cleanup_is_reported(
    tmp_path: Path, cleanup: str
) -> None:
    """The pass reads the engine again after its cleanups (a reclaim's fenced unload before
    the evidence, a stray's after it): a new life found by that read is a restart like any
    other, recorded and in the pass's report."""
    async with rig(engines=2) as r:
        if cleanup == "reclaim fence":
            await reclaiming_v1(r)
        else:
            await r.publish(1)
            await load_managed(r.local["e0"], "agent@dep-99-0123456789abcdef", 51)
        double = NewLifeAfterUnload(r.fleet["e0"])
        r.fleet.replace(double)
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        report = await reconciler.reconcile_engine("e0")
        assert double.life is not None  # the cleanup ran
        assert report.restarted == ("e0",), report
        assert not [e for e in report.errors if "unexpected" in e], report.errors
        assert r.ledger.state.engines["e0"].incarnation == "next-life"


class OtherBytesUnder:
    """A double of an engine that serves other weights under one managed name (loaded there
    by whoever reached its control routes): its inventory lists the name with their digest."""

    def __init__(self, inner: Any, name: str, digest: str) -> None:
        self._inner = inner
        self._name = name
        self._digest = digest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def inventory(self) -> Any:
        inventory = await self._inner.inventory()
        adapters = tuple(
            msgspec.structs.replace(a, digest=self._digest) if a.lora_name == self._name else a
            for a in inventory.adapters
        )
        return msgspec.structs.replace(inventory, adapters=adapters)


async def test_a_digest_the_inventory_reports_is_evidence_of_other_content(
    tmp_path: Path,
) -> None:
    """An engine that reports the digest of what it serves (the local engine, SGLang's
    tensor path) proves other content under a version's name from its inventory alone: the
    pass passes the digests on, and the ledger records the mismatch."""
    async with rig(engines=2) as r:
        await r.publish(1)
        r.fleet.replace(OtherBytesUnder(r.fleet["e1"], r.names[1], "ab" * 32))
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        seq = r.ledger.state.last_seq
        await reconciler.reconcile_engine("e1")
        found = of_type(await events(r.ledger, after=seq), ServedContentMismatch)
        assert [(e.engine, e.version_id, e.evidence, e.seen) for e in found] == [
            ("e1", 1, "digest", "ab" * 32)
        ]


def staged_as(name: str, attempt: int = 1) -> Candidate:
    config, tensors = make_adapter(60)
    manifest = build_manifest(config, tensors)
    return Candidate(lora_name=name, digest=manifest.digest, attempt=attempt, manifest=manifest)


async def test_staging_nothing_will_load_is_dropped_and_only_that(tmp_path: Path) -> None:
    """Bytes staged under a name (prepared, never loaded) that nothing will ever load are
    dropped at each pass: a name this deployment never allocated (unfenced) and a version that
    is over (fenced by its last attempt). Another deployment's staging and a name of no
    deployment are left alone, whatever order the engine lists them in."""
    async with rig(engines=2) as r, LocalEngine("e2", limits=LIMITS) as newcomer:
        await reclaiming_v1(r)
        assert await r.reclaimer().sweep() == [1]
        v1 = r.ledger.state.versions[1]
        kept = ["aaa-not-ours", "agent@other-1-0123456789abcdef"]  # listed first and last
        dropped = {"agent@dep-98-0123456789abcdef": 1, v1.lora_name: v1.attempt}
        for name in kept:
            await newcomer.prepare(staged_as(name))
        for name, attempt in dropped.items():
            await newcomer.prepare(staged_as(name, attempt))
        r.fleet.add(newcomer)
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        await reconciler.reconcile_engine("e2")
        assert sorted((await newcomer.inventory()).staged) == kept
        with pytest.raises(CleanRefusal) as refused:  # v1's was fenced by its attempt
            await newcomer.prepare(staged_as(v1.lora_name, v1.attempt))
        assert refused.value.code == ErrorCode.STALE_ATTEMPT


async def test_an_engine_an_operator_suspended_is_not_repaired_by_a_pass(tmp_path: Path) -> None:
    """Only an operator lifts an operator's suspension: a pass over the engine finds nothing
    to restore and leaves it suspended, without trying (and failing) a repair."""
    async with rig(engines=2) as r:
        await r.publish(1)
        await r.ledger.suspend_engine("e1", cause="operator", detail="maintenance")
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        report = await reconciler.reconcile_engine("e1")
        assert report.repaired == () and report.errors == (), report
        assert r.ledger.state.engines["e1"].suspended


async def test_one_engines_repair_leaves_another_engines_back_off_alone(tmp_path: Path) -> None:
    """The restore back-off is per engine and life: a pass over one engine forgets only that
    engine's earlier lives, never another engine's wait."""
    async with published_on_two(tmp_path) as (engines, plane, v1):
        reconciler = reconciler_for(plane, Clock())
        sick = engines[1]
        await host(sick).current.unload(v1.lora_name)  # an eviction: no fence
        sick.inject("prepare", ServerError(), times=1000)
        await reconciler.health_check({"e1"})  # its reload fails: the next try is 1 s away
        prepares = sick.count("prepare")
        await reconciler.reconcile_engine("e0")  # another engine's pass, at the same instant
        await reconciler.health_check({"e1"})  # still inside e1's back-off
        assert sick.count("prepare") == prepares


def test_served_digests_are_those_the_engine_reports_for_the_names_asked() -> None:
    """Only the names asked about (this deployment's) and only with a digest: a name the
    engine reports without one (a path engine) proves nothing and is left out."""
    inventory = Inventory(
        engine_id="e0",
        incarnation="life",
        adapters=(
            InventoryEntry(lora_name="agent@dep-1-a", digest="aa"),
            InventoryEntry(lora_name="agent@dep-2-b", digest=None, path="/adapters/b"),
            InventoryEntry(lora_name="someone-else", digest="cc"),
        ),
    )
    names = ("agent@dep-1-a", "agent@dep-2-b")
    assert served_digests(inventory, names) == (("agent@dep-1-a", "aa"),)


async def test_canaries_are_due_by_the_period_since_the_last_and_at_a_new_controller(
    tmp_path: Path,
) -> None:
    """A canary is due ``canary_every_s`` after the last answer, counted from that answer
    (not from the clock's zero); canary times are soft state, so a controller that starts
    over a log holding baselines asks each held version's canary at its first pass."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        clock = Clock()
        clock.now = 100.0
        first = canary_reconciler(r, clock, 60.0, tmp_path)
        await first.reconcile_engine("e0")  # the baseline, answered at 100 s
        asked = len(engine.asked)
        clock.now = 101.0
        await first.reconcile_engine("e0")
        assert len(engine.asked) == asked  # not due before 160 s
        report = await canary_reconciler(r, Clock(), 60.0, tmp_path).reconcile_engine("e0")
        assert report.errors == ()
        assert len(engine.asked) == asked + 1


def store_holding(tmp_path: Path, *version_ids: int) -> None:
    """Put the rig's adapters of ``version_ids`` (published with their default seeds) in the
    artifact store ``rig_reconciler`` restores from: a version missing there cannot be
    restored (its restore fails before reaching the engine)."""
    store = ArtifactStore(tmp_path / "artifacts")
    for version_id in version_ids:
        config, tensors = make_adapter(version_id)
        store.put(build_manifest(config, tensors), tensors)


class Evicting:
    """A double of an engine that drops an adapter on its own and loads it again when asked,
    in the same process life: SGLang under ``--max-loaded-loras`` unloads the least recently
    used adapter inside another load, and a later load of the name works. (The local engine
    never loads a managed name again once it unloaded it, so the double hides the name
    instead: after ``evict(name)`` the inventory omits it until a load of it, which the real
    engine underneath answers as a replay.)"""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.evicted: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def evict(self, *names: str) -> None:
        self.evicted.update(names)

    async def inventory(self) -> Inventory:
        held: Inventory = await self.inner.inventory()
        kept = tuple(a for a in held.adapters if a.lora_name not in self.evicted)
        return msgspec.structs.replace(held, adapters=kept)

    async def load(self, candidate: Candidate) -> Any:
        receipt = await self.inner.load(candidate)
        self.evicted.discard(candidate.lora_name)
        return receipt


def evicting(r: Rig) -> Evicting:
    (engine,) = list(r.fleet)
    assert isinstance(engine, Evicting)
    return engine


async def test_a_version_that_cannot_be_restored_does_not_hold_up_the_restores_after_it(
    tmp_path: Path,
) -> None:
    """Each needed version is restored on its own: one whose restore just failed, and then the
    same one backing off after that failure, is passed over, and the needed versions after it
    are restored in the same pass (or one broken version would keep the engine out of routing
    for every other)."""
    async with rig(engines=1, wrap=Evicting) as r:
        await r.publish(1)
        await r.ledger.register_owner("w", ttl_s=IDLE)
        await r.ledger.bind("pinned", "w")  # v1 stays needed after v2
        await r.publish(2)
        assert r.ledger.state.needed_versions() == [1, 2]
        store_holding(tmp_path, 2)  # v1's bytes are missing: its restore fails
        reconciler = rig_reconciler(r, Clock(), tmp_path)
        evicting(r).evict(r.names[1], r.names[2])
        report = await reconciler.reconcile_engine("e0")
        assert report.restored == ("e0:2",), report
        assert [e.split(": ")[1] for e in report.errors] == ["restore version 1"], report
        evicting(r).evict(r.names[2])  # lost again, while v1 backs off
        report = await reconciler.reconcile_engine("e0")  # the clock has not moved
        assert report.restored == ("e0:2",) and report.errors == (), report
        assert r.ledger.state.engines["e0"].holds == {r.names[2]: 2}


async def test_a_successful_restore_ends_its_versions_back_off(tmp_path: Path) -> None:
    """Failed restores of a version back off, and count toward the engine's suspension, only
    until one succeeds: when the version is lost again later, its first failure waits
    ``restore_backoff_s`` again, and the failures before the success do not count (three
    would suspend the engine)."""
    async with rig(engines=1, wrap=lambda e: Evicting(FaultyEngine(e))) as r:
        await r.publish(1)
        store_holding(tmp_path, 1)
        clock = Clock()
        reconciler = rig_reconciler(r, clock, tmp_path)  # back-off: 1 s doubling
        engine = evicting(r)
        faults = engine.inner
        assert isinstance(faults, FaultyEngine)
        engine.evict(r.names[1])
        faults.inject("prepare", ServerError(), times=2)
        restored = []
        for second in (0.0, 1.0, 3.0):  # fails, fails (the next try 2 s later), restored
            clock.now = second
            restored.append((await reconciler.reconcile_engine("e0")).restored)
        assert restored == [(), (), ("e0:1",)]
        engine.evict(r.names[1])  # lost again, a while later
        faults.inject("prepare", ServerError())
        clock.now = 10.0
        assert (await reconciler.reconcile_engine("e0")).restored == ()
        clock.now = 11.0  # the first delay again, not the third
        assert (await reconciler.reconcile_engine("e0")).restored == ("e0:1",)
        member = r.ledger.state.engines["e0"]
        assert member.routable and not member.suspended


async def test_a_restored_version_answers_its_canary_at_once(tmp_path: Path) -> None:
    """A version restored on a path engine is loaded again under its name: what the engine
    serves under it is asked at the same pass, not ``canary_every_s`` after the answer given
    before its loss (other weights may stand behind the name now)."""
    async with rig(engines=1, wrap=lambda e: Evicting(PathEngine(e))) as r:
        await r.publish(1)
        store_holding(tmp_path, 1)
        engine = evicting(r)
        asked = engine.inner.asked
        clock = Clock()
        reconciler = canary_reconciler(r, clock, 60.0, tmp_path)
        await reconciler.reconcile_engine("e0")  # the baseline
        assert len(asked) == 1
        engine.evict(r.names[1])
        clock.now = 1.0
        report = await reconciler.reconcile_engine("e0")
        assert report.restored == ("e0:1",), report
        assert [name for _, name, _ in asked] == [r.names[1], r.names[1]]


async def test_a_pass_over_one_engine_keeps_another_engines_canary_times(tmp_path: Path) -> None:
    """Canary times are per engine and life: a pass over one engine forgets only that engine's
    earlier lives, so another engine's held versions are not asked again before
    ``canary_every_s``."""
    async with rig(engines=2, wrap=PathEngine) as r:
        await r.publish(1)
        clock = Clock()
        reconciler = canary_reconciler(r, clock, 60.0, tmp_path)
        await reconciler.reconcile()  # both baselines, at 0 s
        asked = {e.engine_id: len(e.asked) for e in r.fleet if isinstance(e, PathEngine)}
        assert asked == {"e0": 1, "e1": 1}
        clock.now = 1.0
        await reconciler.reconcile_engine("e1")
        await reconciler.reconcile_engine("e0")
        assert {e.engine_id: len(e.asked) for e in r.fleet if isinstance(e, PathEngine)} == asked


async def test_a_version_claimed_for_reclaim_between_two_canaries_is_skipped_alone(
    tmp_path: Path,
) -> None:
    """v1's, v2's and v3's canaries are due; v2 is claimed for reclaim while v1's runs: v2 is
    not asked (its unload may come any moment), and v3 still is."""
    async with rig(engines=1, wrap=PathEngine) as r:
        for version_id in (1, 2, 3):
            await r.publish(version_id)  # v1 and v2 retired, unbound: still served
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)

        async def claim_v2(name: str | None) -> None:
            if name == r.names[1]:
                await r.ledger.claim_reclaim(2, r.reclaimer().evidence(2))

        engine.on_ask = claim_v2
        await canary_reconciler(r, Clock(), 60.0, tmp_path).reconcile_engine("e0")
        assert r.ledger.state.versions[2].state is VersionState.RECLAIMING
        assert [name for _, name, _ in engine.asked] == [r.names[1], r.names[3]]


async def test_a_canary_asked_again_is_counted_in_flight_on_its_engine(tmp_path: Path) -> None:
    """The second ask of a canary that differed is a request on the version like the first:
    counted in flight on its version and engine while it runs (reclaim waits for it)."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        clock = Clock()
        reconciler = canary_reconciler(r, clock, 0.0, tmp_path)
        await reconciler.reconcile_engine("e0")  # the baseline
        seen: list[list[InFlight]] = []

        async def read_evidence(name: str | None) -> None:
            seen.append(reconciler.inflight_evidence(1))

        engine.on_ask = read_evidence
        engine.other_answers = [(1, 2, 3)]  # the first ask differs: asked again
        await reconciler.reconcile_engine("e0")
        on_e0 = [InFlight(reporter="canaries", engine="e0", count=1, at=0.0)]
        assert seen == [on_e0, on_e0]


async def test_a_canary_that_fails_does_not_stop_the_canaries_after_it(tmp_path: Path) -> None:
    """v1's canary fails (an ambiguous reply): no baseline for it, and v2's canary, due in the
    same pass, is still asked and recorded."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await r.publish(1)
        await r.publish(2)  # v1 retired, still served
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)

        async def v1_fails(name: str | None) -> None:
            if name == r.names[1]:
                raise RuntimeError("the engine answered 503")

        engine.on_ask = v1_fails
        await canary_reconciler(r, Clock(), 60.0, tmp_path).reconcile_engine("e0")
        assert [name for _, name, _ in engine.asked] == [r.names[1], r.names[2]]
        assert r.ledger.state.engines["e0"].canaries.keys() == {r.names[2]}


async def test_a_held_version_no_longer_served_hides_no_canary_after_it(tmp_path: Path) -> None:
    """v1, claimed for reclaim, is still held (a request counted in flight on it holds its
    unload back): its canary is not asked, and v2's, due after it, is."""
    async with rig(engines=1, wrap=PathEngine) as r:
        await reclaiming_v1(r)
        (engine,) = list(r.fleet)
        assert isinstance(engine, PathEngine)
        reconciler = rig_reconciler(
            r,
            Clock(),
            tmp_path,
            canary_every_s=60.0,
            inflight=lambda engine_id, version_id: int(version_id == 1),
        )
        await reconciler.reconcile_engine("e0")
        assert r.names[1] in r.ledger.state.engines["e0"].holds
        assert engine.asked == [(CANARY_PROMPT, r.names[2], CANARY_PARAMS)]
