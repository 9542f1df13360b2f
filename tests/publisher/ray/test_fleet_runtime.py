"""The fleet changes at runtime on Ray (engines added, replaced and removed), with real
actors: engine actors hosting local engines, the ledger actor hosting the control plane, a
rollout-worker actor whose gateway routes over ``RayLedger.fleet``, and a trainer client
publishing from the test's process.

Nothing here restarts the ledger or the rollout actor (but the last test, on purpose): each
checks the ledger's process and epoch are the ones it started with, and the rollout actor
learns every change from the ledger's membership view.

* an engine actor killed for good is suspended at the first failed probe (``ENGINE_GONE``),
  long before ``suspend_after_s``; only turns that were on their way to it fail, each
  ``AMBIGUOUS_DISPATCH``; publication goes on; an operator's ``remove`` takes it out;
* a replacement actor joins under the same id, is repaired, and serves the rollout actor;
* an added engine receives the routable version, then the rollout actor's traffic;
* a clean ``NOT_LOADED`` from an engine that restarted empty is served by the other holder,
  and its report has the reconciler repair the engine without waiting for a probe tick;
* an engine actor Ray restarts (``max_restarts=1``) is repaired before it serves again;
* the runtime changes (added, replaced, removed) survive a restart of the ledger actor;
* a turn cancelled by ``close_session(cancel=True)`` while its engine actor goes on generating
  keeps its version from reclaim until the engine actor confirms the request's end.

Detection and recovery times are printed (``-s``), not asserted: the machine is shared.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import ray

from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.testing import RestartableEngine
from evlog.events import (
    EngineLeft,
    EngineRepaired,
    EngineRestarted,
    EngineSuspended,
    ReclaimClaimed,
)
from evlog.sqlite import SQLiteStore
from projections.status import EngineStatus, LedgerStatus
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.gateway import DispatchCode, Gateway
from publisher.gateway.affinity import rendezvous
from publisher.ray.client import RayLedger
from publisher.ray.engine import EngineActor, EngineInfo, RayEngine, start_engine, stop_engine
from publisher.ray.ledger_actor import LedgerConfig, PlaneConfig, start_ledger, stop_ledger
from publisher.ray.trainer import RayTrainerClient
from publisher.sessions import RolloutWorker
from tests.publisher.ray.scenario import LIMITS, PLANE_OPTIONS, Outcome, RolloutActor, SessionRunner
from tests.publisher.rollout_kit import NonDraining
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings(
        "ignore:Adapter .* was active which is now deleted:UserWarning",
        "ignore:.*is_gradient_checkpointing.*:FutureWarning",
    ),
]
NAMESPACE = "loraledger"
# Far beyond any wait below: a suspension seen here came from the ENGINE_GONE path, not from
# failed probes being counted for suspend_after_s.
SUSPEND_AFTER_S = 600.0


class RestartableEngineActor(EngineActor):
    """An engine actor whose engine can restart inside it: a new, empty engine life with a new
    incarnation behind the same live actor (what a crashed and supervised server looks like
    between two probes)."""

    async def restart_engine(self) -> str:
        await self._host.call(self._engine.restart)  # type: ignore[attr-defined]
        return await self._host.call(self._engine.incarnation)


class DiesInLoadEngineActor(EngineActor):
    """An engine actor whose process dies in the middle of its next ``load`` once armed (its
    node lost during a publication): the load's caller gets Ray's ``ActorDiedError``."""

    armed = False

    async def die_in_next_load(self) -> None:
        self.armed = True

    async def load(self, candidate: Any) -> Any:
        if self.armed:
            os._exit(1)
        return await super().load(candidate)


class PausableEngineActor(EngineActor):
    """An engine actor whose generations can be held between tokens (the local engine's
    in-place pause), so that turns are surely running on it when it is removed."""

    async def pause(self) -> None:
        await self._host.call(self._engine.pause_generation)  # type: ignore[attr-defined]

    async def resume(self) -> None:
        await self._host.call(self._engine.continue_generation)  # type: ignore[attr-defined]


def _restartable(engine_id: str) -> RestartableEngine:
    return RestartableEngine(functools.partial(LocalEngine, engine_id, limits=LIMITS))


class FleetRig:
    """Engines, the ledger actor (with its plane), one rollout actor and a trainer client."""

    def __init__(self, tmp: Path, *, options: dict[str, Any] | None = None) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.ledger_name = f"ledger-{self.tag}"
        self.path = tmp / "ledger.db"
        self.artifacts = tmp / "artifacts"
        self.options = {**PLANE_OPTIONS, "suspend_after_s": SUSPEND_AFTER_S, **(options or {})}
        self.engines: list[RayEngine] = []
        self.ledger: Any = None
        self.rollout: Any = None
        self.client: RayLedger | None = None
        self.trainer = RayTrainerClient(self.ledger_name, namespace=NAMESPACE)
        self.pid_epoch: tuple[int, int] = (0, 0)

    def engine(self, engine_id: str, *, suffix: str = "", max_restarts: int = 0) -> RayEngine:
        engine = start_engine(
            functools.partial(LocalEngine, engine_id, limits=LIMITS),
            name=f"{self.tag}-{engine_id}{suffix}",
            namespace=NAMESPACE,
            max_restarts=max_restarts,
        )
        self.engines.append(engine)
        return engine

    def restartable_engine(self, engine_id: str) -> RayEngine:
        handle = (
            ray.remote(RestartableEngineActor)
            .options(name=f"{self.tag}-{engine_id}", namespace=NAMESPACE, num_cpus=0)
            .remote(functools.partial(_restartable, engine_id))
        )
        info: EngineInfo = ray.get(handle.describe.remote(), timeout=300)
        engine = RayEngine(handle, info.engine_id, info.kind, info.transport)  # type: ignore[arg-type]
        self.engines.append(engine)
        return engine

    def dying_engine(self, engine_id: str) -> RayEngine:
        handle = (
            ray.remote(DiesInLoadEngineActor)
            .options(name=f"{self.tag}-{engine_id}", namespace=NAMESPACE, num_cpus=0)
            .remote(functools.partial(LocalEngine, engine_id, limits=LIMITS))
        )
        info: EngineInfo = ray.get(handle.describe.remote(), timeout=300)
        engine = RayEngine(handle, info.engine_id, info.kind, info.transport)  # type: ignore[arg-type]
        self.engines.append(engine)
        return engine

    def start(self, engines: Sequence[RayEngine]) -> None:
        config = LedgerConfig(
            path=str(self.path),
            plane=PlaneConfig(
                deployment="dep",
                prefix="agent",
                capacity=4,
                artifact_root=str(self.artifacts),
                engines=tuple(engines),
                options=self.options,
            ),
        )
        self.ledger = start_ledger(config, name=self.ledger_name, namespace=NAMESPACE)
        info = ray.get(self.ledger.describe.remote(), timeout=60)
        self.pid_epoch = (info.pid, info.epoch)
        self.rollout = (
            ray.remote(RolloutActor).options(num_cpus=0).remote("w0", self.ledger_name, NAMESPACE)
        )
        ray.get(self.rollout.mirror.remote(), timeout=300)

    def stop(self) -> None:
        if self.rollout is not None:
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(self.rollout.stop.remote(), timeout=60)
            ray.kill(self.rollout, no_restart=True)
        if self.ledger is not None:
            stop_ledger(self.ledger_name, namespace=NAMESPACE)
        for engine in self.engines:
            stop_engine(engine, timeout=5)

    # --- reads ------------------------------------------------------------------------------

    async def status(self) -> LedgerStatus:
        assert self.client is not None
        return await self.client.status()

    async def member(self, engine_id: str) -> EngineStatus | None:
        status = await self.status()
        return next((e for e in status.engines if e.engine == engine_id), None)

    async def wait_for(
        self, what: str, predicate: Callable[[LedgerStatus], bool], timeout: float = 60.0
    ) -> float:
        """Poll the ledger's status until ``predicate`` holds; the monotonic time it did."""

        async def holds() -> bool:
            return predicate(await self.status())

        await wait_for(what, holds, timeout=timeout, every=0.05)
        return time.monotonic()

    async def until_rollout_routes_to(self, engine_id: str, timeout: float = 30.0) -> None:
        """Routing reaches the rollout actor with its next ledger reply (a lease renewal):
        wait for the table that has ``engine_id`` routable again."""

        async def routes() -> bool:
            return bool(await self.rollout.routes_to.remote(engine_id))

        await wait_for(
            f"the rollout actor to route to {engine_id}", routes, timeout=timeout, every=0.05
        )

    async def attempt(self, sessions: Sequence[str], turn: int) -> list[Outcome]:
        return await self.rollout.attempt.remote(list(sessions), turn)  # type: ignore[no-any-return]

    async def publish(self, step: int) -> Any:
        config, tensors = make_adapter(step)
        return await self.trainer.publish(tensors, config, step=step)

    async def same_ledger_process(self) -> bool:
        info = await self.ledger.describe.remote()
        return (info.pid, info.epoch) == self.pid_epoch

    async def log(self) -> list[Any]:
        """Every event of the log (after the ledger actor was stopped)."""
        async with SQLiteStore.open(self.path) as store:
            return [record.event for record in await store.read()]


@contextlib.asynccontextmanager
async def fleet_rig(
    tmp: Path,
    make: Callable[[FleetRig], Sequence[RayEngine]],
    *,
    options: dict[str, Any] | None = None,
) -> AsyncIterator[FleetRig]:
    rig = FleetRig(tmp, options=options)
    try:
        engines = await anyio.to_thread.run_sync(make, rig)
        await anyio.to_thread.run_sync(rig.start, engines)
        async with RayLedger.connect(rig.ledger_name, namespace=NAMESPACE) as client:
            rig.client = client
            published = await rig.publish(1)
            assert published.status == "PUBLISHED", published
            yield rig
    finally:
        rig.client = None
        await anyio.to_thread.run_sync(rig.stop)


def routable(status: LedgerStatus, engine_id: str) -> bool:
    return any(e.engine == engine_id and e.routable for e in status.engines)


def two_engines(rig: FleetRig) -> list[RayEngine]:
    return [rig.engine("e0"), rig.engine("e1")]


SESSIONS = [f"s{i}" for i in range(12)]


async def test_an_engine_actor_killed_for_good_is_suspended_and_leaves_routing(
    ray_instance: Any, tmp_path: Path
) -> None:
    async with fleet_rig(tmp_path, two_engines) as rig:
        first = await rig.attempt(SESSIONS, 0)
        assert all(o.code == "" for o in first), first
        on_e0 = [o.session for o in first if o.engine == "e0"]
        assert on_e0, "rendezvous put no session on e0"

        doomed = rig.engines[0]
        killed_at = time.monotonic()
        ray.kill(doomed.handle, no_restart=True)
        outcomes: list[Outcome] = []
        suspended_at: float | None = None
        turn = 1
        with anyio.fail_after(60):
            # turns go on while the kill lands: count what it costs
            while suspended_at is None or turn < 4:
                outcomes += await rig.attempt(SESSIONS, turn)
                turn += 1
                if suspended_at is None and not routable(await rig.status(), "e0"):
                    suspended_at = time.monotonic()
        detection = suspended_at - killed_at
        failed = Counter(o.code for o in outcomes if o.code)
        print(
            f"\nkilled for good: suspended after {detection:.2f} s; {len(on_e0)} of "
            f"{len(SESSIONS)} sessions on it; {len(outcomes)} turns, failed {dict(failed)}"
        )
        # Only turns that were on their way to e0 can fail, and only as ambiguous: nothing that
        # may have run was resent, and no turn failed for a reason the gateway could avoid.
        assert set(failed) <= {DispatchCode.AMBIGUOUS_DISPATCH}
        assert sum(failed.values()) <= len(on_e0)
        assert {o.engine for o in outcomes[-len(SESSIONS) :]} == {"e1"}

        # publication does not wait for the dead engine, nor fail on it
        second = await rig.publish(2)
        assert second.status == "PUBLISHED", second
        late = await rig.attempt(["late-0", "late-1"], 0)
        assert [(o.engine, o.version_id, o.code) for o in late] == [("e1", 2, "")] * 2

        # an operator removes it; the rollout actor's mirror drops it
        await rig.ledger.remove_engine.remote("e0")
        assert await rig.member("e0") is None
        with anyio.fail_after(30):
            while "e0" in await rig.rollout.mirror.remote():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert await rig.same_ledger_process()
    events = await rig.log()
    suspensions = [e for e in events if isinstance(e, EngineSuspended) and e.engine == "e0"]
    assert len(suspensions) == 1
    assert suspensions[0].cause == "unhealthy"
    assert "ENGINE_GONE" in suspensions[0].detail
    assert [e.cause for e in events if isinstance(e, EngineLeft)] == ["operator"]


async def test_a_trainer_is_told_what_a_version_settles_as_after_an_engine_dies_mid_publication(
    ray_instance: Any, tmp_path: Path
) -> None:
    """e1's actor dies during v2's load: its reply is ambiguous, so the attempt ends
    FAILED_FATAL, and the probe that finds the actor gone suspends e1, which resolves v2 to
    FAILED_RETRYABLE. The trainer must hear that (``RETRYABLE``: publish a later step), not
    the FATAL of the moment the attempt ended. Probes are rare here (30 s): only the failure's
    own follow-up can suspend e1, never a probe during the attempt."""
    slow_probes = {"probe_interval_s": 30.0, "full_reconcile_s": 120.0}
    async with fleet_rig(
        tmp_path, lambda rig: [rig.engine("e0"), rig.dying_engine("e1")], options=slow_probes
    ) as rig:
        await rig.engines[1].handle.die_in_next_load.remote()
        with pytest.raises(PublicationError) as failed:
            await rig.publish(2)
        err = failed.value
        assert (err.kind, err.details["state"]) == (ErrorKind.RETRYABLE, "FAILED_RETRYABLE"), err
        assert err.details["cause"] == "ENGINE_GONE"
        status = await rig.status()
        assert {v.version_id: str(v.state) for v in status.versions}[2] == "FAILED_RETRYABLE"
        assert not routable(status, "e1")
        # and the trainer's next step publishes on the engine left
        third = await rig.publish(3)
        assert third.status == "PUBLISHED", third
    events = await rig.log()
    assert [type(e).__name__ for e in events if getattr(e, "version_id", None) == 2][-2:] == [
        "AttemptFailed",
        "FatalResolved",
    ]


async def test_remove_then_stop_under_traffic_loses_no_turn(
    ray_instance: Any, tmp_path: Path
) -> None:
    """Turns running on e0 (held between tokens) when the operator removes it and stops it
    at once, as a script would: the ledger actor's ``remove_engine`` routes e0 away first
    (``EngineLeft``: a new turn goes to e1), then drains the in-flight counts it knows for
    e0, and ``stop_engine`` drains the engine actor's own generations before it stops it.
    Every turn is served. Before: the removal answered at once and the stop ended the
    running generations (``ENGINE_STOPPED``: ambiguous turns, never resent)."""

    def engines(rig: FleetRig) -> list[RayEngine]:
        handle = (
            ray.remote(PausableEngineActor)
            .options(name=f"{rig.tag}-e0", namespace=NAMESPACE, num_cpus=0)
            .remote(functools.partial(LocalEngine, "e0", limits=LIMITS))
        )
        info: EngineInfo = ray.get(handle.describe.remote(), timeout=300)
        e0 = RayEngine(handle, info.engine_id, info.kind, info.transport)  # type: ignore[arg-type]
        rig.engines.append(e0)
        return [e0, rig.engine("e1")]

    async with fleet_rig(tmp_path, engines) as rig:
        e0 = rig.engines[0]
        running = sessions_on("e0", ["e0", "e1"], "drain", 4)
        await e0.handle.pause.remote()
        outcomes: list[Outcome] = []
        stopped = anyio.Event()

        async def turns() -> None:
            outcomes.extend(await rig.attempt(running, 0))

        async def remove_then_stop() -> None:
            await rig.ledger.remove_engine.remote("e0")
            await anyio.to_thread.run_sync(functools.partial(stop_engine, e0, timeout=10))
            stopped.set()

        async def all_running() -> bool:
            return await e0.generate_calls() == len(running)

        async with anyio.create_task_group() as tg:
            tg.start_soon(turns)
            await wait_for("the turns running on e0", all_running, timeout=120, every=0.05)
            tg.start_soon(remove_then_stop)
            await rig.wait_for("e0 routed away", lambda s: not routable(s, "e0"))
            late = await rig.attempt(["drain-late"], 0)
            assert [(o.engine, o.code) for o in late] == [("e1", "")]
            assert not stopped.is_set()  # the turns on e0 hold its stop
            await e0.handle.resume.remote()
        assert [(o.engine, o.code) for o in outcomes] == [("e0", "")] * len(running)
    events = await rig.log()
    assert [e.cause for e in events if isinstance(e, EngineLeft)] == ["operator"]


@contextlib.asynccontextmanager
async def non_draining(engine_id: str) -> AsyncIterator[NonDraining]:
    """A local engine whose unload does not drain (vLLM's): the name goes at once, whatever
    still runs on it."""
    async with LocalEngine(engine_id, limits=LIMITS) as inner:
        yield NonDraining(inner)


class LateAbortEngineActor(PausableEngineActor):
    """A pausable engine actor whose engine hears an abort only when the test lets it land
    (:meth:`let_abort_land`), as vLLM's and SGLang's reach a running request only after a
    step: until then ``abort_request`` neither ends the request nor answers. A generation
    goes on in the actor whatever its caller does (cancelling a Ray call cancels nothing
    there). ``happened`` keeps the order of the abort's landing and the unloads."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        super().__init__(factory)
        self.aborts: list[str] = []  # request ids it was asked to end
        self.happened: list[str] = []  # "abort landed", "unload <name>", in order
        self._lands: anyio.Event | None = None

    def _landing(self) -> anyio.Event:
        if self._lands is None:
            self._lands = anyio.Event()
        return self._lands

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        self.aborts.append(request_id)
        await self._landing().wait()
        return await super().abort_request(request_id, lora_name)

    async def let_abort_land(self) -> None:
        self.happened.append("abort landed")
        self._landing().set()

    async def unload(self, lora_name: str, attempt: int | None) -> Any:
        self.happened.append(f"unload {lora_name}")
        return await super().unload(lora_name, attempt)

    async def asked_to_abort(self) -> list[str]:
        return list(self.aborts)

    async def history(self) -> list[str]:
        return list(self.happened)

    async def running(self) -> int:
        """Generations running in the engine (frozen ones included)."""

        async def read() -> int:
            return self._engine.in_flight  # type: ignore[attr-defined,no-any-return]

        return await self._host.call(read)


class CancellingRolloutActor(RolloutActor):
    """The rollout actor, with what the cancel test asks of it: a session closed with its
    turns cancelled, the worker's own in-flight counts (what its renewals carry to the
    ledger), and the gateway's bound on waiting for an engine's confirmation."""

    async def close_session(self, session: str, cancel: bool) -> bool:
        return (await self.rollout.close_session(session, cancel=cancel)).released

    async def counts(self) -> tuple[dict[tuple[str, int], int], int]:
        return await self.rollout.run(_counts)

    async def wait_for_ends_at_most(self, seconds: float) -> None:
        await self.rollout.run(_set_abort_timeout, seconds)

    async def renewed(self) -> None:
        """Returns once the ledger answered a renewal sent after this call: it has the
        worker's counts as they are now."""
        await self.rollout.run(_renewed)


async def _counts(worker: RolloutWorker) -> tuple[dict[tuple[str, int], int], int]:
    return worker.inflight.counts(), worker.gateway.unconfirmed


async def _set_abort_timeout(worker: RolloutWorker, seconds: float) -> None:
    worker.gateway.abort_timeout_s = seconds


async def _renewed(worker: RolloutWorker) -> None:
    await worker.confirm_live()


async def test_a_cancelled_turn_holds_its_version_until_the_engine_actor_confirms_its_end(
    ray_instance: Any, tmp_path: Path
) -> None:
    """A rollout actor's turn on v1, running (frozen) on e0, whose session is closed with
    ``close_session(cancel=True)`` after v2 retired v1: the engine goes on generating until
    the abort lands there, and its unload does not drain (vLLM's), so only the count stands
    between v1 and an unload under the request. The close returns (the gateway waits for the
    engine's word at most ``abort_timeout_s``), the session is released, and the request's
    count is held in the worker's lease renewals: v1 stays RETIRED while v2, retired after it
    by v3 and held by nothing, is reclaimed. Once the abort lands and the engine actor
    confirms the request's end (asked again at a renewal), the count ends and v1 is
    reclaimed. Before: the count ended with the cancel, and v1 was reclaimed -- unloaded from
    e0 -- while the request still ran on it."""

    def engines(rig: FleetRig) -> list[RayEngine]:
        handle = (
            ray.remote(LateAbortEngineActor)
            .options(name=f"{rig.tag}-e0", namespace=NAMESPACE, num_cpus=0)
            .remote(functools.partial(non_draining, "e0"))
        )
        info: EngineInfo = ray.get(handle.describe.remote(), timeout=300)
        e0 = RayEngine(handle, info.engine_id, info.kind, info.transport)  # type: ignore[arg-type]
        rig.engines.append(e0)
        return [e0]

    async with fleet_rig(tmp_path, engines) as rig:
        e0 = rig.engines[0]

        async def states() -> dict[int, str]:
            return {v.version_id: str(v.state) for v in (await rig.status()).versions}

        worker = (
            ray.remote(CancellingRolloutActor)
            .options(num_cpus=0)
            .remote("w1", rig.ledger_name, NAMESPACE, {"renew_every": 0.2})
        )
        try:
            await worker.wait_for_ends_at_most.remote(0.5)
            await e0.handle.pause.remote()
            outcomes: list[Outcome] = []

            async def turn() -> None:
                outcomes.extend(await worker.attempt.remote(["c"], 0))

            async def one_running() -> bool:
                running: int = await e0.handle.running.remote()
                return running == 1

            async def counts_ended() -> bool:
                counts: tuple[dict[tuple[str, int], int], int] = await worker.counts.remote()
                return counts == ({}, 0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(turn)
                await wait_for("the turn running on e0", one_running, timeout=120, every=0.05)
                assert (await rig.publish(2)).status == "PUBLISHED"
                assert (await states())[1] == "RETIRED"
                with anyio.fail_after(60):
                    assert await worker.close_session.remote("c", True)
            assert [o.code for o in outcomes] == [Code.SESSION_CLOSED]
            # The caller gave up; the engine has not heard of it and goes on.
            assert await e0.handle.running.remote() == 1
            assert await e0.handle.asked_to_abort.remote()
            assert await worker.counts.remote() == ({("e0", 1): 1}, 1)
            v1 = next(v for v in (await rig.status()).versions if v.version_id == 1)
            assert (v1.state, v1.bound) == ("RETIRED", 0)
            await worker.renewed.remote()  # the ledger has the worker's counts of now

            # v3 retires v2, which nothing holds: the sweep that claims it looked at v1 first
            # (a sweep takes versions in order), with the same evidence; v1 is not claimed.
            assert (await rig.publish(3)).status == "PUBLISHED"
            await rig.wait_for(
                "v2 reclaimed",
                lambda s: any(v.version_id == 2 and v.state == "RECLAIMED" for v in s.versions),
            )
            assert (await states())[1] == "RETIRED"
            assert await e0.handle.running.remote() == 1
            assert (await worker.counts.remote())[0] == {("e0", 1): 1}

            await e0.handle.let_abort_land.remote()  # the engine ends it and confirms
            await wait_for("the count ended", counts_ended, timeout=60, every=0.05)
            assert await e0.handle.running.remote() == 0
            await rig.wait_for(
                "v1 reclaimed",
                lambda s: any(v.version_id == 1 and v.state == "RECLAIMED" for v in s.versions),
            )
            await e0.handle.resume.remote()
            asked = set(await e0.handle.asked_to_abort.remote())
            assert len(asked) == 1  # one request, asked again at renewals
            # nothing was unloaded on e0 under the running request
            history = await e0.handle.history.remote()
            assert history.index("abort landed") < history.index(f"unload {v1.lora_name}")
        finally:
            with contextlib.suppress(ray.exceptions.RayActorError):
                await worker.stop.remote()
            ray.kill(worker, no_restart=True)
    events = await rig.log()
    claimed = [e.version_id for e in events if isinstance(e, ReclaimClaimed)]
    assert claimed == [2, 1]


async def test_a_replacement_joins_under_the_same_id_and_serves_after_repair(
    ray_instance: Any, tmp_path: Path
) -> None:
    async with fleet_rig(tmp_path, two_engines) as rig:
        first = await rig.attempt(SESSIONS, 0)
        on_e0 = {o.session for o in first if o.engine == "e0"}
        assert on_e0 and all(o.code == "" for o in first), first
        old = rig.engines[0]
        ray.kill(old.handle, no_restart=True)
        await rig.wait_for("e0 suspended", lambda s: not routable(s, "e0"))

        replacement = await anyio.to_thread.run_sync(
            functools.partial(rig.engine, "e0", suffix="-b")
        )
        started = time.monotonic()
        report = await rig.ledger.replace_engine.remote(replacement)
        print(f"\nreplacement routable after {time.monotonic() - started:.2f} s: {report}")
        assert report.restarted == ("e0",)
        assert report.restored == ("e0:1",)
        assert report.repaired == ("e0",)
        member = await rig.member("e0")
        assert member is not None and member.routable
        assert member.incarnation == await replacement.incarnation()

        # the rollout actor, started before the replacement, routes to the new actor
        with anyio.fail_after(30):
            while (await rig.rollout.mirror.remote()).get("e0") != replacement.actor_id:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        again = await rig.attempt(sorted(on_e0), 1)
        assert [(o.engine, o.incarnation, o.code) for o in again] == [
            ("e0", member.incarnation, "")
        ] * len(on_e0)
        assert await replacement.generate_calls() == len(on_e0)
        assert await rig.same_ledger_process()
    events = await rig.log()
    e0 = [type(e).__name__ for e in events if getattr(e, "engine", None) == "e0"]
    # suspended when it died, then the new actor's incarnation: a restart, repaired
    assert e0[-4:] == ["EngineSuspended", "EngineRestarted", "VersionRestored", "EngineRepaired"]


async def test_a_replaced_rollout_life_is_refused_before_its_next_turn_is_sent(
    ray_instance: Any, tmp_path: Path
) -> None:
    """A zombie: Ray restarted the rollout actor while its old process still runs. The new
    life's registration releases the old one's sessions; the old one's next turn, asked right
    after, must be refused (``OWNER_RESTARTED``, nothing sent) although its client has not yet
    forwarded a renewal that would have told it. It was served, every time."""
    async with fleet_rig(tmp_path, two_engines) as rig:
        assert rig.client is not None
        sessions = SESSIONS[:5]
        first = await rig.attempt(sessions, 0)
        assert all(o.code == "" for o in first), first
        sent = sum([await e.generate_calls() for e in rig.engines])
        # what the restarted actor's RayRollout does first: register the owner anew
        await rig.client.register_owner("w0", ttl_s=30.0, incarnation="the-successor")
        assert (await rig.status()).sessions_bound == 0  # released, cause owner_restarted
        zombie = await rig.attempt(sessions, 1)
        assert [o.code for o in zombie] == [Code.OWNER_RESTARTED] * len(sessions), zombie
        assert sum([await e.generate_calls() for e in rig.engines]) == sent  # none sent


def sessions_on(engine_id: str, holders: Sequence[str], prefix: str, n: int) -> list[str]:
    """The first ``n`` session ids ``prefix-<i>`` that rendezvous puts on ``engine_id``."""
    ids = (f"{prefix}-{i}" for i in itertools.count())
    return list(itertools.islice((s for s in ids if rendezvous(s, holders) == engine_id), n))


async def test_the_very_next_turn_after_a_replace_is_served_by_the_replacement(
    ray_instance: Any, tmp_path: Path
) -> None:
    """No waiting for any mirror: e0's engine actor is killed, ``replace_engine`` returns, and
    the next turn -- the first turn of a session that rendezvous puts on e0, from a rollout
    actor (another process) and from a worker on this process's client (the caller's side)
    -- is served by the new actor. Neither client hears from the ledger between the swap and
    that turn (renewals 200 s apart): the reply to the session's bind brings the routing that
    has e0 back, and the turn is dispatched right after it.

    Before the handles travelled with that reply, the turn met the dead actor's handle unless
    the mirror's own refresh (one round trip, started when the reply came) happened to win
    the race against the dispatch (``AMBIGUOUS_DISPATCH``, never resent): about half the time
    on this machine, hence three rounds, each replacing the actor the previous one put in."""
    quiet_ttl_s = 600.0  # renewals 200 s apart: only the turn's own bind reaches the ledger
    rounds = 3
    async with fleet_rig(tmp_path, two_engines) as rig:
        assert rig.client is not None
        client = rig.client
        rollout = (
            ray.remote(RolloutActor)
            .options(num_cpus=0)
            .remote("w1", rig.ledger_name, NAMESPACE, {"ttl_s": quiet_ttl_s})
        )
        gateway = Gateway(
            client.fleet,
            client.view,
            gateway_id="driver",
            on_engine_trouble=client.engine_failed,
        )
        sessions = iter(sessions_on("e0", ["e0", "e1"], "after", 2 * rounds))
        served: list[dict[str, tuple[str, str, str]]] = []
        expected: list[dict[str, tuple[str, str, str]]] = []
        try:
            async with RolloutWorker.open(
                client, gateway, owner="driver", ttl_s=quiet_ttl_s
            ) as worker:
                current = rig.engines[0]
                assert (await rollout.mirror.remote())["e0"] == current.actor_id
                for k in range(rounds):
                    ray.kill(current.handle, no_restart=True)
                    current = await anyio.to_thread.run_sync(
                        functools.partial(rig.engine, "e0", suffix=f"-r{k}")
                    )
                    report = await rig.ledger.replace_engine.remote(current)
                    assert report.repaired == ("e0",)
                    remote_session, local_session = next(sessions), next(sessions)
                    outcomes: dict[str, Outcome] = {}

                    async def remote(session: str, into: dict[str, Outcome]) -> None:
                        [into["rollout actor"]] = await rollout.attempt.remote([session], 0)

                    async def local(session: str, into: dict[str, Outcome]) -> None:
                        [into["this process"]] = await SessionRunner(worker).attempt([session], 0)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(remote, remote_session, outcomes)
                        tg.start_soon(local, local_session, outcomes)
                    served.append(
                        {who: (o.engine, o.incarnation, o.code) for who, o in outcomes.items()}
                    )
                    new = ("e0", await current.incarnation(), "")
                    expected.append({"rollout actor": new, "this process": new})
                    assert await current.generate_calls() == sum(
                        o.engine == "e0" for o in outcomes.values()
                    )
            assert served == expected
            assert await rig.same_ledger_process()
        finally:
            with contextlib.suppress(ray.exceptions.RayActorError):
                await rollout.stop.remote()
            ray.kill(rollout, no_restart=True)


async def test_an_added_engine_gets_the_routable_versions_then_traffic(
    ray_instance: Any, tmp_path: Path
) -> None:
    async with fleet_rig(tmp_path, two_engines) as rig:
        first = await rig.attempt(SESSIONS, 0)
        assert all(o.code == "" for o in first), first
        added = await anyio.to_thread.run_sync(functools.partial(rig.engine, "e2"))
        report = await rig.ledger.add_engine.remote(added)
        assert (report.joined, report.restored, report.repaired) == (("e2",), ("e2:1",), ("e2",))
        stats = await added.transfer_stats()  # the repair's bytes: pulled, none inline
        assert (stats.inline_bytes, stats.pulls, stats.refused_pulls) == (0, 1, 0), stats
        status = await rig.status()
        v1 = next(v for v in status.versions if v.version_id == 1)
        assert routable(status, "e2")
        assert "e2" in v1.holders

        with anyio.fail_after(30):
            while "e2" not in await rig.rollout.mirror.remote():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        newcomers = [f"n{i}" for i in range(12)]
        served = await rig.attempt(newcomers, 0)
        assert all(o.code == "" for o in served), served
        on_e2 = [o for o in served if o.engine == "e2"]
        assert on_e2, "rendezvous over three holders put no new session on e2"
        assert await added.generate_calls() == len(on_e2)
        assert await rig.same_ledger_process()


async def test_a_clean_refusal_of_an_engine_that_restarted_empty_is_served_elsewhere(
    ray_instance: Any, tmp_path: Path
) -> None:
    """The engine restarts inside its live actor between two probes, and probes are rare here
    (30 s): the first turn sent to it meets the fresh engine's NOT_LOADED, is served by the
    other holder, and its report has the reconciler look at once."""
    slow_probes = {"probe_interval_s": 30.0, "full_reconcile_s": 120.0}
    async with fleet_rig(
        tmp_path,
        lambda rig: [rig.restartable_engine("e0"), rig.engine("e1")],
        options=slow_probes,
    ) as rig:
        first = await rig.attempt(SESSIONS, 0)
        on_e0 = sorted(o.session for o in first if o.engine == "e0")
        assert on_e0 and all(o.code == "" for o in first), first
        e0 = rig.engines[0]
        before = await e0.generate_calls()
        new_incarnation = await e0.handle.restart_engine.remote()
        restarted_at = time.monotonic()

        one = await rig.attempt(on_e0[:1], 1)
        assert [(o.engine, o.code) for o in one] == [("e1", "")]
        assert await e0.generate_calls() == before + 1  # asked once, refused, not resent there
        repaired_at = await rig.wait_for(
            "e0 repaired",
            lambda s: any(
                e.engine == "e0" and e.routable and e.incarnation == new_incarnation
                for e in s.engines
            ),
            timeout=25,  # well inside the 30 s probe interval: the report did it
        )
        print(f"\nrestarted empty: repaired {repaired_at - restarted_at:.2f} s after the restart")
        await rig.until_rollout_routes_to("e0")
        back = await rig.attempt(on_e0, 2)
        assert [(o.engine, o.incarnation, o.code) for o in back] == [
            ("e0", new_incarnation, "")
        ] * len(on_e0)


async def test_an_engine_ray_restarts_is_repaired_before_it_serves_again(
    ray_instance: Any, tmp_path: Path
) -> None:
    async with fleet_rig(
        tmp_path, lambda rig: [rig.engine("e0", max_restarts=1), rig.engine("e1")]
    ) as rig:
        first = await rig.attempt(SESSIONS, 0)
        assert all(o.code == "" for o in first), first
        old = await rig.member("e0")
        assert old is not None
        e0 = rig.engines[0]
        answered_at: list[float] = []

        async def first_answer() -> None:
            """When the restarted actor first answers a probe of its own (for the figures)."""
            while True:
                with contextlib.suppress(ray.exceptions.RayActorError):
                    if await e0.handle.incarnation.remote() != old.incarnation:
                        answered_at.append(time.monotonic())
                        return
                await anyio.sleep(0.05)

        killed_at = time.monotonic()
        ray.kill(e0.handle, no_restart=False)  # Ray restarts it: same handle, new process
        outcomes: list[Outcome] = []
        noticed_at: float | None = None
        back_at: float | None = None
        turn = 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(first_answer)
            with anyio.fail_after(120):
                while not answered_at:
                    outcomes += await rig.attempt(SESSIONS, turn)
                    turn += 1
        with anyio.fail_after(120):
            while back_at is None or turn < 3:
                outcomes += await rig.attempt(SESSIONS, turn)
                turn += 1
                member = await rig.member("e0")
                assert member is not None
                if noticed_at is None and member.incarnation != old.incarnation:
                    noticed_at = time.monotonic()
                if noticed_at is not None and back_at is None and member.routable:
                    back_at = time.monotonic()
                    new = member
        assert noticed_at is not None and back_at is not None
        failed = Counter(o.code for o in outcomes if o.code)
        print(
            f"\nRay-restarted: the new process answered after {answered_at[0] - killed_at:.2f} s, "
            f"its incarnation was recorded after {noticed_at - killed_at:.2f} s, "
            f"routable after {back_at - killed_at:.2f} s; {len(outcomes)} turns, failed "
            f"{dict(failed)}"
        )
        # a turn in flight at the kill (or sent into the restart) is ambiguous; none failed
        # because the fresh engine refused it (tried elsewhere)
        assert set(failed) <= {DispatchCode.AMBIGUOUS_DISPATCH}
        # served by e0 after the kill only once repaired: on the new incarnation, never the old
        served_by_e0 = [o for o in outcomes if o.engine == "e0"]
        assert {o.incarnation for o in served_by_e0} <= {old.incarnation, new.incarnation}
        await rig.until_rollout_routes_to("e0")
        last = await rig.attempt(SESSIONS, turn)
        assert all(o.code == "" for o in last), last
        assert {o.incarnation for o in last if o.engine == "e0"} == {new.incarnation}
        assert await rig.same_ledger_process()
    events = await rig.log()
    kinds = [type(e) for e in events if getattr(e, "engine", None) == "e0"]
    restart = kinds.index(EngineRestarted)
    assert EngineRepaired in kinds[restart:]


async def test_runtime_changes_survive_a_restart_of_the_ledger_actor(
    ray_instance: Any, tmp_path: Path
) -> None:
    """The ledger actor is created with e0 and e1; at runtime e0 is replaced, e2 added and e1
    removed; Ray then restarts the ledger actor with its original arguments. The restarted
    plane serves the runtime fleet, not the configured one: nothing leaves or joins again."""
    async with fleet_rig(tmp_path, two_engines) as rig:
        ray.kill(rig.engines[0].handle, no_restart=True)
        replacement = await anyio.to_thread.run_sync(
            functools.partial(rig.engine, "e0", suffix="-b")
        )
        await rig.ledger.replace_engine.remote(replacement)
        added = await anyio.to_thread.run_sync(functools.partial(rig.engine, "e2"))
        await rig.ledger.add_engine.remote(added)
        await rig.ledger.remove_engine.remote("e1")
        before = await rig.status()
        assert sorted((e.engine, e.routable) for e in before.engines) == [
            ("e0", True),
            ("e2", True),
        ]

        ray.kill(rig.ledger, no_restart=False)  # Ray restarts it: same arguments, same log
        with anyio.fail_after(120):
            while True:
                with contextlib.suppress(ray.exceptions.RayActorError):
                    info = await rig.ledger.describe.remote()
                    if info.epoch > before.epoch:
                        break
                await anyio.sleep(0.2)
        after = await rig.wait_for(
            "the runtime fleet routable",
            lambda s: (
                sorted((e.engine, e.routable) for e in s.engines) == [("e0", True), ("e2", True)]
            ),
        )
        assert after
        status = await rig.status()
        incarnations = {e.engine: e.incarnation for e in status.engines}
        assert incarnations == {
            "e0": await replacement.incarnation(),
            "e2": await added.incarnation(),
        }
        served = await rig.attempt([f"r{i}" for i in range(8)], 0)
        assert all(o.code == "" and o.engine in ("e0", "e2") for o in served), served
    events = await rig.log()
    restart = max(i for i, e in enumerate(events) if type(e).__name__ == "ControllerStarted")
    after_restart = [type(e).__name__ for e in events[restart:] if hasattr(e, "engine")]
    assert "EngineLeft" not in after_restart and "EngineJoined" not in after_restart
