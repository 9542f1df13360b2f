"""History projections for tools: per-version timelines, per-engine timelines, per-session
histories. Pure folds over records (they need ``seq`` and ``recorded_at``, so they read the
envelope, not just the event); no I/O, no clock.

The registry fold runs alongside (through :func:`projections.lifecycle.advance`, like every
other analysis) so every version entry can say which state it left and which it entered:
``replay --version 7`` prints exactly the transitions the decider made, each with the event that
caused it.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from evlog.events import (
    AttemptFailed,
    AttemptStarted,
    DeploymentConfigured,
    EngineJoined,
    EngineLeft,
    EnginePrepared,
    EngineReady,
    EngineRepaired,
    EngineRestarted,
    EngineUnloaded,
    Event,
    FatalResolved,
    InventoryObserved,
    OwnerDeregistered,
    OwnerLeaseExpired,
    OwnerRegistered,
    PublicationBlocked,
    PublicationSkipped,
    ReceiptRejected,
    ReclaimAmbiguous,
    ReclaimClaimed,
    ServedContentMismatch,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    TransportClaimed,
    VerdictConflict,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)
from evlog.record import Record
from projections.lifecycle import advance, versions_touched
from projections.registry import EngineMember, RegistryState


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a timeline: when, which event, and what it changed."""

    seq: int
    at: float
    event: str
    subject: str
    from_state: str | None = None
    to_state: str | None = None
    detail: str = ""


class History:
    """Fold records into timelines. ``sessions`` limits session histories to those ids
    (``None`` keeps all: fine for audits of a finished run, not for a live million-session
    ledger)."""

    def __init__(self, sessions: Iterable[str] | None = None) -> None:
        self.registry = RegistryState()
        self.versions: dict[int, list[Entry]] = {}
        self.engines: dict[str, list[Entry]] = {}
        self.sessions: dict[str, list[Entry]] = {}
        self.owners: dict[str, list[Entry]] = {}
        # Refused or skipped publications per version, with their records' seq and time: what
        # ``projections.stalls`` explains.
        self.stalls: dict[int, list[tuple[int, float, PublicationBlocked | PublicationSkipped]]]
        self.stalls = {}
        self._only = None if sessions is None else set(sessions)

    def apply(self, record: Record) -> None:
        event = record.event
        engine = getattr(event, "engine", None)
        if engine == "*":
            engine = None
        was = _engine_view(self.registry.engines.get(engine)) if engine is not None else None
        moved = {change.version_id: change for change in advance(self.registry, record)}
        name = type(event).__name__
        for version_id in versions_touched(event):
            # Every version the event names gets a line; one it did not move (or that never
            # existed: a skipped publication) shows the same state on both sides.
            change = moved.get(version_id)
            if change is None:
                before = after = self._state_of(version_id)
            else:
                before = None if change.before is None else str(change.before)
                after = str(change.after)
            self.versions.setdefault(version_id, []).append(
                Entry(
                    seq=record.seq,
                    at=record.recorded_at,
                    event=name,
                    subject=f"v{version_id}",
                    from_state=before,
                    to_state=after,
                    detail=_detail(event),
                )
            )
        if engine is not None:
            now = _engine_view(self.registry.engines.get(engine))
            self.engines.setdefault(engine, []).append(
                Entry(
                    seq=record.seq,
                    at=record.recorded_at,
                    event=name,
                    subject=engine,
                    from_state=was.health if was is not None else None,
                    to_state=now.health,
                    detail=_engine_detail(event, was, now),
                )
            )
        if isinstance(event, PublicationBlocked | PublicationSkipped):
            self.stalls.setdefault(event.version_id, []).append(
                (record.seq, record.recorded_at, event)
            )
        if isinstance(event, SessionBound | SessionReleased):
            self._session(record, event.session, name, _detail(event))
        elif isinstance(event, SessionsForgotten):
            for session in event.sessions:
                self._session(record, session, name, "tombstone forgotten")
        elif isinstance(event, OwnerLeaseExpired | OwnerDeregistered | OwnerRegistered):
            self.owners.setdefault(event.owner, []).append(
                Entry(
                    seq=record.seq,
                    at=record.recorded_at,
                    event=name,
                    subject=event.owner,
                    detail=_detail(event),
                )
            )

    def apply_all(self, records: Iterable[Record]) -> History:
        for record in records:
            self.apply(record)
        return self

    def _state_of(self, version_id: int) -> str | None:
        v = self.registry.versions.get(version_id)
        return None if v is None else str(v.state)

    def _session(self, record: Record, session: str, name: str, detail: str) -> None:
        if self._only is not None and session not in self._only:
            return
        self.sessions.setdefault(session, []).append(
            Entry(seq=record.seq, at=record.recorded_at, event=name, subject=session, detail=detail)
        )


class _EngineView(msgspec.Struct, frozen=True):
    """What an engine timeline line compares before and after an event."""

    health: str  # routable, not routable, absent (not a member) -- or a state a later event adds
    holds: dict[str, int]  # lora_name -> version id
    strays: tuple[str, ...]


def _engine_view(member: EngineMember | None) -> _EngineView:
    if member is None:
        return _EngineView("absent", {}, ())
    # A member may carry more health than routable/not: a ``suspended`` flag (with its
    # ``suspend_cause``) or a ``health`` string, read if the member has them, so an engine
    # timeline shows them without this module knowing every event that sets them.
    health = getattr(member, "health", None)
    if getattr(member, "suspended", False):
        cause = getattr(member, "suspend_cause", "")
        health = f"suspended ({cause})" if cause else "suspended"
    if not isinstance(health, str) or not health:
        health = "routable" if member.routable else "not routable"
    return _EngineView(health, dict(member.holds), tuple(member.strays))


def _versions(names: dict[str, int], keys: Iterable[str]) -> str:
    return ", ".join(f"v{v}" for v in sorted(names[k] for k in keys))


def _engine_detail(event: Event, was: _EngineView | None, now: _EngineView) -> str:
    """An engine timeline line: the event's own reading, then which versions it loaded and
    unloaded on the engine and what the engine holds after it (by version, not by count)."""
    base = _detail(event)
    if isinstance(event, InventoryObserved):
        base = f"inventory of {len(event.adapters)} managed names"
    version_id = getattr(event, "version_id", None)
    if version_id is not None:
        base = f"v{version_id} {base}".strip()
    parts = [base] if base else []
    before = {} if was is None else was.holds
    loaded = set(now.holds) - set(before)
    unloaded = set(before) - set(now.holds)
    if loaded:
        parts.append(f"loaded {_versions(now.holds, loaded)}")
    if unloaded:
        verb = "lost" if isinstance(event, EngineRestarted | EngineLeft) else "unloaded"
        parts.append(f"{verb} {_versions(before, unloaded)}")
    if loaded or unloaded or isinstance(event, InventoryObserved):
        parts.append(f"holds {_versions(now.holds, now.holds) or 'nothing'}")
    new_strays = set(now.strays) - set(() if was is None else was.strays)
    if new_strays:
        parts.append(f"strays {', '.join(sorted(new_strays))}")
    return "; ".join(parts)


def _fields(event: Event) -> str:
    """Any event's payload in words, for events this module has no sentence for (so an event
    type added later still shows what it carries on a timeline)."""
    parts = []
    for name in event.__struct_fields__:
        if name in ("engine", "version_id"):
            continue  # the timeline's subject already
        value = getattr(event, name)
        if isinstance(value, tuple):
            value = ", ".join(map(str, value)) or "-"
        parts.append(f"{name} {value}")
    return ", ".join(parts)


def _detail(event: Event) -> str:
    """A short human reading of an event's payload."""
    match event:
        case VersionAllocated():
            return f"{event.lora_name} digest {event.digest[:16]}"
        case AttemptStarted():
            return f"attempt {event.attempt} on {', '.join(event.fleet)}"
        case TransportClaimed():
            return f"attempt {event.attempt} transport by {event.owner}"
        case EnginePrepared() | EngineReady():
            return f"{event.engine} ({event.incarnation}) attempt {event.attempt}"
        case VersionPublished():
            retired = f", retired v{event.retired}" if event.retired is not None else ""
            rollback = " (a rollback)" if event.rollback else ""
            return f"revision {event.revision}{retired}{rollback}"
        case AttemptFailed():
            kind = "clean" if event.clean else "ambiguous"
            return f"attempt {event.attempt} {kind}: {event.code}: {event.reason}"
        case FatalResolved():
            return f"attempt {event.attempt} proven absent everywhere"
        case PublicationSkipped():
            return f"{event.code}: {event.message}"
        case PublicationBlocked():
            blockers = ", ".join(f"v{b}" for b in event.blocked_by)
            return f"{event.code}" + (f" by {blockers}" if blockers else "") + f": {event.cause}"
        case DeploymentConfigured():
            limit = event.max_staleness
            return f"max_staleness {'unbounded' if limit is None else limit}"
        case ReclaimClaimed():
            busy = sum(x.count for x in event.evidence)
            return f"{len(event.evidence)} in-flight reports, {busy} busy"
        case EngineUnloaded() | VersionRestored():
            return f"{event.engine} ({event.incarnation})"
        case ServedContentMismatch():
            return (
                f"{event.engine} ({event.incarnation}) serves other content: {event.evidence} "
                f"{event.seen[:16]}, expected {event.expected[:16]}"
            )
        case ReclaimAmbiguous():
            return f"{event.engine}: {event.reason}"
        case VersionReclaimed():
            return "unloaded on every engine; slot free"
        case ReceiptRejected():
            return f"{event.code} from {event.engine}: {event.detail}"
        case VerdictConflict():
            verdict = "clean" if event.clean else "fatal"
            return f"{verdict} report on attempt {event.attempt} ({event.state}): {event.code}"
        case EngineJoined():
            return f"incarnation {event.incarnation} {event.kind} {event.endpoint}".strip()
        case EngineRestarted():
            return f"{event.old} -> {event.new}"
        case EngineRepaired():
            return f"routable again ({event.incarnation})"
        case EngineLeft():
            return "left the fleet"
        case InventoryObserved():
            return f"holds {len(event.adapters)}: {', '.join(event.adapters)}"
        case SessionBound():
            return f"v{event.version_id} at revision {event.revision} by {event.owner}"
        case SessionReleased():
            bound = f"v{event.version_id}" if event.version_id is not None else "never bound"
            last, at, idle_s = event.last_turn, event.at, event.idle_s
            if last is not None and at is not None and idle_s is not None:
                return f"{bound}, {event.cause}, no turn for {at - last:.1f}s (bound {idle_s:g}s)"
            return f"{bound}, {event.cause}"
        case OwnerLeaseExpired():
            return f"last renewal {event.at - event.last_seen:.1f}s before expiry"
        case OwnerRegistered():
            life = f"incarnation {event.incarnation or '(unnamed)'}, ttl {event.ttl_s:g}s"
            if event.sessions_idle_s is not None:
                life += f", relay (sessions client-held, idle {event.sessions_idle_s:g}s)"
            return (
                life
                if event.replaced is None
                else f"{life}, replaces {event.replaced or '(unnamed)'}"
            )
        case OwnerDeregistered():
            return f"incarnation {event.incarnation or '(unnamed)'} exited cleanly"
    return _fields(event)
