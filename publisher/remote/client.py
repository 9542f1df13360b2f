"""The ledger, as a process other than the ledger's sees it: one remote client over a
transport (HTTP to ``loraledger serve``: :class:`~publisher.remote.http.HttpLedger`; Ray to the
ledger actor: :class:`~publisher.ray.client.RayLedger`).

A :class:`RemoteLedger` is a :class:`~publisher.sessions.LedgerPort` (``register_owner``,
``deregister_owner``, ``renew_lease``, ``execute_many``) and has a :class:`RemoteView` (its
``view``), so a :class:`~publisher.sessions.RolloutWorker`, a
:class:`~publisher.gateway.Gateway` and the OpenAI face run unchanged in another process::

    async with HttpLedger.connect(url, token=token) as ledger:
        gateway = Gateway(fleet, ledger.view, on_engine_trouble=ledger.engine_failed)
        async with RolloutWorker.open(ledger, gateway, owner="gw-1") as worker:
            ...

What differs from in process, and why, once for every transport:

* **Round trips are coalesced.** Calls made while ``max_in_flight`` round trips are already
  under way are queued and sent together, as ONE ``execute`` (group commit's idea, one hop
  earlier): many sessions binding at once cost a few round trips, not one each. A caller's
  commands are decided in the order given; calls of different callers were concurrent, so
  whatever order they are decided in is one the in-process ledger could have chosen too. Each
  caller gets its own outcome or refusal. A single call on an idle client goes out at once.
* **Lease renewals are local and forwarded.** ``renew_lease`` must be synchronous (a worker
  checks its lease right before the gateway counts a request in flight), so it records the
  renewal per life ``(owner, incarnation)`` (:mod:`publisher.remote.renewals`) and raises only
  what the client already knows (the life ended); a background task forwards the newest
  renewal of every life, at most one round trip at a time and at most every
  ``renew_interval`` seconds, and learns refusals from the reply. The counts are what the
  ledger's reclaim waits for.
* **Routing is a copy** (:class:`RemoteView`): the newest routing table any reply carried
  (every reply carries it when it changed since the caller's mark, so a bind's reply routes to
  the version it bound), and the last status read, refreshed every ``refresh_interval``
  seconds and on demand (the dispatch executor refreshes before it answers ``NO_ROUTE``).
* **Engine trouble is forwarded**: the gateway's ``on_engine_trouble`` hook is
  :meth:`RemoteLedger.engine_failed`, which sends the error in the background, at most one
  report per engine and kind in flight; the ledger's reconciler reads it.
* **A clean exit ends the owners it registered**: leaving the client's block normally
  deregisters the owners registered through it that did not deregister yet (their sessions
  still bound are released, ``owner_exited``), so a process that exits cleanly leaves no lease
  to expire; ``deregister_on_exit=False`` keeps them for a later process.
* **Lost replies**: a transport that cannot reach the ledger raises a ``ConnectionError`` (HTTP)
  or rides over a restart itself (Ray's actor link); every command sent here is idempotent in
  the ledger, so the worker's retry policy asks again.

Refusals come back as the ledger's own errors (same class and code), exactly as in process.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from engines.contract import EngineError
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger_api import TypedCommands
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.drivers.engine_ops import lacks_adapter
from publisher.logs import get_logger
from publisher.remote.renewals import Counts, Life, PendingRenewals
from publisher.remote.routing import Mark, RoutingTable
from publisher.sessions import OWNER_LOST_CODES

log = get_logger("loraledger.remote")


@dataclass(frozen=True)
class Answered:
    """A transport's answer to a group of commands: outcomes and refusals in place, and the
    routing if it changed since the caller's mark."""

    results: list[Outcome | LoraLedgerError]
    routing: RoutingTable | None


@dataclass(frozen=True)
class Renewed:
    """A transport's answer to renewals: the lives the ledger refused, and the routing."""

    lost: dict[Life, LoraLedgerError]
    routing: RoutingTable | None


class Transport(Protocol):
    """How a remote ledger's calls reach the ledger: the same calls over HTTP or Ray."""

    async def execute(self, commands: Sequence[c.Command], mark: Mark | None) -> Answered: ...

    async def register_owner(
        self, owner: str, ttl_s: float, incarnation: str, sessions_idle_s: float | None
    ) -> Done: ...

    async def deregister_owner(self, owner: str, incarnation: str) -> Deregistered: ...

    async def renew(
        self,
        lives: Mapping[Life, Counts],
        mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]],
    ) -> Renewed: ...

    async def routing(self) -> RoutingTable: ...

    async def status(self) -> LedgerStatus: ...

    async def report_trouble(self, engine_id: str, error: EngineError) -> None: ...


class RemoteView:
    """A :class:`~publisher.gateway.LedgerView` of a ledger in another process: the newest
    routing table seen and the last status read (see the module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._table: RoutingTable | None = None
        self._status: LedgerStatus | None = None
        self._refreshing: tuple[anyio.Event, list[Exception]] | None = None
        self.refreshes = 0

    @property
    def mark(self) -> Mark | None:
        return None if self._table is None else self._table.mark

    @property
    def table(self) -> RoutingTable | None:
        return self._table

    def take(self, table: RoutingTable | None) -> None:
        """Keep ``table`` if it is newer than the one held (replies can arrive out of order
        when several calls are in flight)."""
        if table is not None and (self._table is None or table.mark > self._table.mark):
            self._table = table

    def holders(self, lora_name: str) -> tuple[str, ...]:
        return () if self._table is None else self._table.holders.get(lora_name, ())

    @property
    def default_revision(self) -> int:
        return 0 if self._table is None else self._table.default_revision

    @property
    def max_staleness(self) -> int | None:
        return None if self._table is None else self._table.max_staleness

    def incarnation(self, engine: str) -> str:
        return "" if self._table is None else self._table.incarnations.get(engine, "")

    def status(self) -> LedgerStatus:
        if self._status is None:
            raise LedgerError(Code.LEDGER_CLOSED, "no status read from the ledger yet")
        return self._status

    def knows_unbound(self, session: str) -> bool:
        """Never: the status lists no sessions (another process may have bound any of them),
        so the OpenAI face lets the bind answer (docs/openai.md, "Sessions and model")."""
        return False

    async def refresh(self) -> None:
        """Read the routing and the status now; callers during a read wait for that one and
        hear its failure too (a waiter must not take an old copy for a fresh one)."""
        if self._refreshing is not None:
            done, failure = self._refreshing
            await done.wait()
            if failure:
                raise failure[0]
            return
        done, failure = anyio.Event(), []
        self._refreshing = (done, failure)
        try:
            table = await self._transport.routing()
            self._status = await self._transport.status()
            self.take(table)
            self.refreshes += 1
        except BaseException as exc:
            failure.append(
                exc
                if isinstance(exc, Exception)
                else LedgerError(Code.LEDGER_CLOSED, "the refresh was cancelled")
            )
            raise
        finally:
            self._refreshing = None
            done.set()


class _Request:
    """One caller's commands and where their answers land."""

    __slots__ = ("commands", "done", "error", "results")

    def __init__(self, commands: list[c.Command]) -> None:
        self.commands = commands
        self.done = anyio.Event()
        self.results: list[Outcome | LoraLedgerError] | None = None
        self.error: BaseException | None = None


class RemoteLedger(TypedCommands):
    """A ledger in another process, over ``transport``. Run it with :meth:`running` (the
    transports' ``connect`` do); safe to use from many tasks of one event loop. The typed
    session commands (``bind``, ``release``, ``forget``) are the in-process ledger's own."""

    def __init__(
        self,
        transport: Transport,
        *,
        max_in_flight: int = 2,
        max_batch: int = 4096,
        renew_interval: float = 0.5,
        refresh_interval: float | None = 1.0,
    ) -> None:
        if max_in_flight < 1 or max_batch < 1:
            raise InvalidInput(INVALID_INPUT, "max_in_flight and max_batch must be >= 1")
        for name, value in (
            ("renew_interval", renew_interval),
            ("refresh_interval", refresh_interval),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise InvalidInput(INVALID_INPUT, f"{name} must be a finite number >= 0")
        self.transport = transport
        self.view = RemoteView(transport)
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.renew_interval = renew_interval
        self.refresh_interval = refresh_interval
        self._queue: deque[_Request] = deque()
        self._senders = 0
        self._tg: TaskGroup | None = None
        self._renewals = PendingRenewals()
        self._registered: dict[str, str] = {}  # owner -> incarnation, until it deregisters
        self._reporting: set[tuple[str, bool]] = set()  # (engine, lacks the adapter) in flight
        self.round_trips = 0  # command round trips sent (coalescing shows here)
        self.renewals_sent = 0

    @asynccontextmanager
    async def running(self, *, deregister_on_exit: bool = True) -> AsyncIterator[None]:
        """Read the view once (a wrong address or credential fails here, not on the first
        turn), then run the renewal and refresh tasks for the life of the block; calls still
        waiting when it exits fail with ``LEDGER_CLOSED``. A normal exit deregisters the owners
        registered here (module docstring), and the last renewals are forwarded."""
        await self.view.refresh()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._renewer)
                if self.refresh_interval:
                    tg.start_soon(self._refresher, self.refresh_interval)
                try:
                    yield
                    if deregister_on_exit:
                        await self._deregister_remaining()
                finally:
                    self._tg = None
                    with anyio.CancelScope(shield=True):
                        await self._forward_renewals()  # the last counts (usually all zero)
                    tg.cancel_scope.cancel()
        finally:
            self._fail_queued(LedgerError(Code.LEDGER_CLOSED, "the ledger client was closed"))

    # --- commands ------------------------------------------------------------------------------

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """Decide a group in one round trip (or fewer: it may share one with other callers).
        Refusals come back in place, as in process; a transport failure is raised."""
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

    async def status(self) -> LedgerStatus:
        """The ledger's status, read now (one round trip; ``view.status()`` is the copy)."""
        return await self.transport.status()

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
                    answered = await self.transport.execute(commands, self.view.mark)
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
                self.view.take(answered.routing)
                start = 0
                for request in group:
                    end = start + len(request.commands)
                    request.results = answered.results[start:end]
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
        self,
        owner: str,
        *,
        ttl_s: float = 30.0,
        incarnation: str = "",
        sessions_idle_s: float | None = None,
    ) -> Done:
        """Register ``owner``'s life ``incarnation`` (idempotent for the same one);
        ``sessions_idle_s``: a relay's (its sessions are client-held)."""
        done = await self.transport.register_owner(owner, ttl_s, incarnation, sessions_idle_s)
        self._renewals.registered((owner, incarnation))
        self._registered[owner] = incarnation
        return done

    async def deregister_owner(self, owner: str, *, incarnation: str = "") -> Deregistered:
        """A clean exit: the ledger releases the owner's sessions still bound
        (``owner_exited``) and no renewal of it is forwarded any more (idempotent)."""
        outcome = await self.transport.deregister_owner(owner, incarnation)
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
            except (LoraLedgerError, ConnectionError) as exc:
                self._registered.pop(owner, None)
                if not isinstance(exc, LoraLedgerError) or exc.code not in OWNER_LOST_CODES:
                    log.warning("remote.deregister_failed", owner=owner, error=str(exc))

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
    ) -> None:
        """Record a renewal of ``owner`` (its life ``incarnation``) with its in-flight counts
        per (engine, version) and the client-held ``sessions`` it had a turn of, and have it
        forwarded. Raises the refusal (``LEASE_EXPIRED``, ``OWNER_RESTARTED``, ...) once the
        ledger refused a renewal of this life."""
        self._renewals.record(owner, incarnation, inflight, sessions)

    async def _renewer(self) -> None:
        while True:
            await self._renewals.wanted.wait()
            await self._forward_renewals()
            await anyio.sleep(self.renew_interval)

    async def _forward_renewals(self) -> None:
        lives = self._renewals.take()
        sessions = self._renewals.take_sessions()
        if not lives:
            return
        try:
            renewed = await self.transport.renew(lives, self.view.mark, sessions)
        except Exception as exc:
            # Unreachable, refused as a whole, or an answer not understood: keep the newest
            # renewals for next time (the client's other work must not stop for it).
            log.warning("remote.renew_failed", error=repr(exc))
            for life, counts in lives.items():
                self._renewals.keep(life, counts, sessions.get(life, ()))
            return
        self.renewals_sent += 1
        for life, error in renewed.lost.items():
            if error.code in OWNER_LOST_CODES:
                self._renewals.refused(life, error)
            else:
                log.warning("remote.renew_refused", owner=life[0], code=error.code)
        self.view.take(renewed.routing)

    # --- engine trouble ----------------------------------------------------------------------

    def engine_failed(self, engine_id: str, error: EngineError) -> None:
        """A generation on ``engine_id`` failed in a way that says something about the engine
        (the gateway's ``on_engine_trouble`` hook): tell the ledger's process, whose
        reconciler reads it.

        Synchronous and never raising: the gateway calls it on the path of a failing request,
        which must not wait for, or fail because of, a hint. At most one report per engine
        and kind (lacks the adapter or not) is in flight, so a flood of failures is one round
        trip at a time and a report of one kind never hides one of the other. A report that
        is lost or refused is logged: the ledger's own probes and full passes find what it
        said."""
        key = (engine_id, lacks_adapter(error))
        if self._tg is None or key in self._reporting:
            return
        self._reporting.add(key)
        self._tg.start_soon(self._report, key, error)

    async def _report(self, key: tuple[str, bool], error: EngineError) -> None:
        try:
            await self.transport.report_trouble(key[0], error)
        except Exception as exc:  # only a hint: the ledger's own probes find what it said
            log.warning("remote.trouble_report_failed", engine=key[0], error=repr(exc))
        finally:
            self._reporting.discard(key)

    # --- the view --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the routing and the status now (``view.refresh``)."""
        await self.view.refresh()

    async def _refresher(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            try:
                await self.view.refresh()
            except Exception as exc:  # the next tick reads again; routing still comes with replies
                log.warning("remote.refresh_failed", error=repr(exc))
