"""ControlPlane: the one composition every entry point uses (demo, ``serve``, the Ray actor,
tests), so they cannot wire the drivers differently.

``async with ControlPlane.open(store, fleet, deployment=..., prefix=..., capacity=...,
artifact_root=...) as plane:``

1. opens the :class:`~publisher.core.ledger.Ledger` on ``store`` (replay + a new controller epoch)
   and creates the deployment if the log is new (a reopened log keeps its own rules: a
   different deployment or prefix is refused, since every engine-side name depends on them);
   ``max_staleness`` (docs/sessions.md#staleness) is the opener's, recorded as
   ``DeploymentConfigured`` when it differs from the log's;
2. runs the reconciler's start-up pass: engines without a handle leave, orphaned ``LOADING``
   attempts end, every engine of ``fleet`` is joined or found restarted, observed, cleaned and
   repaired (routable only after that);
3. runs, in its task group until the block exits: the reclaim driver (every new ledger event
   and every ``reclaim_tick_s``), the reconciler's health loop (an incarnation probe of every
   engine each ``probe_interval_s``, a full inventory pass each ``full_reconcile_s``) and the
   owner-lease expiry loop (``ledger.expire_leases()`` every ``lease_check_s``), which also
   releases idle client-held sessions (``ledger.release_idle_sessions()``: the ledger's
   process decides it, not the face that relayed them, docs/sessions.md).

The drivers' own timers (the reconciler's full-pass period, the reclaim driver's artifact grace)
read the event loop's clock, the one their sleeps and timeouts already use, so a test loop
with virtual time (tests/fault/simloop.py) drives every timer of the plane consistently.

Exposes ``plane.ledger``, ``plane.fleet``, ``plane.artifacts``, ``plane.publisher``,
``plane.reclaimer``, ``plane.reconciler``; :meth:`add_inflight_source` registers a gateway's
in-flight counts with the reclaim driver; :meth:`add_engine` / :meth:`replace_engine` /
:meth:`remove_engine` change the fleet at runtime (as ledger events; the drivers share
``plane.fleet``, so each sees the change at its next call).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from engines.artifacts import ArtifactStore
from engines.contract import Engine
from engines.drain import DEFAULT_DRAIN_TIMEOUT_S
from evlog.errors import LoraLedgerError
from evlog.store import EventStore
from projections.registry import HOLDABLE_STATES
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.drivers.adapter_copy import DEFAULT_BUCKET_BYTES, plan_buckets
from publisher.drivers.adapter_source import RestoreBytes
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet, InFlightSource
from publisher.drivers.publication import PublicationDriver
from publisher.drivers.reclaim import ReclaimDriver
from publisher.drivers.reconciler import Reconciler, ReconcileReport
from publisher.logs import get_logger

log = get_logger("loraledger.plane")

DRAIN_POLL_S = 0.05  # how often a drain reads the in-flight counts


class ControlPlane:
    def __init__(
        self,
        ledger: Ledger,
        fleet: Fleet,
        artifacts: ArtifactStore,
        *,
        timeouts: EngineTimeouts,
        probe_interval_s: float,
        full_reconcile_s: float,
        reclaim_tick_s: float,
        cleanup_timeout: float,
        delete_artifacts_after_s: float | None,
        publisher_id: str,
        bucket_bytes: int,
        suspend_after_s: float | None = 30.0,
        restore_bytes: RestoreBytes = plan_buckets,
        canary_every_s: float | None = None,
    ) -> None:
        self.ledger = ledger
        self.fleet = fleet
        self.artifacts = artifacts
        self.reconciler = Reconciler(
            ledger,
            fleet,
            artifacts,
            timeouts=timeouts,
            probe_interval_s=probe_interval_s,
            full_every_s=full_reconcile_s,
            cleanup_timeout=cleanup_timeout,
            bucket_bytes=bucket_bytes,
            clock=anyio.current_time,
            inflight=lambda engine_id, version_id: self.reclaimer.inflight(engine_id, version_id),
            suspend_after_s=suspend_after_s,
            restore_bytes=restore_bytes,
            canary_every_s=canary_every_s,
        )
        self.publisher = PublicationDriver(
            ledger,
            fleet,
            artifacts,
            reconciler=self.reconciler,
            timeouts=timeouts,
            cleanup_timeout=cleanup_timeout,
            owner=publisher_id,
        )
        self.reclaimer = ReclaimDriver(
            ledger,
            fleet,
            # the reconciler's canaries are requests on a version too (none without canaries)
            sources=() if canary_every_s is None else (self.reconciler,),
            timeouts=timeouts,
            tick_s=reclaim_tick_s,
            artifacts=artifacts,
            delete_artifacts_after_s=delete_artifacts_after_s,
            on_ambiguous=self.reconciler.poke,
            on_restart=self.reconciler.poke,
            clock=anyio.current_time,
        )
        self.bucket_bytes = bucket_bytes
        self.started: ReconcileReport | None = None

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        store: EventStore,
        fleet: Fleet,
        *,
        deployment: str,
        prefix: str,
        capacity: int,
        artifact_root: str | Path,
        timeouts: EngineTimeouts | None = None,
        probe_interval_s: float = 1.0,
        full_reconcile_s: float = 30.0,
        reclaim_tick_s: float = 0.5,
        lease_check_s: float = 1.0,
        cleanup_timeout: float = 60.0,
        delete_artifacts_after_s: float | None = None,
        publisher_id: str = "publisher",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        clock: Callable[[], float] = time.time,
        max_staleness: int | None = None,
        suspend_after_s: float | None = 30.0,
        restore_bytes: RestoreBytes = plan_buckets,
        canary_every_s: float | None = None,
    ) -> AsyncIterator[ControlPlane]:
        async with Ledger.open(store, clock=clock) as ledger:
            state = ledger.state
            if state.deployment is None:
                await ledger.create_deployment(
                    deployment, prefix=prefix, capacity=capacity, fleet=fleet.ids()
                )
            elif (state.deployment, state.prefix) != (deployment, prefix):
                raise LedgerError(
                    Code.ALREADY_INITIALIZED,
                    f"this log holds deployment {state.deployment!r} with prefix "
                    f"{state.prefix!r}, not {deployment!r}/{prefix!r}",
                )
            elif state.capacity != capacity:
                log.warning("plane.capacity_from_log", log=state.capacity, asked=capacity)
            # The opener's setting rules from now on, and the log says so (a no-op if equal).
            await ledger.configure_deployment(max_staleness=max_staleness)
            plane = cls(
                ledger,
                fleet,
                ArtifactStore(artifact_root),
                timeouts=timeouts or EngineTimeouts(),
                probe_interval_s=probe_interval_s,
                full_reconcile_s=full_reconcile_s,
                reclaim_tick_s=reclaim_tick_s,
                cleanup_timeout=cleanup_timeout,
                delete_artifacts_after_s=delete_artifacts_after_s,
                publisher_id=publisher_id,
                bucket_bytes=bucket_bytes,
                suspend_after_s=suspend_after_s,
                restore_bytes=restore_bytes,
                canary_every_s=canary_every_s,
            )
            plane.started = await plane.reconciler.start()
            log.info(
                "plane.started",
                deployment=deployment,
                engines=fleet.ids(),
                routable=list(ledger.state.routable_engines()),
                seq=ledger.state.last_seq,
            )
            async with anyio.create_task_group() as tg:
                await tg.start(plane.reclaimer.run)
                await tg.start(plane.reconciler.run)
                tg.start_soon(plane._expire_leases, lease_check_s)
                try:
                    yield plane
                finally:
                    tg.cancel_scope.cancel()

    async def _expire_leases(self, every_s: float) -> None:
        while True:
            await anyio.sleep(every_s)
            try:
                await self.ledger.expire_leases()
                await self.ledger.release_idle_sessions()
            except LoraLedgerError as exc:
                if exc.code in (Code.LEDGER_CLOSED, Code.FENCED):
                    raise
                log.error("plane.lease_expiry_failed", error=str(exc))

    def add_inflight_source(self, source: InFlightSource) -> None:
        """Count ``source``'s in-flight requests before any reclaim (a gateway)."""
        self.reclaimer.add_source(source)

    async def add_engine(self, engine: Engine) -> ReconcileReport:
        """A new fleet member: joined, observed and repaired (routable once it holds every
        needed version)."""
        self.fleet.add(engine)
        return await self.reconciler.reconcile_engine(engine.engine_id)

    async def replace_engine(self, engine: Engine) -> ReconcileReport:
        """A new handle for a fleet member (its process was replaced: a new actor, a new
        server behind another address), or a new member. The handle is swapped first, so
        publication, reclaim and the health loop use it from the next call on; then the
        engine is reconciled: a new process answers a new incarnation, which is recorded as
        a restart (``EngineRestarted``: not routable) and repaired before it serves."""
        self.fleet.replace(engine)
        report = await self.reconciler.reconcile_engine(engine.engine_id)
        self.reclaimer.wake()
        return report

    async def remove_engine(
        self,
        engine_id: str,
        *,
        cause: str = "fleet",
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> int:
        """The engine leaves the fleet, routed away first and drained before its handle goes:

        1. **route away**: the decision is recorded (``EngineLeft`` with ``cause``:
           ``operator`` when a person removed it), so no gateway sends it a new request from
           the routing it reads next;
        2. **drain**: wait until the in-flight counts the ledger knows for it (this process's
           gateways, remote workers' lease renewals) are zero, at most ``drain_timeout_s``
           seconds (:meth:`drain_engine`);
        3. its handle is dropped, so the reconciler does not join it again. Stopping the
           engine's process is its owner's job, safe once this returned 0.

        The reconciler holds the engine out from before the decision is recorded until its
        handle is gone: a probe of it while it drains would find an engine the ledger no
        longer has and join it again, routable. If the drain is cancelled, the handle goes all
        the same: the log says the engine left, and nothing here may bring it back.

        Returns how many requests were still counted on it when the drain ended (0: none)."""
        self.reconciler.hold_out(engine_id)
        try:
            if cause == "fleet":
                await self.ledger.leave_engine(engine_id)
            else:
                await self.ledger.remove_engine(engine_id, cause=cause)
            try:
                left = await self.drain_engine(engine_id, drain_timeout_s)
            finally:
                self.fleet.remove(engine_id)
        finally:
            self.reconciler.let_in(engine_id)
        if left:
            log.warning("plane.drain_timed_out", engine=engine_id, in_flight=left)
        self.reclaimer.wake()
        return left

    async def drain_engine(self, engine_id: str, timeout_s: float) -> int:
        """Wait until no request is counted in flight on ``engine_id`` (every reporter the
        reclaim driver reads, for every version an engine may hold), at most ``timeout_s``
        seconds; returns the count left. Counts fall without a ledger event (a reply, a
        renewal), so this reads them every ``DRAIN_POLL_S``."""
        with anyio.move_on_after(timeout_s):
            while self.inflight_on(engine_id):  # noqa: ASYNC110 -- no event: see above
                await anyio.sleep(DRAIN_POLL_S)
        return self.inflight_on(engine_id)

    def inflight_on(self, engine_id: str) -> int:
        """Requests counted in flight on ``engine_id``, over every version it may hold."""
        return sum(
            self.reclaimer.inflight(engine_id, v.version_id)
            for v in self.ledger.state.versions.values()
            if v.state in HOLDABLE_STATES
        )
