"""Why a version stalled: each refused or skipped publication of it, what stood in the way,
and when each obstacle cleared -- from the log alone (docs/operations.md#why-did-version-n-stall).

A stall is a ``PublicationBlocked`` (allocation refused: a fatal or ambiguous version blocks
the fleet, another version is loading, no engine is routable, capacity full before the first
commit) or a ``PublicationSkipped`` (capacity full: the record names every slot holder and why it
holds). For each, :func:`explain` names the blockers with their state at the stall and the
first later record that moved each of them, and the record where the stalled version itself
went on (its next attempt), so ``replay --version N`` answers in one screen.
"""

from __future__ import annotations

import msgspec

from evlog.events import PublicationBlocked
from projections.history import Entry, History
from projections.holders import HolderFold


class Obstacle(msgspec.Struct, frozen=True, kw_only=True):
    """One version in the way: its state at the stall (``reason``: why it held a slot, for a
    skip), and the first later record that changed its state (None: not yet, in this range)."""

    version_id: int
    state: str | None
    reason: str = ""
    bound: int = 0
    sessions: tuple[str, ...] = ()  # of a skip's holder: the sessions bound to it then
    cleared_seq: int | None = None
    cleared_at: float | None = None
    cleared_by: str | None = None  # the event that moved it
    cleared_to: str | None = None  # the state it moved to


class Stall(msgspec.Struct, frozen=True, kw_only=True):
    version_id: int
    seq: int
    at: float
    event: str  # PublicationBlocked or PublicationSkipped
    code: str
    cause: str
    obstacles: tuple[Obstacle, ...]
    went_on_seq: int | None = None  # the stalled version's next attempt, if any
    went_on_at: float | None = None


def explain(history: History, version_id: int, holders: HolderFold | None = None) -> list[Stall]:
    """Every stall of ``version_id`` in the replayed range, oldest first; with ``holders``
    (folded over the same records), a skip's holders name the sessions bound to them."""
    found: list[Stall] = []
    own = history.versions.get(version_id, [])
    for seq, at, event in history.stalls.get(version_id, []):
        if isinstance(event, PublicationBlocked):
            ids = [(b, "", 0) for b in event.blocked_by]
            cause = event.cause
        else:
            ids = [(h.version_id, h.reason, h.bound) for h in event.holders]
            cause = event.message
        sessions = {} if holders is None else holders.skips.get(seq, {})
        obstacles = tuple(
            _obstacle(history.versions.get(b, []), b, seq, reason, bound, sessions.get(b, ()))
            for b, reason, bound in ids
        )
        went_on = next(
            (e for e in own if e.seq > seq and e.event in ("AttemptStarted", "VersionAllocated")),
            None,
        )
        found.append(
            Stall(
                version_id=version_id,
                seq=seq,
                at=at,
                event=type(event).__name__,
                code=event.code,
                cause=cause,
                obstacles=obstacles,
                went_on_seq=None if went_on is None else went_on.seq,
                went_on_at=None if went_on is None else went_on.at,
            )
        )
    return found


def _obstacle(
    entries: list[Entry],
    version_id: int,
    seq: int,
    reason: str,
    bound: int,
    sessions: tuple[str, ...],
) -> Obstacle:
    state: str | None = None
    for e in entries:
        if e.seq > seq:
            break
        state = e.to_state
    cleared = next(
        (e for e in entries if e.seq > seq and e.from_state != e.to_state and e.to_state != state),
        None,
    )
    return Obstacle(
        version_id=version_id,
        state=state,
        reason=reason,
        bound=bound,
        sessions=sessions,
        cleared_seq=None if cleared is None else cleared.seq,
        cleared_at=None if cleared is None else cleared.at,
        cleared_by=None if cleared is None else cleared.event,
        cleared_to=None if cleared is None else cleared.to_state,
    )
