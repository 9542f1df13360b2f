"""Per-session audit: when a session bound, to which exact version, what that version did
while (and after) the session held it, and when and why the session was released.

This is the answer to "which policy produced this trajectory, and was it still the one the
trainer thought?": the binding names the immutable identity (version id, adapter name, digest,
the default revision the session saw), and the version's milestones (published, retired,
restored on a restarted engine, reclaimed) carry seqs and times, so a reader can check that the
version stayed loaded for as long as the session used it. Provenance rows (one per generation)
are joined by the tools (``tools/audit.py``); this fold needs only the log. Pure.

A session id can live more than once (after its tombstone is forgotten it may bind again), so
the result is one :class:`SessionAudit` per *life* of a session.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from msgspec.structs import replace

from evlog.events import (
    OwnerLeaseExpired,
    ServedContentMismatch,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    VersionAllocated,
    VersionPublished,
    VersionRestored,
)
from evlog.record import Record
from projections.lifecycle import advance
from projections.registry import RegistryState, VersionState

_MILESTONE = {
    VersionState.LOADING: "loading",
    VersionState.PUBLISHED: "published",
    VersionState.RETIRED: "retired",
    VersionState.RECLAIMING: "reclaiming",
    VersionState.RECLAIMED: "reclaimed",
    VersionState.FAILED_RETRYABLE: "failed",
    VersionState.FAILED_FATAL: "failed (ambiguous)",
}


class VersionFact(msgspec.Struct, frozen=True, kw_only=True):
    """A milestone of the bound version. ``during`` is True when it happened while the session
    was bound (between its bind and its release)."""

    seq: int
    at: float
    what: str
    detail: str = ""
    during: bool = False


class SessionAudit(msgspec.Struct, frozen=True, kw_only=True):
    """One life of a session. The fold keeps this same value while it reads the log (replacing
    it as the session binds, is released and is forgotten) and fills in the version's name,
    digest and milestones when it finishes."""

    session: str
    owner: str
    version_id: int | None = None  # None: closed before it ever bound
    lora_name: str | None = None
    digest: str | None = None
    revision: int | None = None
    bound_seq: int | None = None
    bound_at: float | None = None
    released_seq: int | None = None
    released_at: float | None = None
    cause: str | None = None
    lease_expired_seq: int | None = None  # the recorded decision behind a lease release
    forgotten_seq: int | None = None
    forgotten_at: float | None = None
    version_facts: tuple[VersionFact, ...] = ()


class AuditFold:
    """Fold records into session audits. Select with ``sessions`` (ids), ``owner``, or neither
    (every session: fine for a finished run; a long-lived ledger should select)."""

    def __init__(self, *, sessions: Iterable[str] | None = None, owner: str | None = None):
        self.registry = RegistryState()
        self._sessions = None if sessions is None else set(sessions)
        self._owner = owner
        self._lives: list[SessionAudit] = []  # in the order they began
        self._current: dict[str, int] = {}  # session -> index of its latest life in _lives
        self._facts: dict[int, list[tuple[int, float, str, str]]] = {}
        self._names: dict[int, tuple[str, str]] = {}
        self._expiry: dict[str, int] = {}

    def _wanted(self, session: str, owner: str) -> bool:
        if self._sessions is not None and session not in self._sessions:
            return False
        return self._owner is None or owner == self._owner

    def apply(self, record: Record) -> None:
        seq, at, event = record.seq, record.recorded_at, record.event
        for change in advance(self.registry, record):
            detail = ""
            if change.after is VersionState.PUBLISHED:
                v = self.registry.versions[change.version_id]
                detail = f"default at revision {v.revision}"
            elif change.after is VersionState.RETIRED and isinstance(event, VersionPublished):
                detail = f"replaced by v{event.version_id}"
            self._fact(change.version_id, seq, at, _MILESTONE[change.after], detail)
        match event:
            case VersionAllocated():
                self._names[event.version_id] = (event.lora_name, event.digest)
            case VersionRestored():
                self._fact(
                    event.version_id, seq, at, "restored", f"reloaded on restarted {event.engine}"
                )
            case ServedContentMismatch():
                # Turns on that engine before this record may have run on other weights.
                self._fact(
                    event.version_id,
                    seq,
                    at,
                    "content_mismatch",
                    f"{event.engine} served other content under its name ({event.evidence})",
                )
            case SessionBound() if self._wanted(event.session, event.owner):
                i = self._open_life(event.session, event.owner)
                self._lives[i] = replace(
                    self._lives[i],
                    version_id=event.version_id,
                    revision=event.revision,
                    bound_seq=seq,
                    bound_at=at,
                )
            case SessionReleased() if self._wanted(event.session, event.owner):
                i = self._open_life(event.session, event.owner)  # a new one: never bound
                life = self._lives[i]
                expired = life.lease_expired_seq
                if event.cause == "lease_expired":
                    expired = self._expiry.get(event.owner)
                self._lives[i] = replace(
                    life,
                    released_seq=seq,
                    released_at=at,
                    cause=event.cause,
                    lease_expired_seq=expired,
                )
            case OwnerLeaseExpired():
                self._expiry[event.owner] = seq
            case SessionsForgotten():
                for session in event.sessions:
                    forgotten = self._current.pop(session, None)
                    if forgotten is not None:
                        self._lives[forgotten] = replace(
                            self._lives[forgotten], forgotten_seq=seq, forgotten_at=at
                        )
            case _:
                pass

    def _open_life(self, session: str, owner: str) -> int:
        """The index of the session's open life; a new life when it has none (its first event,
        or its first since it was released)."""
        i = self._current.get(session)
        if i is None or self._lives[i].released_seq is not None:
            i = len(self._lives)
            self._lives.append(SessionAudit(session=session, owner=owner))
            self._current[session] = i
        return i

    def _fact(self, version_id: int, seq: int, at: float, what: str, detail: str) -> None:
        self._facts.setdefault(version_id, []).append((seq, at, what, detail))

    def apply_all(self, records: Iterable[Record]) -> AuditFold:
        for record in records:
            self.apply(record)
        return self

    def finish(self) -> list[SessionAudit]:
        """One audit per session life, in the order the lives began."""
        out: list[SessionAudit] = []
        for life in self._lives:
            if life.version_id is None:
                out.append(life)
                continue
            name, digest = self._names.get(life.version_id, (None, None))
            start = life.bound_seq or 0
            end = life.released_seq
            facts = tuple(
                VersionFact(
                    seq=seq,
                    at=at,
                    what=what,
                    detail=detail,
                    during=start < seq and (end is None or seq < end),
                )
                for seq, at, what, detail in self._facts.get(life.version_id, ())
            )
            out.append(replace(life, lora_name=name, digest=digest, version_facts=facts))
        return out
