"""RayLedger: the ledger, as a process other than the ledger actor sees it.

It has the API rollout code uses in process -- it is a
:class:`~publisher.sessions.LedgerPort` (``register_owner``, ``deregister_owner``,
``renew_lease``, ``execute_many``) plus ``execute`` and the session commands (``bind``, ``release``,
``forget``) -- and it provides the :class:`~publisher.gateway.RoutingView` a gateway needs
(:attr:`RayLedger.routing`). So a :class:`~publisher.sessions.RolloutWorker` and a
:class:`~publisher.gateway.Gateway` run unchanged in a Ray actor::

    async with RayLedger.connect("ledger") as ledger:
        gateway = Gateway(ledger.fleet, ledger.routing, gateway_id="w1",
                          on_engine_trouble=ledger.engine_failed)
        async with RolloutWorker.open(ledger, gateway, owner="w1") as worker:
            served = await worker.session("s1").generate(prompt)

Three things differ from in process, each for a reason:

* **Round trips are coalesced.** Calls made while ``max_in_flight`` round trips are already
  under way are queued and sent together, as ONE ``execute_many`` (group commit's idea, one
  hop earlier): many sessions binding at once cost a few Ray round trips, not one each. A
  caller's commands are decided in the order given; calls of different callers were
  concurrent, so whatever order they are decided in is one the in-process ledger could have
  chosen too. Each caller gets its own outcome or refusal. A single call on an idle client
  goes out at once.
* **Lease renewals are local and forwarded.** ``renew_lease`` must be synchronous (a worker
  checks its lease right before the gateway counts a request in flight), so it records the
  renewal and raises only what the client already knows (the owner expired); a background task
  forwards the newest renewal of every owner's life (``(owner, incarnation)``: see
  publisher/renewals.py) to the ledger, at most one round trip at a time
  and at most every ``renew_interval`` seconds, and learns expiries from the reply. A worker
  therefore learns it lost its lease one renewal later than in process.
* **The fleet is the ledger's.** :attr:`RayLedger.fleet` is a :class:`~publisher.fleet.Fleet`
  mirroring the ledger actor's engine handles (its membership view, fetched at connect) and
  changed in place, so a gateway built on ``ledger.fleet`` routes to a replacement actor
  without a restart of its process. Each command batch and lease renewal tells the actor which
  fleet version the mirror holds (:attr:`fleet_mark`), and a reply whose routing comes from a
  newer one carries the new handles too, mirrored *before* the table is taken
  (:meth:`_routing_seen`): the handles a gateway dispatches to are never older than the
  routing it chose by, so a turn routed on a table from after a ``replace_engine`` -- a
  session's first turn, routed on its bind's reply, included -- never meets the replaced
  actor's handle. (Fetched afterwards, as a separate call, the handle arrived one round trip
  after the table, and such a first turn could meet the dead actor: ``AMBIGUOUS_DISPATCH``,
  never resent.) A failed engine call reported through :meth:`engine_failed` (the gateway's
  ``on_engine_trouble`` hook) also refreshes the mirror, and goes to the ledger actor's
  reconciler (:meth:`~publisher.reconciler.Reconciler.engine_trouble`), which probes the engine
  at once (a dead actor is suspended at its first failed probe) or, for a refusal saying it
  lacks the adapter, reads its inventory at once (a lost adapter is recorded and routed around).
* **A clean exit ends the owners it registered.** Leaving :meth:`RayLedger.connect` normally
  deregisters every owner registered through this client and not deregistered yet (their
  sessions still bound are released, ``owner_exited``), so a process that exits cleanly leaves
  no lease to expire. (A :class:`~publisher.sessions.RolloutWorker` already deregistered itself
  when its own block ended.) ``deregister_on_exit=False`` keeps them for a later process.
* **Restarts are ridden out.** Every call goes through an
  :class:`~publisher.ray.link.ActorLink`: across a ledger restart it is sent again (every
  ledger command is idempotent: a bind answers the same binding, a release ``released=False``)
  until ``reconnect_timeout``; only then do callers get ``LEDGER_CLOSED``.

Refusals are raised (or returned in place by ``execute_many``) as the same errors, with their
class and ``code``, exactly as in process.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from anyio.abc import TaskGroup

from engines.contract import EngineError
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError
from projections.status import LedgerStatus
from publisher import commands as c
from publisher.errors import Code, LedgerError
from publisher.fleet import Fleet
from publisher.gateway import lacks_adapter
from publisher.logs import get_logger
from publisher.outcomes import Bound, Deregistered, Done, Forgotten, Outcome, Released
from publisher.ray.engine import RayEngine
from publisher.ray.ledger_actor import DEFAULT_LEDGER_NAME, FleetView, RenewReply, Reply
from publisher.ray.link import DEFAULT_NAMESPACE, ActorLink
from publisher.ray.routing import Mark, RemoteRouting, RoutingTable
from publisher.renewals import PendingRenewals
from publisher.sessions import OWNER_LOST_CODES

log = get_logger("loraledger.ray")
OutcomeT = TypeVar("OutcomeT", bound=Outcome)


class _Request:
    """One caller's commands and where their answers land."""

    __slots__ = ("commands", "done", "error", "results")

    def __init__(self, commands: list[c.Command]) -> None:
        self.commands = commands
        self.done = anyio.Event()
        self.results: list[Outcome | LoraLedgerError] | None = None
        self.error: BaseException | None = None


class RayLedger:
    """Client of the ledger actor ``namespace/name``. Open with :meth:`connect`; safe to use
    from many tasks of one event loop (asyncio: Ray's awaitables need it)."""

    def __init__(
        self,
        name: str = DEFAULT_LEDGER_NAME,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        max_in_flight: int = 2,
        max_batch: int = 4096,
        renew_interval: float = 0.5,
        reconnect_timeout: float = 60.0,
    ) -> None:
        if max_in_flight < 1 or max_batch < 1:
            raise InvalidInput(INVALID_INPUT, "max_in_flight and max_batch must be >= 1")
        if not (math.isfinite(renew_interval) and renew_interval >= 0):
            raise InvalidInput(INVALID_INPUT, "renew_interval must be a finite >= 0")
        self.link = ActorLink(name, namespace=namespace, reconnect_timeout=reconnect_timeout)
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.renew_interval = renew_interval
        self.routing = RemoteRouting()
        self._queue: deque[_Request] = deque()
        self._senders = 0
        self._tg: TaskGroup | None = None
        self._renewals = PendingRenewals()
        self._registered: dict[str, str] = {}  # owner -> incarnation, until it deregisters
        self.round_trips = 0  # execute_many round trips sent (coalescing shows here)
        self.fleet = Fleet()  # mirrors the ledger actor's handles (see the module docstring)
        self.fleet_mark: Mark | None = None  # (epoch, version) of the view mirrored
        self.fleet_refreshes = 0  # views fetched (observability, tests)
        self.fleet_hosted = False  # whether the ledger actor hosts a plane (has a fleet)
        self._fleet_wanted = anyio.Event()
        self._fleet_listeners: list[Callable[[], None]] = []
        # (engine, lacks the adapter) whose trouble report is on its way
        self._reported: set[tuple[str, bool]] = set()

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
        reconnect_timeout: float = 60.0,
        deregister_on_exit: bool = True,
    ) -> AsyncIterator[RayLedger]:
        """Resolve the actor, fetch the routing, and run the sender and renewal tasks for the
        life of the block (calls still waiting when it exits fail with ``LEDGER_CLOSED``). A
        normal exit deregisters the owners registered here (see the module docstring)."""
        client = cls(
            name,
            namespace=namespace,
            max_in_flight=max_in_flight,
            max_batch=max_batch,
            renew_interval=renew_interval,
            reconnect_timeout=reconnect_timeout,
        )
        await client.refresh_routing()  # and the fleet: the mirror is empty (fleet_mark None)
        async with anyio.create_task_group() as tg:
            client._tg = tg
            tg.start_soon(client._renewer)
            tg.start_soon(client._fleet_keeper)
            try:
                yield client
                if deregister_on_exit:
                    await client._deregister_remaining()
            finally:
                client._tg = None
                tg.cancel_scope.cancel()
        client._fail_queued(LedgerError(Code.LEDGER_CLOSED, "the ledger client was closed"))

    # --- commands ------------------------------------------------------------------------------

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """Decide a group in one round trip (or fewer: it may share one with other callers).
        Refusals come back in place, as in process."""
        if not commands:
            return []
        if self._tg is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger client is not connected")
        request = _Request(list(commands))
        self._queue.append(request)
        if self._senders < self.max_in_flight:
            self._senders += 1
            self._tg.start_soon(self._sender)
        await request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.results is not None
        return request.results

    async def execute(self, command: c.Command) -> Outcome:
        """Decide one command; a refusal is raised (a ``LoraLedgerError``)."""
        result = (await self.execute_many([command]))[0]
        if isinstance(result, LoraLedgerError):
            raise result
        return result

    async def _typed(self, command: c.Command, kind: type[OutcomeT]) -> OutcomeT:
        outcome = await self.execute(command)
        if not isinstance(outcome, kind):
            raise LedgerError(Code.INVALID_STATE, f"{type(command).__name__} answered {outcome!r}")
        return outcome

    async def bind(self, session: str, owner: str, *, incarnation: str = "") -> Bound:
        return await self._typed(
            c.Bind(session=session, owner=owner, incarnation=incarnation), Bound
        )

    async def release(
        self, session: str, owner: str, *, cause: str = "closed", incarnation: str = ""
    ) -> Released:
        command = c.Release(session=session, owner=owner, cause=cause, incarnation=incarnation)
        return await self._typed(command, Released)

    async def forget(self, sessions: Iterable[str]) -> Forgotten:
        return await self._typed(c.Forget(sessions=tuple(sessions)), Forgotten)

    async def _sender(self) -> None:
        """Send everything queued, a batch at a time, until the queue is empty."""
        try:
            while self._queue:
                group = [self._queue.popleft()]
                size = len(group[0].commands)
                while self._queue and size + len(self._queue[0].commands) <= self.max_batch:
                    size += len(self._queue[0].commands)
                    group.append(self._queue.popleft())
                commands = [command for request in group for command in request.commands]
                try:
                    self.round_trips += 1
                    reply: Reply = await self.link.call(
                        "execute_many", commands, self.routing.mark, self.fleet_mark
                    )
                except BaseException as exc:
                    cause = (
                        LedgerError(Code.LEDGER_CLOSED, "the ledger client was closed")
                        if isinstance(exc, anyio.get_cancelled_exc_class())
                        else exc
                    )
                    for request in group:
                        request.error = cause
                        request.done.set()
                    if cause is not exc:
                        raise
                    continue
                self._routing_seen(reply.routing, reply.fleet)
                start = 0
                for request in group:
                    end = start + len(request.commands)
                    request.results = reply.results[start:end]
                    start = end
                    request.done.set()
        finally:
            self._senders -= 1

    def _fail_queued(self, error: LoraLedgerError) -> None:
        while self._queue:
            request = self._queue.popleft()
            request.error = error
            request.done.set()

    # --- owners and leases -----------------------------------------------------------------------

    async def register_owner(
        self, owner: str, *, ttl_s: float = 30.0, incarnation: str = ""
    ) -> Done:
        """Register ``owner``'s life ``incarnation`` (idempotent for the same one: the link
        may send it again across a ledger restart)."""
        outcome: Done = await self.link.call("register_owner", owner, ttl_s, incarnation)
        self._renewals.registered((owner, incarnation))
        self._registered[owner] = incarnation
        return outcome

    async def deregister_owner(self, owner: str, *, incarnation: str = "") -> Deregistered:
        """A clean exit: the ledger releases the owner's sessions still bound
        (``owner_exited``) and no renewal of it is forwarded any more (idempotent)."""
        outcome: Deregistered = await self.link.call("deregister_owner", owner, incarnation)
        self._renewals.ended((owner, incarnation))
        if self._registered.get(owner) == incarnation:
            del self._registered[owner]
        return outcome

    async def _deregister_remaining(self) -> None:
        """End every life registered here that did not end yet. Best effort: a life that
        ended otherwise (replaced, expired) has nothing to end, and a ledger out of reach
        leaves the rest to their leases (logged)."""
        for owner, incarnation in list(self._registered.items()):
            try:
                await self.deregister_owner(owner, incarnation=incarnation)
            except LoraLedgerError as exc:
                self._registered.pop(owner, None)
                if exc.code not in OWNER_LOST_CODES:
                    log.warning("ray.deregister_failed", owner=owner, error=exc.message)

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
    ) -> None:
        """Record a renewal of ``owner`` (its life ``incarnation``) with its in-flight counts
        per (engine, version) and have it forwarded (see the module docstring). Raises the
        refusal (``LEASE_EXPIRED``, ``OWNER_RESTARTED``, ...) once the ledger refused a renewal
        of this life (see publisher/renewals.py)."""
        self._renewals.record(owner, incarnation, inflight)

    async def _renewer(self) -> None:
        while True:
            await self._renewals.wanted.wait()
            renewals = self._renewals.take()
            try:
                reply: RenewReply = await self.link.call(
                    "renew_leases", renewals, self.routing.mark, self.fleet_mark
                )
            except LoraLedgerError as exc:
                # Unreachable for reconnect_timeout: keep the newest renewals for next time.
                log.warning("ray.renew_failed", error=exc.message)
                for life, counts in renewals.items():
                    self._renewals.keep(life, counts)
            else:
                for life, error in reply.lost.items():
                    self._renewals.refused(life, error)
                self._routing_seen(reply.routing, reply.fleet)
            await anyio.sleep(self.renew_interval)

    # --- reads -------------------------------------------------------------------------------

    async def refresh_routing(self) -> None:
        """Fetch the current routing now (replies carry it anyway when it changed). A table
        from a fleet newer than the mirror is taken only once the view is fetched too (the
        view asked for after the table is at least as new), for the reason of
        :meth:`_routing_seen`."""
        table: RoutingTable = await self.link.call("routing")
        if self.fleet_mark is None or table.fleet_mark > self.fleet_mark:
            await self.refresh_fleet()
        self._routing_seen(table)

    async def status(self) -> LedgerStatus:
        """The ledger's status (one round trip; in process this read is local)."""
        return await self.link.call("status")  # type: ignore[no-any-return]

    # --- the fleet, as the ledger actor has it --------------------------------------------------

    def _routing_seen(self, table: RoutingTable | None, view: FleetView | None = None) -> None:
        """Take a reply's routing and handles, the handles first and with no await between:
        a gateway reads both synchronously when it chooses and dispatches, and a table that
        routes to an engine again (a replacement, repaired) must never be read next to the
        replaced actor's handle. The actor sends ``view`` whenever the table's fleet is not the
        one this client said it mirrors, so the mirror is never found behind below; if it ever
        were, the view is fetched as a separate call (the keeper), as a safety net."""
        if view is not None:
            self._mirror(view)
        self.routing.update(table)
        current = self.routing.table
        if current is not None and (
            self.fleet_mark is None or current.fleet_mark > self.fleet_mark
        ):
            self._fleet_wanted.set()

    async def refresh_fleet(self) -> None:
        """Fetch the ledger actor's membership view and mirror it (:meth:`_mirror`)."""
        view: FleetView = await self.link.call("fleet_view")
        self.fleet_refreshes += 1
        self._mirror(view)

    def _mirror(self, view: FleetView) -> None:
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
        changed = apply_view(self.fleet, view.engines)
        if changed:
            log.info("ray.fleet_mirrored", engines=self.fleet.ids(), mark=list(view.mark))
            for listener in list(self._fleet_listeners):
                listener()

    def on_fleet_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of :attr:`fleet` (e.g. to rebuild routes)."""
        self._fleet_listeners.append(listener)

    def engine_failed(self, engine_id: str, error: EngineError) -> None:
        """A generation on ``engine_id`` failed in a way that says something about the engine
        (the gateway's ``on_engine_trouble`` hook): fetch the membership again (the failure may
        be a replaced actor's handle) and send ``error`` itself to the ledger actor, whose
        reconciler reads it (:meth:`~publisher.reconciler.Reconciler.engine_trouble`: a missing
        adapter gets the engine's inventory read, anything else a probe). At most one report
        per engine and kind (lacks the adapter or not) in flight: a report of one kind never
        hides one of the other. Synchronous: it only schedules the work on this client's task
        group."""
        self._fleet_wanted.set()
        key = (engine_id, lacks_adapter(error))
        if self._tg is None or key in self._reported:
            return
        self._reported.add(key)
        self._tg.start_soon(self._report, key, error)

    async def _report(self, key: tuple[str, bool], error: EngineError) -> None:
        engine_id = key[0]
        try:
            await self.link.call("engine_failed", engine_id, error)
        except LoraLedgerError as exc:
            log.warning("ray.engine_report_failed", engine=engine_id, error=exc.message)
        finally:
            self._reported.discard(key)

    async def _fleet_keeper(self) -> None:
        """Fetch the view whenever a table or a failure said the mirror may be behind."""
        while True:
            await self._fleet_wanted.wait()
            self._fleet_wanted = anyio.Event()
            try:
                await self.refresh_fleet()
            except Exception as exc:
                # The ledger unreachable for reconnect_timeout, or an unexpected answer: the
                # mirror stays as it is (routing still says which engines are routable) and is
                # asked for again; this client's other work must not stop for it.
                log.warning("ray.fleet_refresh_failed", error=repr(exc))
                await anyio.sleep(self.renew_interval)
                self._fleet_wanted.set()


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
