"""The ledger service: one writer owns the state; callers submit commands and await outcomes.

How a command flows:

1. ``execute`` puts the command on a queue and waits.
2. The writer task takes every command already queued (group commit), decides each one in
   order against the in-memory state, applying the accepted events as it goes so the next
   command sees them.
3. All events of the batch are appended in ONE store transaction, with ``expected_seq`` set to
   the last seq this writer knows: if another controller appended meanwhile, the append is
   refused and this ledger is fenced (Kafka's zombie fencing, by optimistic concurrency).
4. Only after COMMIT returns is anyone answered. A refusal is answered without writing, except
   the receipt refusals that DESIGN §3 records.

If the append fails, the in-memory state has run ahead of the log; it is rebuilt from the log
(the durable truth) and every caller of the batch gets the error. Nothing is ever half-applied.

Opening a ledger replays the log (from the newest matching snapshot), appends
``ControllerStarted`` (a new epoch), and starts the writer inside the caller's structured scope:
``async with Ledger.open(store) as ledger: ...``.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar, overload

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from evlog.errors import Code, LedgerError
from evlog.events import InFlight
from evlog.record import Pending, Record, pending_many
from evlog.store import EventStore
from projections import invariants
from projections.registry import RegistryState, evolve
from publisher import commands as c
from publisher.decider import Decision, decide
from publisher.leases import LeaseBook
from publisher.outcomes import (
    Allocated,
    AttemptEnded,
    Bound,
    Claimed,
    Done,
    Expired,
    Forgotten,
    InventoryRecorded,
    Outcome,
    Published,
    ReclaimGranted,
    Released,
    Skipped,
    UnloadRecorded,
)
from publisher.recovery import recover, save_snapshot

CODE_VERSION = "loraledger-0.1.0"

log = structlog.get_logger("loraledger.ledger")
OutcomeT = TypeVar("OutcomeT", bound=Outcome)
OtherOutcomeT = TypeVar("OtherOutcomeT", bound=Outcome)


class _Call:
    """One queued command and the slot its answer lands in. ``done`` is shared by every call
    of the same batch (they are answered together, after the same COMMIT): one event per
    transaction instead of one per command."""

    __slots__ = ("command", "done", "error", "outcome")

    def __init__(self, command: c.Command, done: anyio.Event) -> None:
        self.command = command
        self.done = done
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None


class Ledger:
    """The single writer. Construct with :meth:`open`; every method is safe to call
    concurrently from many tasks."""

    def __init__(
        self,
        store: EventStore,
        state: RegistryState,
        *,
        clock: Callable[[], float],
        code_version: str,
        snapshot_every: int,
        check_invariants: bool,
    ) -> None:
        self._store = store
        self._state = state
        self._clock = clock
        self.code_version = code_version
        self._snapshot_every = snapshot_every
        self._check = check_invariants
        self._since_snapshot = 0
        self._send: MemoryObjectSendStream[_Call] | None = None
        self._fenced: LedgerError | None = None
        self._broken: LedgerError | None = None
        self._next_done: anyio.Event | None = None
        self._in_flight: anyio.Event | None = None  # set when the append in flight finished
        self._failed_append: BaseException | None = None
        self.leases = LeaseBook()
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
    ) -> AsyncIterator[Ledger]:
        state = await recover(store)
        ledger = cls(
            store,
            state,
            clock=clock,
            code_version=code_version,
            snapshot_every=snapshot_every,
            check_invariants=check_invariants,
        )
        now = clock()
        for owner, record in state.owners.items():
            if not record.expired:
                ledger.leases.grant(owner, now)
        send, receive = anyio.create_memory_object_stream[_Call](max_buffer_size=math.inf)
        ledger._send = send
        async with anyio.create_task_group() as tg:
            tg.start_soon(ledger._writer, receive)
            try:
                await ledger.execute(c.StartController(code_version=code_version))
                log.info("ledger.opened", epoch=ledger._state.epoch, seq=ledger._state.last_seq)
                yield ledger
            finally:
                ledger._send = None
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

    def clock(self) -> float:
        return self._clock()

    def subscribe(self, after: int | None = None) -> AsyncIterator[Record]:
        """Every record after ``after`` (default: from the durable end of the log), as it is
        committed. (Not from ``state.last_seq``: the state may already hold the decisions of
        a batch whose COMMIT is still in flight, and their records must not be skipped.)"""
        return self._store.follow(self._store.last_seq if after is None else after)

    # --- executing ------------------------------------------------------------------------------

    async def execute(self, command: c.Command) -> Outcome:
        """Decide, append durably, answer. Raises ``LedgerError`` for a refusal."""
        call = self._submit(command)
        await call.done.wait()
        if call.error is not None:
            raise call.error
        assert call.outcome is not None
        return call.outcome

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LedgerError]:
        """Submit a group at once (one Ray round trip for a whole batch of sessions). Each
        command is decided on its own; refusals come back in place, not raised."""
        calls = [self._submit(command) for command in commands]
        results: list[Outcome | LedgerError] = []
        for call in calls:
            await call.done.wait()
            if call.error is None:
                assert call.outcome is not None
                results.append(call.outcome)
            elif isinstance(call.error, LedgerError):
                results.append(call.error)
            else:
                raise call.error
        return results

    def _submit(self, command: c.Command) -> _Call:
        if self._fenced is not None:
            raise self._fenced
        if self._broken is not None:
            raise self._broken
        if self._send is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger is closed")
        done = self._next_done
        if done is None:
            done = self._next_done = anyio.Event()
        call = _Call(command, done)
        self._send.send_nowait(call)
        return call

    async def _writer(self, receive: MemoryObjectReceiveStream[_Call]) -> None:
        batch: list[_Call] = []
        async with receive, anyio.create_task_group() as commits:
            try:
                while True:
                    try:
                        batch = [await receive.receive()]
                    except anyio.EndOfStream:
                        break
                    # No await between here and the end of the drain: every call queued now
                    # shares one ``done`` event, and later calls get the next one.
                    self._next_done = None
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
            error = self._failure(exc)
            with anyio.CancelScope(shield=True):
                self._state = await recover(self._store)
            for call in batch:
                self._answer(call, error=error)
            _wake(batch)
            finished.set()
            raise_if_cancelled(exc)
            return
        if seqs[-1] != expected + len(pendings):
            raise AssertionError(f"store gave seqs up to {seqs[-1]}, expected {expected}+")
        self.batches += 1
        self.events_written += len(pendings)
        self._since_snapshot += len(pendings)
        self._deliver(batch, decided)
        finished.set()

    def _deliver(self, batch: list[_Call], decided: list[Decision]) -> None:
        for call, decision in zip(batch, decided, strict=True):
            if decision.error is not None:
                self._answer(call, error=decision.error)
            else:
                self._answer(call, outcome=decision.outcome)
        _wake(batch)

    def _failure(self, exc: BaseException) -> BaseException:
        """What callers of a failed append are told (and whether this ledger is fenced)."""
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            return LedgerError(
                Code.LEDGER_CLOSED,
                "the ledger stopped during an append; replay the log to learn the outcome",
            )
        if isinstance(exc, LedgerError) and exc.code == Code.SEQ_CONFLICT:
            self._fenced = LedgerError(
                Code.FENCED,
                "another controller appended to this log; this ledger stopped writing",
            )
            log.error("ledger.fenced", seq=self._state.last_seq)
            return self._fenced
        return exc

    @staticmethod
    def _answer(
        call: _Call, *, outcome: Outcome | None = None, error: BaseException | None = None
    ) -> None:
        call.outcome = outcome
        call.error = error

    @overload
    async def _typed(self, command: c.Command, kind: type[OutcomeT]) -> OutcomeT: ...
    @overload
    async def _typed(
        self, command: c.Command, kind: tuple[type[OutcomeT], type[OtherOutcomeT]]
    ) -> OutcomeT | OtherOutcomeT: ...
    async def _typed(
        self, command: c.Command, kind: type[Outcome] | tuple[type[Outcome], ...]
    ) -> Outcome:
        outcome = await self.execute(command)
        assert isinstance(outcome, kind), f"{type(command).__name__} answered {outcome!r}"
        return outcome

    # --- the API: one method per command of DESIGN §4 -----------------------------------------

    async def create_deployment(
        self, deployment: str, *, prefix: str, capacity: int, fleet: Iterable[str] = ()
    ) -> Done:
        command = c.CreateDeployment(
            deployment=deployment, prefix=prefix, capacity=capacity, fleet=tuple(fleet)
        )
        return await self._typed(command, Done)

    async def join_engine(
        self, engine: str, incarnation: str, *, endpoint: str = "", kind: str = "local"
    ) -> Done:
        command = c.JoinEngine(engine=engine, incarnation=incarnation, endpoint=endpoint, kind=kind)
        return await self._typed(command, Done)

    async def observe_restart(self, engine: str, incarnation: str) -> Done:
        return await self._typed(c.ObserveRestart(engine=engine, incarnation=incarnation), Done)

    async def restore_version(self, version_id: int, engine: str, incarnation: str) -> Done:
        command = c.RestoreVersion(version_id=version_id, engine=engine, incarnation=incarnation)
        return await self._typed(command, Done)

    async def repair_engine(self, engine: str, incarnation: str) -> Done:
        return await self._typed(c.RepairEngine(engine=engine, incarnation=incarnation), Done)

    async def leave_engine(self, engine: str) -> Done:
        return await self._typed(c.LeaveEngine(engine=engine), Done)

    async def observe_inventory(
        self, engine: str, incarnation: str, adapters: Iterable[str]
    ) -> InventoryRecorded:
        command = c.ObserveInventory(
            engine=engine, incarnation=incarnation, adapters=tuple(adapters)
        )
        return await self._typed(command, InventoryRecorded)

    async def allocate(
        self,
        version_id: int,
        digest: str,
        *,
        size_bytes: int = 0,
        command_id: str | None = None,
    ) -> Allocated | Skipped:
        command = c.Allocate(
            version_id=version_id, digest=digest, size_bytes=size_bytes, command_id=command_id
        )
        return await self._typed(command, (Allocated, Skipped))

    async def claim_transport(self, version_id: int, attempt: int, owner: str) -> Claimed:
        command = c.ClaimTransport(version_id=version_id, attempt=attempt, owner=owner)
        return await self._typed(command, Claimed)

    async def record_prepared(
        self,
        version_id: int,
        attempt: int,
        engine: str,
        incarnation: str,
        digest: str,
        lora_name: str,
    ) -> Done:
        command = c.RecordPrepared(
            version_id=version_id,
            attempt=attempt,
            engine=engine,
            incarnation=incarnation,
            digest=digest,
            lora_name=lora_name,
        )
        return await self._typed(command, Done)

    async def record_ready(
        self,
        version_id: int,
        attempt: int,
        engine: str,
        incarnation: str,
        digest: str,
        lora_name: str,
    ) -> Done:
        command = c.RecordReady(
            version_id=version_id,
            attempt=attempt,
            engine=engine,
            incarnation=incarnation,
            digest=digest,
            lora_name=lora_name,
        )
        return await self._typed(command, Done)

    async def commit(self, version_id: int, attempt: int) -> Published:
        return await self._typed(c.Commit(version_id=version_id, attempt=attempt), Published)

    async def fail_attempt(
        self,
        version_id: int,
        attempt: int,
        *,
        clean: bool,
        code: str,
        reason: str,
        absent_on: Iterable[str] = (),
    ) -> AttemptEnded:
        command = c.FailAttempt(
            version_id=version_id,
            attempt=attempt,
            clean=clean,
            code=code,
            reason=reason,
            absent_on=tuple(absent_on),
        )
        return await self._typed(command, AttemptEnded)

    async def register_owner(self, owner: str, *, ttl_s: float = 30.0) -> Done:
        now = self._clock()
        outcome = await self._typed(c.RegisterOwner(owner=owner, ttl_s=ttl_s, now=now), Done)
        self.leases.grant(owner, now)
        return outcome

    def renew_lease(
        self, owner: str, inflight: Mapping[tuple[str, int], int] | None = None
    ) -> None:
        """Renew ``owner``'s lease (not logged) and record its in-flight counts per
        (engine, version_id). A stale worker gets ``LEASE_EXPIRED`` / ``UNKNOWN_OWNER``."""
        record = self._state.owners.get(owner)
        if record is None:
            raise LedgerError(Code.UNKNOWN_OWNER, f"owner {owner!r} is not registered")
        if record.expired:
            raise LedgerError(
                Code.LEASE_EXPIRED, f"owner {owner} lost its lease: its sessions were released"
            )
        if inflight is not None:
            _check_inflight(inflight)
        self.leases.renew(owner, self._clock(), inflight)

    async def expire_leases(self) -> list[Expired]:
        """Record the expiry of every owner whose lease ran out (called periodically)."""
        now = self._clock()
        ttls = {o: r.ttl_s for o, r in self._state.owners.items() if not r.expired}
        expired: list[Expired] = []
        for owner, last_seen in self.leases.overdue(now, ttls):
            outcome = await self._typed(
                c.ExpireOwner(owner=owner, now=now, last_seen=last_seen), Expired
            )
            self.leases.drop(owner)
            expired.append(outcome)
            log.warning("ledger.lease_expired", owner=owner, released=outcome.released)
        return expired

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        return self.leases.inflight(version_id)

    async def bind(self, session: str, owner: str) -> Bound:
        return await self._typed(c.Bind(session=session, owner=owner), Bound)

    async def release(self, session: str, owner: str, *, cause: str = "closed") -> Released:
        return await self._typed(c.Release(session=session, owner=owner, cause=cause), Released)

    async def forget(self, sessions: Iterable[str]) -> Forgotten:
        return await self._typed(c.Forget(sessions=tuple(sessions)), Forgotten)

    async def claim_reclaim(
        self, version_id: int, evidence: Iterable[InFlight] = ()
    ) -> ReclaimGranted:
        command = c.ClaimReclaim(version_id=version_id, evidence=tuple(evidence))
        return await self._typed(command, ReclaimGranted)

    async def record_unloaded(
        self, version_id: int, engine: str, incarnation: str
    ) -> UnloadRecorded:
        command = c.RecordUnloaded(version_id=version_id, engine=engine, incarnation=incarnation)
        return await self._typed(command, UnloadRecorded)

    async def mark_reclaim_ambiguous(self, version_id: int, engine: str, reason: str) -> Done:
        command = c.MarkReclaimAmbiguous(version_id=version_id, engine=engine, reason=reason)
        return await self._typed(command, Done)

    def status(self) -> LedgerStatus:
        return status_of(self._state)


# --- status ------------------------------------------------------------------------------------


class VersionStatus(msgspec.Struct, frozen=True, kw_only=True):
    version_id: int
    lora_name: str
    digest: str
    state: str
    attempt: int
    bound: int
    revision: int | None
    holders: tuple[str, ...]


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    incarnation: str
    kind: str
    endpoint: str
    routable: bool
    holds: tuple[str, ...]
    strays: tuple[str, ...]


class LedgerStatus(msgspec.Struct, frozen=True, kw_only=True):
    deployment: str | None
    epoch: int
    last_seq: int
    capacity: int
    capacity_used: int
    default: int | None
    default_revision: int
    sessions_bound: int
    tombstones: int
    owners: int
    blocked_by: tuple[int, ...]
    versions: tuple[VersionStatus, ...]
    engines: tuple[EngineStatus, ...]


def status_of(state: RegistryState) -> LedgerStatus:
    return LedgerStatus(
        deployment=state.deployment,
        epoch=state.epoch,
        last_seq=state.last_seq,
        capacity=state.capacity,
        capacity_used=state.capacity_used(),
        default=state.default,
        default_revision=state.default_revision,
        sessions_bound=len(state.sessions),
        tombstones=len(state.tombstones),
        owners=sum(1 for o in state.owners.values() if not o.expired),
        blocked_by=tuple(state.blocked_by()),
        versions=tuple(
            VersionStatus(
                version_id=v.version_id,
                lora_name=v.lora_name,
                digest=v.digest,
                state=v.state,
                attempt=v.attempt,
                bound=v.bound,
                revision=v.revision,
                holders=state.holders(v.lora_name, routable_only=False),
            )
            for v in sorted(state.versions.values(), key=lambda v: v.version_id)
        ),
        engines=tuple(
            EngineStatus(
                engine=e.engine,
                incarnation=e.incarnation,
                kind=e.kind,
                endpoint=e.endpoint,
                routable=e.routable,
                holds=tuple(sorted(e.holds)),
                strays=e.strays,
            )
            for e in sorted(state.engines.values(), key=lambda e: e.engine)
        ),
    )


def _check_inflight(inflight: Mapping[tuple[str, int], int]) -> None:
    """Refuse (``INVALID_INPUT``, nothing renewed) counts a reclaim decision could misread: a
    negative count cancelled another reporter's positive one in the reclaim driver's sum (an
    unload under a running request), and any non-zero one held the version forever."""
    for key, count in inflight.items():
        engine, version_id = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if (
            not isinstance(engine, str)
            or not engine
            or not isinstance(version_id, int)
            or isinstance(version_id, bool)
            or version_id <= 0
            or not isinstance(count, int)
            or isinstance(count, bool)
            or count < 0
        ):
            raise LedgerError(
                Code.INVALID_INPUT,
                f"in-flight count {key!r}: {count!r} must be (engine, version id > 0): count >= 0",
            )


def _wake(batch: list[_Call]) -> None:
    """Wake every waiter of an answered batch (normally one shared event)."""
    for done in {id(call.done): call.done for call in batch}.values():
        done.set()


def raise_if_cancelled(exc: BaseException) -> None:
    """Re-raise cancellation after cleanup (the writer must not swallow its own cancellation)."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        raise exc
