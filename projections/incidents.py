"""Incidents: the anomalies an operator wants named after a run, each with the seqs that show it.

A pure fold over records (it reads ``seq`` and ``recorded_at`` from the envelope; no clock, no
I/O): ``finish()`` measures whatever is still open against the time of the *last record*, so
the same log always yields the same incidents, on any machine, at any later date.

Kinds, and why each is worth a line:

* ``stuck`` -- a version stayed LOADING, RECLAIMING or FAILED_FATAL, or RETIRED with nothing
  bound (reclaimable but not reclaimed), longer than ``stuck_after``: every one of those states
  should be short-lived, so a long one is a hung driver or an engine that never answered.
* ``retried`` -- a publication needed a second attempt (which attempts failed, why, and
  whether a later one committed).
* ``fatal`` / ``reclaim_ambiguous`` -- an ambiguous engine reply left a version FAILED_FATAL or
  a reclaim undecided, and how it was resolved (the inventory evidence) or that it was not.
* ``pinned_retired`` -- the sessions that kept a retired version alive longest (they hold its
  capacity slot; the usual answer to "why is v3 still loaded?").
* ``skipped`` -- a publication refused for capacity: the trainer's update never served.
* ``blocked`` -- a publication that had to wait (a fatal or ambiguous version blocking the
  fleet, another one loading, no routable engine), with the versions in the way; once per stall.
* ``lease_expired`` -- a rollout worker died or stalled; how many sessions it lost. One per
  life: an owner id that comes back under a new incarnation and expires again has two.
* ``owner_restarted`` -- a new incarnation of a live owner took over (a worker restarted, e.g.
  by Ray, before its lease ran out): its predecessor died; how many sessions it lost. A clean
  exit (``OwnerDeregistered``, releases with cause ``owner_exited``) is not an incident.
* ``receipt_rejected`` -- a stale, restarted or mismatched engine receipt the ledger refused.
* ``engine_restart`` -- an engine came back as a new process and how long until it was repaired
  (routable again with every needed version). One per restart: an engine that restarts again
  before its repair (a crash loop) has one per process life, each but the last ended by the
  next restart.
* ``engine_suspended`` -- an engine was quarantined (its probes failed, it lost an adapter it
  would not reload, or an operator said so), until a repair made it routable again or it was
  removed; an operator's resumption is listed with it, and a new suspension after that
  resumption, before a repair, ends it and opens the next.
* ``adapter_lost`` -- a committed version vanished from an engine that should hold it (an
  external unload, an eviction), until it was reloaded there, showed up again in that life's
  inventory (loaded outside the ledger), the engine was repaired as a whole, it left, or the
  version was reclaimed (no longer needed). Lost again later, it is a new incident.
* ``content_mismatch`` -- an engine served other content under a committed version's name
  (``ServedContentMismatch``: another digest in its inventory, or another canary answer), with
  the expected and seen evidence, until the version was reloaded there, the engine was
  repaired as a whole, it left, or the version was reclaimed. The name staying in the
  inventory does not end it (it is the impostor).
* ``engine_unreachable`` -- an engine could not be reached (``EngineUnreachable``: its first
  error, and whether a probe or a generation found it), out of routing from then until a probe
  of the same life answered (``EngineReachable``), it came back as a new process life
  (``EngineRestarted``) or it left; with the generations that failed on it meanwhile, as the
  faces counted them (``DispatchFailures``): in all and per session, those that provably did
  not run (tried on another holder) and those that may have run (ambiguous).

An incident of a subject never hides another one of the same subject: one still open when the
next begins is closed there, its resolution saying so (:func:`reopen`).

The last three come from :class:`EngineHealthFold`, which needs no registry: ``verify`` runs it
alongside its checked replay.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, TypedDict, TypeVar, Unpack

import msgspec

from evlog.events import (
    LEASE_EXPIRED_CAUSE,
    OWNER_RESTARTED_CAUSE,
    AdapterLost,
    AttemptFailed,
    AttemptStarted,
    DispatchFailures,
    EngineLeft,
    EngineReachable,
    EngineRepaired,
    EngineRestarted,
    EngineResumed,
    EngineSuspended,
    EngineUnreachable,
    FatalResolved,
    InventoryObserved,
    OwnerLeaseExpired,
    OwnerRegistered,
    PublicationBlocked,
    PublicationSkipped,
    ReceiptRejected,
    ReclaimAmbiguous,
    ServedContentMismatch,
    SessionBound,
    SessionReleased,
    VerdictConflict,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)
from evlog.record import Record
from projections.lifecycle import advance
from projections.registry import RegistryState, VersionState

KINDS = (
    "stuck",
    "retried",
    "fatal",
    "reclaim_ambiguous",
    "pinned_retired",
    "skipped",
    "blocked",
    "lease_expired",
    "receipt_rejected",
    "verdict_conflict",
    "rollback",
    "engine_restart",
    "owner_restarted",
    "engine_suspended",
    "adapter_lost",
    "content_mismatch",
)

# States that must be short-lived. RETIRED is watched separately: only while nothing is bound.
_TRANSIENT = frozenset({VersionState.LOADING, VersionState.RECLAIMING, VersionState.FAILED_FATAL})
_MAX_SEQS = 12  # seqs listed per incident (a lease expiry may release thousands of sessions)
_K = TypeVar("_K")  # what an open incident is kept under: an engine, (engine, version), ...


class Incident(msgspec.Struct, frozen=True, kw_only=True):
    """One anomaly. ``seqs`` are the records that show it (first the one that started it).
    ``resolved`` is None for one-off facts (a skip, a rejected receipt), True once it ended
    (``resolution`` says how: repaired, removed, or ended by the next incident of the same
    subject) and False while it is still open at the last record."""

    kind: str
    subject: str
    at: float
    seqs: tuple[int, ...]
    summary: str
    duration_s: float | None = None
    resolved: bool | None = None
    resolution: str = ""


class _Open(msgspec.Struct, kw_only=True):
    """An incident still accumulating evidence."""

    kind: str
    subject: str
    at: float
    seqs: list[int]
    summary: str
    count: int = 0


class _Attempts(msgspec.Struct, kw_only=True):
    failures: list[tuple[int, int, str, bool, float]] = msgspec.field(default_factory=list)
    restarts: list[int] = msgspec.field(default_factory=list)  # AttemptStarted seqs, attempt >= 2
    published: tuple[int, int, float] | None = None  # (seq, attempt, at)


def fact(kind: str, subject: str, at: float, seq: int, summary: str) -> Incident:
    """A one-off incident shown by one record (a skip, a refusal, a rejected receipt)."""
    return Incident(kind=kind, subject=subject, at=at, seqs=(seq,), summary=summary)


def opened(kind: str, subject: str, at: float, seq: int, summary: str) -> _Open:
    """An incident that stays open until a later record closes it; ``seq`` started it."""
    return _Open(kind=kind, subject=subject, at=at, seqs=[seq], summary=summary)


def freeze(entry: _Open, closed_at: float | None, resolution: str, last_at: float) -> Incident:
    """``entry`` as an incident: resolved at ``closed_at``, or still open at ``last_at``."""
    end = last_at if closed_at is None else closed_at
    return Incident(
        kind=entry.kind,
        subject=entry.subject,
        at=entry.at,
        seqs=tuple(entry.seqs),
        summary=entry.summary,
        duration_s=end - entry.at,
        resolved=closed_at is not None,
        resolution=resolution,
    )


def reopen(
    open_: dict[_K, _Open], key: _K, entry: _Open, resolution: Callable[[_Open], str]
) -> Incident | None:
    """Open ``entry`` under ``key``; an incident of the same subject still open there ends
    where ``entry`` starts (its record listed with it), as ``resolution(it)`` says.

    One subject can have a second incident before its first one ended (an engine restarted
    again before its repair, suspended again after a resumption): overwriting the open one
    would drop it from the report without a trace, so it is closed out and returned."""
    previous = open_.get(key)
    open_[key] = entry
    if previous is None:
        return None
    _add_seq(previous, entry.seqs[0])
    return freeze(previous, entry.at, resolution(previous), entry.at)


class EngineHealthFold:
    """``engine_suspended``, ``adapter_lost`` and ``engine_unreachable`` incidents, from the
    engine events alone.

    A suspension opens at ``EngineSuspended`` and closes at the ``EngineRepaired`` that made the
    engine routable again, at ``EngineLeft`` (removed), or at the next ``EngineSuspended`` when
    an operator resumed it and it was suspended again before that repair; a restart or an
    operator's ``EngineResumed`` in between is listed with it. A lost adapter opens at
    ``AdapterLost`` and closes when the version is reloaded there (``VersionRestored``), when
    the same process life of the engine, not suspended, shows it in its inventory again (loaded
    outside the ledger: the ledger routes it there again), when the engine is repaired as a
    whole after a suspension or restart (``EngineRepaired``), when it leaves, or when the
    version is reclaimed (no longer needed anywhere: nothing will restore it, and an incident
    left open would claim it is still missing); the suspension it may escalate to is listed
    with it. A content mismatch (``ServedContentMismatch``) is kept like a lost adapter, except
    that the name in the inventory is the impostor and closes nothing. An outage opens at
    ``EngineUnreachable`` and closes at ``EngineReachable``, at the
    engine's ``EngineRestarted`` or at ``EngineLeft``; its ``DispatchFailures`` are listed and
    counted with it."""

    def __init__(self) -> None:
        self.found: list[Incident] = []
        self._suspended: dict[str, _Open] = {}
        self._lost: dict[tuple[str, int], _Open] = {}
        self._lost_in: dict[tuple[str, int], str] = {}  # the incarnation that last lost it
        self._names: dict[int, str] = {}  # version id -> its adapter name (VersionAllocated)
        self._outages: dict[str, _Open] = {}
        # engine -> session -> (not run, ambiguous): the failed turns of its open outage
        self._failed: dict[str, dict[str, tuple[int, int]]] = {}
        self._last_at = 0.0

    def apply(self, record: Record) -> None:
        seq, at, event = record.seq, record.recorded_at, record.event
        self._last_at = at
        match event:
            case VersionAllocated():
                self._names[event.version_id] = event.lora_name
            case EngineSuspended():
                detail = f": {event.detail}" if event.detail else ""
                again = f"suspended again ({event.cause}) before a repair"
                self._keep(
                    reopen(
                        self._suspended,
                        event.engine,
                        opened(
                            "engine_suspended",
                            event.engine,
                            at,
                            seq,
                            f"suspended ({event.cause}){detail}; no new traffic",
                        ),
                        lambda e: ("resumed by an operator, then " if e.count else "") + again,
                    )
                )
                self._touch(event.engine, seq, lost_only=True)
            case AdapterLost():
                key = (event.engine, event.version_id)
                self._lost_in[key] = event.incarnation
                self._keep(
                    reopen(
                        self._lost,
                        key,
                        opened(
                            "adapter_lost",
                            event.engine,
                            at,
                            seq,
                            f"v{event.version_id} missing from its inventory "
                            f"({event.incarnation}); no longer routed there",
                        ),
                        lambda _: "lost again before it was restored",
                    )
                )
            case ServedContentMismatch():
                self._keep(
                    reopen(
                        self._lost,
                        (event.engine, event.version_id),
                        opened(
                            "content_mismatch",
                            event.engine,
                            at,
                            seq,
                            f"v{event.version_id} served with other content ({event.incarnation},"
                            f" {event.evidence}: expected {event.expected[:16]}, seen "
                            f"{event.seen[:16]}); no longer routed there",
                        ),
                        lambda _: "served other content before it was restored",
                    )
                )
            case InventoryObserved():
                self._seen(event, seq, at)
            case VersionReclaimed():
                self._reclaimed(event.version_id, seq, at)
            case VersionRestored():
                entry = self._lost.pop((event.engine, event.version_id), None)
                if entry is not None:
                    _add_seq(entry, seq)
                    after = " after the engine restarted" if entry.count else ""
                    self._close(entry, at, f"reloaded under its name{after}")
            case EngineResumed():
                entry = self._suspended.get(event.engine)
                if entry is not None:
                    _add_seq(entry, seq)
                    entry.count += 1  # resumed by an operator: the repair follows
            case EngineUnreachable():
                self._keep(self._outage_ended(event.engine, seq, at, "unreachable again"))
                self._outages[event.engine] = opened(
                    "engine_unreachable",
                    event.engine,
                    event.at,
                    seq,
                    f"unreachable ({event.incarnation}), seen by {event.source}"
                    f"{' (' + event.reporter + ')' if event.reporter else ''}: {event.error}; "
                    "out of routing",
                )
            case DispatchFailures():
                entry = self._outages.get(event.engine)
                if entry is not None:
                    _add_seq(entry, seq)
                    counts = self._failed.setdefault(event.engine, {})
                    for f in event.failures:
                        n, a = counts.get(f.session, (0, 0))
                        counts[f.session] = (n + f.not_run, a + f.ambiguous)
            case EngineReachable():
                self._keep(self._outage_ended(event.engine, seq, event.at, "a probe answered"))
            case EngineRestarted():
                self._touch(event.engine, seq, restarted=True)
                self._keep(
                    self._outage_ended(event.engine, seq, at, "came back as a new process life")
                )
            case EngineRepaired():
                self._end(event.engine, seq, at, "repaired: holds exactly the needed versions")
            case EngineLeft():
                how = "removed by an operator" if event.cause == "operator" else "left the fleet"
                self._end(event.engine, seq, at, how)
                self._keep(self._outage_ended(event.engine, seq, at, how))
            case _:
                pass

    def finish(self) -> list[Incident]:
        """Every incident found, the open ones measured up to the last record."""
        found = list(self.found)
        found += [
            freeze(e, None, "still suspended", self._last_at) for e in self._suspended.values()
        ]
        found += [freeze(e, None, "not restored yet", self._last_at) for e in self._lost.values()]
        found += [
            self._outage_frozen(engine, None, "still unreachable") for engine in list(self._outages)
        ]
        return found

    def _outage_ended(self, engine: str, seq: int, at: float, how: str) -> Incident | None:
        """The engine's open outage, closed at ``at`` by record ``seq`` (None without one)."""
        if engine not in self._outages:
            return None
        _add_seq(self._outages[engine], seq)
        return self._outage_frozen(engine, at, how)

    def _outage_frozen(self, engine: str, closed_at: float | None, how: str) -> Incident:
        """The outage of ``engine`` as an incident, its failed turns counted in the summary."""
        entry = self._outages.pop(engine)
        counts = self._failed.pop(engine, {})
        if counts:
            not_run = sum(n for n, _ in counts.values())
            ambiguous = sum(a for _, a in counts.values())
            per_session = ", ".join(f"{s} {n}/{a}" for s, (n, a) in sorted(counts.items()))
            entry.summary += (
                f"; failed turns: {not_run} not run (tried elsewhere), {ambiguous} ambiguous"
                f" (per session, not run/ambiguous: {per_session})"
            )
        else:
            entry.summary += "; no failed turn counted"
        return freeze(entry, closed_at, how, self._last_at)

    def _seen(self, event: InventoryObserved, seq: int, at: float) -> None:
        """A lost version back in the inventory of the life that lost it, while that engine is
        not suspended: the ledger holds it as loaded there again and routes to it (someone
        loaded it outside the ledger). A later life, or a suspended engine, serves nothing
        before its repair, which closes the incident instead."""
        if event.engine in self._suspended:
            return
        present = set(event.adapters)
        for key in [k for k in self._lost if k[0] == event.engine]:
            name = self._names.get(key[1])
            impostor = self._lost[key].kind == "content_mismatch"
            if name in present and self._lost_in.get(key) == event.incarnation and not impostor:
                entry = self._lost.pop(key)
                _add_seq(entry, seq)
                self._close(entry, at, "back in its inventory without a reload by the ledger")

    def _reclaimed(self, version_id: int, seq: int, at: float) -> None:
        """A reclaimed version is needed nowhere: nothing will restore it where it was lost."""
        for key in [k for k in self._lost if k[1] == version_id]:
            lost = self._lost.pop(key)
            _add_seq(lost, seq)
            self._close(lost, at, "reclaimed: no longer needed")

    def _keep(self, superseded: Incident | None) -> None:
        if superseded is not None:
            self.found.append(superseded)

    def _touch(
        self, engine: str, seq: int, *, lost_only: bool = False, restarted: bool = False
    ) -> None:
        """List ``seq`` with the engine's open incidents (``restarted``: the engine's restart,
        counted on its lost adapters)."""
        lost = [e for (eng, _), e in self._lost.items() if eng == engine]
        for entry in lost:
            entry.count += restarted
        suspended = self._suspended.get(engine)
        for entry in lost + ([suspended] if suspended and not lost_only else []):
            _add_seq(entry, seq)

    def _end(self, engine: str, seq: int, at: float, how: str) -> None:
        entry = self._suspended.pop(engine, None)
        if entry is not None:
            _add_seq(entry, seq)
            resumed = "resumed by an operator, then " if entry.count else ""
            self._close(entry, at, resumed + how)
        for key in [k for k in self._lost if k[0] == engine]:
            lost = self._lost.pop(key)
            _add_seq(lost, seq)
            self._close(lost, at, f"engine {how}" if "repaired" in how else how)

    def _close(self, entry: _Open, at: float, resolution: str) -> None:
        self.found.append(freeze(entry, at, resolution, self._last_at))


def _skipped(e: PublicationSkipped) -> str:
    return f"publication skipped: {e.code}: {e.message}"


def _blocked(e: PublicationBlocked) -> str:
    blockers = ", ".join(f"v{b}" for b in e.blocked_by)
    way = f" (in the way: {blockers})" if blockers else ""
    return f"publication refused: {e.code}{way}: {e.cause}"


def _verdict_conflict(e: VerdictConflict) -> str:
    verdict = "clean" if e.clean else "fatal"
    return (
        f"a {verdict} failure report ({e.code}) for attempt {e.attempt}, which had ended "
        f"{e.state}: {e.reason}"
    )


def _receipt_rejected(e: ReceiptRejected) -> str:
    return f"{e.code} from {e.engine} ({e.incarnation}) attempt {e.attempt}: {e.detail}"


# One-off facts about a version, one record each: the kind and how its summary reads.
_ONE_OFF: dict[type, tuple[str, Callable[[Any], str]]] = {
    PublicationSkipped: ("skipped", _skipped),
    PublicationBlocked: ("blocked", _blocked),
    VerdictConflict: ("verdict_conflict", _verdict_conflict),
    ReceiptRejected: ("receipt_rejected", _receipt_rejected),
}


class IncidentFold:
    """Fold records; ``finish()`` returns every incident, ordered by time then seq.

    ``stuck_after`` is the threshold for ``stuck`` (seconds); ``pinned_top`` how many
    ``pinned_retired`` sessions to report (the longest ones)."""

    def __init__(self, *, stuck_after: float = 60.0, pinned_top: int = 5) -> None:
        self.registry = RegistryState()
        self.stuck_after = stuck_after
        self.pinned_top = pinned_top
        self._found: list[Incident] = []
        self._since: dict[int, tuple[VersionState, float, int]] = {}
        self._reclaimable: dict[int, tuple[float, int]] = {}
        self._attempts: dict[int, _Attempts] = {}
        self._fatal: dict[int, _Open] = {}
        self._ambiguous: dict[int, _Open] = {}
        self._restarts: dict[str, _Open] = {}  # engine -> its restart not repaired yet
        # One incident per ended life of an owner (an owner id lives again under a new
        # incarnation); owner -> its latest expiry / restart, collecting the releases that follow.
        self._lease_expiries: list[_Open] = []
        self._expiring: dict[str, _Open] = {}
        self._owner_restarts: list[_Open] = []
        self._restarting: dict[str, _Open] = {}
        self._inventory: dict[str, tuple[int, float]] = {}  # engine -> its latest (seq, at)
        self._bindings: dict[str, tuple[int, int, float]] = {}  # session -> (vid, seq, at)
        self._retired_at: dict[int, tuple[int, float]] = {}
        self._pinned: list[tuple[float, int, Incident]] = []  # min-heap of the longest
        self._health = EngineHealthFold()
        self._last_at = 0.0
        self._last_seq = 0

    # --- folding ----------------------------------------------------------------------------

    def apply(self, record: Record) -> None:
        seq, at, event = record.seq, record.recorded_at, record.event
        self._last_at, self._last_seq = at, seq
        if isinstance(event, OwnerRegistered):
            self._owner_registered(event, seq, at)  # before the fold: was the owner live?
        for change in advance(self.registry, record):
            self._state_changed(change.version_id, change.before, change.after, seq, at)
        self._health.apply(record)
        match event:
            case SessionBound():
                self._bindings[event.session] = (event.version_id, seq, at)
                self._reclaimable.pop(event.version_id, None)
            case SessionReleased():
                self._released(event, seq, at)
            case VersionPublished() if event.retired is not None:
                self._retired_at[event.retired] = (seq, at)
                self._watch_reclaimable(event.retired, seq, at)
                if event.rollback:
                    self._found.append(
                        fact(
                            "rollback",
                            f"v{event.version_id}",
                            at,
                            seq,
                            f"rolled the default back from v{event.retired} to "
                            f"v{event.version_id} (revision {event.revision}), on purpose",
                        )
                    )
            case AttemptStarted() if event.attempt >= 2:
                self._attempts_of(event.version_id).restarts.append(seq)
            case AttemptFailed():
                self._attempts_of(event.version_id).failures.append(
                    (seq, event.attempt, event.code, event.clean, at)
                )
                if not event.clean:
                    self._fatal[event.version_id] = opened(
                        "fatal",
                        f"v{event.version_id}",
                        at,
                        seq,
                        f"attempt {event.attempt} ended ambiguous: {event.code}: {event.reason}",
                    )
            case InventoryObserved():
                self._inventory[event.engine] = (seq, at)
            case FatalResolved():
                self._close_fatal(event, seq, at)
            case ReclaimAmbiguous():
                entry = self._ambiguous.get(event.version_id)
                if entry is None:
                    self._ambiguous[event.version_id] = opened(
                        "reclaim_ambiguous",
                        f"v{event.version_id}",
                        at,
                        seq,
                        f"unload on {event.engine} ambiguous: {event.reason}",
                    )
                else:
                    _add_seq(entry, seq)
            case VersionReclaimed():
                entry = self._ambiguous.pop(event.version_id, None)
                if entry is not None:
                    self._add_evidence(entry, at)
                    _add_seq(entry, seq)
                    self._close(entry, at, "unload confirmed on every engine; slot freed")
            case (
                PublicationSkipped() | PublicationBlocked() | VerdictConflict() | ReceiptRejected()
            ):
                kind, summary = _ONE_OFF[type(event)]
                self._found.append(fact(kind, f"v{event.version_id}", at, seq, summary(event)))
            case OwnerLeaseExpired():
                self._lease_expired(event, seq, at)
            case EngineRestarted():
                again = f"restarted again ({event.old} -> {event.new}) before it was repaired"
                superseded = reopen(
                    self._restarts,
                    event.engine,
                    opened(
                        "engine_restart",
                        event.engine,
                        at,
                        seq,
                        f"restarted ({event.old} -> {event.new}): lost every adapter",
                    ),
                    lambda _: again,
                )
                if superseded is not None:
                    self._found.append(superseded)
            case VersionRestored():
                entry = self._restarts.get(event.engine)
                if entry is not None:
                    _add_seq(entry, seq)
                    entry.count += 1
            case EngineRepaired():
                entry = self._restarts.pop(event.engine, None)
                if entry is not None:
                    _add_seq(entry, seq)
                    self._close(
                        entry, at, f"repaired: {entry.count} needed versions reloaded, routable"
                    )
            case EngineLeft():
                entry = self._restarts.pop(event.engine, None)
                if entry is not None:
                    _add_seq(entry, seq)
                    self._close(entry, at, "left the fleet before it was repaired")
            case _:
                pass

    def apply_all(self, records: Iterable[Record]) -> IncidentFold:
        for record in records:
            self.apply(record)
        return self

    # --- the end ----------------------------------------------------------------------------

    def finish(self) -> list[Incident]:
        """Every incident found, with the ones still open measured up to the last record."""
        now, found = self._last_at, list(self._found)
        for vid, (state, since, seq) in sorted(self._since.items()):
            if state in _TRANSIENT and now - since > self.stuck_after:
                found.append(self._stuck(vid, state, since, seq, None, now))
        for vid, (since, seq) in sorted(self._reclaimable.items()):
            if now - since > self.stuck_after:
                found.append(self._stuck(vid, VersionState.RETIRED, since, seq, None, now))
        for entry in self._fatal.values():
            found.append(self._freeze(entry, None, "still FAILED_FATAL: no inventory proved it"))
        for entry in self._ambiguous.values():
            found.append(self._freeze(entry, None, "still undecided: no inventory proved it"))
        for entry in self._restarts.values():
            found.append(self._freeze(entry, None, "not repaired yet: not routable"))
        for entry in self._lease_expiries:
            found.append(self._lease_incident(entry))
        for entry in self._owner_restarts:
            found.append(self._lease_incident(entry))
        found.extend(self._health.finish())
        for vid, attempts in sorted(self._attempts.items()):
            if attempts.restarts:
                found.append(self._retried(vid, attempts))
        pinned = [inc for _, _, inc in self._pinned]
        for session, (vid, seq, bound_at) in self._bindings.items():
            retired = self._retired_at.get(vid)
            if retired is not None:
                incident = self._pinned_incident(session, vid, seq, bound_at, retired, None, now)
                if incident is not None:
                    pinned.append(incident)
        pinned.sort(key=lambda inc: (-(inc.duration_s or 0.0), inc.seqs))
        found.extend(pinned[: self.pinned_top])
        found.sort(key=lambda inc: (inc.at, inc.seqs, inc.kind))
        return found

    # --- helpers ----------------------------------------------------------------------------

    def _attempts_of(self, version_id: int) -> _Attempts:
        return self._attempts.setdefault(version_id, _Attempts())

    def _state_changed(
        self, vid: int, before: VersionState | None, after: VersionState, seq: int, at: float
    ) -> None:
        held = self._since.get(vid)
        if held is not None and held[0] in _TRANSIENT and at - held[1] > self.stuck_after:
            self._found.append(self._stuck(vid, held[0], held[1], held[2], seq, at))
        self._since[vid] = (after, at, seq)
        if before is VersionState.RETIRED:
            left = self._reclaimable.pop(vid, None)
            if left is not None and at - left[0] > self.stuck_after:
                self._found.append(self._stuck(vid, before, left[0], left[1], seq, at))
        if after is VersionState.PUBLISHED:
            attempts = self._attempts_of(vid)
            attempts.published = (seq, self.registry.versions[vid].attempt, at)

    def _watch_reclaimable(self, vid: int, seq: int, at: float) -> None:
        v = self.registry.versions.get(vid)
        if v is not None and v.state is VersionState.RETIRED and v.bound == 0:
            self._reclaimable.setdefault(vid, (at, seq))

    def _released(self, event: SessionReleased, seq: int, at: float) -> None:
        binding = self._bindings.pop(event.session, None)
        ended = (
            self._expiring.get(event.owner)
            if event.cause == LEASE_EXPIRED_CAUSE
            else self._restarting.get(event.owner)
            if event.cause == OWNER_RESTARTED_CAUSE
            else None
        )
        if ended is not None:
            ended.count += 1
            _add_seq(ended, seq)
        if binding is None:
            return
        vid, bound_seq, bound_at = binding
        retired = self._retired_at.get(vid)
        if retired is not None:
            incident = self._pinned_incident(
                event.session, vid, bound_seq, bound_at, retired, seq, at
            )
            if incident is not None and self.pinned_top > 0:
                item = (incident.duration_s or 0.0, seq, incident)
                if len(self._pinned) < self.pinned_top:
                    heapq.heappush(self._pinned, item)
                elif item[:2] > self._pinned[0][:2]:
                    heapq.heapreplace(self._pinned, item)
        self._watch_reclaimable(vid, seq, at)

    def _lease_expired(self, event: OwnerLeaseExpired, seq: int, at: float) -> None:
        """An expiry ends one life of the owner: an incident of its own, even when an earlier
        life of the same owner id expired too (the releases that follow are counted here)."""
        owner = self.registry.owners.get(event.owner)
        life = f" (incarnation {owner.incarnation})" if owner and owner.incarnation else ""
        entry = opened(
            "lease_expired",
            f"owner {event.owner}",
            at,
            seq,
            f"no renewal for {event.at - event.last_seen:.1f}s{life}",
        )
        self._lease_expiries.append(entry)
        self._expiring[event.owner] = entry

    def _owner_registered(self, event: OwnerRegistered, seq: int, at: float) -> None:
        """A new incarnation of an owner that was still live: the one it replaces died without
        a clean exit (a restarted worker). A new life after an expiry or a deregistration is
        not one: that end was already reported (or was clean)."""
        before = self.registry.owners.get(event.owner)
        if before is None or not before.live:
            return
        entry = _Open(
            kind="owner_restarted",
            subject=f"owner {event.owner}",
            at=at,
            seqs=[seq],
            summary=f"restarted ({event.replaced or '(unnamed)'} -> "
            f"{event.incarnation or '(unnamed)'}) before its lease ran out",
        )
        self._owner_restarts.append(entry)
        self._restarting[event.owner] = entry

    def _pinned_incident(
        self,
        session: str,
        vid: int,
        bound_seq: int,
        bound_at: float,
        retired: tuple[int, float],
        released_seq: int | None,
        until: float,
    ) -> Incident | None:
        """How long ``session`` kept retired ``vid`` in use (from its retirement, or from the
        binding if later), up to its release or ``until``."""
        retired_seq, retired_at = retired
        start = max(retired_at, bound_at)
        held = until - start
        if held <= 0:
            return None
        seqs = (bound_seq, retired_seq) + (() if released_seq is None else (released_seq,))
        return Incident(
            kind="pinned_retired",
            subject=f"session {session}",
            at=start,
            seqs=seqs,
            summary=f"kept retired v{vid} in use for {held:.1f}s",
            duration_s=held,
            resolved=released_seq is not None,
            resolution="released" if released_seq is not None else "still bound",
        )

    def _close_fatal(self, event: FatalResolved, seq: int, at: float) -> None:
        entry = self._fatal.pop(event.version_id, None)
        if entry is None:
            return
        for evidence in event.evidence:
            _add_seq(entry, evidence)
        self._add_evidence(entry, at)
        _add_seq(entry, seq)
        self._close(entry, at, "inventories proved the candidate absent on every engine")

    def _add_evidence(self, entry: _Open, at: float) -> None:
        """The inventories recorded at the resolving moment (the same decision batch) are the
        evidence the ledger relied on: list their seqs with the incident."""
        for seq, seen_at in sorted(self._inventory.values()):
            if seen_at == at and seq > entry.seqs[0]:
                _add_seq(entry, seq)

    def _close(self, entry: _Open, at: float, resolution: str) -> None:
        self._found.append(self._freeze(entry, at, resolution))

    def _freeze(self, entry: _Open, closed_at: float | None, resolution: str) -> Incident:
        return freeze(entry, closed_at, resolution, self._last_at)

    def _lease_incident(self, entry: _Open) -> Incident:
        summary = f"{entry.summary}; {entry.count} sessions released"
        return Incident(
            kind=entry.kind,
            subject=entry.subject,
            at=entry.at,
            seqs=tuple(entry.seqs),
            summary=summary,
        )

    def _stuck(
        self,
        vid: int,
        state: VersionState,
        since: float,
        since_seq: int,
        left_seq: int | None,
        until: float,
    ) -> Incident:
        what = (
            "RETIRED and unbound (reclaimable, not reclaimed)"
            if (state is VersionState.RETIRED)
            else str(state)
        )
        seqs = (since_seq,) if left_seq is None else (since_seq, left_seq)
        return Incident(
            kind="stuck",
            subject=f"v{vid}",
            at=since,
            seqs=seqs,
            summary=f"{what} for {until - since:.1f}s (threshold {self.stuck_after:g}s)",
            duration_s=until - since,
            resolved=left_seq is not None,
            resolution="" if left_seq is None else f"left {state} at seq {left_seq}",
        )

    def _retried(self, vid: int, attempts: _Attempts) -> Incident:
        failed = attempts.failures
        seqs = sorted({s for s, *_ in failed} | set(attempts.restarts))
        reasons = "; ".join(
            f"attempt {a} {'clean' if clean else 'ambiguous'} {code}"
            for _, a, code, clean, _ in failed
        )
        first_at = failed[0][4] if failed else self._last_at
        if attempts.published is not None:
            pub_seq, pub_attempt, pub_at = attempts.published
            seqs.append(pub_seq)
            resolution, resolved, end = f"attempt {pub_attempt} published", True, pub_at
        else:
            resolution, resolved, end = "not published", False, self._last_at
        return Incident(
            kind="retried",
            subject=f"v{vid}",
            at=first_at,
            seqs=tuple(seqs[:_MAX_SEQS]),
            summary=f"needed {len(attempts.restarts) + 1} attempts ({reasons})",
            duration_s=end - first_at,
            resolved=resolved,
            resolution=resolution,
        )


def _add_seq(entry: _Open, seq: int) -> None:
    if len(entry.seqs) < _MAX_SEQS and seq not in entry.seqs:
        entry.seqs.append(seq)


class FoldOptions(TypedDict, total=False):
    """The keyword options of :class:`IncidentFold`, so :func:`incidents` forwards them typed."""

    stuck_after: float
    pinned_top: int


def incidents(records: Iterable[Record], **options: Unpack[FoldOptions]) -> list[Incident]:
    """Convenience: fold ``records`` and finish (``options`` as for :class:`IncidentFold`)."""
    return IncidentFold(**options).apply_all(records).finish()
