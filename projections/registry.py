"""The registry projection: the whole decision state, folded from the log.

``evolve(state, event)`` applies one event. It mutates ``state`` in place (a replay of a million
events must stay under 10 s, so no copying), but it is still a pure function in the sense that
matters for event sourcing: no clock, no randomness, no I/O, and the result depends only on the
state and the event. Every event in the log was decided valid when it was appended, so it does
not re-validate inputs; it only asserts what is cheap and must hold: each version's new state
comes from the transitions table (:mod:`projections.transitions`), so an impossible step raises
``TransitionViolation`` naming the version, its state and the event instead of being applied,
and a few paired facts (the attempt a receipt names, the binding a release names) are checked
where the state is at hand. ``invariants`` checks the whole outcome.

Everything the decider and the drivers ask ("who is the default", "which engines hold v7",
"is v3 reclaimable") is answered from this state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from evlog.events import (
    AdapterLost,
    AttemptFailed,
    AttemptStarted,
    CanaryRecorded,
    CommandRecorded,
    ControllerStarted,
    DeploymentConfigured,
    DeploymentCreated,
    DispatchFailures,
    EngineJoined,
    EngineLeft,
    EnginePrepared,
    EngineReachable,
    EngineReady,
    EngineRepaired,
    EngineRestarted,
    EngineResumed,
    EngineSuspended,
    EngineUnloaded,
    EngineUnreachable,
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
from projections.transitions import (
    ATTEMPT_FAILED_CLEAN,
    ATTEMPT_FAILED_FATAL,
    PUBLISHED_RETIRES,
    impossible,
    next_state,
)
from projections.transitions import VersionState as VersionState  # its home is the table's

# Bump when evolve() or the state layout changes meaning: older snapshots are then ignored and
# the state is rebuilt from the log (snapshots are a cache, never a source of truth).
PROJECTION_VERSION = "registry-8"  # 2: max_staleness, stalls; 3: engine health, lost adapters;
# 4: owner incarnations and clean deregistration; 5: an ambiguous unload voids the engine's
# proof, engine outages (unreachable), client-held sessions and idle tombstones; 6: served
# content mismatches (``EngineMember.mismatched``); 7: the digest of each owner life's secret;
# 8: the loading attempt's fleet by engine (``VersionRecord.loading_fleet``)


# Versions an engine may legitimately hold: being loaded (LOADING), serving (PUBLISHED,
# RETIRED), being unloaded (RECLAIMING), or possibly loaded after an ambiguous failure
# (FAILED_FATAL). A clean failure and a finished reclaim are proven absent everywhere. The same
# set answers two questions, because a slot of ``capacity`` is engine memory: a version takes a
# slot exactly while an engine may hold it, and anything else an inventory shows is a stray.
HOLDABLE_STATES = frozenset(
    {
        VersionState.LOADING,
        VersionState.PUBLISHED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
        VersionState.FAILED_FATAL,
    }
)
COMPLETED_STATES = frozenset(
    {
        VersionState.PUBLISHED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
        VersionState.RECLAIMED,
    }
)
# Versions a session may be bound to, hence versions an engine must hold to serve it.
SERVING_STATES = frozenset({VersionState.PUBLISHED, VersionState.RETIRED})


class VersionRecord(msgspec.Struct, kw_only=True):
    """One version id's whole life. ``prepared``/``ready`` belong to the current attempt;
    ``confirmed`` collects unload/absence proofs of the current reclaim or fatal resolution.

    ``loading_fleet`` is ``fleet`` keyed by engine while the attempt is LOADING (empty once it
    ended): every receipt of a publication asks whether its engine is in the attempt's fleet,
    and a scan of the tuple there would make a publication to n engines cost O(n^2)."""

    version_id: int
    digest: str
    lora_name: str
    size_bytes: int = 0
    state: VersionState = VersionState.LOADING
    attempt: int = 0
    fleet: tuple[str, ...] = ()
    loading_fleet: dict[str, None] = msgspec.field(default_factory=dict)
    claimed_by: str | None = None
    prepared: dict[str, str] = msgspec.field(default_factory=dict)
    ready: dict[str, str] = msgspec.field(default_factory=dict)
    bound: int = 0
    revision: int | None = None
    confirmed: dict[str, str] = msgspec.field(default_factory=dict)
    ambiguous: bool = False
    failure_code: str | None = None
    failure_reason: str | None = None


class Outage(msgspec.Struct, kw_only=True):
    """An engine's outage while it lasts (``EngineUnreachable`` to ``EngineReachable``): since
    when, its first error, who saw it, and the generations that failed on the engine meanwhile
    (session -> (not run, ambiguous), from ``DispatchFailures``)."""

    since: float
    error: str
    source: str
    reporter: str = ""
    failures: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class EngineMember(msgspec.Struct, kw_only=True):
    """A fleet member. ``holds`` is what the ledger knows it holds (lora_name -> version_id),
    from READY receipts, restorations, unloads and inventories. An engine is ``routable`` only
    once every version still needed is loaded on it (after a join or a restart); it *serves*
    (routing, new publication attempts) while routable and reachable (:attr:`serving`)."""

    engine: str
    incarnation: str
    endpoint: str = ""
    kind: str = "local"
    routable: bool = False
    holds: dict[str, int] = msgspec.field(default_factory=dict)
    # Names the last inventory showed that the engine should not hold (unknown, reclaimed, or
    # of a cleanly failed attempt): the reconciler unloads the managed ones.
    strays: tuple[str, ...] = ()
    # Quarantined (EngineSuspended): never routable, and publication and reclaim do not wait
    # for it. ``suspend_cause`` is the suspension's cause (``operator`` ones only an operator
    # lifts; the others end with the repair that makes the engine routable again).
    suspended: bool = False
    suspend_cause: str = ""
    # Needed versions a fresh inventory showed lost (AdapterLost), until restored: routing
    # does not send them here (they are not in ``holds``).
    lacks: dict[str, int] = msgspec.field(default_factory=dict)
    # Committed versions' names the engine serves other content under (ServedContentMismatch):
    # present in its inventory but never counted as held -- routing, repair and publication
    # treat the version as missing there -- until it is restored, the name is gone from the
    # engine, or the engine restarts.
    mismatched: dict[str, int] = msgspec.field(default_factory=dict)
    # Canary baselines of this life (CanaryRecorded): name -> the answer later ones must equal.
    canaries: dict[str, str] = msgspec.field(default_factory=dict)
    # Names this engine must drop before it serves again (name -> the attempt that fences the
    # unload): entries reclaimed or resolved while it was suspended and could not confirm.
    owes: dict[str, int] = msgspec.field(default_factory=dict)
    # The outage in progress (EngineUnreachable), until a probe of the same life answers
    # (EngineReachable) or the engine comes back as a new life (EngineRestarted). While it
    # lasts the engine is out of routing, whatever ``routable`` says: an outage is a fact about
    # reachability, not about what the engine holds, so it needs no repair to end.
    unreachable: Outage | None = None
    # When the last outage ended: a report of a failure seen before then is late (the engine
    # answered a probe since) and opens nothing.
    reachable_at: float = 0.0

    @property
    def serving(self) -> bool:
        """Whether routing may send it a turn (and a new attempt target it): repaired
        (``routable``) and not in an outage."""
        return self.routable and self.unreachable is None


class Binding(msgspec.Struct, array_like=True):
    """``idle_s``: the ``sessions_idle_s`` of the owner that bound it, kept for the binding's
    life (a later registration of that owner does not change it). None: owner-held (it ends
    with the owner's life); a number: client-held (0: never released for idleness)."""

    owner: str
    version_id: int
    revision: int
    idle_s: float | None = None


class Owner(msgspec.Struct, kw_only=True):
    """One owner id's current life (``incarnation``) and how it ended, if it did: its lease
    ran out (``expired``) or it deregistered (``exited``). ``retired``: the incarnations it
    had before, which may never register or act again (a zombie of a restarted worker, a
    late retry of its registration)."""

    ttl_s: float
    registered_at: float
    expired: bool = False
    incarnation: str = ""
    exited: bool = False
    retired: tuple[str, ...] = ()
    sessions_idle_s: float | None = None  # None: owner-held sessions; else a relay's
    secret_digest: str = ""  # of the life's secret; "": registered without one

    @property
    def live(self) -> bool:
        return not (self.expired or self.exited)


class RecordedCommand(msgspec.Struct, array_like=True):
    fingerprint: str
    outcome: bytes


class Stall(msgspec.Struct, array_like=True, frozen=True):
    """The last recorded refusal of one version's allocation (``PublicationBlocked``): the same
    refusal again is not recorded twice."""

    code: str
    blocked_by: tuple[int, ...]


class RegistryState(msgspec.Struct, kw_only=True):
    deployment: str | None = None
    prefix: str = ""
    capacity: int = 0
    declared_fleet: tuple[str, ...] = ()
    max_staleness: int | None = None  # DeploymentConfigured; None: unbounded
    epoch: int = 0
    code_version: str = ""
    last_seq: int = 0
    versions: dict[int, VersionRecord] = msgspec.field(default_factory=dict)
    default: int | None = None
    default_revision: int = 0
    commits: int = 0
    engines: dict[str, EngineMember] = msgspec.field(default_factory=dict)
    sessions: dict[str, Binding] = msgspec.field(default_factory=dict)
    tombstones: dict[str, str] = msgspec.field(default_factory=dict)  # session -> owner
    # The ledger's idle releases whose tombstones live on: session -> when (in release order).
    idle_released: dict[str, float] = msgspec.field(default_factory=dict)
    owners: dict[str, Owner] = msgspec.field(default_factory=dict)
    commands: dict[str, RecordedCommand] = msgspec.field(default_factory=dict)
    skipped: int = 0
    stalls: dict[int, Stall] = msgspec.field(default_factory=dict)  # version -> last refusal
    rejected_receipts: int = 0
    verdict_conflicts: int = 0

    # --- queries (read-only) ----------------------------------------------------------------

    def capacity_used(self) -> int:
        """Slots taken: every version an engine may hold (see ``HOLDABLE_STATES``)."""
        return sum(1 for v in self.versions.values() if v.state in HOLDABLE_STATES)

    def loading(self) -> VersionRecord | None:
        for v in self.versions.values():
            if v.state is VersionState.LOADING:
                return v
        return None

    def blocked_by(self) -> list[int]:
        """Versions whose unresolved fatal/ambiguous state blocks new publications."""
        return sorted(
            v.version_id
            for v in self.versions.values()
            if v.state is VersionState.FAILED_FATAL
            or (v.state is VersionState.RECLAIMING and v.ambiguous)
        )

    def active_engines(self) -> set[str]:
        """Members that publication and reclaim wait for: every member not suspended."""
        return {e.engine for e in self.engines.values() if not e.suspended}

    def routable_engines(self) -> tuple[str, ...]:
        """Members that serve now (:attr:`EngineMember.serving`: repaired and reachable)."""
        return tuple(sorted(e.engine for e in self.engines.values() if e.serving))

    def holders(self, lora_name: str, *, routable_only: bool = True) -> tuple[str, ...]:
        """Engines that hold ``lora_name`` (and may serve it, when ``routable_only``)."""
        return tuple(
            sorted(
                e.engine
                for e in self.engines.values()
                if lora_name in e.holds and (e.serving or not routable_only)
            )
        )

    def reclaimable(self) -> list[int]:
        """RETIRED versions no session is bound to (in-flight requests are checked at claim)."""
        return sorted(
            v.version_id
            for v in self.versions.values()
            if v.state is VersionState.RETIRED and v.bound == 0
        )

    def needed_versions(self) -> list[int]:
        """Versions every serving engine must hold: the default and every bound version."""
        return sorted(
            v.version_id
            for v in self.versions.values()
            if v.state in SERVING_STATES and (v.version_id == self.default or v.bound > 0)
        )

    def lora_name(self, version_id: int, digest: str) -> str:
        """The immutable engine-side name: never reused, never containing ':' or '/'."""
        return f"{self.prefix}@{self.deployment}-{version_id}-{digest[:16]}"

    def version_by_name(self, lora_name: str) -> VersionRecord | None:
        for v in self.versions.values():
            if v.lora_name == lora_name:
                return v
        return None


# --- evolve ----------------------------------------------------------------------------------


def _version(s: RegistryState, version_id: int, event: str) -> VersionRecord:
    """The version an event names; only an allocation may name one the log does not know."""
    v = s.versions.get(version_id)
    if v is None:
        raise impossible(f"version {version_id}", "ABSENT", event, "it was never allocated")
    return v


def _step(s: RegistryState, version_id: int, event: str) -> VersionRecord:
    """Move a version along the transitions table, or raise: the one way its state changes."""
    v = _version(s, version_id, event)
    v.state = next_state(version_id, v.state, event)
    return v


def _check_attempt(s: RegistryState, version_id: int, event: str, attempt: int) -> None:
    """Paired with the decider's fencing: a receipt or an ending names the current attempt
    (checked before the step, so a violation changes nothing)."""
    v = _version(s, version_id, event)
    if attempt != v.attempt:
        raise impossible(
            f"version {version_id}",
            v.state,
            f"{event}(attempt {attempt})",
            f"the current attempt is {v.attempt}",
        )


def _deployment_created(s: RegistryState, e: DeploymentCreated) -> None:
    s.deployment = e.deployment
    s.prefix = e.prefix
    s.capacity = e.capacity
    s.declared_fleet = e.fleet


def _deployment_configured(s: RegistryState, e: DeploymentConfigured) -> None:
    s.max_staleness = e.max_staleness


def _controller_started(s: RegistryState, e: ControllerStarted) -> None:
    s.epoch = e.epoch
    s.code_version = e.code_version


def _engine_joined(s: RegistryState, e: EngineJoined) -> None:
    s.engines[e.engine] = EngineMember(
        engine=e.engine, incarnation=e.incarnation, endpoint=e.endpoint, kind=e.kind
    )


def _engine_restarted(s: RegistryState, e: EngineRestarted) -> None:
    member = s.engines[e.engine]
    member.incarnation = e.new
    if e.endpoint is not None:
        member.endpoint = e.endpoint
    if e.kind is not None:
        member.kind = e.kind
    member.routable = False
    member.holds.clear()  # a new process life holds nothing
    member.strays = ()
    member.lacks.clear()
    member.mismatched.clear()
    member.canaries.clear()
    member.owes.clear()
    member.unreachable = None  # it answered, as a new process: whatever outage there was ended


def _engine_repaired(s: RegistryState, e: EngineRepaired) -> None:
    member = s.engines[e.engine]
    member.routable = True
    # The repair proved the engine holds what it must (an operator's suspension is lifted by
    # the operator first: the decider refuses to repair it).
    member.suspended = False
    member.suspend_cause = ""


def _engine_suspended(s: RegistryState, e: EngineSuspended) -> None:
    member = s.engines[e.engine]
    member.suspended = True
    member.suspend_cause = e.cause
    member.routable = False


def _engine_resumed(s: RegistryState, e: EngineResumed) -> None:
    member = s.engines[e.engine]
    member.suspended = False
    member.suspend_cause = ""


def _engine_unreachable(s: RegistryState, e: EngineUnreachable) -> None:
    s.engines[e.engine].unreachable = Outage(
        since=e.at, error=e.error, source=e.source, reporter=e.reporter
    )


def _dispatch_failures(s: RegistryState, e: DispatchFailures) -> None:
    outage = s.engines[e.engine].unreachable
    if outage is None:
        raise impossible(f"engine {e.engine}", "reachable", "DispatchFailures", "no outage is open")
    for f in e.failures:
        not_run, ambiguous = outage.failures.get(f.session, (0, 0))
        outage.failures[f.session] = (not_run + f.not_run, ambiguous + f.ambiguous)


def _engine_reachable(s: RegistryState, e: EngineReachable) -> None:
    member = s.engines[e.engine]
    member.unreachable = None
    member.reachable_at = e.at


def _adapter_lost(s: RegistryState, e: AdapterLost) -> None:
    v = _step(s, e.version_id, "AdapterLost")
    member = s.engines[e.engine]
    member.holds.pop(v.lora_name, None)
    member.lacks[v.lora_name] = v.version_id


def _served_content_mismatch(s: RegistryState, e: ServedContentMismatch) -> None:
    v = _step(s, e.version_id, "ServedContentMismatch")
    member = s.engines[e.engine]
    member.holds.pop(v.lora_name, None)
    member.mismatched[v.lora_name] = v.version_id
    if v.version_id in s.needed_versions():
        member.lacks[v.lora_name] = v.version_id


def _canary_recorded(s: RegistryState, e: CanaryRecorded) -> None:
    v = _step(s, e.version_id, "CanaryRecorded")
    s.engines[e.engine].canaries[v.lora_name] = e.answer


def _owe(s: RegistryState, engines: tuple[str, ...], v: VersionRecord) -> None:
    """Engines that could not confirm ``v`` gone (suspended) must drop it before serving."""
    for engine in engines:
        member = s.engines.get(engine)
        if member is not None:
            member.holds.pop(v.lora_name, None)
            member.owes[v.lora_name] = v.attempt


def _engine_left(s: RegistryState, e: EngineLeft) -> None:
    del s.engines[e.engine]


def _inventory_observed(s: RegistryState, e: InventoryObserved) -> None:
    member = s.engines[e.engine]
    present = set(e.adapters)
    member.holds = {}
    legit: set[str] = set()
    # A name served with other content stays out of ``holds`` while it is present.
    member.mismatched = {n: vid for n, vid in member.mismatched.items() if n in present}
    for v in s.versions.values():
        held = v.lora_name in present
        if held and v.state in HOLDABLE_STATES and v.lora_name not in member.mismatched:
            member.holds[v.lora_name] = v.version_id
            legit.add(v.lora_name)
        awaiting_proof = v.state is VersionState.RECLAIMING or (
            v.state is VersionState.FAILED_FATAL and e.engine in v.fleet
        )
        if awaiting_proof:
            if held:
                v.confirmed.pop(e.engine, None)
            else:
                v.confirmed[e.engine] = e.incarnation
    member.strays = tuple(sorted(present - legit - set(member.mismatched)))
    if member.lacks:
        member.lacks = {n: vid for n, vid in member.lacks.items() if n not in member.holds}
    if member.owes:
        member.owes = {n: attempt for n, attempt in member.owes.items() if n in present}


def _version_allocated(s: RegistryState, e: VersionAllocated) -> None:
    # Allocation always opens attempt 1 (its AttemptStarted follows in the same decision);
    # recording it here keeps every single-event prefix of the log consistent.
    existing = s.versions.get(e.version_id)
    state = next_state(
        e.version_id, None if existing is None else existing.state, "VersionAllocated"
    )
    s.versions[e.version_id] = VersionRecord(
        version_id=e.version_id,
        digest=e.digest,
        lora_name=e.lora_name,
        size_bytes=e.size_bytes,
        state=state,
        attempt=1,
    )


def _attempt_started(s: RegistryState, e: AttemptStarted) -> None:
    v = _version(s, e.version_id, "AttemptStarted")
    state = next_state(v.version_id, v.state, "AttemptStarted")
    # From LOADING: the allocation's own attempt 1, not started yet (a started one has a
    # fleet). From FAILED_RETRYABLE: the attempt after the one that failed.
    fresh = v.state is VersionState.LOADING
    if e.attempt != (1 if fresh else v.attempt + 1) or (fresh and v.fleet):
        raise impossible(
            f"version {v.version_id}",
            v.state,
            f"AttemptStarted(attempt {e.attempt})",
            f"attempt {v.attempt} was the last one allocated or started",
        )
    v.state = state
    v.attempt = e.attempt
    v.fleet = e.fleet
    v.loading_fleet = dict.fromkeys(e.fleet)
    s.stalls.pop(v.version_id, None)  # the stall is over: a later one is a new one
    v.claimed_by = None
    v.prepared = {}
    v.ready = {}
    v.confirmed = {}
    v.failure_code = v.failure_reason = None


def _transport_claimed(s: RegistryState, e: TransportClaimed) -> None:
    _check_attempt(s, e.version_id, "TransportClaimed", e.attempt)
    _step(s, e.version_id, "TransportClaimed").claimed_by = e.owner


def _engine_prepared(s: RegistryState, e: EnginePrepared) -> None:
    _check_attempt(s, e.version_id, "EnginePrepared", e.attempt)
    _step(s, e.version_id, "EnginePrepared").prepared[e.engine] = e.incarnation


def _engine_ready(s: RegistryState, e: EngineReady) -> None:
    _check_attempt(s, e.version_id, "EngineReady", e.attempt)
    _step(s, e.version_id, "EngineReady").ready[e.engine] = e.incarnation
    s.engines[e.engine].holds[e.lora_name] = e.version_id


def _version_restored(s: RegistryState, e: VersionRestored) -> None:
    v = _step(s, e.version_id, "VersionRestored")
    member = s.engines[e.engine]
    member.holds[v.lora_name] = e.version_id
    member.lacks.pop(v.lora_name, None)
    member.mismatched.pop(v.lora_name, None)


def _version_published(s: RegistryState, e: VersionPublished) -> None:
    v = _version(s, e.version_id, "VersionPublished")
    published = next_state(v.version_id, v.state, "VersionPublished")
    _check_attempt(s, e.version_id, "VersionPublished", e.attempt)
    # Paired with the decider: a commit retires exactly the current default and takes the
    # next revision (checked before anything changes, so a violation applies nothing).
    if (e.retired, e.revision) != (s.default, s.default_revision + 1):
        raise impossible(
            f"version {v.version_id}",
            v.state,
            f"VersionPublished(revision {e.revision}, retired {e.retired})",
            f"the default is {s.default} at revision {s.default_revision}",
        )
    if e.retired is not None:
        _step(s, e.retired, PUBLISHED_RETIRES)
    v.state = published
    v.loading_fleet = {}
    v.revision = e.revision
    s.default = e.version_id
    s.default_revision = e.revision
    s.commits += 1


def _attempt_failed(s: RegistryState, e: AttemptFailed) -> None:
    _check_attempt(s, e.version_id, "AttemptFailed", e.attempt)
    v = _step(s, e.version_id, ATTEMPT_FAILED_CLEAN if e.clean else ATTEMPT_FAILED_FATAL)
    v.failure_code = e.code
    v.failure_reason = e.reason
    v.claimed_by = None
    v.confirmed = {}
    v.loading_fleet = {}
    if e.clean:
        for member in s.engines.values():
            member.holds.pop(v.lora_name, None)
        # A suspended engine of the attempt could not prove the candidate absent: it owes the
        # drop (the decider ended the attempt clean on the active engines' proofs).
        owed = tuple(
            engine
            for engine in v.fleet
            if engine not in e.absent_on and engine in s.engines and s.engines[engine].suspended
        )
        _owe(s, owed, v)


def _fatal_resolved(s: RegistryState, e: FatalResolved) -> None:
    _check_attempt(s, e.version_id, "FatalResolved", e.attempt)
    v = _step(s, e.version_id, "FatalResolved")
    v.confirmed = {}
    _owe(s, e.owed_by, v)


def _publication_skipped(s: RegistryState, e: PublicationSkipped) -> None:
    s.skipped += 1


def _publication_blocked(s: RegistryState, e: PublicationBlocked) -> None:
    s.stalls[e.version_id] = Stall(e.code, e.blocked_by)


def _owner_registered(s: RegistryState, e: OwnerRegistered) -> None:
    # A new life of a known owner: the sessions of the one it replaces are released by the
    # SessionReleased events that follow (the decider wrote them in the same decision).
    before = s.owners.get(e.owner)
    retired = () if before is None else (*before.retired, before.incarnation)
    s.owners[e.owner] = Owner(
        ttl_s=e.ttl_s,
        registered_at=e.at,
        incarnation=e.incarnation,
        retired=retired,
        sessions_idle_s=e.sessions_idle_s,
        secret_digest=e.secret_digest,
    )


def _owner_deregistered(s: RegistryState, e: OwnerDeregistered) -> None:
    s.owners[e.owner].exited = True


def _owner_lease_expired(s: RegistryState, e: OwnerLeaseExpired) -> None:
    s.owners[e.owner].expired = True


def _session_bound(s: RegistryState, e: SessionBound) -> None:
    # Paired with the decider: a session binds once, and never after its release. (Which
    # versions may be bound is an invariant of the outcome, checked by ``invariants``.)
    v = s.versions.get(e.version_id)
    if v is None or e.session in s.sessions or e.session in s.tombstones:
        raise _binding_violation(s, e)
    owner = s.owners.get(e.owner)
    idle_s = None if owner is None else owner.sessions_idle_s
    s.sessions[e.session] = Binding(e.owner, e.version_id, e.revision, idle_s)
    v.bound += 1


def _session_released(s: RegistryState, e: SessionReleased) -> None:
    # Paired with the decider: a release names the session's binding (None: the session was
    # closed before it ever bound), and a session is released once.
    binding = s.sessions.get(e.session)
    if binding is None:
        if e.version_id is not None or e.session in s.tombstones:
            raise _binding_violation(s, e)
    elif binding.version_id != e.version_id:
        raise _binding_violation(s, e)
    else:
        del s.sessions[e.session]
        s.versions[binding.version_id].bound -= 1
    s.tombstones[e.session] = e.owner
    if e.at is not None:  # the ledger's idle release: it forgets the tombstone later
        s.idle_released[e.session] = e.at


def _binding_violation(s: RegistryState, e: SessionBound | SessionReleased) -> AssertionError:
    """Why a binding event cannot follow the state (off the hot path: only to raise it)."""
    if e.version_id is not None and e.version_id not in s.versions:
        return impossible(
            f"version {e.version_id}", "ABSENT", type(e).__name__, "it was never allocated"
        )
    binding = s.sessions.get(e.session)
    was = (
        "released"
        if e.session in s.tombstones
        else "not bound"
        if binding is None
        else f"bound to version {binding.version_id}"
    )
    if isinstance(e, SessionBound):
        return impossible(f"session {e.session}", was, "SessionBound", "a session binds once")
    why = "a release names the session's binding, once"
    return impossible(f"session {e.session}", was, f"SessionReleased({e.version_id})", why)


def _sessions_forgotten(s: RegistryState, e: SessionsForgotten) -> None:
    tombstones = s.tombstones
    idle = s.idle_released
    for session in e.sessions:
        tombstones.pop(session, None)
        idle.pop(session, None)
    # CPython dicts never shrink on deletion: rebuild a mostly-empty one so a million
    # sessions bound, released and forgotten leave the projection where it started.
    if not tombstones and len(s.sessions) < 1024:
        s.tombstones = {}
        s.idle_released = {}
        s.sessions = dict(s.sessions)


def _reclaim_claimed(s: RegistryState, e: ReclaimClaimed) -> None:
    v = _version(s, e.version_id, "ReclaimClaimed")
    reclaiming = next_state(v.version_id, v.state, "ReclaimClaimed")
    if v.bound:  # paired with the decider's NOT_RECLAIMABLE
        raise impossible(
            f"version {v.version_id}", v.state, "ReclaimClaimed", f"{v.bound} sessions bound"
        )
    v.state = reclaiming
    v.confirmed = {}
    v.ambiguous = False


def _engine_unloaded(s: RegistryState, e: EngineUnloaded) -> None:
    v = _step(s, e.version_id, "EngineUnloaded")
    v.confirmed[e.engine] = e.incarnation
    member = s.engines.get(e.engine)
    if member is not None:
        member.holds.pop(v.lora_name, None)


def _version_reclaimed(s: RegistryState, e: VersionReclaimed) -> None:
    v = _step(s, e.version_id, "VersionReclaimed")
    v.ambiguous = False
    for member in s.engines.values():
        member.holds.pop(v.lora_name, None)
        member.lacks.pop(v.lora_name, None)
        member.mismatched.pop(v.lora_name, None)
        member.canaries.pop(v.lora_name, None)
    _owe(s, e.owed_by, v)


def _reclaim_ambiguous(s: RegistryState, e: ReclaimAmbiguous) -> None:
    # The engine's state is unknown from here on: a proof it gave before (an unload or an
    # inventory racing this unload) no longer counts, so the reclaim completes only once the
    # engine proves the name gone again (docs/publication.md, "Ambiguity").
    v = _step(s, e.version_id, "ReclaimAmbiguous")
    v.ambiguous = True
    v.confirmed.pop(e.engine, None)


def _receipt_rejected(s: RegistryState, e: ReceiptRejected) -> None:
    s.rejected_receipts += 1


def _verdict_conflict(s: RegistryState, e: VerdictConflict) -> None:
    s.verdict_conflicts += 1


def _command_recorded(s: RegistryState, e: CommandRecorded) -> None:
    s.commands[e.command_id] = RecordedCommand(e.fingerprint, e.outcome)


_APPLY: dict[type[Event], Callable[[RegistryState, Any], None]] = {
    DeploymentCreated: _deployment_created,
    DeploymentConfigured: _deployment_configured,
    ControllerStarted: _controller_started,
    EngineJoined: _engine_joined,
    EngineRestarted: _engine_restarted,
    EngineRepaired: _engine_repaired,
    EngineLeft: _engine_left,
    EngineSuspended: _engine_suspended,
    EngineResumed: _engine_resumed,
    AdapterLost: _adapter_lost,
    ServedContentMismatch: _served_content_mismatch,
    CanaryRecorded: _canary_recorded,
    InventoryObserved: _inventory_observed,
    EngineUnreachable: _engine_unreachable,
    DispatchFailures: _dispatch_failures,
    EngineReachable: _engine_reachable,
    VersionAllocated: _version_allocated,
    AttemptStarted: _attempt_started,
    TransportClaimed: _transport_claimed,
    EnginePrepared: _engine_prepared,
    EngineReady: _engine_ready,
    VersionRestored: _version_restored,
    VersionPublished: _version_published,
    AttemptFailed: _attempt_failed,
    FatalResolved: _fatal_resolved,
    PublicationSkipped: _publication_skipped,
    PublicationBlocked: _publication_blocked,
    OwnerRegistered: _owner_registered,
    OwnerLeaseExpired: _owner_lease_expired,
    OwnerDeregistered: _owner_deregistered,
    SessionBound: _session_bound,
    SessionReleased: _session_released,
    SessionsForgotten: _sessions_forgotten,
    ReclaimClaimed: _reclaim_claimed,
    EngineUnloaded: _engine_unloaded,
    VersionReclaimed: _version_reclaimed,
    ReclaimAmbiguous: _reclaim_ambiguous,
    ReceiptRejected: _receipt_rejected,
    VerdictConflict: _verdict_conflict,
    CommandRecorded: _command_recorded,
}


def evolve(state: RegistryState, event: Event, seq: int | None = None) -> RegistryState:
    """Apply one event (in place) and return the state. ``seq`` advances ``last_seq``.

    Raises ``TransitionViolation`` (an ``AssertionError``), before changing anything, for an
    event that cannot follow the state: a version step missing from the transitions table,
    a receipt for another attempt, a release that does not name the session's binding, or a
    record out of order (paired with the store, which hands out seqs one after another)."""
    if seq is None:
        _APPLY[type(event)](state, event)
        return state
    if seq != state.last_seq + 1:
        raise impossible(
            "the state",
            f"at seq {state.last_seq}",
            f"{type(event).__name__} at seq {seq}",
            "records apply once each, in seq order",
        )
    _APPLY[type(event)](state, event)
    state.last_seq = seq
    return state


_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(RegistryState)


def encode_state(state: RegistryState) -> bytes:
    """Canonical bytes of a state: equal states encode to equal bytes (determinism checks and
    snapshots)."""
    return _state_encoder.encode(state)


def decode_state(blob: bytes) -> RegistryState:
    return _state_decoder.decode(blob)
