"""The ledger as ONE named, detached Ray actor: the single writer of one SQLite log.

Why one actor: the ledger's guarantees (group commit, decisions in one order, fencing) rest on
a single writer per log, and a Ray actor is a single process at a stable name that every
trainer and rollout worker can reach. Why detached: it must outlive whoever created it (the
driver of a training job may come and go; the log and the bindings must not).

Inside, the actor hosts either a bare :class:`~publisher.ledger.Ledger` or a whole
:class:`~publisher.plane.ControlPlane` (ledger + publication, reclaim and reconcile drivers
over a fleet of :class:`~publisher.ray.engine.RayEngine` handles), on a private event loop held
by a :class:`~publisher.ray.hosting.PortalHost`. It is an async actor: calls from many workers
run concurrently and land in the ledger's queue together, so group commit works across Ray
exactly as in process (one fsync for every call that arrived meanwhile).

Restart story. The actor's only durable state is its SQLite file, on the disk of the node it
was first placed on (a hard node affinity keeps every later incarnation there). ``__init__``
opens that file, verifies the chain tail, replays (from the newest snapshot) and appends a new
``ControllerStarted``: every binding, owner and version comes back from the log. This happens
whether Ray restarts the actor after a crash (``max_restarts``, the default is unlimited) or an
operator kills it and calls :func:`start_ledger` again under the same name. Callers ride over
the gap through :class:`~publisher.ray.link.ActorLink` (their calls are idempotent).

Each method answers with outcomes and refusals as values where a batch is involved
(``execute_many``), and piggybacks a :class:`~publisher.ray.routing.RoutingTable` when the
routing changed since the caller's ``mark``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evlog.errors import LoraLedgerError
from evlog.sqlite import SQLiteStore, Synchronous
from projections.status import LedgerStatus
from publisher import commands as c
from publisher.errors import Code, LedgerError
from publisher.fleet import Fleet
from publisher.ledger import Ledger
from publisher.logs import get_logger
from publisher.outcomes import Deregistered, Done, Outcome
from publisher.ray.engine import RayEngine
from publisher.ray.hosting import PortalHost
from publisher.ray.link import DEFAULT_NAMESPACE
from publisher.ray.routing import Mark, RoutingTable, RoutingTracker
from publisher.ray.trainer import AdapterWire, rebuild_copy

DEFAULT_LEDGER_NAME = "ledger"
_DYING_RETRIES = 25
_DYING_WAIT_S = 0.2

log = get_logger("loraledger.ray")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlaneConfig:
    """Host a :class:`~publisher.plane.ControlPlane` next to the ledger: ``engines`` are the
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
    for deployments whose publication runs elsewhere, and for the benchmark)."""

    path: str
    synchronous: Synchronous = "FULL"
    snapshot_every: int = 200_000
    # bare ledger: how often owners whose lease ran out are expired (the plane has its own)
    lease_check_s: float = 1.0
    plane: PlaneConfig | None = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """Outcomes (refusals in place) plus the routing, if it changed since the caller's mark."""

    results: list[Outcome | LoraLedgerError]
    routing: RoutingTable | None


@dataclasses.dataclass(frozen=True)
class RenewReply:
    """Owners whose renewal was refused (``LEASE_EXPIRED``, ``OWNER_RESTARTED``, ...), and
    routing."""

    lost: dict[str, LoraLedgerError]
    routing: RoutingTable | None


class LedgerInfo(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    node_id: str
    pid: int
    epoch: int
    last_seq: int
    plane: bool
    bucket_bytes: int | None


class _Service:
    """What the actor's methods run, on the hosted loop (the ledger is not thread-safe: every
    access happens on that loop)."""

    def __init__(self, ledger: Ledger, plane: Any, config: LedgerConfig) -> None:
        self.ledger = ledger
        self.plane = plane
        self.config = config
        self.routing = RoutingTracker()

    async def execute_many(self, commands: Sequence[c.Command], mark: Mark | None) -> Reply:
        results = await self.ledger.execute_many(commands)
        return Reply(results, self.routing.newer_than(self.ledger.state, mark))

    async def register_owner(self, owner: str, ttl_s: float, incarnation: str) -> Done:
        return await self.ledger.register_owner(owner, ttl_s=ttl_s, incarnation=incarnation)

    async def deregister_owner(self, owner: str, incarnation: str) -> Deregistered:
        return await self.ledger.deregister_owner(owner, incarnation=incarnation)

    async def renew_leases(
        self,
        renewals: Mapping[str, Mapping[tuple[str, int], int]],
        mark: Mark | None,
        incarnations: Mapping[str, str],
    ) -> RenewReply:
        lost: dict[str, LoraLedgerError] = {}
        for owner, inflight in renewals.items():
            try:
                self.ledger.renew_lease(owner, inflight, incarnation=incarnations.get(owner, ""))
            except LoraLedgerError as exc:
                lost[owner] = exc
        return RenewReply(lost, self.routing.newer_than(self.ledger.state, mark))

    async def routing_table(self) -> RoutingTable:
        return self.routing.current(self.ledger.state)

    async def status(self) -> LedgerStatus:
        return self.ledger.status()

    async def publish(self, wire: AdapterWire, step: int) -> Any:
        if self.plane is None:
            raise LedgerError(
                Code.INVALID_STATE, "this ledger actor hosts no control plane: nothing publishes"
            )
        from publisher.trainer import TrainerClient

        adapter = await anyio.to_thread.run_sync(rebuild_copy, wire, self.plane.bucket_bytes)
        return await TrainerClient(self.plane).publish(adapter, step=step)

    async def info(self) -> LedgerInfo:
        state = self.ledger.state
        return LedgerInfo(
            path=self.config.path,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            epoch=state.epoch,
            last_seq=state.last_seq,
            plane=self.plane is not None,
            bucket_bytes=None if self.plane is None else self.plane.bucket_bytes,
        )


@asynccontextmanager
async def _serve(config: LedgerConfig) -> AsyncIterator[_Service]:
    async with SQLiteStore.open(config.path, synchronous=config.synchronous) as store:
        if config.plane is None:
            async with (
                Ledger.open(store, snapshot_every=config.snapshot_every) as ledger,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(_expire_leases, ledger, config.lease_check_s)
                log.info("ray.ledger_serving", path=config.path, seq=ledger.state.last_seq)
                try:
                    yield _Service(ledger, None, config)
                finally:
                    tg.cancel_scope.cancel()
            return
        from publisher.plane import ControlPlane

        p = config.plane
        async with ControlPlane.open(
            store,
            Fleet(p.engines),
            deployment=p.deployment,
            prefix=p.prefix,
            capacity=p.capacity,
            artifact_root=p.artifact_root,
            **dict(p.options),
        ) as plane:
            log.info("ray.plane_serving", path=config.path, seq=plane.ledger.state.last_seq)
            yield _Service(plane.ledger, plane, config)


async def _expire_leases(ledger: Ledger, every_s: float) -> None:
    """A dead worker must not pin a version forever (docs/sessions.md): expire overdue owners."""
    while True:
        await anyio.sleep(every_s)
        try:
            await ledger.expire_leases()
        except LoraLedgerError as exc:
            if exc.code in (Code.LEDGER_CLOSED, Code.FENCED):
                raise
            log.error("ray.lease_expiry_failed", error=str(exc))


class LedgerActor:
    """The actor class (create it with :func:`start_ledger`). Every method is a coroutine run
    concurrently on the actor's loop and forwarded to the hosted service."""

    def __init__(self, config: LedgerConfig) -> None:
        self._host: PortalHost[_Service] = PortalHost(lambda: _serve(config), name="ledger")
        self._service = self._host.value

    async def execute_many(self, commands: list[c.Command], mark: Mark | None = None) -> Reply:
        return await self._host.call(self._service.execute_many, commands, mark)

    async def register_owner(self, owner: str, ttl_s: float = 30.0, incarnation: str = "") -> Done:
        return await self._host.call(self._service.register_owner, owner, ttl_s, incarnation)

    async def deregister_owner(self, owner: str, incarnation: str = "") -> Deregistered:
        return await self._host.call(self._service.deregister_owner, owner, incarnation)

    async def renew_leases(
        self,
        renewals: dict[str, dict[tuple[str, int], int]],
        mark: Mark | None = None,
        incarnations: dict[str, str] | None = None,
    ) -> RenewReply:
        return await self._host.call(self._service.renew_leases, renewals, mark, incarnations or {})

    async def routing(self) -> RoutingTable:
        return await self._host.call(self._service.routing_table)

    async def status(self) -> LedgerStatus:
        return await self._host.call(self._service.status)

    async def publish(self, wire: AdapterWire, step: int) -> Any:
        return await self._host.call(self._service.publish, wire, step)

    async def describe(self) -> LedgerInfo:
        return await self._host.call(self._service.info)

    async def close(self) -> None:
        """Close the ledger cleanly (queued calls commit, a snapshot is saved); the actor
        answers nothing afterwards and should then be killed (:func:`stop_ledger`)."""
        await anyio.to_thread.run_sync(self._host.close)


def start_ledger(
    config: LedgerConfig,
    *,
    name: str = DEFAULT_LEDGER_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    node_id: str | None = None,
    max_restarts: int = -1,
    timeout: float = 300.0,
) -> ActorHandle:
    """Start the ledger actor ``namespace/name`` on ``node_id`` (default: this node, whose
    disk holds ``config.path``) or return the one already running under that name, once it
    has replayed its log (blocking). A running actor serving another file is refused."""
    path = str(Path(config.path).resolve())
    config = dataclasses.replace(config, path=path)
    node = node_id or ray.get_runtime_context().get_node_id()
    actor = ray.remote(LedgerActor).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=0,  # callers retry through ActorLink; Ray must not resend alone
        max_concurrency=1000,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
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
    if info.path != path:
        raise LedgerError(
            Code.ALREADY_INITIALIZED,
            f"ledger actor {namespace}/{name} already serves {info.path}, not {path}",
        )
    log.info("ray.ledger_started", name=name, path=path, epoch=info.epoch, pid=info.pid)
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
