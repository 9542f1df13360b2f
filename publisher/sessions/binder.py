"""One session, as a rollout coroutine holds it: bind on the first generation, pin every later
turn, release once (docs/sessions.md).

Rules and why:

* **Bind on the first generation, once.** The version a session serves is the default *at its
  first generation*, not at creation (a session created long before it runs must not be pinned
  to an old version for nothing). Concurrent first generations share ONE bind task, owned by
  the worker's task group (a :class:`Slot`): a waiter that is cancelled stops waiting, the bind
  goes on, and its result is cached. Nothing ever re-chooses: the ledger answers the same
  binding forever, so a resume (a new binder for the same session id, in any worker or process)
  gets it too.
* **At most once below the caller.** A generation is never resent here (the gateway's rule);
  binds and releases are idempotent in the ledger, so a lost reply is simply asked again.
* **Close waits for (or cancels) the session's generations, then releases exactly once.** The
  release runs in the worker's task group too, so a caller cancelled mid-close cannot leave
  half a cleanup. Closing before the first bind tombstones the session: it can never bind.
* **A stale worker is told, never rebound.** Every call checks the lease first; once the ledger
  ended the owner, bind/generate/close raise ``LEASE_EXPIRED`` (or ``OWNER_RESTARTED``,
  ``OWNER_DEREGISTERED``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar

import anyio

from engines.contract import SamplingParams
from evlog.errors import LoraLedgerError
from projections.staleness import TOO_STALE
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound, Released
from publisher.gateway import Gateway, Owner, Served
from publisher.logs import get_logger

log = get_logger("loraledger.sessions")

T = TypeVar("T")
# The release cause of a session that went ``idle_release_s`` without a turn.
IDLE_CAUSE = "idle"


class Slot(Generic[T]):
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


class BinderOwner(Owner, Protocol):
    """The worker a binder belongs to (a :class:`~publisher.sessions.worker.RolloutWorker`), as
    the binder sees it: the lease and the in-flight tally the gateway checks and counts (it is
    the turns' :class:`~publisher.gateway.Owner`), the gateway, and the shared tasks that bind
    and release many binders in one ledger round trip."""

    @property
    def gateway(self) -> Gateway: ...

    @property
    def idle_release_s(self) -> float: ...

    @property
    def binding_cache_s(self) -> float | None: ...

    def shared_binds(
        self, binders: list[SessionBinder], *, expect_version: int | None = None
    ) -> list[Slot[Bound]]: ...

    def turn_started(self, session_id: str) -> None: ...

    def turn_ended(self, session_id: str, still_running: bool) -> None: ...

    def idle_released(self, session_id: str) -> bool: ...

    async def close_many(
        self, binders: list[SessionBinder], *, cancel: bool = False, cause: str | None = None
    ) -> list[Released | LoraLedgerError]: ...


class SessionBinder:
    """One session, as a rollout coroutine sees it. Get one with :meth:`RolloutWorker.session`.

    ``generate`` binds on first use and then always sends the same immutable ``lora_name``;
    ``close`` waits for (``cancel=True``: cancels) the session's generations, then releases.

    The worker batches binds and releases of many binders into one ledger call each; the
    slots below are where those shared tasks leave their answers (:meth:`answer_bind`,
    :meth:`answer_release`), and ``closing`` / ``release_cause`` are what it reads."""

    def __init__(self, worker: BinderOwner, session_id: str) -> None:
        self.session_id = session_id
        self._worker = worker
        self._bound: Bound | None = None
        self.bind_slot: Slot[Bound] | None = None  # the shared bind, once asked
        self.bind_expect: int | None = None  # the version the turn that asked it named
        self.release_slot: Slot[Released] | None = None  # the shared release, once asked
        self.closing = False  # no generation may start any more
        self.release_cause = "closed"  # what the release records (SessionReleased.cause)
        self.idle_closed = False  # closed by the worker's idle release
        self._active: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None  # None or set: nothing in flight
        self._next_turn = 0
        self._stale: LedgerError | None = None  # set once a turn was refused as too stale
        self.last_used = anyio.current_time()  # the end of its last turn (anyio's clock)

    @property
    def bound(self) -> Bound | None:
        """The binding once known (None before the first generation finished binding)."""
        return self._bound

    @property
    def closed(self) -> bool:
        return self.closing

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
        return await self._worker.shared_binds([self])[0].wait()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        turn: int | None = None,
        request_id: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Served:
        """One generation on the session's version, sent at most once under the worker's
        lease (see :meth:`Gateway.generate` for its errors). ``turn`` labels the provenance row
        (default: a counter per binder; pass it explicitly to label a retry of the same turn)."""
        self._check_usable()
        turn = self.next_turn(turn)
        async with self.turn() as bound:
            return await self._worker.gateway.generate(
                bound,
                prompt,
                params,
                turn=turn,
                request_id=request_id,
                extra_body=extra_body,
                owner=self._worker,
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
    async def turn(self, *, expect_version: int | None = None) -> AsyncIterator[Bound]:
        """One generation of this session, as any face sends it (:meth:`generate`, the
        OpenAI face): binds on the first turn (the shared bind) and yields the binding. The body
        sends through the gateway's executor (``Gateway.dispatch`` with ``owner`` this worker),
        which checks the lease and the staleness before each attempt. A turn refused as beyond
        the deployment's ``max_staleness`` (``SESSION_TOO_STALE``, nothing sent) ends the
        session: it is released with cause ``too_stale`` and every later call hears the same
        refusal. ``close`` waits for the body (``cancel=True`` cancels it, and this raises
        ``SESSION_CLOSED``); the lease's in-flight counts are renewed when it ends.

        ``expect_version``: the version this turn names, if any. A first turn then binds only
        if that version is the ledger's default (``VERSION_NOT_BOUND`` otherwise, nothing
        bound); an existing binding is yielded whatever it is, for the caller to judge."""
        self._check_usable()
        cache = self._worker.binding_cache_s
        if (
            cache is not None
            and self._bound is not None
            and not self._active
            and anyio.current_time() - self.last_used >= cache
        ):
            # A relay's binding unused that long may have been released in the ledger
            # meanwhile (idle, or through another face): ask again rather than serve it.
            self._bound = None
            self.bind_slot = None
        stale: LedgerError | None = None
        with anyio.CancelScope() as scope:
            self._enter(scope)
            try:
                bound = self._bound
                if bound is None:
                    bound = await self._bind_as(expect_version)
                try:
                    yield bound
                except LedgerError as refusal:
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

    async def _bind_as(self, expect_version: int | None) -> Bound:
        """The shared bind, as this turn needs it. A bind already in flight for another turn
        is shared whatever it expects; if it was refused for that turn's named version
        (``VERSION_NOT_BOUND``) and this turn names another (or none), this one asks again."""
        while True:
            slot = self._worker.shared_binds([self], expect_version=expect_version)[0]
            asked = self.bind_expect
            try:
                return await slot.wait()
            except LedgerError as refusal:
                if refusal.code != Code.VERSION_NOT_BOUND or asked == expect_version:
                    raise

    async def _drop_stale(self, refusal: LedgerError) -> None:
        """A turn refused as too stale ends the session: it is released with cause
        ``too_stale`` (recorded, so its version becomes reclaimable once its other sessions
        go), and every later call hears the same refusal. The release runs in the worker's
        task group, so a caller cancelled here cannot leave the session bound."""
        if self._stale is None:
            self._stale = refusal
            self.release_cause = TOO_STALE
        result = (await self._worker.close_many([self]))[0]
        if isinstance(result, LoraLedgerError):
            log.error("sessions.stale_release_failed", session=self.session_id, error=str(result))

    def _check_usable(self) -> None:
        self._worker.ensure_live()  # a stale worker hears LEASE_EXPIRED first, always
        if self._stale is not None:
            raise self._stale
        if self.closing or self._worker.idle_released(self.session_id):
            if self.idle_closed or self._worker.idle_released(self.session_id):
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
        self._worker.turn_started(self.session_id)

    def _exit(self, scope: anyio.CancelScope) -> None:
        self._active.discard(scope)
        self.last_used = anyio.current_time()
        self._worker.turn_ended(self.session_id, still_running=bool(self._active))
        if not self._active and self._idle is not None:
            self._idle.set()

    async def quiesce(self, cancel: bool) -> None:
        """Wait for (``cancel``: cancel) the running generations and a bind in progress. Once
        ``closing`` is set no generation can start, so idle stays idle."""
        if cancel:
            for scope in list(self._active):
                scope.cancel()
        await self.wait_idle()
        if self.bind_slot is not None:  # release after the bind in the log, never before
            await self.bind_slot.done.wait()

    async def wait_idle(self) -> None:
        """Until no generation of this session is running."""
        while self._active and self._idle is not None:
            await self._idle.wait()

    # --- the worker's shared tasks answer here -------------------------------------------------

    def answer_bind(self, result: Bound | LoraLedgerError) -> None:
        """The shared bind's answer. A binding is kept forever; a failed bind is not cached:
        the next generation asks again (the ledger still decides, so nothing can re-choose a
        binding that exists)."""
        slot = self.bind_slot
        assert slot is not None, "a bind answered without being asked"
        if isinstance(result, Bound):
            self._bound = result
            slot.set(result)
        else:
            self.bind_slot = None
            slot.fail(result)

    def answer_release(self, result: Released | LoraLedgerError) -> None:
        """The shared release's answer; a failed one may be asked again by a later close."""
        slot = self.release_slot
        assert slot is not None, "a release answered without being asked"
        if isinstance(result, Released):
            slot.set(result)
        else:
            self.release_slot = None
            slot.fail(result)
