"""Which version states a record changed: the registry fold, plus the transitions it made.

The analyses (histories, incidents, lifetimes, audits) all need the same fact: "this record moved
version 7 from RETIRED to RECLAIMING". Deriving it from the registry fold itself, rather than
re-deriving state machines per analysis, means an analysis can never disagree with the state the
ledger decided on: there is one ``evolve``, and this only watches it.
"""

from __future__ import annotations

from typing import NamedTuple

from evlog.events import Event, SessionBound, SessionReleased, VersionPublished
from evlog.record import Record
from projections.registry import RegistryState, VersionState, evolve


class Change(NamedTuple):
    """Version ``version_id`` went from ``before`` (None: it did not exist) to ``after``."""

    version_id: int
    before: VersionState | None
    after: VersionState


def versions_touched(event: Event) -> tuple[int, ...]:
    """The versions whose *state* an event may change (a binding changes only a count)."""
    if isinstance(event, SessionBound | SessionReleased):
        return ()
    if isinstance(event, VersionPublished) and event.retired is not None:
        return (event.version_id, event.retired)
    version_id = getattr(event, "version_id", None)
    return () if version_id is None else (version_id,)


def advance(state: RegistryState, record: Record) -> list[Change]:
    """Apply ``record`` to ``state`` (in place) and return the state changes it made."""
    touched = versions_touched(record.event)
    versions = state.versions
    before = [(vid, versions[vid].state if vid in versions else None) for vid in touched]
    evolve(state, record.event, record.seq)
    changes: list[Change] = []
    for vid, was in before:
        v = versions.get(vid)  # a skipped publication names a version that never existed
        if v is not None and v.state is not was:
            changes.append(Change(vid, was, v.state))
    return changes
