"""The ledger service: one writer owns the state; callers submit commands and await outcomes.

How a command flows:

1. ``execute`` puts the command on a queue and waits. The queue is bounded (``max_queued``):
   when the writer falls that far behind, ``execute`` waits for room before queuing (callers
   feel the back-pressure as latency, and memory stays bounded), it never fails for it.
2. The writer task takes every command already queued (group commit), decides each one in
   order against the in-memory state, applying the accepted events as it goes so the next
   command sees them.
3. All events of the batch are appended in ONE store transaction, with ``expected_seq`` set to
   the last seq this writer knows: if another controller appended meanwhile, the append is
   refused and this ledger is fenced (Kafka's zombie fencing, by optimistic concurrency).
4. Only after COMMIT returns is anyone answered. A refusal is answered without writing, except
   refused engine receipts, which are recorded (``ReceiptRejected``).

If the append fails, the in-memory state has run ahead of the log; it is rebuilt from the log
(the durable truth) and every caller of the batch gets the error. Nothing is ever half-applied.

Opening a ledger replays the log (from the newest matching snapshot), appends
``ControllerStarted`` (a new epoch), and starts the writer inside the caller's structured scope:
``async with Ledger.open(store) as ledger: ...``.

Fencing is noticed without waiting for an append: a ledger that writes nothing (an idle
service) would otherwise go on answering from a state another controller has already moved
on (its leases renewed, its cached session bindings served). So while it is open it also
watches the log (one read of the records after its own, every ``watch_every_s``): a
``ControllerStarted`` there is another controller's, and fences this one as a refused append
would. A fenced ledger refuses every command and every lease renewal (``FENCED``), reports
itself in :attr:`Ledger.fenced`, and wakes :meth:`Ledger.wait_fenced`, so the process running
it can stop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import (
    MemoryObjectReceiveStream,
    MemoryObjectSendStream,
    MemoryObjectStreamStatistics,
)

from evlog.errors import LoraLedgerError, StoreCode, StoreError
from evlog.events import ControllerStarted
from evlog.record import Pending, Record, pending_many
from evlog.store import EventStore
from projections import invariants
from projections.recovery import recover, save_snapshot
from projections.registry import RegistryState, evolve
from publisher.core import commands as c
from publisher.core.decider import Decision, decide
from publisher.core.errors import Code, LedgerError
from publisher.core.leases import LeaseBook
from publisher.core.ledger_api import LedgerAPI
from publisher.core.outcomes import Outcome
from publisher.core.session_activity import SessionActivity
from publisher.logs import get_logger

CODE_VERSION = "loraledger-0.1.0"
# Commands queued for the writer before ``execute`` makes the next caller wait. Far above what
# group commit needs (a batch is whatever queued during one COMMIT: 256 concurrent sessions
# queue at most 256), small enough that a stalled store cannot grow memory without limit.
MAX_QUEUED = 4096
# How often an open ledger reads the log for another controller's ``ControllerStarted``: one
# indexed read of the records after its own, so a fenced service stops within about a second.
WATCH_EVERY_S = 1.0
# Records read per watch: more than one batch of this writer's own can be in flight (their
# COMMIT done, not yet settled); a rival's record beyond them is found by the next watch.
_WATCH_READ = 256

log = get_logger("loraledger.ledger")


class _Call:
    """One queued command and the slot its answer lands in. ``woken`` is a bare asyncio
    future, resolved once the answer is in: every caller waits on something of its own anyway
    (an ``anyio.Event`` shared by a batch still made one future per waiter inside, behind two
    more layers), and at 256 callers per batch that wrapper was a tenth of the ledger's own
    cost per command. A caller cancelled while waiting cancels only its own future; its
    command is still decided and answered (``_wake`` skips a future already done)."""

    __slots__ = ("command", "error", "outcome", "woken")

    def __init__(self, command: c.Command, woken: asyncio.Future[None]) -> None:
        self.command = command
        self.woken = woken
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None


class Ledger(LedgerAPI):
    """The single writer. Construct with :meth:`open`; every method is safe to call
    concurrently from many tasks. The typed methods (``bind``, ``commit``, ...) are
    :class:`~publisher.core.ledger_api.LedgerAPI`'s, each one call of :meth:`execute`."""

    def __init__(
        self,
        store: EventStore,
        state: RegistryState,
        *,
        clock: Callable[[], float],
        code_version: str,
        snapshot_every: int,
        check_invariants: bool,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._store = store
        self._state = state
        self._clock = clock
        self.code_version = code_version
        self._snapshot_every = snapshot_every
        self._check = check_invariants
        self._since_snapshot = 0
        self.max_queued = max_queued
        self._send: MemoryObjectSendStream[_Call] | None = None
        self._fenced: LedgerError | None = None
        self._fenced_event = anyio.Event()
        self._broken: LedgerError | None = None
        self._epoch = 0  # this controller's own epoch, once its ControllerStarted is durable
        self._committed_seq = 0  # the last seq this ledger appended (or found at open)
        self._committed = anyio.Event()  # set, and replaced, after every commit
        self._watch_scope = anyio.CancelScope()
        self._in_flight: anyio.Event | None = None  # set when the append in flight finished
        self._failed_append: BaseException | None = None
        self.leases = LeaseBook()
        self.activity = SessionActivity()  # client-held sessions' last turns (soft state)
        self.batches = 0
        self.events_written = 0

    # --- lifecycle ----------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        store: EventStore,
        *,
        clock: Callable[[], float] = time.time,
        code_version: str = CODE_VERSION,
        snapshot_every: int = 200_000,
        check_invariants: bool = True,
        snapshot_on_close: bool = True,
        max_queued: int = MAX_QUEUED,
        watch_every_s: float | None = WATCH_EVERY_S,
    ) -> AsyncIterator[Ledger]:
        """Recover the state from ``store``, start a new epoch, and serve until the block ends
        (the commands queued by then are still decided and answered). ``max_queued`` bounds
        the command queue (see :data:`MAX_QUEUED`); ``watch_every_s`` is how often the log is
        read for another controller (None: only a refused append tells, see the module
        docstring)."""
        if watch_every_s is not None and not (math.isfinite(watch_every_s) and watch_every_s > 0):
            raise ValueError(
                f"watch_every_s must be a finite number of seconds > 0 or None: {watch_every_s}"
            )
        state = await recover(store)
        ledger = cls(
            store,
            state,
            clock=clock,
            code_version=code_version,
            snapshot_every=snapshot_every,
            check_invariants=check_invariants,
            max_queued=max_queued,
        )
        now = clock()
        for owner, record in state.owners.items():
            if record.live:  # its in-flight counts unknown until it renews
                ledger.leases.grant(owner, now, heard=False)
        send, receive = anyio.create_memory_object_stream[_Call](max_buffer_size=max_queued)
        ledger._send = send
        ledger._committed_seq = state.last_seq
        async with anyio.create_task_group() as tg:
            tg.start_soon(ledger._writer, receive)
            try:
                await ledger.execute(c.StartController(code_version=code_version))
                ledger._epoch = ledger._state.epoch
                log.info("ledger.opened", epoch=ledger._epoch, seq=ledger._state.last_seq)
                if watch_every_s is not None:
                    tg.start_soon(ledger._watch, watch_every_s)
                yield ledger
            finally:
                ledger._send = None
                ledger._watch_scope.cancel()
                await send.aclose()  # the writer drains what is queued, then returns
        if snapshot_on_close and ledger._fenced is None and ledger._since_snapshot:
            with anyio.CancelScope(shield=True):
                await save_snapshot(store, ledger._state)

    # --- reading --------------------------------------------------------------------------------

    @property
    def state(self) -> RegistryState:
        """The live state. Read-only for callers: mutate it and you break the ledger.

        It may already hold the decisions of one batch whose COMMIT is in flight (the writer
        decides ahead); those callers are answered only once their events are durable, and if
        the COMMIT fails the state is rebuilt from the log. Use it for routing and reporting,
        never as proof that something happened: proof is an answered command."""
        return self._state

    @property
    def store(self) -> EventStore:
        return self._store

    @property
    def epoch(self) -> int:
        """This controller's own epoch (0 until its ``ControllerStarted`` is durable). Not
        ``state.epoch``: once fenced, the state is rebuilt from the log and shows the rival's."""
        return self._epoch

    @property
    def fenced(self) -> LedgerError | None:
        """Why this ledger stopped writing because another controller took the log over
        (``FENCED``, naming both epochs), or None. Once set, it never clears: the process
        must stop (its leases and cached session bindings may be stale)."""
        return self._fenced

    async def wait_fenced(self) -> LedgerError:
        """Wait until this ledger is fenced (see :attr:`fenced`) and return why."""
        await self._fenced_event.wait()
        assert self._fenced is not None
        return self._fenced

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
        secret: str = "",
    ) -> None:
        """As :meth:`LedgerAPI.renew_lease`, refused once this ledger is fenced: a lease of
        this epoch says nothing any more (the new controller may have released the owner's
        sessions), and every turn checks it first, so no cached binding is served after."""
        if self._fenced is not None:
            raise self._fenced
        super().renew_lease(
            owner, inflight, incarnation=incarnation, sessions=sessions, secret=secret
        )

    def clock(self) -> float:
        return self._clock()

    def queue_statistics(self) -> MemoryObjectStreamStatistics:
        """The command queue now: ``current_buffer_used`` commands wait for the writer (at most
        ``max_queued``), ``tasks_waiting_send`` callers wait for room (back-pressure)."""
        if self._send is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger is closed")
        return self._send.statistics()

    async def wait_committed(self, seq: int) -> None:
        """Wait until a record after ``seq`` is durable (a state change others may wait on:
        the routing's long poll). Cheap: one event shared by every waiter, set per commit."""
        while self._committed_seq <= seq:
            await self._committed.wait()

    def subscribe(self, after: int | None = None) -> AsyncIterator[Record]:
        """Every record after ``after`` (default: from the durable end of the log), as it is
        committed. (Not from ``state.last_seq``: the state may already hold the decisions of
        a batch whose COMMIT is still in flight, and their records must not be skipped.)"""
        return self._store.follow(self._store.last_seq if after is None else after)

    # --- executing ------------------------------------------------------------------------------

    async def execute(self, command: c.Command) -> Outcome:
        """Decide, append durably, answer. Raises ``LedgerError`` for a refusal. Waits for room
        first when ``max_queued`` commands are already queued."""
        call = self._enqueue(command) or await self._submit(command)
        await call.woken
        if call.error is not None:
            raise call.error
        assert call.outcome is not None
        return call.outcome

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """Submit a group at once (one Ray round trip for a whole batch of sessions). Each
        command is decided on its own; refusals come back in place, not raised. (A ledger
        that closes while the group waits for room refuses the rest of the group in place.)"""
        calls: list[_Call | LoraLedgerError] = []
        for command in commands:
            try:
                calls.append(await self._submit(command))
            except LoraLedgerError as refusal:
                if not calls:
                    raise  # nothing was queued: the ledger refuses the whole group
                calls.append(refusal)
        results: list[Outcome | LoraLedgerError] = []
        for call in calls:
            if isinstance(call, LoraLedgerError):
                results.append(call)
                continue
            await call.woken
            if call.error is None:
                assert call.outcome is not None
                results.append(call.outcome)
            elif isinstance(call.error, LoraLedgerError):
                results.append(call.error)
            else:
                raise call.error
        return results

    def _enqueue(self, command: c.Command) -> _Call | None:
        """Queue ``command`` without waiting; None when the queue is full (then
        :meth:`_submit` waits for room). Not a coroutine: the hot path creates none."""
        send = self._send
        if self._fenced is not None or self._broken is not None or send is None:
            raise self._refusal()
        call = _Call(command, asyncio.get_running_loop().create_future())
        try:
            send.send_nowait(call)
        except anyio.WouldBlock:
            return None
        return call

    async def _submit(self, command: c.Command) -> _Call:
        call = self._enqueue(command)
        if call is not None:
            return call
        # The queue is full: wait for room.
        send = self._send
        if send is None:
            raise self._refusal()
        call = _Call(command, asyncio.get_running_loop().create_future())
        try:
            await send.send(call)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise self._refusal() from None
        return call

    def _refusal(self) -> LedgerError:
        """Why no command is accepted any more: fenced, the writer stopped, or closed."""
        return (
            self._fenced or self._broken or LedgerError(Code.LEDGER_CLOSED, "the ledger is closed")
        )

    async def _writer(self, receive: MemoryObjectReceiveStream[_Call]) -> None:
        batch: list[_Call] = []
        async with receive, anyio.create_task_group() as commits:
            try:
                while True:
                    try:
                        batch = [await receive.receive()]
                    except anyio.EndOfStream:
                        break
                    while True:
                        try:
                            batch.append(receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    await self._process(batch, commits)
                    batch = []
                if self._in_flight is not None:
                    await self._in_flight.wait()
            except BaseException as exc:
                # A bug (an invariant broke) or cancellation: nobody may wait forever. Fail the
                # batch in hand and everything still queued, refuse every later call, re-raise.
                self._broken = LedgerError(
                    Code.LEDGER_CLOSED, f"the ledger writer stopped: {exc!r}"
                )
                log.critical("ledger.writer_stopped", error=repr(exc))
                while True:
                    try:
                        batch.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                for call in batch:
                    if call.outcome is None and call.error is None:
                        self._answer(call, error=self._broken)
                _wake(batch)
                raise

    async def _process(self, batch: list[_Call], commits: TaskGroup) -> None:
        """Decide a batch while the previous batch's COMMIT is still in flight (pipelining),
        then append it once that COMMIT succeeded.

        Deciding ahead is speculation: the state already holds the previous batch's events,
        which are not durable yet. Nothing is answered until everything it relied on is
        durable, and if the previous append fails, the state is rebuilt from the log and this
        batch is decided again from scratch (its callers were never answered)."""
        if self._since_snapshot >= self._snapshot_every:
            await self._settle()
            if self._fenced is None:
                self._since_snapshot = 0
                await save_snapshot(self._store, self._state)
        while True:
            if self._in_flight is not None and self._in_flight.is_set():
                await self._settle()  # finished already: no need to speculate on it
            if self._fenced is not None:
                for call in batch:
                    self._answer(call, error=self._fenced)
                _wake(batch)
                return
            state = self._state
            expected = state.last_seq
            events = []
            decided = []
            for call in batch:
                decision = decide(state, call.command)
                for event in decision.events:
                    evolve(state, event)
                    events.append(event)
                decided.append(decision)
            if events:
                state.last_seq = expected + len(events)
                if self._check:
                    invariants.check(state, deep=False)
            if await self._settle():
                break  # everything this batch saw is durable
            # The previous append failed: our decisions stood on events that never landed.
        if not events:
            self._deliver(batch, decided)
            return
        pendings = pending_many(events, self._clock())
        finished = self._in_flight = anyio.Event()
        commits.start_soon(self._commit, batch, decided, pendings, expected, finished)

    async def _settle(self) -> bool:
        """Wait for the append in flight. False if it failed (the state is then rebuilt)."""
        finished = self._in_flight
        if finished is None:
            return True
        await finished.wait()
        self._in_flight = None
        if self._failed_append is None:
            return True
        self._failed_append = None  # the commit task already rebuilt the state from the log
        return False

    async def _commit(
        self,
        batch: list[_Call],
        decided: list[Decision],
        pendings: list[Pending],
        expected: int,
        finished: anyio.Event,
    ) -> None:
        try:
            seqs = await self._store.append(pendings, expected_seq=expected)
        except BaseException as exc:
            # The state ran ahead of the log: rebuild it from the log (the durable truth)
            # before anyone hears about it; the writer re-decides what it speculated on.
            self._failed_append = exc
            with anyio.CancelScope(shield=True):
                self._state = await recover(self._store)
            error = self._failure(exc)  # after the rebuild: it names the rival's epoch
            for call in batch:
                self._answer(call, error=error)
            _wake(batch)
            finished.set()
            raise_if_cancelled(exc)
            return
        if seqs[-1] != expected + len(pendings):
            raise AssertionError(f"store gave seqs up to {seqs[-1]}, expected {expected}+")
        self._committed_seq = seqs[-1]
        committed, self._committed = self._committed, anyio.Event()
        committed.set()
        self.batches += 1
        self.events_written += len(pendings)
        self._since_snapshot += len(pendings)
        self._deliver(batch, decided)
        finished.set()

    def _deliver(self, batch: list[_Call], decided: list[Decision]) -> None:
        for call, decision in zip(batch, decided, strict=True):
            call.error = decision.error
            call.outcome = decision.outcome if decision.error is None else None
        _wake(batch)

    def _failure(self, exc: BaseException) -> BaseException:
        """What callers of a failed append are told (and whether this ledger is fenced)."""
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            return LedgerError(
                Code.LEDGER_CLOSED,
                "the ledger stopped during an append; replay the log to learn the outcome",
            )
        if isinstance(exc, StoreError) and exc.code == StoreCode.SEQ_CONFLICT:
            rival = self._state.epoch  # the state was just rebuilt from the log
            return self._fence(rival if rival > self._epoch else None)
        return exc

    def _fence(self, by_epoch: int | None) -> LedgerError:
        """Stop writing for good: another controller (of epoch ``by_epoch``, when known)
        appended to the log. Every later command and renewal is refused with this error."""
        if self._fenced is None:
            by = "" if by_epoch is None else f" (epoch {by_epoch})"
            own = f"epoch {self._epoch}" if self._epoch else "not started yet"
            self._fenced = LedgerError(
                Code.FENCED,
                f"another controller{by} appended to this log; this ledger ({own}) stopped writing",
                epoch=self._epoch,
                fenced_by_epoch=by_epoch,
            )
            log.error(
                "ledger.fenced", epoch=self._epoch, by_epoch=by_epoch, seq=self._state.last_seq
            )
            self._fenced_event.set()
        return self._fenced

    async def _watch(self, every_s: float) -> None:
        """Read the log after this ledger's own records every ``every_s`` for another
        controller's ``ControllerStarted`` (this ledger writes its own once, at open, before
        the watch starts, so any later one is a rival's). Records of this ledger's own batch in
        flight may show up first; they are never a ``ControllerStarted``. The watch is advisory:
        a failed read is logged and tried again at the next tick, never raised into the
        ledger's scope (the writer hears of a broken store on its own)."""
        with self._watch_scope:
            while self._fenced is None:
                await anyio.sleep(every_s)
                try:
                    records = await self._store.read(self._committed_seq, limit=_WATCH_READ)
                except LoraLedgerError as exc:
                    if exc.code == StoreCode.STORE_CLOSED:
                        return
                    log.warning("ledger.watch_failed", error=str(exc))
                    continue
                except Exception as exc:
                    log.warning("ledger.watch_failed", error=repr(exc))
                    continue
                for record in records:
                    if isinstance(record.event, ControllerStarted):
                        self._fence(record.event.epoch)
                        return

    @staticmethod
    def _answer(
        call: _Call, *, outcome: Outcome | None = None, error: BaseException | None = None
    ) -> None:
        call.outcome = outcome
        call.error = error


def _wake(batch: list[_Call]) -> None:
    """Wake every waiter of an answered batch (a cancelled waiter's future is already done)."""
    for call in batch:
        if not call.woken.done():
            call.woken.set_result(None)


def raise_if_cancelled(exc: BaseException) -> None:
    """Re-raise cancellation after cleanup (the writer must not swallow its own cancellation)."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        raise exc
