"""The owner of a group of sessions: its life with the ledger, and the shared tasks of its
sessions (docs/sessions.md).

A :class:`RolloutWorker` registers with the ledger, renews its lease in a background task and
whenever one of its generations is admitted or ends (carrying the in-flight counts of its
requests, as the gateway counted them, so reclaim also sees requests of remote workers and is
never held back by a count that already fell), runs the shared bind and release tasks of its
sessions (:class:`~publisher.sessions.binder.SessionBinder`), releases idle ones, and forgets
the tombstones of its finished sessions in batches. Its API is batch-friendly
(:meth:`RolloutWorker.bind_many`, :meth:`RolloutWorker.close_many`: one ``execute_many`` round
trip per group), which is what a Ray actor wants.

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
* **A stale worker is told, never rebound.** Once the ledger ended the owner, every call
  raises ``LEASE_EXPIRED`` (or ``OWNER_RESTARTED``, ``OWNER_DEREGISTERED``): the worker is the
  gateway's ``Owner``, whose lease the dispatch executor checks before every attempt.
* **A relay holds nothing of its own** (``sessions_idle_s`` given: the worker of an OpenAI
  face). Its sessions are client-held: no end of its life releases them, and a later process
  binds them again (the ledger answers the existing binding). It reports the sessions it had a
  turn of with its renewals, and the ledger's process releases idle ones; it keeps a binding
  only while it is in use (a cached one unused for the idle time is asked of the ledger again,
  so a session released meanwhile is refused), and forgets only the tombstones it wrote.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound, Deregistered, Forgotten, Outcome, Released
from publisher.gateway import Gateway, InFlightCounter
from publisher.logs import get_logger
from publisher.sessions.binder import IDLE_CAUSE, SessionBinder, Slot
from publisher.sessions.port import OWNER_LOST_CODES, ConfirmsLeases, LedgerPort, RetryPolicy

log = get_logger("loraledger.sessions")

T = TypeVar("T")
# How long a relay whose sessions never go idle (``sessions_idle_s`` 0) keeps a binding cached
# without a turn of it: only its memory is at stake (a session is never released for idleness).
RELAY_CACHE_S = 1800.0


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
        sessions_idle_s: float | None = None,
        secret: str | None = None,
    ) -> None:
        if sessions_idle_s is not None and not (
            math.isfinite(sessions_idle_s) and sessions_idle_s >= 0 and idle_release_s == 0
        ):
            raise InvalidInput(
                INVALID_INPUT,
                "sessions_idle_s must be finite and >= 0, without idle_release_s (a relay's "
                "sessions are released for idleness by the ledger's process)",
            )
        if not (math.isfinite(ttl_s) and ttl_s > 0) or forget_batch < 1:
            raise InvalidInput(INVALID_INPUT, "ttl_s must be > 0 and forget_batch >= 1")
        if not (math.isfinite(idle_release_s) and idle_release_s >= 0) or not (
            math.isfinite(idle_tombstone_s) and idle_tombstone_s >= 0
        ):
            raise InvalidInput(
                INVALID_INPUT, "idle_release_s and idle_tombstone_s must be finite and >= 0"
            )
        self.ledger = ledger
        self._confirmer = ledger if isinstance(ledger, ConfirmsLeases) else None
        self.gateway = gateway
        self.owner = owner
        # This life of the owner: made here, at the edge (never by the ledger), so every
        # start of a worker -- a Ray actor restarted by Ray included -- is a new incarnation.
        self.incarnation = incarnation if incarnation is not None else uuid.uuid4().hex
        # This life's secret, made here with it and sent with every call for the life (the
        # ledger keeps only its digest): another caller that learns the owner id and the
        # incarnation still cannot bind, renew, release or deregister for it. Never logged.
        # ``os.urandom`` is what ``secrets`` draws from, read at the call as ``uuid4`` does (a
        # seeded simulation replays it).
        self.secret = secret if secret is not None else os.urandom(32).hex()
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
        self._releases: set[Slot[Released]] = set()
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
        # A relay (the worker of an OpenAI face) when not None: its sessions are client-held,
        # released by the ledger's process after this long without a turn (0: never), which
        # hears of their turns through the renewals (``_touched``: since the last renewal;
        # ``_running``: with a turn in flight, reported again at every renewal tick).
        self.sessions_idle_s = sessions_idle_s
        self._touched: set[str] = set()
        self._running: set[str] = set()
        # How long a relay trusts a binding it cached without a turn of it here: past that, the
        # ledger may have released the session, so the next turn asks it again. None: always.
        self.binding_cache_s: float | None = (
            None if sessions_idle_s is None else sessions_idle_s or RELAY_CACHE_S
        )
        if sessions_idle_s:  # a turn still running is reported well within the idle bound
            self.renew_every = min(self.renew_every, sessions_idle_s / 4)

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
        sessions_idle_s: float | None = None,
        secret: str | None = None,
    ) -> AsyncIterator[RolloutWorker]:
        """Register (a new incarnation unless ``incarnation`` is given), run the background
        work for the life of the block, and on a normal exit deregister (see the module
        docstring; ``deregister_on_exit=False`` leaves the sessions bound under the lease).
        ``sessions_idle_s`` makes the worker a relay of client-held sessions (module
        docstring). ``secret``: the life's secret (made here unless given: a worker that
        takes over a life on purpose passes its ``incarnation`` and ``secret``)."""
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
            sessions_idle_s=sessions_idle_s,
            secret=secret,
        )
        worker._forget_lock = anyio.Lock()
        await worker._call(worker._register)
        async with anyio.create_task_group() as tg:
            worker._tg = tg
            tg.start_soon(worker._renew_loop)
            if idle_release_s > 0 or sessions_idle_s is not None:
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

    def bindings(self) -> dict[str, int]:
        """Session -> the version it is bound to, of the sessions this worker holds now (for a
        gateway process's own page)."""
        return {
            session: binder.bound.version_id
            for session, binder in self._binders.items()
            if binder.bound is not None and not binder.closed
        }

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
        open_group = [b for b in group if not b.closing]
        slots = dict(zip(map(id, open_group), self.shared_binds(open_group), strict=True))
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
            binder.closing = True
        for binder in group:
            await binder.quiesce(cancel)
        if any(b.release_slot is None for b in group):
            self.ensure_live()
        fresh = [b for b in group if b.release_slot is None]
        for binder in fresh:
            binder.release_slot = Slot()
            self._releases.add(binder.release_slot)
        if fresh:
            if cause is not None:  # recorded in the log (SessionReleased.cause)
                for binder in fresh:
                    binder.release_cause = cause
            self._spawn(self._release_task, fresh)
        results: list[Released | LoraLedgerError] = []
        for binder in group:
            assert binder.release_slot is not None
            try:
                results.append(await binder.release_slot.wait())
            except LoraLedgerError as refusal:
                results.append(refusal)
        return results

    # --- the lease -----------------------------------------------------------------------------

    @property
    def lost(self) -> LoraLedgerError | None:
        """Why this worker may no longer act (its lease expired), or None."""
        return self._lost

    async def _register(self) -> Any:
        if self.sessions_idle_s is None:  # owner-held: the call every ledger port knows
            return await self.ledger.register_owner(
                self.owner, ttl_s=self.ttl_s, incarnation=self.incarnation, secret=self.secret
            )
        return await self.ledger.register_owner(
            self.owner,
            ttl_s=self.ttl_s,
            incarnation=self.incarnation,
            sessions_idle_s=self.sessions_idle_s,
            secret=self.secret,
        )

    def ensure_live(self) -> None:
        """Renew the lease now (carrying this worker's in-flight counts, and a relay's
        sessions with a turn since the last renewal); raise ``LEASE_EXPIRED`` if the ledger
        expired this owner. Synchronous on purpose."""
        if self._lost is not None:
            raise self._lost
        try:
            if self.sessions_idle_s is None:
                self.ledger.renew_lease(
                    self.owner,
                    self.inflight.counts(),
                    incarnation=self.incarnation,
                    secret=self.secret,
                )
            else:
                touched, self._touched = self._touched, set()
                self.ledger.renew_lease(
                    self.owner,
                    self.inflight.counts(),
                    incarnation=self.incarnation,
                    sessions=touched,
                    secret=self.secret,
                )
        except LoraLedgerError as exc:
            if exc.code in OWNER_LOST_CODES:
                self._owner_lost(exc)
            raise
        self.renewals += 1

    async def confirm_live(self) -> None:
        """The ledger's own word on this life, awaited before a generation is sent (the
        dispatch executor asks after ``ensure_live`` and the in-flight count, every attempt).
        In process ``ensure_live`` already was the ledger's answer; a remote ledger's renewal
        answers from memory, so without this a zombie (a replaced life, its sessions already
        released) would send one more turn before the refusal came back. Raises the refusal."""
        if self._lost is not None:
            raise self._lost
        if self._confirmer is None:
            return
        try:
            await self._confirmer.confirm_lease(
                self.owner, incarnation=self.incarnation, secret=self.secret
            )
        except LoraLedgerError as exc:
            if exc.code in OWNER_LOST_CODES:
                self._owner_lost(exc)
            raise

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
            if binder.closing or binder._active or now - binder.last_used < self.idle_release_s:
                continue
            if binder.bound is None:
                if binder.bind_slot is None:  # never bound (a failed bind): nothing to release
                    del self._binders[session]
                continue  # a bind in flight is not idle
            binder.idle_closed = True
            idle.append(binder)
        if not idle:
            return 0
        results = await self.close_many(idle, cause=IDLE_CAUSE)
        released = sum(isinstance(r, Released) for r in results)
        self.idle_releases += released
        log.info("sessions.idle_released", owner=self.owner, count=released, of=len(idle))
        return released

    async def _idle_loop(self) -> None:
        idle = self.idle_release_s if self.binding_cache_s is None else self.binding_cache_s
        period = min(idle / 4, 30.0)
        while self._lost is None:
            await anyio.sleep(period)
            if self.binding_cache_s is not None:
                self.drop_unused()
                continue
            try:
                await self.release_idle()
            except LoraLedgerError as exc:
                log.warning("sessions.idle_release_failed", owner=self.owner, error=repr(exc))

    # --- a relay's sessions --------------------------------------------------------------------

    def turn_started(self, session_id: str) -> None:
        """A binder's turn began (a relay reports it with its next renewal)."""
        if self.sessions_idle_s is not None:
            self._touched.add(session_id)
            self._running.add(session_id)

    def turn_ended(self, session_id: str, still_running: bool) -> None:
        """A binder's turn ended (reported with the next renewal, like its start)."""
        if self.sessions_idle_s is not None:
            self._touched.add(session_id)
            if not still_running:
                self._running.discard(session_id)

    def drop_unused(self, now: float | None = None) -> int:
        """A relay forgets (here only: the ledger is not asked) the bindings it cached that
        had no turn here for ``binding_cache_s``, so that its memory stays bounded and the
        next turn of one asks the ledger, which may have released it meanwhile. Returns how
        many."""
        idle = self.binding_cache_s
        if idle is None:
            return 0
        now = anyio.current_time() if now is None else now
        unused = [
            session
            for session, binder in self._binders.items()
            if not binder.closing
            and not binder.in_flight
            and (binder.bind_slot is None or binder.bound is not None)
            and now - binder.last_used >= idle
        ]
        for session in unused:
            del self._binders[session]
        return len(unused)

    def discard(self, binder: SessionBinder) -> None:
        """Forget a binder whose session the ledger says is closed (released elsewhere, or
        idle), without asking the ledger anything: releasing it again would only make this
        worker forget a tombstone it did not write, and a late turn would bind afresh."""
        if (
            self._binders.get(binder.session_id) is binder
            and not binder.in_flight
            and binder.release_slot is None
        ):
            del self._binders[binder.session_id]

    async def _renew_loop(self) -> None:
        while self._lost is None:
            await anyio.sleep(self.renew_every)
            self._touched |= self._running  # a turn still running is a turn now
            if self.gateway.unconfirmed:
                # Requests whose end the engine did not confirm yet are counted (and renewed)
                # until it does: ask again, so a held count ends soon after it can.
                await self.gateway.confirm_ends()
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

    def _spawn(
        self,
        task: Callable[[list[SessionBinder]], Coroutine[Any, Any, None]],
        binders: list[SessionBinder],
    ) -> None:
        if self._tg is None:
            raise LedgerError(Code.LEDGER_CLOSED, f"rollout worker {self.owner} is not running")
        self._tg.start_soon(task, binders)

    def shared_binds(
        self, binders: list[SessionBinder], *, expect_version: int | None = None
    ) -> list[Slot[Bound]]:
        """Each binder's bind slot, starting ONE task for those that have none yet (a group
        bound in one ledger round trip). A slot that succeeded is kept forever (it holds the
        binding); a failed one is dropped, so the next turn asks again. ``expect_version``:
        the version the asking turn names (``Bind.expect_version``), for the fresh ones."""
        fresh = [b for b in binders if b.bind_slot is None]
        for binder in fresh:
            binder.bind_slot = Slot()
            binder.bind_expect = expect_version
        if fresh:
            self._spawn(self._bind_task, fresh)
        slots = [b.bind_slot for b in binders]
        assert all(slot is not None for slot in slots)
        return slots  # type: ignore[return-value]

    def idle_released(self, session_id: str) -> bool:
        """Whether this worker released ``session_id`` for idleness and still remembers it
        (its late turns are refused ``SESSION_CLOSED`` with cause ``idle``)."""
        return session_id in self._idle_released

    async def _bind_task(self, binders: list[SessionBinder]) -> None:
        commands = [
            c.Bind(
                session=b.session_id,
                owner=self.owner,
                incarnation=self.incarnation,
                expect_version=b.bind_expect,
                secret=self.secret,
            )
            for b in binders
        ]
        results = await self._settle(commands, binders, "bind")
        for binder, result in zip(binders, results, strict=True):
            binder.answer_bind(result if isinstance(result, Bound) else self._refusal(result))

    async def _release_task(self, binders: list[SessionBinder]) -> None:
        commands = [
            c.Release(
                session=b.session_id,
                owner=self.owner,
                cause=b.release_cause,
                incarnation=self.incarnation,
                secret=self.secret,
            )
            for b in binders
        ]
        results = await self._settle(commands, binders, "release")
        for binder, result in zip(binders, results, strict=True):
            slot = binder.release_slot
            assert slot is not None
            self._releases.discard(slot)
            if isinstance(result, Released):
                if binder.release_cause == IDLE_CAUSE:  # forgotten later (release_idle)
                    self._idle_released[binder.session_id] = anyio.current_time()
                elif self.sessions_idle_s is None or result.tombstoned:
                    # A relay forgets only the tombstones it wrote: one written by another
                    # (the ledger's idle release, another face) must live on for its writer.
                    self._finished.append(binder.session_id)
                if self._binders.get(binder.session_id) is binder:
                    del self._binders[binder.session_id]
                binder.answer_release(result)
            else:
                binder.answer_release(self._refusal(result))
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
            if what == "bind":
                if binder.bind_slot is not None and not binder.bind_slot.done.is_set():
                    binder.answer_bind(error)
            elif binder.release_slot is not None and not binder.release_slot.done.is_set():
                self._releases.discard(binder.release_slot)
                binder.answer_release(error)

    def _refusal(self, result: Outcome | LoraLedgerError) -> LoraLedgerError:
        if isinstance(result, LoraLedgerError):
            if result.code in OWNER_LOST_CODES:
                self._owner_lost(result)
                return self._lost or result
            return result
        return LedgerError(Code.INVALID_STATE, f"unexpected outcome {result!r}")

    async def _execute(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """``execute_many`` with retries of lost replies and retryable refusals (only the
        commands still unanswered are asked again). Refusals come back in place."""
        policy = self.retry
        results: list[Outcome | LoraLedgerError | None] = [None] * len(commands)
        pending = list(range(len(commands)))
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
        answered = [r for r in results if r is not None]
        assert len(answered) == len(commands), "every command is answered or the call raised"
        return answered

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """One idempotent call (register, deregister), asked again after a lost reply."""
        policy = self.retry
        for attempt in range(policy.attempts):
            try:
                return await call()
            except Exception as exc:
                if attempt == policy.attempts - 1 or not policy.retryable(exc):
                    raise
                await anyio.sleep(policy.delay(attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

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
            outcome = await self._call(
                lambda: self.ledger.deregister_owner(
                    self.owner, incarnation=self.incarnation, secret=self.secret
                )
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
            await binder.wait_idle()
        for slot in list(self._releases):
            await slot.done.wait()
        self._finished.extend(self._idle_released)  # no one is left to refuse their late turns
        self._idle_released.clear()
        if self._lost is None:
            await self.flush_forgets()
