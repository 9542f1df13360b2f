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
  ledger's reclaim waits for: a request on an engine and version whose count the ledger may
  hold at zero is not sent before its renewal was answered (``confirm_lease``, at most
  ``count_timeout``), later ones ride the interval (:mod:`publisher.remote.renewals`).
* **Routing is a copy** (:class:`RemoteView`): the newest routing table any reply carried
  (every reply carries it when it changed since the caller's mark, so a bind's reply routes to
  the version it bound), and the last status read, refreshed every ``refresh_interval``
  seconds and on demand (the dispatch executor refreshes before it answers ``NO_ROUTE``).
  Between replies, a long poll (:meth:`Transport.wait_routing`, one call in flight) brings
  every change of routing as it happens: an engine's outage recorded by the ledger leaves this
  process's routing within moments, whether or not this process talks to the ledger.
* **A turn is confirmed by the ledger before it is sent** (``confirm_timeout`` set; Ray's
  clients set it): a remote ``renew_lease`` answers from memory, so a worker the ledger has
  just ended (a zombie whose successor registered, its sessions released) would otherwise send
  one more turn before a forwarded renewal brought the refusal back.
  :meth:`RemoteLedger.confirm_lease` forwards the life's renewal at once and waits for the
  ledger's answer to it; every caller waiting meanwhile shares that round trip. A ledger that
  does not answer within ``confirm_timeout`` is taken as out of reach, and turns go on under
  the last answer until a renewal is answered again: sessions already bound keep generating
  through a ledger outage, and a refusal the ledger decided just before it went away reaches
  the worker when it is back.
* **Engine trouble is forwarded**: the gateway's ``on_engine_trouble`` hook is
  :meth:`RemoteLedger.engine_failed`, which sends the error in the background, at most one
  report per engine and kind in flight; the failed turns counted meanwhile, per session, go
  with the next report; the ledger's reconciler reads it.
* **A clean exit ends the owners it registered**: leaving the client's block normally
  deregisters the owners registered through it that did not deregister yet (their sessions
  still bound are released, ``owner_exited``), so a process that exits cleanly leaves no lease
  to expire; ``deregister_on_exit=False`` keeps them for a later process.
* **Provenance goes to the ledger's process** (:meth:`RemoteLedger.store_provenance`, the sink
  :meth:`RemoteLedger.provenance_sink` a recorder writes through): rows of concurrent callers
  travel in one round trip, and a batch is sent again -- after a lost reply, an unreachable or
  restarting ledger -- until its store acknowledges it, so a row arrives at least once and is
  stored once (its ``row_id`` is the store's key). Meanwhile the recorder's buffer holds the
  rows: a generation waits only when that buffer is full, as for any slow sink.
* **Lost replies**: a transport that cannot reach the ledger raises a ``ConnectionError`` (HTTP)
  or rides over a restart itself (Ray's actor link); every command sent here is idempotent in
  the ledger, so the worker's retry policy asks again.

Refusals come back as the ledger's own errors (same class and code), exactly as in process.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import anyio
import msgspec
from anyio.abc import TaskGroup

from engines.contract import EngineError
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, StoreCode
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger_api import TypedCommands
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.drivers.engine_ops import lacks_adapter
from publisher.drivers.trouble import FailureTally, says_unreachable
from publisher.gateway.provenance import ProvenanceRow
from publisher.logs import get_logger
from publisher.remote.renewals import Counts, Life, PendingRenewals
from publisher.remote.routing import Mark, RoutingTable
from publisher.remote.service import TroubleBatch
from publisher.sessions import OWNER_LOST_CODES

log = get_logger("loraledger.remote")
T = TypeVar("T")

# Refusals that mean "not now" for a batch of provenance rows: it is sent again until stored.
RESEND_PROVENANCE_ON = frozenset(
    {Code.LEDGER_CLOSED, Code.FENCED, StoreCode.STORE_FAILED, StoreCode.STORE_CLOSED}
)


@dataclass(frozen=True)
class Answered:
    """A transport's answer to a group of commands: outcomes and refusals in place, and the
    routing if it changed since the caller's mark."""

    results: list[Outcome | LoraLedgerError]
    routing: RoutingTable | None


@dataclass
class _Round:
    """One forward of renewals: set ``done`` when it ended, ``answered`` if the ledger answered
    it, with its refusals by life (every code, not only the ones that end an owner)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    answered: bool = False
    refused: dict[Life, LoraLedgerError] = field(default_factory=dict)


@dataclass(frozen=True)
class Renewed:
    """A transport's answer to renewals: the lives the ledger refused, and the routing."""

    lost: dict[Life, LoraLedgerError]
    routing: RoutingTable | None


class Transport(Protocol):
    """How a remote ledger's calls reach the ledger: the same calls over HTTP or Ray."""

    async def execute(self, commands: Sequence[c.Command], mark: Mark | None) -> Answered: ...

    async def register_owner(
        self,
        owner: str,
        ttl_s: float,
        incarnation: str,
        sessions_idle_s: float | None,
        secret: str,
    ) -> Done: ...

    async def deregister_owner(self, owner: str, incarnation: str, secret: str) -> Deregistered: ...

    async def renew(
        self,
        lives: Mapping[Life, Counts],
        mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]],
        secrets: Mapping[Life, str],
    ) -> Renewed:
        """Forward each life's renewal with its secret (``secrets``)."""
        ...

    async def routing(self) -> RoutingTable: ...

    async def wait_routing(self, mark: Mark | None, wait_s: float) -> RoutingTable | None:
        """The routing as soon as it is not the table ``mark`` names, or within ``wait_s``
        seconds whatever it is (None: unchanged)."""
        ...

    async def status(self) -> LedgerStatus: ...

    async def report_trouble(
        self, engine_id: str, error: EngineError, batch: TroubleBatch
    ) -> None: ...

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> int: ...


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


# How long one long poll for the routing waits at the ledger before it answers unchanged: a
# fraction of every transport's timeout, so an idle poll never looks like a lost ledger.
WATCH_WAIT_S = 5.0
# How long the long poll waits before it asks again after a failure (the ledger restarting).
_RETRY_WATCH_S = 1.0


class _Trouble:
    """One engine's trouble of one kind, not reported yet: the first error and when it was
    seen, the life it was routed to, the failed turns counted per session since."""

    __slots__ = ("error", "incarnation", "seen", "tally")

    def __init__(self) -> None:
        self.error: EngineError | None = None
        self.incarnation = ""
        self.seen = 0.0
        self.tally = FailureTally()


class _Request(Generic[T]):
    """One caller's items (commands, provenance rows) and where their answers land."""

    __slots__ = ("done", "error", "items", "results")

    def __init__(self, items: list[T]) -> None:
        self.items = items
        self.done = anyio.Event()
        self.results: list[Outcome | LoraLedgerError] | None = None  # a command's answers
        self.error: BaseException | None = None


class LedgerSink:
    """A recorder's sink that sends its rows to the ledger's process
    (:meth:`RemoteLedger.store_provenance`): ``ProvenanceRecorder(ledger.provenance_sink())``."""

    def __init__(self, ledger: RemoteLedger) -> None:
        self.ledger = ledger

    async def write(self, rows: Sequence[ProvenanceRow]) -> None:
        await self.ledger.store_provenance(rows)


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
        confirm_timeout: float | None = None,
        count_timeout: float = 2.0,
    ) -> None:
        if max_in_flight < 1 or max_batch < 1:
            raise InvalidInput(INVALID_INPUT, "max_in_flight and max_batch must be >= 1")
        for name, value in (
            ("renew_interval", renew_interval),
            ("refresh_interval", refresh_interval),
            ("confirm_timeout", confirm_timeout),
            ("count_timeout", count_timeout),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise InvalidInput(INVALID_INPUT, f"{name} must be a finite number >= 0")
        self.transport = transport
        self.view = RemoteView(transport)
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.renew_interval = renew_interval
        self.refresh_interval = refresh_interval
        self.confirm_timeout = confirm_timeout  # None: turns are not confirmed (module docstring)
        self.count_timeout = count_timeout  # how long a count the ledger has not seen is awaited
        self._queue: deque[_Request[c.Command]] = deque()
        self._senders = 0
        self._tg: TaskGroup | None = None
        self._renewals = PendingRenewals()
        self._registered: dict[str, str] = {}  # owner -> incarnation, until it deregisters
        # Each life's secret (its worker's), sent with every call for it; never logged.
        self._secrets: dict[Life, str] = {}
        # (engine, kind) -> what is not reported yet; a key present in _reporting has a sender
        self._trouble: dict[tuple[str, str], _Trouble] = {}
        self._reporting: set[tuple[str, str]] = set()
        self.routing_polls = 0  # long polls answered (observability, tests)
        self._rows: deque[_Request[ProvenanceRow]] = deque()
        self._sending_rows = False
        self.round_trips = 0  # command round trips sent (coalescing shows here)
        self.renewals_sent = 0
        self.provenance_round_trips = 0  # rows' round trips, resends included
        self.provenance_resend_s = (0.1, 5.0)  # first and longest wait before a resend
        self._next_round = _Round()  # the forward that will carry the renewals pending now
        self._urgent = anyio.Event()  # a confirmation waits: forward without the interval
        self._unanswered = False  # the last forward, or a confirmation, got no answer in time
        self.unconfirmed = 0  # confirmations that went on without the ledger's answer

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
                tg.start_soon(self._watch_routing)
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
        request = _Request([self._proven(command) for command in commands])
        self._queue.append(request)
        if self._senders < self.max_in_flight:
            self._senders += 1
            self._tg.start_soon(self._sender)
        await request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.results is not None
        return request.results

    def _proven(self, command: c.Command) -> c.Command:
        """A bind or release for a life registered through this client, carrying its secret
        (the caller's own, or the one this client keeps for the life)."""
        if not isinstance(command, c.Bind | c.Release) or command.secret:
            return command
        incarnation = command.incarnation or self._registered.get(command.owner, "")
        secret = self._secrets.get((command.owner, incarnation))
        return command if secret is None else msgspec.structs.replace(command, secret=secret)

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
        """Send every queued command, a batch at a time, until the queue is empty."""
        try:
            await self._drain(self._queue, self._execute_group)
        finally:
            self._senders -= 1

    async def _execute_group(self, group: list[_Request[c.Command]]) -> None:
        commands = [command for request in group for command in request.items]
        self.round_trips += 1
        answered = await self.transport.execute(commands, self.view.mark)
        self.view.take(answered.routing)
        start = 0
        for request in group:
            end = start + len(request.items)
            request.results = answered.results[start:end]
            start = end
            request.done.set()

    async def _drain(
        self,
        queue: deque[_Request[T]],
        send: Callable[[list[_Request[T]]], Awaitable[None]],
    ) -> None:
        """Coalesce: hand ``send`` the callers queued, a group of at most ``max_batch`` items
        at a time, until the queue is empty; ``send`` answers its group. When it fails, every
        caller of the group hears why (a cancellation as ``LEDGER_CLOSED``, then raised)."""
        while queue:
            group = [queue.popleft()]
            size = len(group[0].items)
            while queue and size + len(queue[0].items) <= self.max_batch:
                size += len(queue[0].items)
                group.append(queue.popleft())
            try:
                await send(group)
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

    def _fail_queued(self, error: LoraLedgerError) -> None:
        for queue in (self._queue, self._rows):
            while queue:
                request = queue.popleft()
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
        secret: str = "",
    ) -> Done:
        """Register ``owner``'s life ``incarnation`` (idempotent for the same one);
        ``sessions_idle_s``: a relay's (its sessions are client-held). ``secret``: the life's
        (its worker's; made here when none is given), kept here to go with the renewals,
        binds and releases sent for it."""
        secret = secret or os.urandom(32).hex()  # what secrets.token_hex(32) draws
        done = await self.transport.register_owner(
            owner, ttl_s, incarnation, sessions_idle_s, secret
        )
        self._renewals.registered((owner, incarnation))
        self._registered[owner] = incarnation
        self._secrets[(owner, incarnation)] = secret
        return done

    async def deregister_owner(
        self, owner: str, *, incarnation: str = "", secret: str = ""
    ) -> Deregistered:
        """A clean exit: the ledger releases the owner's sessions still bound
        (``owner_exited``) and no renewal of it is forwarded any more (idempotent)."""
        life = (owner, incarnation)
        outcome = await self.transport.deregister_owner(
            owner, incarnation, secret or self._secrets.get(life, "")
        )
        self._renewals.ended(life)
        self._secrets.pop(life, None)
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
        secret: str = "",
    ) -> None:
        """Record a renewal of ``owner`` (its life ``incarnation``, proven by its ``secret``)
        with its in-flight counts per (engine, version) and the client-held ``sessions`` it had
        a turn of, and have it forwarded. Raises the refusal (``LEASE_EXPIRED``,
        ``OWNER_RESTARTED``, ...) once the ledger refused a renewal of this life."""
        if secret:
            self._secrets[(owner, incarnation)] = secret
        self._renewals.record(owner, incarnation, inflight, sessions)

    async def confirm_lease(self, owner: str, *, incarnation: str = "", secret: str = "") -> None:
        """The ledger's own answer about the life ``(owner, incarnation)``, awaited: returns
        once a renewal of it forwarded after this call was answered live, raises the ledger's
        refusal (``OWNER_RESTARTED``, ``LEASE_EXPIRED``, ``FENCED``, ...) otherwise. Without
        ``confirm_timeout`` it answers from memory, as ``renew_lease`` does; with it, a ledger
        that does not answer in time leaves the last answer standing (module docstring).

        Either way, a life that counts a request on a key its ledger evidence may hold at zero
        (:meth:`PendingRenewals.unseen <publisher.remote.renewals.PendingRenewals.unseen>`)
        has its renewal forwarded now and waited for (at most ``count_timeout``), so that
        request's count reaches the ledger before the request is sent, not at the next tick."""
        life = (owner, incarnation)
        if secret:
            self._secrets[life] = secret
        known = self._renewals.lost(life)
        if known is not None:
            raise known
        timeout = self.confirm_timeout
        if self._renewals.unseen(life):
            timeout = max(timeout or 0.0, self.count_timeout)
        elif timeout is None:
            return
        if self._tg is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger client is not connected")
        self._renewals.pend(life)
        round_ = self._next_round  # it takes everything pending, this life included
        self._urgent.set()
        if not self._unanswered:
            with anyio.move_on_after(timeout):
                await round_.done.wait()
        refused = round_.refused.get(life) or self._renewals.lost(life)
        if refused is not None:
            raise refused
        if not round_.answered:
            # Out of reach (or slow past the timeout): go on under the last answer; the next
            # confirmations do not wait until a forward is answered again.
            self._unanswered = True
            self.unconfirmed += 1

    async def _renewer(self) -> None:
        while True:
            await self._renewals.wanted.wait()
            await self._forward_renewals()
            # One forward per renew_interval, unless a confirmation waits for the next one.
            with anyio.move_on_after(self.renew_interval):
                await self._urgent.wait()

    async def _forward_renewals(self) -> None:
        round_, self._next_round = self._next_round, _Round()
        self._urgent = anyio.Event()
        try:
            lives, take = self._renewals.take(), self._renewals.takes
            await self._forward(round_, lives, self._renewals.take_sessions(), take)
        finally:
            round_.done.set()

    async def _forward(
        self,
        round_: _Round,
        lives: dict[Life, Counts],
        sessions: dict[Life, tuple[str, ...]],
        take: int,
    ) -> None:
        if not lives:
            return
        try:
            secrets = {life: self._secrets.get(life, "") for life in lives}
            renewed = await self.transport.renew(lives, self.view.mark, sessions, secrets)
        except Exception as exc:
            # Unreachable, refused as a whole, or an answer not understood: keep the newest
            # renewals for next time (the client's other work must not stop for it).
            log.warning("remote.renew_failed", error=repr(exc))
            self._unanswered = True
            for life, counts in lives.items():
                self._renewals.keep(life, counts, sessions.get(life, ()))
            return
        self.renewals_sent += 1
        self._unanswered = False
        round_.answered = True
        round_.refused = dict(renewed.lost)
        for life, error in renewed.lost.items():
            if error.code in OWNER_LOST_CODES:
                self._renewals.refused(life, error)
            else:
                log.warning("remote.renew_refused", owner=life[0], code=error.code)
        self._renewals.answered(
            {life: counts for life, counts in lives.items() if life not in renewed.lost}, take
        )
        self.view.take(renewed.routing)

    # --- engine trouble ----------------------------------------------------------------------

    def engine_failed(
        self, engine_id: str, error: EngineError, /, *, session: str = "", incarnation: str = ""
    ) -> None:
        """A generation of ``session`` on ``engine_id`` (its life ``incarnation``) failed in a
        way that says something about the engine (the gateway's ``on_engine_trouble`` hook):
        tell the ledger's process, whose reconciler reads it.

        Synchronous and never raising: the gateway calls it on the path of a failing request,
        which must not wait for, or fail because of, a hint. At most one report per engine
        and kind (could not reach it, lacks the adapter, anything else) is in flight, so a
        flood of failures is one round trip at a time and a report of one kind never hides
        one of the other; the turns that fail meanwhile are counted per session and go with
        the next report of their kind, dated by how long ago its error was seen. A report that
        is lost or refused is logged: the ledger's own probes and full passes find what it
        said (its counts are lost with it, never sent twice)."""
        if self._tg is None:
            return
        kind = "unreachable" if says_unreachable(error) else str(lacks_adapter(error))
        key = (engine_id, kind)
        pending = self._trouble.get(key)
        if pending is None:
            pending = self._trouble[key] = _Trouble()
        if pending.error is None:
            pending.error, pending.seen, pending.incarnation = error, time.monotonic(), incarnation
        pending.tally.add(session, error)
        if key not in self._reporting:
            self._reporting.add(key)
            self._tg.start_soon(self._report, key)

    async def _report(self, key: tuple[str, str]) -> None:
        """Send what is pending under ``key``, again while more arrived during the send."""
        try:
            while (pending := self._trouble.pop(key, None)) is not None and pending.error:
                batch = TroubleBatch(
                    incarnation=pending.incarnation,
                    age_s=max(0.0, time.monotonic() - pending.seen),
                    failures=pending.tally.take(),
                    reporter=", ".join(sorted(self._registered))[:200],
                )
                try:
                    await self.transport.report_trouble(key[0], pending.error, batch)
                except Exception as exc:  # only a hint: the ledger's own probes find what it said
                    log.warning("remote.trouble_report_failed", engine=key[0], error=repr(exc))
        finally:
            self._reporting.discard(key)

    # --- provenance --------------------------------------------------------------------------

    def provenance_sink(self) -> LedgerSink:
        """The sink a :class:`~publisher.gateway.provenance.ProvenanceRecorder` of this
        process writes through: its rows go to the ledger's provenance store."""
        return LedgerSink(self)

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> None:
        """Have the ledger's process store ``rows`` beside its log; returns once they are
        stored (module docstring: coalesced, sent again until acknowledged). A refusal that
        sending again cannot change (no store there, a bad token) is raised."""
        if not rows:
            return
        if self._tg is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger client is not connected")
        waiting = _Request(list(rows))
        self._rows.append(waiting)
        if not self._sending_rows:
            self._sending_rows = True
            self._tg.start_soon(self._send_rows)
        await waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error

    async def _send_rows(self) -> None:
        """Send every queued caller's rows, in as few round trips as ``max_batch`` allows."""
        try:
            await self._drain(self._rows, self._store_group)
        finally:
            self._sending_rows = False

    async def _store_group(self, group: list[_Request[ProvenanceRow]]) -> None:
        await self._until_stored([row for waiting in group for row in waiting.items])
        for waiting in group:
            waiting.done.set()

    async def _until_stored(self, rows: list[ProvenanceRow]) -> None:
        """Send ``rows`` until the ledger's store acknowledges them: a lost reply, an
        unreachable ledger or one that cannot store now is answered by sending the same rows
        again, after a wait that doubles up to ``provenance_resend_s[1]``."""
        wait, longest = self.provenance_resend_s
        while True:
            self.provenance_round_trips += 1
            try:
                await self.transport.store_provenance(rows)
                return
            except ConnectionError as exc:
                error = repr(exc)
            except LoraLedgerError as exc:
                if exc.code not in RESEND_PROVENANCE_ON:
                    raise
                error = f"{exc.code}: {exc.message}"
            log.warning("remote.provenance_resend", rows=len(rows), error=error, in_s=wait)
            await anyio.sleep(wait)
            wait = min(wait * 2, longest)

    # --- the view --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the routing and the status now (``view.refresh``)."""
        await self.view.refresh()

    async def _watch_routing(self) -> None:
        """Keep one long poll for the routing in flight for the life of the client: each
        change the ledger makes (an outage, a repair, a publication) reaches this view as it
        happens, not with the next reply or refresh."""
        while True:
            try:
                table = await self.transport.wait_routing(self.view.mark, WATCH_WAIT_S)
            except Exception as exc:  # unreachable for now: replies and refreshes still route
                log.warning("remote.routing_watch_failed", error=repr(exc))
                await anyio.sleep(_RETRY_WATCH_S)
                continue
            self.routing_polls += 1
            self.view.take(table)

    async def _refresher(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            try:
                await self.view.refresh()
            except Exception as exc:  # the next tick reads again; routing still comes with replies
                log.warning("remote.refresh_failed", error=repr(exc))
