"""Who held a version, and whose leaving let it go -- from the log alone.

A version is reclaimable once it is RETIRED and no session is bound to it (docs/publication.md,
reclaim). So the question an operator asks of a reclaim, "what made it possible?", has one of
two answers, both in the log: the **last binding of the version to go** (a ``SessionReleased``:
which session, which owner, why -- ``closed``, ``idle``, ``lease_expired``, ``owner_exited``
...) when the version was already retired then, or else the **retirement** itself (the
``VersionPublished`` that made another version the default), when its sessions had all gone
before. :class:`HolderFold` folds the log into exactly that, per reclaim
(:class:`ReclaimCause`), and keeps the sessions bound to each version as it goes, so a
``PublicationSkipped``, whose ``holders`` name versions and counts, can be shown with the
sessions that held those slots at that seq (:attr:`HolderFold.skips`).

Pure: records in, structs out; no clock, no I/O. The sessions of a skip are kept only for the
versions asked about (``versions``), and at most ``sample`` names per holder (the count is the
record's own ``bound``), so a replay of a long log holds no more than the bindings themselves.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

import msgspec

from evlog.events import (
    PublicationSkipped,
    ReclaimClaimed,
    SessionBound,
    SessionReleased,
    VersionPublished,
)
from evlog.record import Record

SAMPLE = 20  # session names kept per slot holder of a skip (the record has the count)


class Release(msgspec.Struct, frozen=True, kw_only=True):
    """One binding that went: the session, its owner, why (the release's cause), where."""

    session: str
    owner: str
    cause: str
    seq: int
    at: float


class ReclaimCause(msgspec.Struct, frozen=True, kw_only=True):
    """What made the reclaim claimed at ``claimed_seq`` possible.

    ``last_release`` is the last binding of the version to go before the claim (None: no
    session was ever bound to it); ``retired_seq`` the record that retired it.
    ``enabled_by`` says which of the two came last, hence made it reclaimable: ``release``
    (the version was retired and that session was the last one holding it) or
    ``retirement`` (its sessions had all gone already, or there never were any)."""

    version_id: int
    claimed_seq: int
    claimed_at: float
    enabled_by: str
    last_release: Release | None = None
    retired_seq: int | None = None
    retired_at: float | None = None


class HolderFold:
    """Fold records into the sessions bound to each version, each reclaim's cause and each
    asked-about skip's holding sessions (module docstring). ``versions`` limits the skips
    kept (None: every version)."""

    def __init__(self, versions: Collection[int] | None = None, *, sample: int = SAMPLE) -> None:
        self._only = None if versions is None else set(versions)
        self._sample = sample
        self._bound: dict[int, dict[str, str]] = {}  # version -> session -> owner
        self._last_release: dict[int, Release] = {}
        self._retired: dict[int, tuple[int, float]] = {}  # version -> (seq, at)
        self.reclaims: dict[int, list[ReclaimCause]] = {}
        # the seq of a PublicationSkipped -> holder version -> sessions bound to it then
        self.skips: dict[int, dict[int, tuple[str, ...]]] = {}

    def apply(self, record: Record) -> None:
        event = record.event
        if isinstance(event, SessionBound):
            self._bound.setdefault(event.version_id, {})[event.session] = event.owner
        elif isinstance(event, SessionReleased):
            if event.version_id is None:  # closed before it ever bound: held nothing
                return
            self._bound.get(event.version_id, {}).pop(event.session, None)
            self._last_release[event.version_id] = Release(
                session=event.session,
                owner=event.owner,
                cause=event.cause,
                seq=record.seq,
                at=record.recorded_at,
            )
        elif isinstance(event, VersionPublished) and event.retired is not None:
            self._retired[event.retired] = (record.seq, record.recorded_at)
        elif isinstance(event, ReclaimClaimed):
            self.reclaims.setdefault(event.version_id, []).append(
                self._cause(event.version_id, record)
            )
        elif isinstance(event, PublicationSkipped) and (
            self._only is None or event.version_id in self._only
        ):
            self.skips[record.seq] = {
                h.version_id: self.bound_to(h.version_id) for h in event.holders if h.bound
            }

    def bound_to(self, version_id: int) -> tuple[str, ...]:
        """The sessions bound to ``version_id`` now (in name order, at most ``sample``)."""
        return tuple(heapq.nsmallest(self._sample, self._bound.get(version_id, {})))

    def _cause(self, version_id: int, record: Record) -> ReclaimCause:
        release = self._last_release.get(version_id)
        retired = self._retired.get(version_id)
        if release is not None and (retired is None or release.seq > retired[0]):
            enabled_by = "release"
        else:
            enabled_by = "retirement"
        return ReclaimCause(
            version_id=version_id,
            claimed_seq=record.seq,
            claimed_at=record.recorded_at,
            enabled_by=enabled_by,
            last_release=release,
            retired_seq=None if retired is None else retired[0],
            retired_at=None if retired is None else retired[1],
        )
