"""The ledger as ONE named, detached Ray actor: the single writer of one log (SQLite or
PostgreSQL).

Why one actor: the ledger's guarantees (group commit, decisions in one order, fencing) rest on
a single writer per log, and a Ray actor is a single process at a stable name that every
trainer and rollout worker can reach. Why detached: it must outlive whoever created it (the
driver of a training job may come and go; the log and the bindings must not).

Inside, the actor hosts either a bare :class:`~publisher.core.ledger.Ledger` or a whole
:class:`~publisher.drivers.plane.ControlPlane` (ledger + publication, reclaim and reconcile drivers
over a fleet of :class:`~publisher.ray.engine.RayEngine` handles), on a private event loop held
by a :class:`~publisher.ray.hosting.PortalHost`. It is an async actor: calls from many workers
run concurrently and land in the ledger's queue together, so group commit works across Ray
exactly as in process (one fsync for every call that arrived meanwhile).

Restart story. The actor's durable state is its log (plus the engine book, below). A SQLite file
lives on the disk of the node the actor was first placed on (a hard node affinity keeps every
later incarnation there, and that disk must survive the node: docs/stores.md); a PostgreSQL log
(``path="postgresql://..."``) lives on a server every node reaches, so the actor is placed
anywhere (or where ``node_id``/``resources`` say) and a later incarnation on another node
resumes the same log. ``__init__`` opens the log, verifies the chain tail, replays (from the
newest snapshot) and appends a new ``ControllerStarted``: every binding, owner and version comes
back from the log. This happens whether Ray restarts the actor after a crash (``max_restarts``,
the default is unlimited) or an operator kills it and calls :func:`start_ledger` again under the
same name. Callers ride over the gap through :class:`~publisher.ray.link.ActorLink` (their calls
are idempotent). The fleet's runtime changes (engines added, replaced, removed through this
actor) come back too: the actor keeps which engine actor serves each changed id in the engine
book (:mod:`publisher.ray.engine_book`) and opens its plane with the configured engines plus the
book's changes.

Provenance: the rows gateway actors and other clients send (``store_provenance``) are kept in
the store beside the log (``evlog/provenance_store.py``: a SQLite file next to a SQLite log, a
table in a PostgreSQL log's database), opened with the log, so they outlive the actor as the
log does.

Each method answers with outcomes and refusals as values where a batch is involved
(``execute_many``), and piggybacks a :class:`~publisher.remote.routing.RoutingTable` when the
routing changed since the caller's ``mark``, with the fleet's handles (a :class:`FleetView`)
when they changed since the caller's ``fleet_mark``: a client takes both from one reply, so it
never routes on a table newer than its handles (:meth:`_Service.fleet_for`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import anyio.to_thread
import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engines.contract import EngineError
from evlog.errors import LoraLedgerError
from evlog.provenance_store import ProvenanceStore, open_provenance
from evlog.sqlite import Synchronous
from evlog.stores import describe, is_shared, open_store
from projections.status import LedgerStatus
from projections.transitions import VersionState
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.drivers.fleet import Fleet, FleetError
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.gateway.provenance import ProvenanceRow
from publisher.logs import get_logger
from publisher.ray.adapter_objects import AdapterDescriptor, check_descriptor
from publisher.ray.engine import RayEngine
from publisher.ray.engine_book import EngineBook, entry_for, fleet_with_book
from publisher.ray.hosting import PortalHost, exit_process
from publisher.ray.link import DEFAULT_NAMESPACE
from publisher.ray.stored_adapter import PullStats, StoredAdapter, restore_payload
from publisher.remote.renewals import Life
from publisher.remote.routing import Mark, RoutingTable
from publisher.remote.service import LedgerService, TroubleBatch

if TYPE_CHECKING:
    from publisher.drivers.plane import ControlPlane
    from publisher.drivers.reconciler import ReconcileReport

DEFAULT_LEDGER_NAME = "ledger"
_FATAL = str(VersionState.FAILED_FATAL)
R = TypeVar("R")
_DYING_RETRIES = 25
_DYING_WAIT_S = 0.2

log = get_logger("loraledger.ray")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlaneConfig:
    """Host a :class:`~publisher.drivers.plane.ControlPlane` next to the ledger: ``engines`` are the
    fleet's handles, ``options`` go to ``ControlPlane.open`` unchanged (probe interval,
    timeouts, bucket size, ...)."""

    deployment: str
    prefix: str
    capacity: int
    artifact_root: str
    engines: tuple[RayEngine, ...]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    """Where the log lives and what the actor hosts (a bare ledger when ``plane`` is None:
    for deployments whose publication runs elsewhere, and for the benchmark). ``path`` is a
    SQLite file or a ``postgresql://`` URL (:func:`evlog.stores.open_store`); ``synchronous``
    applies to SQLite only."""

    path: str
    synchronous: Synchronous = "FULL"
    snapshot_every: int = 200_000
    # bare ledger: how often owners whose lease ran out are expired (the plane has its own)
    lease_check_s: float = 1.0
    plane: PlaneConfig | None = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """Outcomes (refusals in place) plus the routing, if it changed since the caller's mark,
    and the fleet's handles, if they changed since the caller's fleet mark (see
    :meth:`_Service.fleet_for`)."""

    results: list[Outcome | LoraLedgerError]
    routing: RoutingTable | None
    fleet: FleetView | None = None


@dataclasses.dataclass(frozen=True)
class RenewReply:
    """Lives ``(owner, incarnation)`` whose renewal was refused (``LEASE_EXPIRED``,
    ``OWNER_RESTARTED``, ...), and routing and handles, as in :class:`Reply`."""

    lost: dict[Life, LoraLedgerError]
    routing: RoutingTable | None
    fleet: FleetView | None = None


@dataclasses.dataclass(frozen=True)
class FleetView:
    """The ledger actor's engine handles, by id, at fleet ``version`` of controller ``epoch``
    (the ``fleet_mark`` of the routing tables sent from then on)."""

    epoch: int
    version: int
    engines: tuple[RayEngine, ...]
    plane: bool = True  # False: a bare ledger, which has no fleet (clients keep their own)

    @property
    def mark(self) -> Mark:
        return (self.epoch, self.version)


class LedgerInfo(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    node_id: str
    pid: int
    epoch: int
    last_seq: int
    plane: bool
    bucket_bytes: int | None
    fenced: str = ""  # why this actor stopped serving (another controller took the log over)


class _Service:
    """What the actor's methods run, on the hosted loop (the ledger is not thread-safe: every
    access happens on that loop). The ledger's calls are the :class:`LedgerService` every
    transport shares; Ray adds the fleet's handles to the replies, publication of adapters in
    the object store, and runtime fleet changes."""

    def __init__(
        self,
        ledger: Ledger,
        plane: ControlPlane | None,
        config: LedgerConfig,
        book: EngineBook | None = None,
        provenance: ProvenanceStore | None = None,
    ) -> None:
        self.ledger = ledger
        self.plane = plane
        self.config = config
        self.ledger_service = LedgerService(
            ledger,
            fleet_version=lambda: self.fleet_version,
            engine_trouble=None if plane is None else plane.reconciler.engine_trouble,
            provenance=provenance,
        )
        self.pulls = PullStats()
        self.book = book  # where runtime fleet changes are kept for a restart

    async def execute_many(
        self, commands: Sequence[c.Command], mark: Mark | None, fleet_mark: Mark | None
    ) -> Reply:
        results, table = await self.ledger_service.execute(commands, mark)
        # Table and view read together (no await between): the view is the table's fleet.
        return Reply(results, table, self.fleet_for(fleet_mark))

    async def register_owner(
        self,
        owner: str,
        ttl_s: float,
        incarnation: str,
        sessions_idle_s: float | None = None,
        secret: str = "",
    ) -> Done:
        return await self.ledger_service.register(
            owner, ttl_s, incarnation, sessions_idle_s, secret=secret
        )

    async def deregister_owner(
        self, owner: str, incarnation: str, secret: str = ""
    ) -> Deregistered:
        return await self.ledger_service.deregister(owner, incarnation, secret=secret)

    async def renew_leases(
        self,
        renewals: Mapping[Life, Mapping[tuple[str, int], int]],
        mark: Mark | None,
        fleet_mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]] | None = None,
        secrets: Mapping[Life, str] | None = None,
    ) -> RenewReply:
        lost, table = self.ledger_service.renew(renewals, mark, sessions, secrets=secrets or {})
        return RenewReply(lost, table, self.fleet_for(fleet_mark))

    async def routing_table(self) -> RoutingTable:
        return self.ledger_service.table()

    async def wait_routing(
        self, mark: Mark | None, fleet_mark: Mark | None, wait_s: float
    ) -> Reply:
        table = await self.ledger_service.wait_routing(mark, wait_s)
        return Reply([], table, None if table is None else self.fleet_for(fleet_mark))

    async def status(self) -> LedgerStatus:
        return self.ledger_service.status()

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> int:
        return await self.ledger_service.store_provenance(rows)

    async def publish(
        self, descriptor: AdapterDescriptor, step: int, allow_rollback: bool = False
    ) -> Any:
        """Publish the adapter the descriptor points to. Only the descriptor came in: the
        engine actors pull the bytes from the object store and verify them; this process pulls
        them once more, off its loop, for the durable copy (publisher/ray/stored_adapter.py).
        ``allow_rollback`` as for ``TrainerClient.publish``. A failed attempt is answered with
        what the version settles as (:meth:`_settled`)."""
        if self.plane is None:
            raise LedgerError(
                Code.INVALID_STATE, "this ledger actor hosts no control plane: nothing publishes"
            )
        stored = StoredAdapter(
            check_descriptor(descriptor), bucket_bytes=self.plane.bucket_bytes, stats=self.pulls
        )
        self.pulls.descriptors += 1
        try:
            return await self.plane.publisher.publish(
                stored, version_id=step, allow_rollback=allow_rollback
            )
        except PublicationError as failed:
            raise await self._settled(self.plane, failed) from None

    async def _settled(self, plane: ControlPlane, failed: PublicationError) -> PublicationError:
        """The trainer's answer for an attempt that ended ``FAILED_FATAL``: the ledger's word
        once every engine has been looked at again, not the word of the moment it ended.

        Why: an engine actor that dies mid-publication leaves an ambiguous reply, so the
        attempt ends ``FAILED_FATAL``; the reconciler's next probe finds the actor gone and
        suspends it, which resolves the entry (``FatalResolved``: ``FAILED_RETRYABLE``)
        milliseconds later. Told ``FATAL``, a trainer stops or alerts for what is, by then, a
        step it may simply publish again. So one health check runs first (every engine probed:
        a gone one suspended, the attempt's live ones reconciled, each call bounded by its
        timeout) and the error carries the state the version is in after it; a version still
        ``FAILED_FATAL`` then is reported ``FATAL``, as before."""
        if failed.kind != ErrorKind.FATAL or failed.details.get("state") != _FATAL:
            return failed
        version_id, attempt = failed.details.get("version_id"), failed.details.get("attempt")
        await plane.reconciler.health_check()
        v = self.ledger.state.versions.get(version_id) if isinstance(version_id, int) else None
        if v is None or v.attempt != attempt or v.state != VersionState.FAILED_RETRYABLE:
            return failed
        log.info("ray.publication_settled", version=version_id, attempt=attempt, state=v.state)
        return PublicationError(
            failed.code,
            f"{failed.message}; the engines were checked again and every one of the attempt "
            f"proved it absent or left service: it is {v.state}",
            **{**failed.details, "kind": ErrorKind.RETRYABLE, "state": str(v.state)},
        )

    async def pull_stats(self) -> PullStats:
        return dataclasses.replace(self.pulls)

    # --- fleet membership at runtime (docs/engines.md#engines-as-ray-actors) ------------------

    @property
    def fleet_version(self) -> int:
        return 0 if self.plane is None else int(self.plane.fleet.version)

    def _plane_for(self, action: str) -> Any:
        if self.plane is None:
            raise LedgerError(
                Code.INVALID_STATE, f"this ledger actor hosts no control plane: cannot {action}"
            )
        return self.plane

    async def fleet_view(self) -> FleetView:
        return self._view()

    def _view(self) -> FleetView:
        # The actor's plane is opened on RayEngine handles, and only RayEngines are added or
        # replaced through it (add_engine, replace_engine): its fleet holds nothing else.
        engines = () if self.plane is None else cast(tuple[RayEngine, ...], tuple(self.plane.fleet))
        return FleetView(
            epoch=self.ledger.epoch,  # the marks of this controller's tables (remote/routing.py)
            version=self.fleet_version,
            engines=engines,
            plane=self.plane is not None,
        )

    def fleet_for(self, fleet_mark: Mark | None) -> FleetView | None:
        """The membership view to send with a reply whose caller mirrors the fleet at
        ``fleet_mark``: None when that is the current mark (nothing changed) or when the
        caller mirrors nothing (None).

        Why the handles travel with the reply: a routing table that makes a replaced engine
        routable again reaches the caller in this same reply, and the caller routes on it
        right away (a session's first turn is dispatched as soon as its bind answers). Were the
        new handle fetched afterwards, that turn could still find the old actor's handle in
        the caller's mirror -- usually a dead actor, so the turn fails ``AMBIGUOUS_DISPATCH``
        and is never resent. With the view here, the caller mirrors it before it takes the table:
        the handles it dispatches to are never older than the routing it chose by. Sent once
        per change and caller (its next call carries the new mark), so a publication, which
        changes routing but not the fleet, sends no handle."""
        if fleet_mark is None:
            return None
        view = self._view()
        return None if view.mark == tuple(fleet_mark) else view

    async def add_engine(self, engine: RayEngine) -> ReconcileReport:
        plane = self._plane_for("add an engine")
        report: ReconcileReport = await plane.add_engine(engine)
        await self._book(engine)
        log.info("ray.engine_added", engine=engine.engine_id, report=str(report))
        return report

    async def replace_engine(self, engine: RayEngine) -> ReconcileReport:
        plane = self._plane_for("replace an engine")
        if (
            engine.engine_id not in plane.fleet
            and engine.engine_id not in self.ledger.state.engines
        ):
            raise FleetError(
                Code.UNKNOWN_ENGINE,
                f"engine {engine.engine_id!r} is not in the fleet: add it instead",
            )
        report: ReconcileReport = await plane.replace_engine(engine)
        await self._book(engine)
        log.info("ray.engine_replaced", engine=engine.engine_id, report=str(report))
        return report

    async def remove_engine(self, engine_id: str, cause: str) -> int:
        plane = self._plane_for("remove an engine")
        if engine_id not in plane.fleet and engine_id not in self.ledger.state.engines:
            raise FleetError(Code.UNKNOWN_ENGINE, f"engine {engine_id!r} is not in the fleet")
        left: int = await plane.remove_engine(engine_id, cause=cause)  # routed away, drained
        if self.book is not None:
            await anyio.to_thread.run_sync(self.book.record, engine_id, None)
        log.info("ray.engine_removed", engine=engine_id, cause=cause, in_flight_left=left)
        return left

    async def _book(self, engine: RayEngine) -> None:
        """Keep the engine's actor in the book, so a restarted ledger actor serves it again."""
        if self.book is None:
            return
        book = self.book
        try:
            entry = await anyio.to_thread.run_sync(entry_for, engine)
            if entry is None:
                await anyio.to_thread.run_sync(book.forget, engine.engine_id)
            else:
                await anyio.to_thread.run_sync(book.record, engine.engine_id, entry)
        except Exception as exc:
            # The change itself is made and recorded in the log; only a restart of this actor
            # would not find the engine's actor again. Loud, but not a failed change.
            log.error("ray.engine_book_not_written", engine=engine.engine_id, error=repr(exc))

    async def engine_failed(
        self, engine_id: str, error: EngineError, batch: TroubleBatch | None = None
    ) -> None:
        """A caller's generation on ``engine_id`` failed in a way that says something about the
        engine: handed to the reconciler (:meth:`LedgerService.trouble`), with the failures
        the caller counted, when the engine is one of the plane's."""
        if self.plane is not None and engine_id in self.plane.fleet:
            self.ledger_service.trouble(engine_id, error, batch)

    async def info(self) -> LedgerInfo:
        return self.info_now()

    def info_now(self) -> LedgerInfo:
        """Read on the hosted loop while the ledger serves; once it is fenced, the actor's own
        thread reads it (the ledger no longer writes, and the hosted loop may be gone)."""
        state = self.ledger.state
        fenced = self.ledger.fenced
        return LedgerInfo(
            path=describe(self.config.path),
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            epoch=self.ledger.epoch if fenced is not None else state.epoch,
            last_seq=state.last_seq,
            plane=self.plane is not None,
            bucket_bytes=None if self.plane is None else self.plane.bucket_bytes,
            fenced="" if fenced is None else fenced.message,
        )


@asynccontextmanager
async def _serve(config: LedgerConfig) -> AsyncIterator[_Service]:
    async with (
        open_store(config.path, synchronous=config.synchronous) as store,
        open_provenance(config.path) as provenance,
    ):
        if config.plane is None:
            async with (
                Ledger.open(store, snapshot_every=config.snapshot_every) as ledger,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(_expire_leases, ledger, config.lease_check_s)
                tg.start_soon(_stop_when_fenced, ledger)
                log.info(
                    "ray.ledger_serving", path=describe(config.path), seq=ledger.state.last_seq
                )
                try:
                    yield _Service(ledger, None, config, provenance=provenance)
                finally:
                    tg.cancel_scope.cancel()
            return
        from publisher.drivers.plane import ControlPlane

        p = config.plane
        # The configured fleet, with the changes made at runtime by an earlier life of this
        # actor (publisher/ray/engine_book.py).
        book = await anyio.to_thread.run_sync(EngineBook.of_this_actor, p.deployment, config.path)
        engines: list[RayEngine] = list(p.engines)
        if book is not None:
            entries = await anyio.to_thread.run_sync(book.read)
            if entries:
                engines = await anyio.to_thread.run_sync(fleet_with_book, p.engines, entries)
                log.info("ray.engine_book_applied", engines=sorted(e.engine_id for e in engines))
        async with (
            ControlPlane.open(
                store,
                Fleet(engines),
                deployment=p.deployment,
                prefix=p.prefix,
                capacity=p.capacity,
                artifact_root=p.artifact_root,
                restore_bytes=restore_payload,  # repairs: the object store, as publication
                **dict(p.options),
            ) as plane,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(_stop_when_fenced, plane.ledger)
            log.info(
                "ray.plane_serving", path=describe(config.path), seq=plane.ledger.state.last_seq
            )
            try:
                yield _Service(plane.ledger, plane, config, book, provenance)
            finally:
                tg.cancel_scope.cancel()


async def _stop_when_fenced(ledger: Ledger) -> None:
    """Another controller took the log over: stop hosting, by failing the hosted context, so
    the plane's drivers stop acting on engines for a ledger that can no longer record. The
    actor itself stays and answers ``FENCED`` (:class:`LedgerActor`) instead of exiting: Ray
    would restart it, and the restarted actor would take the log back in turn."""
    fenced = await ledger.wait_fenced()
    log.error("ray.ledger_fenced", reason=fenced.message, pid=os.getpid())
    raise fenced


async def _expire_leases(ledger: Ledger, every_s: float) -> None:
    """A dead worker must not pin a version forever (docs/sessions.md): expire overdue owners,
    and release the client-held sessions that went idle (the plane's loop does both too)."""
    while True:
        await anyio.sleep(every_s)
        try:
            await ledger.expire_leases()
            await ledger.release_idle_sessions()
        except LoraLedgerError as exc:
            if exc.code in (Code.LEDGER_CLOSED, Code.FENCED):
                raise
            log.error("ray.lease_expiry_failed", error=str(exc))


class LedgerActor:
    """The actor class (create it with :func:`start_ledger`). Every method is a coroutine run
    concurrently on the actor's loop and forwarded to the hosted service.

    Fenced (another controller appended to the log: docs/operations.md, "Where the log must
    live"), it stops serving: the hosted ledger and plane stop, every method but
    :meth:`describe` and :meth:`close` refuses with the ledger's ``FENCED`` error, and
    :meth:`describe` says why (``LedgerInfo.fenced``). It does not exit: Ray would restart it,
    and the restarted actor would take the log back from the controller that has it. End it
    with :func:`stop_ledger`."""

    def __init__(self, config: LedgerConfig) -> None:
        self._host: PortalHost[_Service] = PortalHost(
            lambda: _serve(config), name="ledger", on_dead=self._on_dead
        )
        self._service = self._host.value

    def _fenced(self) -> LedgerError | None:
        return self._service.ledger.fenced

    async def _call(self, func: Callable[..., Awaitable[R]], *args: Any) -> R:
        fenced = self._fenced()
        if fenced is not None:
            raise fenced
        return await self._host.call(func, *args)

    def _on_dead(self, reason: str) -> None:
        """The hosted service stopped on its own: end the process so Ray restarts it from the
        log, unless it stopped because it is fenced (see the class docstring)."""
        if self._fenced() is None:
            exit_process(reason)

    async def execute_many(
        self, commands: list[c.Command], mark: Mark | None = None, fleet_mark: Mark | None = None
    ) -> Reply:
        """Decide ``commands``; the reply carries the routing if it changed since ``mark``, and
        the fleet's handles if they changed since ``fleet_mark`` (the caller's mirror)."""
        return await self._call(self._service.execute_many, commands, mark, fleet_mark)

    async def register_owner(
        self,
        owner: str,
        ttl_s: float = 30.0,
        incarnation: str = "",
        sessions_idle_s: float | None = None,
        secret: str = "",
    ) -> Done:
        """``sessions_idle_s``: a relay's (its sessions are client-held, docs/sessions.md);
        ``secret``: the life's (refused without one)."""
        return await self._call(
            self._service.register_owner, owner, ttl_s, incarnation, sessions_idle_s, secret
        )

    async def deregister_owner(
        self, owner: str, incarnation: str = "", secret: str = ""
    ) -> Deregistered:
        return await self._call(self._service.deregister_owner, owner, incarnation, secret)

    async def renew_leases(
        self,
        renewals: dict[Life, dict[tuple[str, int], int]],
        mark: Mark | None = None,
        fleet_mark: Mark | None = None,
        sessions: dict[Life, tuple[str, ...]] | None = None,
        secrets: dict[Life, str] | None = None,
    ) -> RenewReply:
        """Renew each life ``(owner, incarnation)``, proven by its secret (``secrets``), with
        its in-flight counts and (a relay's) the client-held sessions it had a turn of; the
        lives refused come back by name (see publisher/renewals.py)."""
        return await self._call(
            self._service.renew_leases, renewals, mark, fleet_mark, sessions, secrets
        )

    async def routing(self) -> RoutingTable:
        return await self._call(self._service.routing_table)

    async def wait_routing(
        self, mark: Mark | None = None, fleet_mark: Mark | None = None, wait_s: float = 5.0
    ) -> Reply:
        """A long poll: the routing (and the handles, if they changed since ``fleet_mark``) as
        soon as it is not the table ``mark``, or an empty reply after ``wait_s`` seconds."""
        return await self._call(self._service.wait_routing, mark, fleet_mark, wait_s)

    async def status(self) -> LedgerStatus:
        return await self._call(self._service.status)

    async def store_provenance(self, rows: list[ProvenanceRow]) -> int:
        """Keep provenance rows a gateway actor or another client sent, in the store beside
        the log, durably before answering; how many were new (a resend stores nothing twice)."""
        return await self._call(self._service.store_provenance, rows)

    async def publish(
        self, descriptor: AdapterDescriptor, step: int, allow_rollback: bool = False
    ) -> Any:
        return await self._call(self._service.publish, descriptor, step, allow_rollback)

    async def pull_stats(self) -> PullStats:
        """Descriptors received and adapter bytes this process pulled (durable copies)."""
        return await self._call(self._service.pull_stats)

    async def describe(self) -> LedgerInfo:
        if self._fenced() is not None:
            return self._service.info_now()
        return await self._call(self._service.info)

    # --- fleet membership at runtime ------------------------------------------------------------

    async def fleet_view(self) -> FleetView:
        """The engine handles the hosted plane uses now, with the fleet's version."""
        return await self._call(self._service.fleet_view)

    async def add_engine(self, engine: RayEngine) -> ReconcileReport:
        """A new engine joins (``EngineJoined``), is observed and repaired, and serves once
        routable; the answer says what the reconciliation did. ``ENGINE_EXISTS`` if the
        fleet already has an engine under its id (use :meth:`replace_engine`)."""
        return await self._call(self._service.add_engine, engine)

    async def replace_engine(self, engine: RayEngine) -> ReconcileReport:
        """A new handle for engine ``engine.engine_id`` (a new actor): from now on every call
        of the plane goes to it; its new incarnation is recorded as a restart
        (``EngineRestarted``) and repaired before it serves."""
        return await self._call(self._service.replace_engine, engine)

    async def remove_engine(self, engine_id: str, cause: str = "operator") -> int:
        """The engine leaves the fleet (``EngineLeft`` with ``cause``): routed away, then
        drained (the requests counted on it finish, at most 30 s: ``ControlPlane.remove_engine``),
        then its handle is dropped. Returns the requests still counted on it (0: drained; stop
        it with ``stop_engine`` now)."""
        return await self._call(self._service.remove_engine, engine_id, cause)

    async def engine_failed(
        self, engine_id: str, error: EngineError, batch: TroubleBatch | None = None
    ) -> None:
        """A client's hint that a generation on ``engine_id`` failed with ``error`` (an
        :class:`~engines.contract.EngineError`, sent as is: its class says whether the engine
        answered cleanly), with the failed turns it counted (``batch``); see ``_Service``."""
        await self._call(self._service.engine_failed, engine_id, error, batch)

    async def close(self) -> None:
        """Close the ledger cleanly (queued calls commit, a snapshot is saved); the actor
        answers nothing afterwards and should then be killed (:func:`stop_ledger`)."""
        try:
            await anyio.to_thread.run_sync(self._host.close)
        except Exception:
            if self._fenced() is None:
                raise
            # The hosted service already stopped because it was fenced; that is its story.


def start_ledger(
    config: LedgerConfig,
    *,
    name: str = DEFAULT_LEDGER_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    node_id: str | None = None,
    resources: Mapping[str, float] | None = None,
    max_restarts: int = -1,
    timeout: float = 300.0,
) -> ActorHandle:
    """Start the ledger actor ``namespace/name`` or return the one already running under that
    name, once it has replayed its log (blocking). A running actor serving another log is
    refused.

    Placement: a SQLite log pins the actor to ``node_id`` (default: this node, whose disk holds
    ``config.path``) with a hard node affinity, so Ray never restarts it away from its file. A
    PostgreSQL log leaves the actor free: Ray's default placement, or ``node_id`` (hard
    affinity) and ``resources`` (custom resources it needs, e.g. ``{"ledger-zone": 0.01}``)
    when given."""
    shared = is_shared(config.path)
    path = config.path if shared else str(Path(config.path).resolve())
    config = dataclasses.replace(config, path=path)
    if shared and node_id is None:
        placement: Any = "DEFAULT"
    else:
        node = node_id or ray.get_runtime_context().get_node_id()
        placement = NodeAffinitySchedulingStrategy(node, soft=False)
    actor = ray.remote(LedgerActor).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=0,  # callers retry through ActorLink; Ray must not resend alone
        max_concurrency=1000,
        num_cpus=0,
        resources=dict(resources or {}),
        scheduling_strategy=placement,
    )
    # An actor killed a moment ago may still hold the name: the lookup then finds it dying.
    # Ask again until the name is free (a creation that failed by itself is reported at once).
    for attempt in range(_DYING_RETRIES + 1):
        handle = actor.remote(config)
        try:
            info: LedgerInfo = ray.get(handle.describe.remote(), timeout=timeout)
            break
        except RayActorError as exc:
            if exc.actor_init_failed or attempt == _DYING_RETRIES:
                raise  # this actor's own __init__ failed (e.g. a corrupt log): say why
            time.sleep(_DYING_WAIT_S)
    if info.path != describe(path):
        raise LedgerError(
            Code.ALREADY_INITIALIZED,
            f"ledger actor {namespace}/{name} already serves {info.path}, not {describe(path)}",
        )
    if info.fenced:
        raise LedgerError(
            Code.FENCED,
            f"ledger actor {namespace}/{name} is fenced ({info.fenced}): another controller "
            f"serves {info.path}. Use that one; stop_ledger() this actor first if this one must "
            "take the log over (which fences the other in turn)",
            epoch=info.epoch,
        )
    log.info("ray.ledger_started", name=name, path=describe(path), epoch=info.epoch, pid=info.pid)
    return handle


def stop_ledger(
    name: str = DEFAULT_LEDGER_NAME,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    timeout: float = 60.0,
) -> bool:
    """Close the ledger actor cleanly and end it (blocking). False if none was running."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(handle.close.remote(), timeout=timeout)
    except (RayActorError, GetTimeoutError) as exc:
        log.warning("ray.ledger_close_failed", name=name, error=repr(exc))
    ray.kill(handle, no_restart=True)
    return True
