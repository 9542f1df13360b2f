"""Rebuilding the registry state from a store: newest matching snapshot, then the tail.

Snapshots are a cache keyed by the projection's code version: one written by other projection
code is ignored (and the state is rebuilt from seq 0), so changing ``evolve`` can never be
masked by a stale snapshot.
"""

from __future__ import annotations

from evlog.store import EventStore, Snapshot
from projections import invariants
from projections.registry import (
    PROJECTION_VERSION,
    RegistryState,
    decode_state,
    encode_state,
    evolve,
)


async def recover(
    store: EventStore,
    *,
    use_snapshot: bool = True,
    until: int | None = None,
    check: bool = False,
) -> RegistryState:
    """The registry state at ``until`` (default: the end of the log).

    ``check`` runs the cheap invariants after every event and the deep ones at the end, and
    raises ``InvariantViolation`` naming the seq that broke one."""
    state = RegistryState()
    if use_snapshot:
        snapshot = await store.load_snapshot(PROJECTION_VERSION)
        if snapshot is not None and (until is None or snapshot.seq <= until):
            state = decode_state(snapshot.state)
    async for record in store.iterate(after=state.last_seq, until=until):
        evolve(state, record.event, record.seq)
        if check:
            _check_at(state, record.seq, deep=False)
    if check:
        _check_at(state, state.last_seq, deep=True)
    return state


def _check_at(state: RegistryState, seq: int, *, deep: bool) -> None:
    found = invariants.violations(state, deep=deep)
    if found:
        raise invariants.InvariantViolation(f"after seq {seq}: " + "; ".join(found))


async def save_snapshot(store: EventStore, state: RegistryState) -> Snapshot:
    snapshot = Snapshot(
        code_version=PROJECTION_VERSION, seq=state.last_seq, state=encode_state(state)
    )
    await store.save_snapshot(snapshot)
    return snapshot
