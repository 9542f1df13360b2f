"""Rebuilding the registry state from a store, and replaying a log with every invariant checked.

``recover`` is how a ledger starts (and how tests rebuild what the log says): the newest
matching snapshot, then the tail. Snapshots are a cache keyed by the projection's code version:
one written by other projection code is ignored (and the state is rebuilt from seq 0), so
changing ``evolve`` can never be masked by a stale snapshot.

:class:`CheckedReplay` is the one implementation of "replay and check": every record applied in
order, the cheap invariants after each one (the per-session ones too with ``deep``), the deep
ones at the end, stopping at the first record that cannot be applied or breaks one.
``recover(check=True)`` raises what it finds; ``loraledger verify`` reports it.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from evlog.record import Record
from evlog.store import EventStore, Snapshot
from projections import invariants
from projections.registry import (
    PROJECTION_VERSION,
    RegistryState,
    decode_state,
    encode_state,
    evolve,
)

PROGRESS_EVERY = 4096  # records between two progress reports of a checked replay


async def recover(
    store: EventStore,
    *,
    use_snapshot: bool = True,
    until: int | None = None,
    check: bool = False,
) -> RegistryState:
    """The registry state at ``until`` (default: the end of the log).

    ``check`` runs the cheap invariants after every event and the deep ones at the end, and
    raises ``InvariantViolation`` naming the seq that broke one (an event that cannot be
    applied raises what ``evolve`` raised)."""
    state = RegistryState()
    if use_snapshot:
        snapshot = await store.load_snapshot(PROJECTION_VERSION)
        if snapshot is not None and (until is None or snapshot.seq <= until):
            state = decode_state(snapshot.state)
    if not check:
        async for record in store.iterate(after=state.last_seq, until=until):
            evolve(state, record.event, record.seq)
        return state
    fault = await CheckedReplay(state).run(store, until=until)
    if fault is not None:
        if fault.error is not None:
            raise fault.error
        raise invariants.InvariantViolation(f"after seq {fault.seq}: " + "; ".join(fault.broken))
    return state


async def save_snapshot(store: EventStore, state: RegistryState) -> Snapshot:
    snapshot = Snapshot(
        code_version=PROJECTION_VERSION, seq=state.last_seq, state=encode_state(state)
    )
    await store.save_snapshot(snapshot)
    return snapshot


class ReplayFault(msgspec.Struct, frozen=True, kw_only=True):
    """Where a checked replay stopped, and why: the record that could not be applied
    (``error``) or the invariants broken after it (``broken``); ``event_type`` is None when
    the deep check at the end of the log found them."""

    seq: int
    event_type: str | None
    broken: tuple[str, ...] = ()
    error: Exception | None = None

    def describe(self) -> str:
        """In words, naming the event (the seq is reported beside it)."""
        if self.error is not None:
            return f"{self.event_type} cannot be applied to the state before it: {self.error!r}"
        where = "at the end of the log" if self.event_type is None else f"after {self.event_type}"
        return f"{where}: " + "; ".join(self.broken)


class CheckedReplay:
    """Apply records in order onto ``state``, checking the invariants after each one.

    With ``deep`` the per-session invariants (O(sessions)) run after every record too;
    without it they run once, at the end. ``state`` is the replayed state so far (its
    ``last_seq`` is the last record applied, also after a fault)."""

    def __init__(self, state: RegistryState | None = None, *, deep: bool = False) -> None:
        self.state = RegistryState() if state is None else state
        self.deep = deep

    def apply(self, record: Record) -> ReplayFault | None:
        try:
            evolve(self.state, record.event, record.seq)
        except Exception as exc:  # a forged or impossible event: it cannot even be applied
            return ReplayFault(seq=record.seq, event_type=record.type, error=exc)
        found = invariants.violations(self.state, deep=self.deep)
        if found:
            return ReplayFault(seq=record.seq, event_type=record.type, broken=tuple(found))
        return None

    def finish(self) -> ReplayFault | None:
        """The deep check at the end (nothing to add if every step was deep)."""
        found = () if self.deep else invariants.violations(self.state, deep=True)
        if found:
            return ReplayFault(seq=self.state.last_seq, event_type=None, broken=tuple(found))
        return None

    async def run(
        self,
        store: EventStore,
        *,
        until: int | None = None,
        progress: Callable[[int], None] | None = None,
        observe: Callable[[Record], None] | None = None,
    ) -> ReplayFault | None:
        """Replay the store's records after the state's ``last_seq`` up to ``until``; the first
        fault, or None. ``progress(seq)`` is called every ``PROGRESS_EVERY`` seqs;
        ``observe(record)`` after each record applied without a fault (another fold fed from
        the same pass). A store error (a record that does not decode) is raised as the store
        raised it."""
        async for record in store.iterate(after=self.state.last_seq, until=until):
            fault = self.apply(record)
            if fault is not None:
                return fault
            if observe is not None:
                observe(record)
            if progress is not None and record.seq % PROGRESS_EVERY == 0:
                progress(record.seq)
        return self.finish()
