"""RayLedger: the remote ledger over Ray, as a process other than the ledger actor sees it.

It is the one remote client (:class:`~publisher.remote.client.RemoteLedger`: coalesced round
trips, lease renewals forwarded per life, routing piggybacked on replies, trouble reports, a
clean exit that deregisters its owners) over :class:`RayTransport`, plus the typed session
commands (``bind``, ``release``, ``forget``). So a
:class:`~publisher.sessions.RolloutWorker` and a :class:`~publisher.gateway.Gateway` run
unchanged in a Ray actor::

    async with RayLedger.connect("ledger") as ledger:
        gateway = Gateway(ledger.fleet, ledger.view, gateway_id="w1",
                          on_engine_trouble=ledger.engine_failed)
        async with RolloutWorker.open(ledger, gateway, owner="w1") as worker:
            served = await worker.session("s1").generate(prompt)

What only Ray adds, each for a reason:

* **The fleet is the ledger's.** :attr:`RayLedger.fleet` is a
  :class:`~publisher.drivers.fleet.Fleet` mirroring the ledger actor's engine handles (its
  membership view, fetched at connect) and changed in place, so a gateway built on
  ``ledger.fleet`` routes to a replacement actor without a restart of its process. Each command
  batch and lease renewal tells the actor which fleet version the mirror holds
  (:attr:`RayTransport.fleet_mark`), and a reply whose routing comes from a newer one carries
  the new handles too, mirrored *before* the table is taken (:meth:`RayTransport.mirrored`,
  which returns before the client takes the table, with no await between): the handles a gateway
  dispatches to are never older than the routing it chose by, so a turn routed on a table from
  after a ``replace_engine`` -- a session's first turn, routed on its bind's reply, included --
  never meets the replaced actor's handle. (Fetched afterwards, as a separate call, the handle
  arrived one round trip after the table, and such a first turn could meet the dead actor:
  ``AMBIGUOUS_DISPATCH``, never resent.) A failed engine call reported through
  :meth:`RayLedger.engine_failed` also refreshes the mirror.
* **Turns are confirmed by the ledger** (``confirm_timeout``,
  :meth:`~publisher.remote.client.RemoteLedger.confirm_lease`): when Ray restarts a rollout
  actor whose old process still runs, the new life's registration releases the old one's
  sessions, and the old one's next turn is refused ``OWNER_RESTARTED`` before it is sent.
* **Restarts are ridden out.** Every call goes through an
  :class:`~publisher.ray.link.ActorLink`: across a ledger restart it is sent again (every
  ledger command is idempotent: a bind answers the same binding, a release ``released=False``)
  until ``reconnect_timeout``; only then do callers get ``LEDGER_CLOSED``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engines.contract import EngineError
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.outcomes import Deregistered, Done
from publisher.drivers.fleet import Fleet
from publisher.gateway.provenance import ProvenanceRow
from publisher.logs import get_logger
from publisher.ray.engine import RayEngine
from publisher.ray.ledger_actor import DEFAULT_LEDGER_NAME, FleetView, RenewReply, Reply
from publisher.ray.link import DEFAULT_NAMESPACE, ActorLink
from publisher.remote.client import Answered, RemoteLedger, Renewed
from publisher.remote.renewals import Counts, Life
from publisher.remote.routing import Mark, RoutingTable
from publisher.remote.service import TroubleBatch

log = get_logger("loraledger.ray")


class RayTransport:
    """The remote ledger's calls as the ledger actor's methods, and the mirror of its fleet."""

    def __init__(self, link: ActorLink, *, retry_every: float = 0.5) -> None:
        self.link = link
        self.fleet = Fleet()  # mirrors the ledger actor's handles (see the module docstring)
        self.fleet_mark: Mark | None = None  # (epoch, version) of the view mirrored
        self.fleet_refreshes = 0  # views fetched (observability, tests)
        self.fleet_hosted = False  # whether the ledger actor hosts a plane (has a fleet)
        self.fleet_wanted = anyio.Event()
        self._retry_every = retry_every
        self._listeners: list[Callable[[], None]] = []

    async def execute(self, commands: Sequence[c.Command], mark: Mark | None) -> Answered:
        reply: Reply = await self.link.call("execute_many", list(commands), mark, self.fleet_mark)
        return Answered(reply.results, self.mirrored(reply.routing, reply.fleet))

    async def register_owner(
        self,
        owner: str,
        ttl_s: float,
        incarnation: str,
        sessions_idle_s: float | None,
        secret: str,
    ) -> Done:
        done: Done = await self.link.call(
            "register_owner", owner, ttl_s, incarnation, sessions_idle_s, secret
        )
        return done

    async def deregister_owner(self, owner: str, incarnation: str, secret: str) -> Deregistered:
        outcome: Deregistered = await self.link.call("deregister_owner", owner, incarnation, secret)
        return outcome

    async def renew(
        self,
        lives: Mapping[Life, Counts],
        mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]],
        secrets: Mapping[Life, str],
    ) -> Renewed:
        reply: RenewReply = await self.link.call(
            "renew_leases", dict(lives), mark, self.fleet_mark, dict(sessions), dict(secrets)
        )
        return Renewed(reply.lost, self.mirrored(reply.routing, reply.fleet))

    async def routing(self) -> RoutingTable:
        """The current table; one from a fleet newer than the mirror is returned only once the
        view is fetched too (the view asked for after the table is at least as new)."""
        table: RoutingTable = await self.link.call("routing")
        if self.fleet_mark is None or table.fleet_mark > self.fleet_mark:
            await self.refresh_fleet()
        return table

    async def wait_routing(self, mark: Mark | None, wait_s: float) -> RoutingTable | None:
        """The ledger actor's long poll (:meth:`LedgerService.wait_routing`), with the fleet's
        handles when they changed too, mirrored before the table is taken."""
        reply: Reply = await self.link.call("wait_routing", mark, self.fleet_mark, wait_s)
        return self.mirrored(reply.routing, reply.fleet)

    async def status(self) -> LedgerStatus:
        status: LedgerStatus = await self.link.call("status")
        return status

    async def report_trouble(self, engine_id: str, error: EngineError, batch: TroubleBatch) -> None:
        await self.link.call("engine_failed", engine_id, error, batch)

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> int:
        stored: int = await self.link.call("store_provenance", list(rows))
        return stored

    # --- the fleet, as the ledger actor has it --------------------------------------------------

    def mirrored(
        self, table: RoutingTable | None, view: FleetView | None = None
    ) -> RoutingTable | None:
        """Mirror a reply's handles, then hand its table on (the client takes it right after,
        with no await between). The actor sends ``view`` whenever the table's fleet is not the
        one this client said it mirrors, so the mirror is never found behind below; if it ever
        were, the view is fetched as a separate call (:meth:`keep_fleet`), as a safety net."""
        if view is not None:
            self.mirror(view)
        if table is not None and (self.fleet_mark is None or table.fleet_mark > self.fleet_mark):
            self.fleet_wanted.set()
        return table

    async def refresh_fleet(self) -> None:
        """Fetch the ledger actor's membership view and mirror it (:meth:`mirror`)."""
        view: FleetView = await self.link.call("fleet_view")
        self.fleet_refreshes += 1
        self.mirror(view)

    def mirror(self, view: FleetView) -> None:
        """Mirror ``view`` in :attr:`fleet` in place: new ids added, a handle of another actor
        replaced, ids the view lacks removed. A handle of the same actor is kept (with what its
        calls learned, e.g. that it is gone). An older view than the one mirrored (replies
        can arrive out of order) changes nothing."""
        if self.fleet_mark is not None and view.mark < self.fleet_mark:
            return
        self.fleet_hosted = view.plane
        self.fleet_mark = view.mark
        if not view.plane:
            return  # a bare ledger has no fleet: the mirror holds what its owner put there
        if apply_view(self.fleet, view.engines):
            log.info("ray.fleet_mirrored", engines=self.fleet.ids(), mark=list(view.mark))
            for listener in list(self._listeners):
                listener()

    def on_fleet_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    async def keep_fleet(self) -> None:
        """Fetch the view whenever a table or a failure said the mirror may be behind."""
        while True:
            await self.fleet_wanted.wait()
            self.fleet_wanted = anyio.Event()
            try:
                await self.refresh_fleet()
            except Exception as exc:
                # The ledger unreachable for reconnect_timeout, or an unexpected answer: the
                # mirror stays as it is (routing still says which engines are routable) and is
                # asked for again; this client's other work must not stop for it.
                log.warning("ray.fleet_refresh_failed", error=repr(exc))
                await anyio.sleep(self._retry_every)
                self.fleet_wanted.set()


class RayLedger(RemoteLedger):
    """Client of the ledger actor ``namespace/name``. Open with :meth:`connect`; safe to use
    from many tasks of one event loop (asyncio: Ray's awaitables need it)."""

    transport: RayTransport

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        name: str = DEFAULT_LEDGER_NAME,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        max_in_flight: int = 2,
        max_batch: int = 4096,
        renew_interval: float = 0.5,
        refresh_interval: float | None = None,
        reconnect_timeout: float = 60.0,
        deregister_on_exit: bool = True,
        confirm_timeout: float | None = 2.0,
    ) -> AsyncIterator[RayLedger]:
        """Resolve the actor, read the routing (with the fleet) and the status, and run the
        client for the life of the block (:meth:`RemoteLedger.running`); ``refresh_interval``
        re-reads the status that often (None: only on demand; routing comes with replies).
        ``confirm_timeout``: every turn of a worker over this client is confirmed by the
        ledger before it is sent, waiting at most that long for its answer (a Ray-restarted
        rollout actor's zombie is refused, not served; None: turns answer from memory)."""
        link = ActorLink(name, namespace=namespace, reconnect_timeout=reconnect_timeout)
        transport = RayTransport(link, retry_every=renew_interval or 0.5)
        client = cls(
            transport,
            max_in_flight=max_in_flight,
            max_batch=max_batch,
            renew_interval=renew_interval,
            refresh_interval=refresh_interval,
            confirm_timeout=confirm_timeout,
        )
        async with (
            client.running(deregister_on_exit=deregister_on_exit),
            _task(transport.keep_fleet),
        ):
            yield client

    @property
    def link(self) -> ActorLink:
        return self.transport.link

    @property
    def fleet(self) -> Fleet:
        return self.transport.fleet

    @property
    def fleet_hosted(self) -> bool:
        return self.transport.fleet_hosted

    @property
    def fleet_mark(self) -> Mark | None:
        return self.transport.fleet_mark

    @property
    def fleet_refreshes(self) -> int:
        return self.transport.fleet_refreshes

    def on_fleet_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of :attr:`fleet` (e.g. to rebuild routes)."""
        self.transport.on_fleet_change(listener)

    def engine_failed(
        self, engine_id: str, error: EngineError, /, *, session: str = "", incarnation: str = ""
    ) -> None:
        """As :meth:`RemoteLedger.engine_failed`, and fetch the membership again: the failure
        may be a replaced actor's handle."""
        self.transport.fleet_wanted.set()
        super().engine_failed(engine_id, error, session=session, incarnation=incarnation)


@asynccontextmanager
async def _task(run: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[TaskGroup]:
    """Run ``run`` in the background for the life of the block."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            yield tg
        finally:
            tg.cancel_scope.cancel()


def apply_view(fleet: Fleet, engines: Iterable[RayEngine]) -> bool:
    """Make ``fleet`` hold exactly ``engines`` (by id), changing it in place; a handle of the
    same actor as the one held is kept. Whether anything changed."""
    wanted = {engine.engine_id: engine for engine in engines}
    changed = False
    for engine_id in fleet.ids():
        if engine_id not in wanted:
            fleet.remove(engine_id)
            changed = True
    for engine_id, engine in wanted.items():
        held = fleet[engine_id] if engine_id in fleet else None  # noqa: SIM401 -- no .get
        if held is None or _actor_of(held) != _actor_of(engine):
            fleet.replace(engine)
            changed = True
    return changed


def _actor_of(engine: object) -> str:
    return getattr(engine, "actor_id", "") or f"object-{id(engine)}"
