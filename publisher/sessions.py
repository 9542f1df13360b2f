"""The rollout side of a session: bind on the first generation, pin every later turn, release
once, and keep a lease so a dead worker cannot pin a version forever (docs/sessions.md).

Two objects:

* :class:`RolloutWorker` -- the *owner*. It registers with the ledger, renews its lease in a
  background task and whenever one of its generations ends (carrying the in-flight counts of
  its requests, as the gateway counted them, so reclaim also sees requests of remote workers
  and is never held back by a count that already fell), runs the shared bind and release
  tasks, and forgets the tombstones of its finished sessions in batches. Its API is
  batch-friendly (:meth:`RolloutWorker.bind_many`, :meth:`RolloutWorker.close_many`: one
  ``execute_many`` round trip per group), which is what a Ray actor wants.
* :class:`SessionBinder` -- what a rollout coroutine holds for one session.

Rules and why:

* **Bind on the first generation, once.** The version a session serves is the default *at its
  first generation*, not at creation (a session created long before it runs must not be pinned
  to an old version for nothing). Concurrent first generations share ONE bind task, owned by
  the worker's task group: a waiter that is cancelled stops waiting, the bind goes on, and its
  result is cached. Nothing ever re-chooses: the ledger answers the same binding forever, so a
  resume (a new binder for the same session id, in any worker or process) gets it too.
* **At most once below the caller.** A generation is never resent here (the gateway's rule);
  binds and releases are idempotent in the ledger, so a lost reply is simply asked again.
* **Close waits for (or cancels) the session's generations, then releases exactly once.** The
  release runs in the worker's task group too, so a caller cancelled mid-close cannot leave
  half a cleanup; it is retried after a lost reply (the ledger's release is idempotent).
  Closing before the first bind tombstones the session: it can never bind.
* **A stale worker is told, never rebound.** Every call checks the lease first (a renewal,
  cheap and not logged); once the ledger expired the owner, bind/generate/close raise
  ``LEASE_EXPIRED``. The check and the gateway's in-flight increment run with no ``await`` in
  between, so a reclaim decided after the expiry cannot miss a request this worker started.

* **One incarnation per worker life.** A worker registers its owner id under an incarnation
  token made when it starts (a uuid, or the one given). The ledger treats a second
  incarnation of a live owner as a restart: the predecessor's sessions are released at once
  (``owner_restarted``) and the predecessor is fenced out (``OWNER_RESTARTED`` on its next
  renewal, bind or release). A retry of the same registration is a no-op.
* **A clean exit deregisters.** Leaving ``RolloutWorker.open`` normally lets pending releases
  land (and forgets their tombstones), then deregisters the owner: its sessions still bound
  are released, cause ``owner_exited`` (a clean end, not an incident). A worker that dies (an
  exception, cancellation, a killed process) leaves them bound until its lease expires (an
  incident), or until its next incarnation registers. To hand sessions to a later worker on
  purpose, open it with the same ``incarnation`` and ``deregister_on_exit=False``.

Why one module of ~600 lines: the worker and the binder share the slot and retry machinery
and one ordering rule (lease check, then the in-flight increment, with no ``await`` between);
apart, that rule would have to be restated on both sides.
"""

from __future__ import annotations

import inspect
import math
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup

from engines.contract import SamplingParams
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, StoreCode
from projections.staleness import TOO_STALE
from publisher import commands as c
from publisher.errors import Code, LedgerError
from publisher.gateway import Gateway, InFlightCounter, Served
from publisher.logs import get_logger
from publisher.outcomes import Bound, Deregistered, Done, Forgotten, Outcome, Released

log = get_logger("loraledger.sessions")

T = TypeVar("T")

# Refusals that only say "the write did not happen, ask again" (idempotent commands only).
RETRYABLE_CODES = frozenset({StoreCode.STORE_FAILED})
# Refusals that end this owner: its sessions are gone, it must not act any more.
OWNER_LOST_CODES = frozenset(
    {Code.LEASE_EXPIRED, Code.UNKNOWN_OWNER, Code.OWNER_RESTARTED, Code.OWNER_DEREGISTERED}
)
# The release cause of a session that went ``idle_release_s`` without a turn.
IDLE_CAUSE = "idle"


class LedgerPort(Protocol):
    """What a worker needs from the ledger. The in-process :class:`~publisher.ledger.Ledger`
    satisfies it; the Ray and HTTP clients implement the same four calls."""

    async def register_owner(
        self, owner: str, *, ttl_s: float = ..., incarnation: str = ...
    ) -> Done: ...

    async def deregister_owner(self, owner: str, *, incarnation: str = ...) -> Deregistered: ...

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = ...,
    ) -> None: ...

    async def execute_many(
        self, commands: Sequence[c.Command]
    ) -> list[Outcome | LoraLedgerError]: ...


@dataclass(frozen=True)
class RetryPolicy:
    """How idempotent ledger calls (register, bind, release, forget) are retried after a
    lost reply. ``transient`` are the exception types that mean "the reply was lost" for the
    port in use (a remote client adds its own, e.g. Ray's actor errors)."""

    attempts: int = 6
    first_delay: float = 0.02
    max_delay: float = 1.0
    transient: tuple[type[BaseException], ...] = (OSError,)

    def delay(self, attempt: int) -> float:
        scale: int = 2**attempt  # typeshed types int ** int as Any (a negative power is a float)
        return min(self.max_delay, self.first_delay * scale)

    def retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, LoraLedgerError):
            return exc.code in RETRYABLE_CODES
        return isinstance(exc, self.transient)


class _Slot(Generic[T]):
    """The result of a task owned by the worker; any number of callers wait on it, and a
    waiter that is cancelled never cancels the task."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: T | None = None
        self.error: LoraLedgerError | None = None

    def set(self, value: T) -> None:
        self.value = value
        self.done.set()

    def fail(self, error: LoraLedgerError) -> None:
        self.error = error
        self.done.set()

    async def wait(self) -> T:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


class SessionBinder:
    """One session, as a rollout coroutine sees it. Get one with :meth:`RolloutWorker.session`.

    ``generate`` binds on first use and then always sends the same immutable ``lora_name``;
    ``close`` waits for (``cancel=True``: cancels) the session's generations, then releases.
    """

    def __init__(self, worker: RolloutWorker, session_id: str) -> None:
        self.session_id = session_id
        self._worker = worker
        self._bound: Bound | None = None
        self._bind_slot: _Slot[Bound] | None = None
        self._release_slot: _Slot[Released] | None = None
        self._closing = False
        self._active: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None  # None or set: nothing in flight
        self._next_turn = 0
        self._release_cause = "closed"
        self._stale: LedgerError | None = None  # set once a turn was refused as too stale
        self.last_used = anyio.current_time()  # the end of its last turn (anyio's clock)
        self._idle_closed = False  # closed by the worker's idle release

    @property
    def bound(self) -> Bound | None:
        """The binding once known (None before the first generation finished binding)."""
        return self._bound

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def staleness(self) -> int | None:
        """Versions published since this session bound (None before it bound): what the next
        turn's provenance will say, readable before the turn so a framework can apply its own
        off-policy rule (docs/sessions.md#staleness)."""
        if self._bound is None:
            return None
        return self._worker.gateway.staleness(self._bound)

    async def bind(self) -> Bound:
        """The session's binding, binding now if this is the first call (shared with every
        concurrent first call). Usually implicit in :meth:`generate`."""
        self._check_usable()
        if self._bound is not None:
            return self._bound
        return await self._worker._bind_slots([self])[0].wait()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        turn: int | None = None,
        request_id: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Served:
        """One generation on the session's version, sent at most once (see
        :meth:`Gateway.generate` for its errors). ``turn`` labels the provenance row (default:
        a counter per binder; pass it explicitly to label a retry of the same turn)."""
        self._check_usable()
        turn = self.next_turn(turn)
        async with self.turn() as bound:  # no await from its lease check to the increment
            return await self._worker.gateway.generate(
                bound,
                prompt,
                params,
                turn=turn,
                request_id=request_id,
                extra_body=extra_body,
                tally=self._worker.inflight,
            )
        raise AssertionError("unreachable: turn() raises when its body is cancelled")

    def next_turn(self, turn: int | None = None) -> int:
        """The turn label of the next generation (a counter per binder; ``turn`` given
        labels a retry of that turn and moves the counter past it)."""
        if turn is None:
            turn = self._next_turn
        self._next_turn = max(self._next_turn, turn + 1)
        return turn

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Bound]:
        """One generation of this session, as any face sends it (:meth:`generate`, the
        OpenAI gateway): binds on the first turn (the shared bind), renews the lease, refuses a
        turn beyond the deployment's ``max_staleness`` (``SESSION_TOO_STALE``: the session is
        then released with cause ``too_stale``, nothing was counted or sent), and yields the
        binding. The body must count its request in flight (``Gateway.admit`` with the
        worker's ``inflight``) before its first ``await``: the lease check happened just before
        the yield, so a reclaim decided after it cannot miss the request. ``close`` waits for
        the body (``cancel=True`` cancels it, and this raises ``SESSION_CLOSED``); the lease's
        in-flight counts are renewed when it ends."""
        self._check_usable()
        stale: LedgerError | None = None
        with anyio.CancelScope() as scope:
            self._enter(scope)
            try:
                bound = self._bound
                if bound is None:
                    bound = await self._worker._bind_slots([self])[0].wait()
                self._worker.ensure_live()  # no await from here to the body's increment
                try:
                    self._worker.gateway.check_staleness(bound)
                except LedgerError as refusal:
                    if refusal.code != Code.SESSION_TOO_STALE:
                        raise
                    stale = refusal
                else:
                    try:
                        yield bound
                    except LedgerError as refusal:
                        # The gateway checks again before a try on another holder.
                        if refusal.code != Code.SESSION_TOO_STALE:
                            raise
                        stale = refusal
                    else:
                        return
            finally:
                self._exit(scope)
                self._worker.report()  # the lease's in-flight counts are fresh again
        if stale is not None:
            await self._drop_stale(stale)
            raise stale
        raise LedgerError(
            Code.SESSION_CLOSED,
            f"session {self.session_id} was closed (cancel=True) during this generation",
            session=self.session_id,
        )

    async def close(self, *, cancel: bool = False) -> Released:
        """Stop new generations, wait for (or cancel) the running ones, release the binding.
        Idempotent: a second close returns the first one's answer."""
        result = (await self._worker.close_many([self], cancel=cancel))[0]
        if isinstance(result, LoraLedgerError):
            raise result
        return result

    # --- internals -----------------------------------------------------------------------------

    async def _drop_stale(self, refusal: LedgerError) -> None:
        """A turn refused as too stale ends the session: it is released with cause
        ``too_stale`` (recorded, so its version becomes reclaimable once its other sessions
        go), and every later call hears the same refusal. The release runs in the worker's
        task group, so a caller cancelled here cannot leave the session bound."""
        if self._stale is None:
            self._stale = refusal
            self._release_cause = TOO_STALE
        result = (await self._worker.close_many([self]))[0]
        if isinstance(result, LoraLedgerError):
            log.error("sessions.stale_release_failed", session=self.session_id, error=str(result))

    def _check_usable(self) -> None:
        self._worker.ensure_live()  # a stale worker hears LEASE_EXPIRED first, always
        if self._stale is not None:
            raise self._stale
        if self._closing or self.session_id in self._worker._idle_released:
            if self._idle_closed or self.session_id in self._worker._idle_released:
                raise LedgerError(
                    Code.SESSION_CLOSED,
                    f"session {self.session_id} was released after "
                    f"{self._worker.idle_release_s:g} s without a turn (cause idle): its "
                    "version may be reclaimed; start a new session id",
                    session=self.session_id,
                    cause=IDLE_CAUSE,
                )
            raise LedgerError(
                Code.SESSION_CLOSED, f"session {self.session_id} is closed", session=self.session_id
            )

    def _enter(self, scope: anyio.CancelScope) -> None:
        if not self._active:
            self._idle = anyio.Event()
        self._active.add(scope)

    def _exit(self, scope: anyio.CancelScope) -> None:
        self._active.discard(scope)
        self.last_used = anyio.current_time()
        if not self._active and self._idle is not None:
            self._idle.set()

    async def _quiesce(self, cancel: bool) -> None:
        """After ``_closing`` is set no generation can start, so idle stays idle."""
        if cancel:
            for scope in list(self._active):
                scope.cancel()
        if self._idle is not None:
            await self._idle.wait()
        if self._bind_slot is not None:  # release after the bind in the log, never before
            await self._bind_slot.done.wait()


class RolloutWorker:
    """The owner of a group of sessions: lease, shared bind/release tasks, forget batches.

    Open with ``async with RolloutWorker.open(ledger, gateway, owner="w1") as worker:``. The
    background work (lease renewal, bind and release tasks, forget batches) lives in that block.
    ``renew_every`` defaults to a third of ``ttl_s``.
    """

    def __init__(
        self,
        ledger: LedgerPort,
        gateway: Gateway,
        *,
        owner: str,
        ttl_s: float = 30.0,
        renew_every: float | None = None,
        forget_batch: int = 256,
        retry: RetryPolicy | None = None,
        idle_release_s: float = 0.0,
        idle_tombstone_s: float = 86400.0,
        incarnation: str | None = None,
        deregister_on_exit: bool = True,
    ) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0) or forget_batch < 1:
            raise InvalidInput(INVALID_INPUT, "ttl_s must be > 0 and forget_batch >= 1")
        if not (math.isfinite(idle_release_s) and idle_release_s >= 0) or not (
            math.isfinite(idle_tombstone_s) and idle_tombstone_s >= 0
        ):
            raise InvalidInput(
                INVALID_INPUT, "idle_release_s and idle_tombstone_s must be finite and >= 0"
            )
        self.ledger = ledger
        self.gateway = gateway
        self.owner = owner
        # This life of the owner: made here, at the edge (never by the ledger), so every
        # start of a worker -- a Ray actor restarted by Ray included -- is a new incarnation.
        self.incarnation = incarnation if incarnation is not None else uuid.uuid4().hex
        self.deregister_on_exit = deregister_on_exit
        self.deregistered: Deregistered | None = None
        self.ttl_s = ttl_s
        self.renew_every = ttl_s / 3 if renew_every is None else renew_every
        self.forget_batch = forget_batch
        self.retry = retry or RetryPolicy()
        self._binders: dict[str, SessionBinder] = {}
        self._tg: TaskGroup | None = None
        self._lost: LoraLedgerError | None = None
        self._finished: list[str] = []  # released, tombstone not yet forgotten
        self._forgetting = False
        self._forget_lock: anyio.Lock | None = None
        self._releases: set[_Slot[Released]] = set()
        # This worker's requests in flight per (engine, version), counted by the gateway.
        self.inflight = InFlightCounter()
        self.forgotten = 0
        self.renewals = 0
        # Idle release (0: never): a session this worker bound with no turn for that long is
        # released (cause ``idle``); its tombstone is kept ``idle_tombstone_s`` so a late turn
        # is refused SESSION_CLOSED rather than bound afresh, then forgotten.
        self.idle_release_s = idle_release_s
        self.idle_tombstone_s = idle_tombstone_s
        self._idle_released: dict[str, float] = {}  # session -> when (anyio's clock)
        self.idle_releases = 0

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        ledger: LedgerPort,
        gateway: Gateway,
        *,
        owner: str,
        ttl_s: float = 30.0,
        renew_every: float | None = None,
        forget_batch: int = 256,
        retry: RetryPolicy | None = None,
        idle_release_s: float = 0.0,
        idle_tombstone_s: float = 86400.0,
        incarnation: str | None = None,
        deregister_on_exit: bool = True,
    ) -> AsyncIterator[RolloutWorker]:
        """Register (a new incarnation unless ``incarnation`` is given), run the background
        work for the life of the block, and on a normal exit deregister (see the module
        docstring; ``deregister_on_exit=False`` leaves the sessions bound under the lease)."""
        worker = cls(
            ledger,
            gateway,
            owner=owner,
            ttl_s=ttl_s,
            renew_every=renew_every,
            forget_batch=forget_batch,
            retry=retry,
            idle_release_s=idle_release_s,
            idle_tombstone_s=idle_tombstone_s,
            incarnation=incarnation,
            deregister_on_exit=deregister_on_exit,
        )
        worker._forget_lock = anyio.Lock()
        await worker._with_retry(
            lambda: worker.ledger.register_owner(owner, ttl_s=ttl_s, incarnation=worker.incarnation)
        )
        async with anyio.create_task_group() as tg:
            worker._tg = tg
            tg.start_soon(worker._renew_loop)
            if idle_release_s > 0:
                tg.start_soon(worker._idle_loop)
            try:
                yield worker
                await worker._finish_cleanup()
                worker.report()  # the last word on this worker's in-flight counts
                if worker.deregister_on_exit:
                    await worker.deregister()
            finally:
                worker._tg = None
                if worker.deregistered is None:
                    worker.report()
                tg.cancel_scope.cancel()  # renewals stop; unfinished binds fail their waiters

    # --- sessions ------------------------------------------------------------------------------

    def session(self, session_id: str) -> SessionBinder:
        """The binder of ``session_id`` in this worker (the same object until it is released,
        so two callers of one session still share one bind). Creating it binds nothing.

        Session ids are never reused: once this worker forgot a closed session's tombstone,
        the ledger no longer knows the id was closed, and it would bind afresh."""
        binder = self._binders.get(session_id)
        if binder is None:
            binder = self._binders[session_id] = SessionBinder(self, session_id)
        return binder

    async def bind_many(self, binders: Iterable[SessionBinder]) -> list[Bound | LoraLedgerError]:
        """Bind a group in one ledger round trip (e.g. a GRPO group starting together).
        Refusals come back in place. Binders already bound or binding are not asked again."""
        group = list(binders)
        self.ensure_live()
        open_group = [b for b in group if not b._closing]
        slots = dict(zip(map(id, open_group), self._bind_slots(open_group), strict=True))
        results: list[Bound | LoraLedgerError] = []
        for binder in group:
            slot = slots.get(id(binder))
            if slot is None:
                results.append(
                    LedgerError(
                        Code.SESSION_CLOSED,
                        f"session {binder.session_id} is closed",
                        session=binder.session_id,
                    )
                )
                continue
            try:
                results.append(await slot.wait())
            except LoraLedgerError as refusal:
                results.append(refusal)
        return results

    async def close_many(
        self, binders: Iterable[SessionBinder], *, cancel: bool = False, cause: str | None = None
    ) -> list[Released | LoraLedgerError]:
        """Close a group: stop new generations, wait for (``cancel``: cancel) the running
        ones, then release all of them in one ledger round trip. Refusals come back in place;
        a stale worker gets ``LEASE_EXPIRED`` raised."""
        group = list(binders)
        for binder in group:
            binder._closing = True
        for binder in group:
            await binder._quiesce(cancel)
        if any(b._release_slot is None for b in group):
            self.ensure_live()
        fresh = [b for b in group if b._release_slot is None]
        for binder in fresh:
            binder._release_slot = _Slot()
            self._releases.add(binder._release_slot)
        if fresh:
            if cause is not None:  # recorded in the log (SessionReleased.cause)
                for binder in fresh:
                    binder._release_cause = cause
            self._spawn(self._release_task, fresh)
        results: list[Released | LoraLedgerError] = []
        for binder in group:
            assert binder._release_slot is not None
            try:
                results.append(await binder._release_slot.wait())
            except LoraLedgerError as refusal:
                results.append(refusal)
        return results

    # --- the lease -----------------------------------------------------------------------------

    @property
    def lost(self) -> LoraLedgerError | None:
        """Why this worker may no longer act (its lease expired), or None."""
        return self._lost

    def ensure_live(self) -> None:
        """Renew the lease now (carrying this worker's in-flight counts); raise
        ``LEASE_EXPIRED`` if the ledger expired this owner. Synchronous on purpose."""
        if self._lost is not None:
            raise self._lost
        try:
            self.ledger.renew_lease(
                self.owner, self.inflight.counts(), incarnation=self.incarnation
            )
        except LoraLedgerError as exc:
            if exc.code in OWNER_LOST_CODES:
                self._owner_lost(exc)
            raise
        self.renewals += 1

    def report(self) -> None:
        """Renew with the current counts, never raising: called when a generation ends (a
        count that fell must not keep a version from reclaim until the next renewal tick) and
        when the worker stops. A lost lease is remembered for the next call to raise."""
        if self._lost is not None:
            return
        try:
            self.ensure_live()
        except LoraLedgerError as exc:
            if exc.code not in OWNER_LOST_CODES:
                log.warning("sessions.report_failed", owner=self.owner, error=repr(exc))
        except Exception as exc:
            log.warning("sessions.report_failed", owner=self.owner, error=repr(exc))

    def _owner_lost(self, exc: LoraLedgerError) -> None:
        if self._lost is None and exc.code == Code.OWNER_RESTARTED:
            self._lost = LedgerError(
                Code.OWNER_RESTARTED,
                f"owner {self.owner} was restarted: a newer incarnation replaced this worker "
                f"({self.incarnation}) and its sessions were released. Stop this worker.",
                owner=self.owner,
            )
            log.error("sessions.owner_replaced", owner=self.owner, incarnation=self.incarnation)
        if self._lost is None:
            self._lost = LedgerError(
                Code.LEASE_EXPIRED,
                f"owner {self.owner} lost its lease ({exc.code}); its sessions were released. "
                "Register a new worker under a new owner id.",
                owner=self.owner,
                cause=exc.code,
            )
            log.error("sessions.owner_lost", owner=self.owner, code=exc.code)

    async def release_idle(self, now: float | None = None) -> int:
        """Release every bound session of this worker with no turn in flight and none ended
        in the last ``idle_release_s`` (cause ``idle``), and forget the tombstones of idle
        releases older than ``idle_tombstone_s``. Returns how many it released. ``now`` is
        anyio's clock (given by a test); the idle loop calls this every quarter of the idle
        time (at most 30 s), so a session goes 1-1.25 idle periods before its release.

        Why here and not in the ledger: only the faces see turns (a turn after the first never
        reaches the ledger), and an OpenAI client never says its episode ended. The choice and
        the ``_closing`` flag are set with no ``await`` between, so a turn starting later is
        refused ``SESSION_CLOSED``, and one that started before is waited for by the close."""
        now = anyio.current_time() if now is None else now
        for session, at in list(self._idle_released.items()):
            if now - at >= self.idle_tombstone_s:
                del self._idle_released[session]
                self._finished.append(session)
        if self.idle_release_s <= 0 or self._lost is not None:
            return 0
        idle: list[SessionBinder] = []
        for session, binder in list(self._binders.items()):
            if binder._closing or binder._active or now - binder.last_used < self.idle_release_s:
                continue
            if binder._bound is None:
                if binder._bind_slot is None:  # never bound (a failed bind): nothing to release
                    del self._binders[session]
                continue  # a bind in flight is not idle
            binder._idle_closed = True
            idle.append(binder)
        if not idle:
            return 0
        results = await self.close_many(idle, cause=IDLE_CAUSE)
        released = sum(isinstance(r, Released) for r in results)
        self.idle_releases += released
        log.info("sessions.idle_released", owner=self.owner, count=released, of=len(idle))
        return released

    async def _idle_loop(self) -> None:
        period = min(self.idle_release_s / 4, 30.0)
        while self._lost is None:
            await anyio.sleep(period)
            try:
                await self.release_idle()
            except LoraLedgerError as exc:
                log.warning("sessions.idle_release_failed", owner=self.owner, error=repr(exc))

    async def _renew_loop(self) -> None:
        while self._lost is None:
            await anyio.sleep(self.renew_every)
            try:
                self.ensure_live()
            except LoraLedgerError as exc:
                if exc.code in OWNER_LOST_CODES:
                    return
                log.warning("sessions.renew_failed", owner=self.owner, error=repr(exc))
            except Exception as exc:
                if not self.retry.retryable(exc):
                    raise
                log.warning("sessions.renew_failed", owner=self.owner, error=repr(exc))

    # --- shared tasks --------------------------------------------------------------------------

    def _spawn(self, fn: Any, *args: Any) -> None:
        if self._tg is None:
            raise LedgerError(Code.LEDGER_CLOSED, f"rollout worker {self.owner} is not running")
        self._tg.start_soon(fn, *args)

    def _bind_slots(self, binders: list[SessionBinder]) -> list[_Slot[Bound]]:
        """Each binder's bind slot, starting ONE task for those that have none yet. A slot
        that succeeded is kept forever (it holds the binding); a failed one is dropped."""
        fresh = [b for b in binders if b._bind_slot is None]
        for binder in fresh:
            binder._bind_slot = _Slot()
        if fresh:
            self._spawn(self._bind_task, fresh)
        return [b._bind_slot for b in binders]  # type: ignore[misc]

    async def _bind_task(self, binders: list[SessionBinder]) -> None:
        commands = [
            c.Bind(session=b.session_id, owner=self.owner, incarnation=self.incarnation)
            for b in binders
        ]
        results = await self._settle(commands, binders, "bind")
        for binder, result in zip(binders, results, strict=True):
            slot = binder._bind_slot
            assert slot is not None
            if isinstance(result, Bound):
                binder._bound = result
                slot.set(result)
            else:
                # A failed bind is not cached: the next generation asks again (the ledger
                # still decides, so nothing can re-choose a binding that exists).
                binder._bind_slot = None
                slot.fail(self._refusal(result))

    async def _release_task(self, binders: list[SessionBinder]) -> None:
        commands = [
            c.Release(
                session=b.session_id,
                owner=self.owner,
                cause=b._release_cause,
                incarnation=self.incarnation,
            )
            for b in binders
        ]
        results = await self._settle(commands, binders, "release")
        for binder, result in zip(binders, results, strict=True):
            slot = binder._release_slot
            assert slot is not None
            self._releases.discard(slot)
            if isinstance(result, Released):
                slot.set(result)
                if binder._release_cause == IDLE_CAUSE:  # forgotten later (release_idle)
                    self._idle_released[binder.session_id] = anyio.current_time()
                else:
                    self._finished.append(binder.session_id)
                if self._binders.get(binder.session_id) is binder:
                    del self._binders[binder.session_id]
            else:
                binder._release_slot = None  # a later close may try again
                slot.fail(self._refusal(result))
        if len(self._finished) >= self.forget_batch and not self._forgetting and self._tg:
            self._forgetting = True
            self._tg.start_soon(self._background_forget)

    async def _settle(
        self, commands: Sequence[c.Command], binders: list[SessionBinder], what: str
    ) -> list[Outcome | LoraLedgerError]:
        """Execute with retries; any failure (cancellation included) becomes a refusal for
        each command, so no waiter can hang on a slot nobody will fill."""
        failure: LoraLedgerError | None = None
        try:
            return await self._execute(commands)
        except LoraLedgerError as exc:
            failure = exc
        except anyio.get_cancelled_exc_class():
            failure = LedgerError(
                Code.LEDGER_CLOSED, f"rollout worker {self.owner} stopped during a {what}"
            )
            self._fail_slots(binders, what, failure)
            raise
        except Exception as exc:
            failure = LedgerError(
                Code.LEDGER_CLOSED, f"{what} of {len(commands)} sessions failed: {exc!r}"
            )
        log.error("sessions.call_failed", what=what, owner=self.owner, error=failure.message)
        return [failure] * len(commands)

    def _fail_slots(self, binders: list[SessionBinder], what: str, error: LoraLedgerError) -> None:
        for binder in binders:
            slot = binder._bind_slot if what == "bind" else binder._release_slot
            if slot is not None and not slot.done.is_set():
                if what == "bind":
                    binder._bind_slot = None
                else:
                    binder._release_slot = None
                    self._releases.discard(slot)
                slot.fail(error)

    def _refusal(self, result: Outcome | LoraLedgerError) -> LoraLedgerError:
        if isinstance(result, LoraLedgerError):
            if result.code in OWNER_LOST_CODES:
                self._owner_lost(result)
                return self._lost or result
            return result
        return LedgerError(Code.INVALID_STATE, f"unexpected outcome {result!r}")

    async def _execute(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """``execute_many`` with retries of lost replies and retryable refusals (every command
        sent here is idempotent in the ledger, so asking again cannot act twice)."""
        results: list[Outcome | LoraLedgerError | None] = [None] * len(commands)
        pending = list(range(len(commands)))
        policy = self.retry
        for attempt in range(policy.attempts):
            last = attempt == policy.attempts - 1
            try:
                answers = await self.ledger.execute_many([commands[i] for i in pending])
            except Exception as exc:
                if last or not policy.retryable(exc):
                    raise
                log.warning("sessions.retry", owner=self.owner, attempt=attempt, error=repr(exc))
                await anyio.sleep(policy.delay(attempt))
                continue
            again: list[int] = []
            for index, answer in zip(pending, answers, strict=True):
                if not last and isinstance(answer, LoraLedgerError) and policy.retryable(answer):
                    again.append(index)
                else:
                    results[index] = answer
            pending = again
            if not pending:
                break
            await anyio.sleep(policy.delay(attempt))
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    async def _with_retry(self, call: Any) -> Any:
        policy = self.retry
        for attempt in range(policy.attempts):
            try:
                result = call()
                return await result if inspect.isawaitable(result) else result
            except Exception as exc:
                if attempt == policy.attempts - 1 or not policy.retryable(exc):
                    raise
                await anyio.sleep(policy.delay(attempt))
        raise AssertionError("unreachable")

    # --- the end -------------------------------------------------------------------------------

    async def deregister(self) -> Deregistered | None:
        """End this incarnation cleanly: the ledger releases the sessions still bound (cause
        ``owner_exited``, not an incident) and drops the lease now. Called by a normal exit
        from :meth:`open`; afterwards every call raises ``OWNER_DEREGISTERED``. Idempotent.
        A ledger that cannot be reached (after the retry policy) is logged and answered None:
        the lease then expires as for a crash. A worker that was replaced or whose lease
        expired has nothing to end (None)."""
        if self.deregistered is not None:
            return self.deregistered
        if self._lost is not None:
            return None
        try:
            outcome: Deregistered = await self._with_retry(
                lambda: self.ledger.deregister_owner(self.owner, incarnation=self.incarnation)
            )
        except LoraLedgerError as exc:
            if exc.code in OWNER_LOST_CODES:
                self._owner_lost(exc)
                return None
            log.warning("sessions.deregister_failed", owner=self.owner, error=repr(exc))
            return None
        except Exception as exc:
            if not self.retry.retryable(exc):
                raise
            log.warning("sessions.deregister_failed", owner=self.owner, error=repr(exc))
            return None
        self.deregistered = outcome
        self._lost = LedgerError(
            Code.OWNER_DEREGISTERED,
            f"rollout worker {self.owner} deregistered (incarnation {self.incarnation}): "
            "open a new worker to act again",
            owner=self.owner,
        )
        # The tombstones of the sessions it released stay (unlike those of sessions closed
        # here, forgotten at exit): another process may still send a turn of one, which must be
        # refused SESSION_CLOSED, never bound afresh to another version.
        log.info("sessions.deregistered", owner=self.owner, released=outcome.released)
        return outcome

    # --- forgetting tombstones -------------------------------------------------------------------

    @property
    def unforgotten(self) -> int:
        """Released sessions whose tombstones this worker has not forgotten yet."""
        return len(self._finished)

    async def flush_forgets(self) -> int:
        """Forget the tombstones of every session this worker released, in batches of
        ``forget_batch``. Returns how many the ledger dropped."""
        assert self._forget_lock is not None
        dropped = 0
        async with self._forget_lock:
            while self._finished:
                batch = tuple(self._finished[: self.forget_batch])
                answer = (await self._execute([c.Forget(sessions=batch)]))[0]
                if isinstance(answer, LoraLedgerError):
                    raise answer
                assert isinstance(answer, Forgotten)
                del self._finished[: len(batch)]
                dropped += answer.count
        self.forgotten += dropped
        return dropped

    async def _background_forget(self) -> None:
        try:
            await self.flush_forgets()
        except Exception as exc:  # kept for the next flush; never kills the worker
            log.warning("sessions.forget_failed", owner=self.owner, error=repr(exc))
        finally:
            self._forgetting = False

    async def _finish_cleanup(self) -> None:
        """On a normal exit: let the turns still running end, and pending releases land, then
        forget every tombstone. In process every turn runs inside the worker's block, so none
        is left; a host that serves turns beside the block (``RayRollout``, whose calls run in
        its portal) can close while some run, and the deregistration that follows releases
        every session and drops this owner's in-flight counts: before the turns end, that
        would let a reclaim unload a version under a request still running."""
        for binder in list(self._binders.values()):
            while binder._active and binder._idle is not None:
                await binder._idle.wait()
        for slot in list(self._releases):
            await slot.done.wait()
        self._finished.extend(self._idle_released)  # no one is left to refuse their late turns
        self._idle_released.clear()
        if self._lost is None:
            await self.flush_forgets()
