"""The registry projection: the whole decision state, folded from the log.

``evolve(state, event)`` applies one event. It mutates ``state`` in place (a replay of a million
events must stay under 10 s, so no copying), but it is still a pure function in the sense that
matters for event sourcing: no clock, no randomness, no I/O, and the result depends only on the
state and the event. It never validates: every event in the log was decided valid when it was
appended, so applying it cannot fail; ``invariants()`` checks the outcome.

Everything the decider and the drivers ask ("who is the default", "which engines hold v7",
"is v3 reclaimable") is answered from this state.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

import msgspec

from evlog.events import (
    AttemptFailed,
    AttemptStarted,
    CommandRecorded,
    ControllerStarted,
    DeploymentCreated,
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
    OwnerLeaseExpired,
    OwnerRegistered,
    PublicationSkipped,
    ReceiptRejected,
    ReclaimAmbiguous,
    ReclaimClaimed,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    TransportClaimed,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)

# Bump when evolve() or the state layout changes meaning: older snapshots are then ignored and
# the state is rebuilt from the log (snapshots are a cache, never a source of truth).
PROJECTION_VERSION = "registry-1"


class VersionState(StrEnum):
    LOADING = "LOADING"
    PUBLISHED = "PUBLISHED"
    RETIRED = "RETIRED"
    RECLAIMING = "RECLAIMING"
    RECLAIMED = "RECLAIMED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_FATAL = "FAILED_FATAL"


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
    ``confirmed`` collects unload/absence proofs of the current reclaim or fatal resolution."""

    version_id: int
    digest: str
    lora_name: str
    size_bytes: int = 0
    state: VersionState = VersionState.LOADING
    attempt: int = 0
    fleet: tuple[str, ...] = ()
    claimed_by: str | None = None
    prepared: dict[str, str] = msgspec.field(default_factory=dict)
    ready: dict[str, str] = msgspec.field(default_factory=dict)
    bound: int = 0
    revision: int | None = None
    confirmed: dict[str, str] = msgspec.field(default_factory=dict)
    ambiguous: bool = False
    failure_code: str | None = None
    failure_reason: str | None = None


class EngineMember(msgspec.Struct, kw_only=True):
    """A fleet member. ``holds`` is what the ledger knows it holds (lora_name -> version_id),
    from READY receipts, restorations, unloads and inventories. An engine is ``routable`` only
    once every version still needed is loaded on it (after a join or a restart)."""

    engine: str
    incarnation: str
    endpoint: str = ""
    kind: str = "local"
    routable: bool = False
    holds: dict[str, int] = msgspec.field(default_factory=dict)
    # Names the last inventory showed that the engine should not hold (unknown, reclaimed, or
    # of a cleanly failed attempt): the reconciler unloads the managed ones.
    strays: tuple[str, ...] = ()


class Binding(msgspec.Struct, array_like=True):
    owner: str
    version_id: int
    revision: int


class Owner(msgspec.Struct, kw_only=True):
    ttl_s: float
    registered_at: float
    expired: bool = False


class RecordedCommand(msgspec.Struct, array_like=True):
    fingerprint: str
    outcome: bytes


class RegistryState(msgspec.Struct, kw_only=True):
    deployment: str | None = None
    prefix: str = ""
    capacity: int = 0
    declared_fleet: tuple[str, ...] = ()
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
    owners: dict[str, Owner] = msgspec.field(default_factory=dict)
    commands: dict[str, RecordedCommand] = msgspec.field(default_factory=dict)
    skipped: int = 0
    rejected_receipts: int = 0

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

    def routable_engines(self) -> tuple[str, ...]:
        return tuple(sorted(e.engine for e in self.engines.values() if e.routable))

    def holders(self, lora_name: str, *, routable_only: bool = True) -> tuple[str, ...]:
        """Engines that hold ``lora_name`` (and may serve it, when ``routable_only``)."""
        return tuple(
            sorted(
                e.engine
                for e in self.engines.values()
                if lora_name in e.holds and (e.routable or not routable_only)
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


def _deployment_created(s: RegistryState, e: DeploymentCreated) -> None:
    s.deployment = e.deployment
    s.prefix = e.prefix
    s.capacity = e.capacity
    s.declared_fleet = e.fleet


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
    member.routable = False
    member.holds.clear()  # a new process life holds nothing
    member.strays = ()


def _engine_repaired(s: RegistryState, e: EngineRepaired) -> None:
    s.engines[e.engine].routable = True


def _engine_left(s: RegistryState, e: EngineLeft) -> None:
    del s.engines[e.engine]


def _inventory_observed(s: RegistryState, e: InventoryObserved) -> None:
    member = s.engines[e.engine]
    present = set(e.adapters)
    member.holds = {}
    legit: set[str] = set()
    for v in s.versions.values():
        held = v.lora_name in present
        if held and v.state in HOLDABLE_STATES:
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
    member.strays = tuple(sorted(present - legit))


def _version_allocated(s: RegistryState, e: VersionAllocated) -> None:
    # Allocation always opens attempt 1 (its AttemptStarted follows in the same decision);
    # recording it here keeps every single-event prefix of the log consistent.
    s.versions[e.version_id] = VersionRecord(
        version_id=e.version_id,
        digest=e.digest,
        lora_name=e.lora_name,
        size_bytes=e.size_bytes,
        attempt=1,
    )


def _attempt_started(s: RegistryState, e: AttemptStarted) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.LOADING
    v.attempt = e.attempt
    v.fleet = e.fleet
    v.claimed_by = None
    v.prepared = {}
    v.ready = {}
    v.confirmed = {}
    v.failure_code = v.failure_reason = None


def _transport_claimed(s: RegistryState, e: TransportClaimed) -> None:
    s.versions[e.version_id].claimed_by = e.owner


def _engine_prepared(s: RegistryState, e: EnginePrepared) -> None:
    s.versions[e.version_id].prepared[e.engine] = e.incarnation


def _engine_ready(s: RegistryState, e: EngineReady) -> None:
    s.versions[e.version_id].ready[e.engine] = e.incarnation
    s.engines[e.engine].holds[e.lora_name] = e.version_id


def _version_restored(s: RegistryState, e: VersionRestored) -> None:
    s.engines[e.engine].holds[s.versions[e.version_id].lora_name] = e.version_id


def _version_published(s: RegistryState, e: VersionPublished) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.PUBLISHED
    v.revision = e.revision
    if e.retired is not None:
        s.versions[e.retired].state = VersionState.RETIRED
    s.default = e.version_id
    s.default_revision = e.revision
    s.commits += 1


def _attempt_failed(s: RegistryState, e: AttemptFailed) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.FAILED_RETRYABLE if e.clean else VersionState.FAILED_FATAL
    v.failure_code = e.code
    v.failure_reason = e.reason
    v.claimed_by = None
    v.confirmed = {}
    if e.clean:
        for member in s.engines.values():
            member.holds.pop(v.lora_name, None)


def _fatal_resolved(s: RegistryState, e: FatalResolved) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.FAILED_RETRYABLE
    v.confirmed = {}


def _publication_skipped(s: RegistryState, e: PublicationSkipped) -> None:
    s.skipped += 1


def _owner_registered(s: RegistryState, e: OwnerRegistered) -> None:
    s.owners[e.owner] = Owner(ttl_s=e.ttl_s, registered_at=e.at)


def _owner_lease_expired(s: RegistryState, e: OwnerLeaseExpired) -> None:
    s.owners[e.owner].expired = True


def _session_bound(s: RegistryState, e: SessionBound) -> None:
    s.sessions[e.session] = Binding(e.owner, e.version_id, e.revision)
    s.versions[e.version_id].bound += 1


def _session_released(s: RegistryState, e: SessionReleased) -> None:
    binding = s.sessions.pop(e.session, None)
    if binding is not None:
        s.versions[binding.version_id].bound -= 1
    s.tombstones[e.session] = e.owner


def _sessions_forgotten(s: RegistryState, e: SessionsForgotten) -> None:
    tombstones = s.tombstones
    for session in e.sessions:
        tombstones.pop(session, None)
    # CPython dicts never shrink on deletion: rebuild a mostly-empty one so a million
    # sessions bound, released and forgotten leave the projection where it started.
    if not tombstones and len(s.sessions) < 1024:
        s.tombstones = {}
        s.sessions = dict(s.sessions)


def _reclaim_claimed(s: RegistryState, e: ReclaimClaimed) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.RECLAIMING
    v.confirmed = {}
    v.ambiguous = False


def _engine_unloaded(s: RegistryState, e: EngineUnloaded) -> None:
    v = s.versions[e.version_id]
    v.confirmed[e.engine] = e.incarnation
    member = s.engines.get(e.engine)
    if member is not None:
        member.holds.pop(v.lora_name, None)


def _version_reclaimed(s: RegistryState, e: VersionReclaimed) -> None:
    v = s.versions[e.version_id]
    v.state = VersionState.RECLAIMED
    v.ambiguous = False
    for member in s.engines.values():
        member.holds.pop(v.lora_name, None)


def _reclaim_ambiguous(s: RegistryState, e: ReclaimAmbiguous) -> None:
    s.versions[e.version_id].ambiguous = True


def _receipt_rejected(s: RegistryState, e: ReceiptRejected) -> None:
    s.rejected_receipts += 1


def _command_recorded(s: RegistryState, e: CommandRecorded) -> None:
    s.commands[e.command_id] = RecordedCommand(e.fingerprint, e.outcome)


_APPLY: dict[type[Event], Callable[[RegistryState, Any], None]] = {
    DeploymentCreated: _deployment_created,
    ControllerStarted: _controller_started,
    EngineJoined: _engine_joined,
    EngineRestarted: _engine_restarted,
    EngineRepaired: _engine_repaired,
    EngineLeft: _engine_left,
    InventoryObserved: _inventory_observed,
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
    OwnerRegistered: _owner_registered,
    OwnerLeaseExpired: _owner_lease_expired,
    SessionBound: _session_bound,
    SessionReleased: _session_released,
    SessionsForgotten: _sessions_forgotten,
    ReclaimClaimed: _reclaim_claimed,
    EngineUnloaded: _engine_unloaded,
    VersionReclaimed: _version_reclaimed,
    ReclaimAmbiguous: _reclaim_ambiguous,
    ReceiptRejected: _receipt_rejected,
    CommandRecorded: _command_recorded,
}


def evolve(state: RegistryState, event: Event, seq: int | None = None) -> RegistryState:
    """Apply one event (in place) and return the state. ``seq`` advances ``last_seq``."""
    _APPLY[type(event)](state, event)
    if seq is not None:
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
