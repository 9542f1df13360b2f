"""The event vocabulary: every decision the ledger ever makes, as an immutable fact.

Each event is a frozen msgspec ``Struct`` tagged with its class name, so one decoder reads the
whole union. Events carry everything a replay needs (times, engine replies, evidence) as data:
the projections never consult a clock or an engine.

Schema evolution: every class has a ``SCHEMA`` version. The store writes it beside the payload;
when an old payload is read, the upcasters registered with :func:`upcaster` rewrite the decoded
mapping step by step (``1 -> 2 -> ...``) before it is converted to the current class. An old log
therefore always reads with new code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag=True, forbid_unknown_fields=True):
    """Base of every event. ``SCHEMA`` is bumped when a field changes meaning or shape."""

    SCHEMA: ClassVar[int] = 1


# --- deployment and controller -------------------------------------------------------------


class DeploymentCreated(Event, frozen=True):
    """The first event of a log: names the deployment and fixes its rules."""

    deployment: str
    prefix: str
    capacity: int
    fleet: tuple[str, ...] = ()


class DeploymentConfigured(Event, frozen=True):
    """The deployment's tunable rules, as the controller that opened the log set them.

    ``max_staleness``: a session whose bound version is more than this many published versions
    behind the default is refused its next turn (``SESSION_TOO_STALE``) and released (cause
    ``too_stale``); ``None`` (the default) bounds nothing. It is an event, not process
    configuration, because it decides what the ledger accepts: a replay must know it."""

    max_staleness: int | None = None


class ControllerStarted(Event, frozen=True):
    """A controller process opened the log. ``epoch`` fences out older controllers."""

    epoch: int
    code_version: str


# --- fleet ---------------------------------------------------------------------------------


class EngineJoined(Event, frozen=True):
    """An engine became a fleet member. Like a restarted engine, it is not routable until the
    versions still needed are loaded on it (:class:`EngineRepaired`)."""

    engine: str
    incarnation: str
    endpoint: str = ""
    kind: str = "local"


class EngineRestarted(Event, frozen=True):
    """A new process life of an engine was observed: it lost every adapter and is not routable
    until the versions still needed have been loaded again (:class:`EngineRepaired`).

    ``endpoint`` and ``kind``: where the new life serves and what it is, when they changed
    (the server came back behind another address: gateways read the endpoint from the
    ledger); ``None``: unchanged. Schema 2 added them (schema 1 records: unchanged)."""

    SCHEMA: ClassVar[int] = 2

    engine: str
    old: str
    new: str
    endpoint: str | None = None
    kind: str | None = None


class VersionRestored(Event, frozen=True):
    """A version still needed (default or bound) was loaded again on a joined/restarted engine."""

    version_id: int
    engine: str
    incarnation: str


class EngineRepaired(Event, frozen=True):
    """Every version still needed is loaded on the restarted engine; it may serve again."""

    engine: str
    incarnation: str


class EngineLeft(Event, frozen=True):
    """An engine stopped being a fleet member. ``cause``: ``fleet`` (the control plane was
    opened without it) or ``operator`` (removed by hand). Schema 2 added ``cause`` (schema 1
    records: ``fleet``)."""

    SCHEMA: ClassVar[int] = 2

    engine: str
    cause: str = "fleet"


class EngineSuspended(Event, frozen=True):
    """The engine is quarantined: it gets no new traffic (not routable), and publication and
    reclaim stop waiting for it. ``cause``: ``unhealthy`` (its probes failed for the
    configured time), ``unanswered`` (a publication's call to it waited the control timeout
    while its probes failed: it left the attempt's target set), ``lost_adapter`` (a lost
    version could not be reloaded on it) or ``operator``; ``detail`` says what was seen. It
    serves again only after a repair proves it holds exactly the versions still needed
    (:class:`EngineRepaired`)."""

    engine: str
    incarnation: str
    cause: str
    detail: str = ""


class EngineResumed(Event, frozen=True):
    """An operator lifted a suspension. The engine is still not routable: the reconciler
    repairs it first (:class:`EngineRepaired`)."""

    engine: str
    incarnation: str
    cause: str = "operator"


class AdapterLost(Event, frozen=True):
    """An incident: a routable engine's fresh inventory lacks a version it held and that is
    still needed (the default or a bound version). Routing stops sending the version there at
    once; the reconciler reloads it (:class:`VersionRestored`) or suspends the engine."""

    version_id: int
    engine: str
    incarnation: str


class ServedContentMismatch(Event, frozen=True):
    """An incident: an engine serves other content under a committed version's name than the
    version's. ``evidence`` says how it was seen: ``digest`` (the engine's inventory reports,
    per name, the digest of the bytes it loaded: ``expected`` is the version's digest, ``seen``
    the reported one) or ``canary`` (an engine that cannot report one answered the version's
    canary prompt differently: ``expected`` and ``seen`` are the two answers). The engine
    leaves routing for that version at once, as after :class:`AdapterLost`; the reconciler
    replaces the content with the version's (:class:`VersionRestored`) or suspends the
    engine. Written once per (engine, version) until then."""

    version_id: int
    engine: str
    incarnation: str
    evidence: str
    expected: str
    seen: str


class CanaryRecorded(Event, frozen=True):
    """The baseline of a version's canary on one engine life: the greedy tokens (``answer``,
    comma-separated ids) that life gave for the fixed canary prompt on the version, taken
    once it held the version. An engine that cannot report the digest of what it loaded (a
    path engine: SGLang, vLLM) is checked against it (per engine: hardware can differ); another
    answer later is a :class:`ServedContentMismatch` with ``evidence`` ``canary``."""

    version_id: int
    engine: str
    incarnation: str
    answer: str


class InventoryObserved(Event, frozen=True):
    """What an engine proved it holds (managed names only), read fresh from the engine."""

    engine: str
    incarnation: str
    adapters: tuple[str, ...]


# --- engine reachability: an outage, from its first failure to the probe that answered -------


class TurnFailures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One session's generations that failed on an engine during its outage, as the faces
    counted them: ``not_run`` provably never reached the engine (connection refused, a dead
    engine known before sending: each was tried on another holder), ``ambiguous`` may have run
    (answered ``AMBIGUOUS_DISPATCH``, never resent)."""

    session: str
    not_run: int = 0
    ambiguous: int = 0


class EngineUnreachable(Event, frozen=True):
    """An outage began: the engine could not be reached. It leaves routing (and the fleet of
    new publication attempts) from this record on, until :class:`EngineReachable`; written
    once per outage, with its first error. ``at``: when that failure was seen, on the ledger's
    clock (a face's report is dated by its age). ``source``: ``probe`` (the reconciler's
    health probe failed) or ``dispatch`` (a generation was refused a connection, or found the
    engine gone, before it was sent); ``reporter`` names who saw it. Reclaim still waits for
    the engine until the durable suspension (``EngineSuspended``, after ``suspend_after_s`` of
    failed probes); a publication until its call to the engine also went unanswered past the
    control timeout (cause ``unanswered``)."""

    engine: str
    incarnation: str
    at: float
    error: str
    source: str
    reporter: str = ""


class DispatchFailures(Event, frozen=True):
    """Generations that failed on an engine during its outage (the one that began at
    ``since``), per session: recorded in batches, as the faces' trouble reports bring new
    counts, never one event per turn (once the engine is out of routing, no turn goes there and
    nothing more is written)."""

    engine: str
    incarnation: str
    since: float
    failures: tuple[TurnFailures, ...]


class EngineReachable(Event, frozen=True):
    """The outage that began at ``since`` ended at ``at``: a probe of the same process life
    answered. The engine is routable again if it was before the outage (it holds what it held;
    a version it lacks is restored by the reconciler, as after an ``AdapterLost``). A new
    process life ends an outage with ``EngineRestarted`` instead, repaired before it serves."""

    engine: str
    incarnation: str
    at: float
    since: float


# --- publication ---------------------------------------------------------------------------


class VersionAllocated(Event, frozen=True):
    """A new version id took a capacity slot under its immutable name."""

    version_id: int
    digest: str
    lora_name: str
    size_bytes: int = 0


class AttemptStarted(Event, frozen=True):
    """An attempt to load a version on ``fleet`` (the routable members at allocation)."""

    version_id: int
    attempt: int
    fleet: tuple[str, ...]


class TransportClaimed(Event, frozen=True):
    """One driver owns the byte transfer of this attempt; a second one is refused."""

    version_id: int
    attempt: int
    owner: str


class EnginePrepared(Event, frozen=True):
    version_id: int
    attempt: int
    engine: str
    incarnation: str


class EngineReady(Event, frozen=True):
    """An engine loaded the candidate and echoed its identity (confirmed by a fresh inventory)."""

    version_id: int
    attempt: int
    engine: str
    incarnation: str
    digest: str
    lora_name: str


class VersionPublished(Event, frozen=True):
    """The atomic commit: the version becomes the default; ``retired`` is the old default.
    ``rollback``: the new default is a lower version than the one it retires, published on
    purpose (``allow_rollback``). Schema 2 added ``rollback`` (schema 1 records: False)."""

    SCHEMA: ClassVar[int] = 2

    version_id: int
    attempt: int
    revision: int
    retired: int | None = None
    rollback: bool = False


class AttemptFailed(Event, frozen=True):
    """An attempt ended before commit. ``clean`` means every engine of the attempt proved the
    candidate absent (``absent_on``): the slot is freed and a retry may follow. Otherwise the
    version is FAILED_FATAL and keeps its slot until inventory evidence resolves it."""

    version_id: int
    attempt: int
    clean: bool
    code: str
    reason: str
    absent_on: tuple[str, ...] = ()


class FatalResolved(Event, frozen=True):
    """Inventory evidence showed a FAILED_FATAL candidate absent on every active engine it
    targeted. ``owed_by``: suspended engines that could not prove it absent; each must drop
    the name before it serves again. Schema 2 added ``owed_by`` (schema 1 records: none)."""

    SCHEMA: ClassVar[int] = 2

    version_id: int
    attempt: int
    evidence: tuple[int, ...] = ()  # seqs of the InventoryObserved events relied on
    owed_by: tuple[str, ...] = ()


class SlotHolder(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One version holding a capacity slot when a publication was skipped, and why it still
    holds it: ``state`` (its version state), ``bound`` (sessions bound to it), ``reason`` (one
    of ``default``, ``sessions_bound``, ``awaiting_reclaim`` -- retired and unbound, waiting for
    the reclaim driver or for requests in flight --, ``reclaim_in_progress``, ``ambiguous``,
    ``loading``, ``failed_fatal``)."""

    version_id: int
    state: str
    bound: int = 0
    reason: str


class PublicationSkipped(Event, frozen=True):
    """A publication refused before any byte moved (capacity after bootstrap): training goes on.
    ``holders`` (schema 2) names the versions holding the slots and why each still holds one;
    a schema-1 record reads with none."""

    SCHEMA: ClassVar[int] = 2

    version_id: int
    digest: str
    code: str
    message: str
    holders: tuple[SlotHolder, ...] = ()


class PublicationBlocked(Event, frozen=True):
    """An allocation refused because something else must happen first: ``code`` is the
    refusal (``PUBLICATION_BLOCKED``, ``PUBLICATION_IN_PROGRESS``, ``FLEET_MISMATCH``,
    ``CAPACITY_ERROR`` before the first commit), ``blocked_by`` the versions in the way, ``cause``
    why, in words. Recorded once per stall: the same refusal again (same version, code and
    blockers) writes nothing, so a retry loop does not grow the log."""

    version_id: int
    digest: str
    code: str
    cause: str
    blocked_by: tuple[int, ...] = ()


# --- owners and sessions -------------------------------------------------------------------


class OwnerRegistered(Event, frozen=True):
    """A rollout worker took a lease. Renewals are not logged; only the expiry decision is.

    ``incarnation``: the token of this process life of the owner, made by the caller (a uuid
    per worker start). Registering an owner id again under another incarnation starts a new
    life: ``replaced`` names the incarnation it follows, and when that one was still live its
    sessions are released right after this event (cause ``owner_restarted``), so a restarted
    worker never leaves its predecessor's sessions pinning their versions. Schema 2 added
    ``incarnation`` and ``replaced`` (schema 1 records: ``""`` and None).

    ``sessions_idle_s``: who holds the sessions this owner binds. None: the owner does (a
    ``RolloutWorker``): they end with its life (exit, expiry, a new incarnation). A number: the
    owner is a *relay* (an OpenAI face) and its sessions are client-held: the end of its life
    releases none of them; they end by an explicit release, by ``max_staleness``, by an
    operator, or idle, released by the ledger's process after that many seconds without a
    turn (0: never for idleness). Schema 3 added it (schema 2 records: None, owner-held).

    ``secret_digest``: SHA-256 (hex) of the life's secret, which the registering caller made
    and keeps; only a call carrying that secret may bind, renew, release or deregister for this
    life. The log never holds the secret itself. Schema 4 added it (schema 3 records: ``""``, a
    life registered without a secret, which no remote call can act for: it must re-register)."""

    SCHEMA: ClassVar[int] = 4

    owner: str
    ttl_s: float
    at: float
    incarnation: str = ""
    replaced: str | None = None
    sessions_idle_s: float | None = None
    secret_digest: str = ""


class OwnerDeregistered(Event, frozen=True):
    """The owner's ``incarnation`` ended cleanly (the worker closed): its sessions still bound
    are released right after this event (cause ``owner_exited``). A clean end, never an
    incident; its lease is not waited for."""

    owner: str
    incarnation: str
    at: float


class OwnerLeaseExpired(Event, frozen=True):
    """The owner stopped renewing; its sessions are released right after this event."""

    owner: str
    at: float
    last_seen: float


class SessionBound(Event, frozen=True):
    session: str
    owner: str
    version_id: int
    revision: int


# Release causes the ledger itself writes when an owner's life ends (others come from callers:
# ``closed``, ``idle``, ``too_stale``). Only ``lease_expired`` is an incident: the other two are
# a worker that said it ended (``owner_exited``) or a new life of it that took over
# (``owner_restarted``, reported once per restart, with the restart).
LEASE_EXPIRED_CAUSE = "lease_expired"
OWNER_RESTARTED_CAUSE = "owner_restarted"
OWNER_EXITED_CAUSE = "owner_exited"
# A session released after a time without a turn: by the ledger's process for a client-held
# session (with ``last_turn``), or by a ``RolloutWorker`` given ``idle_release_s``.
IDLE_CAUSE = "idle"
# The causes a caller may state in a release (``closed``: it ended the session; the ledger
# checks ``too_stale`` and ``idle`` against the log): the others are the ledger's own.
CALLER_RELEASE_CAUSES = ("closed", IDLE_CAUSE, "too_stale")


class SessionReleased(Event, frozen=True):
    """Tombstones the session (it can never bind again). ``version_id`` is None when the
    session was closed before it ever bound. ``cause``: the caller's (``closed``, ``idle``,
    ``too_stale``) or the ledger's when the owner's life ended (``lease_expired``,
    ``owner_restarted``, ``owner_exited``).

    The ledger's idle release of a client-held session records the evidence it relied on:
    ``last_turn`` (the session's last turn as the faces reported it, by the ledger's clock),
    ``idle_s`` (the bound it used) and ``at`` (when it decided; the tombstone is forgotten a
    retention period later). Schema 2 added them (schema 1 records, and every other release:
    None)."""

    SCHEMA: ClassVar[int] = 2

    session: str
    owner: str
    version_id: int | None
    cause: str = "closed"
    last_turn: float | None = None
    idle_s: float | None = None
    at: float | None = None


class SessionsForgotten(Event, frozen=True):
    """Tombstones dropped once their owner finished cleanup (keeps the projection bounded)."""

    sessions: tuple[str, ...]


# --- reclaim -------------------------------------------------------------------------------


class InFlight(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reporter's count of requests in flight on (engine, version) at time ``at``."""

    reporter: str
    engine: str
    count: int
    at: float


class ReclaimClaimed(Event, frozen=True):
    """A RETIRED, unbound version handed out for unloading, with the in-flight evidence
    (all zero) that the decision relied on."""

    version_id: int
    evidence: tuple[InFlight, ...] = ()


class EngineUnloaded(Event, frozen=True):
    version_id: int
    engine: str
    incarnation: str


class VersionReclaimed(Event, frozen=True):
    """Every active engine confirmed the unload: the slot is free. ``owed_by``: suspended
    engines that did not confirm; each must drop the name before it serves again. Schema 2
    added ``owed_by`` (schema 1 records: none)."""

    SCHEMA: ClassVar[int] = 2

    version_id: int
    owed_by: tuple[str, ...] = ()


class ReclaimAmbiguous(Event, frozen=True):
    """An unload reply was ambiguous: the version keeps its slot until inventories decide."""

    version_id: int
    engine: str
    reason: str


# --- refusals worth an incident trail and command idempotency ------------------------------


class ReceiptRejected(Event, frozen=True):
    """An engine receipt that did not match the attempt it claims (stale, restarted, wrong
    digest): recorded so an incident replay shows it, never applied."""

    code: str
    version_id: int
    attempt: int
    engine: str
    incarnation: str
    detail: str


class VerdictConflict(Event, frozen=True):
    """A failure report whose verdict contradicts how the attempt already ended (a fatal
    report on a FAILED_RETRYABLE attempt, a clean one on a FAILED_FATAL attempt): refused,
    never applied, but recorded so the evidence it carries is not dropped and a replay shows
    it. ``state`` is how the attempt ended; ``clean``, ``code``, ``reason`` and ``absent_on``
    are the report's."""

    version_id: int
    attempt: int
    state: str
    clean: bool
    code: str
    reason: str
    absent_on: tuple[str, ...] = ()


class CommandRecorded(Event, frozen=True):
    """A client command id and the outcome it produced (msgpack bytes of the outcome), so the
    same command id yields the same outcome forever."""

    command_id: str
    fingerprint: str
    outcome: bytes


ALL_EVENTS: tuple[type[Event], ...] = (
    DeploymentCreated,
    DeploymentConfigured,
    ControllerStarted,
    EngineJoined,
    EngineRestarted,
    VersionRestored,
    EngineRepaired,
    EngineLeft,
    EngineSuspended,
    EngineResumed,
    AdapterLost,
    ServedContentMismatch,
    CanaryRecorded,
    InventoryObserved,
    EngineUnreachable,
    DispatchFailures,
    EngineReachable,
    VersionAllocated,
    AttemptStarted,
    TransportClaimed,
    EnginePrepared,
    EngineReady,
    VersionPublished,
    AttemptFailed,
    FatalResolved,
    PublicationSkipped,
    PublicationBlocked,
    OwnerRegistered,
    OwnerLeaseExpired,
    OwnerDeregistered,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    ReclaimClaimed,
    EngineUnloaded,
    VersionReclaimed,
    ReclaimAmbiguous,
    ReceiptRejected,
    VerdictConflict,
    CommandRecorded,
)

AnyEvent = (
    DeploymentCreated
    | DeploymentConfigured
    | ControllerStarted
    | EngineJoined
    | EngineRestarted
    | VersionRestored
    | EngineRepaired
    | EngineLeft
    | EngineSuspended
    | EngineResumed
    | AdapterLost
    | ServedContentMismatch
    | CanaryRecorded
    | InventoryObserved
    | EngineUnreachable
    | DispatchFailures
    | EngineReachable
    | VersionAllocated
    | AttemptStarted
    | TransportClaimed
    | EnginePrepared
    | EngineReady
    | VersionPublished
    | AttemptFailed
    | FatalResolved
    | PublicationSkipped
    | PublicationBlocked
    | OwnerRegistered
    | OwnerLeaseExpired
    | OwnerDeregistered
    | SessionBound
    | SessionReleased
    | SessionsForgotten
    | ReclaimClaimed
    | EngineUnloaded
    | VersionReclaimed
    | ReclaimAmbiguous
    | ReceiptRejected
    | VerdictConflict
    | CommandRecorded
)

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in ALL_EVENTS}


def _stream_field(cls: type[Event]) -> str | None:
    """The field that names an event's stream: the version, else the session, the engine, the
    owner; ``None`` for controller events. Session events carry a version id but belong to
    their session's stream."""
    fields = set(cls.__struct_fields__)
    if "version_id" in fields and cls not in (SessionBound, SessionReleased):
        return "version_id"
    for name in ("session", "engine", "owner"):
        if name in fields:
            return name
    return None


_STREAM_PREFIX = {"version_id": "version-", "session": "session-", "engine": "engine-",
                  "owner": "owner-"}  # fmt: skip
# Decided once per class, not per event: stream_of runs for every event the ledger appends.
_STREAMS: dict[type[Event], tuple[str, str] | None] = {
    cls: (field, _STREAM_PREFIX[field]) if (field := _stream_field(cls)) else None
    for cls in ALL_EVENTS
}


def stream_of(event: Event) -> str:
    """The stream an event belongs to: one per version, session, engine, owner, else controller."""
    spec = _STREAMS[type(event)]
    if spec is None:
        return "controller"
    field, prefix = spec
    return f"{prefix}{getattr(event, field)}"


# --- codec and upcasting -------------------------------------------------------------------

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


def upcaster(type_name: str, from_schema: int) -> Callable[[Upcaster], Upcaster]:
    """Register a pure ``dict -> dict`` rewrite of ``type_name`` from ``from_schema`` to the next.

    Example, after adding a field to ``EngineJoined`` and bumping its ``SCHEMA`` to 2::

        @upcaster("EngineJoined", 1)
        def _engine_joined_v1(d):
            return {**d, "zone": "unknown"}
    """

    def register(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(type_name, from_schema)] = fn
        return fn

    return register


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


@upcaster("VersionPublished", 1)
def _version_published_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "rollback": False}


@upcaster("PublicationSkipped", 1)
def _publication_skipped_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "holders": []}


@upcaster("EngineLeft", 1)
def _engine_left_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "cause": "fleet"}


@upcaster("EngineRestarted", 1)
def _engine_restarted_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "endpoint": None, "kind": None}


@upcaster("OwnerRegistered", 1)
def _owner_registered_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "incarnation": "", "replaced": None}


@upcaster("OwnerRegistered", 2)
def _owner_registered_v2(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "sessions_idle_s": None}


@upcaster("OwnerRegistered", 3)
def _owner_registered_v3(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "secret_digest": ""}


@upcaster("SessionReleased", 1)
def _session_released_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "last_turn": None, "idle_s": None, "at": None}


@upcaster("FatalResolved", 1)
def _fatal_resolved_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "owed_by": []}


@upcaster("VersionReclaimed", 1)
def _version_reclaimed_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "owed_by": []}


def decode_event(payload: bytes, type_name: str, schema: int) -> AnyEvent:
    """Decode a stored payload written with ``schema`` into the current class of ``type_name``.

    Raises ``LookupError`` for an unknown type or a schema newer than this code (an old
    controller must not misread a newer log), ``msgspec.ValidationError`` for a malformed one.
    """
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise LookupError(f"unknown event type {type_name!r}")
    if schema == cls.SCHEMA:
        return _decoder.decode(payload)
    if schema > cls.SCHEMA:
        raise LookupError(f"{type_name} schema {schema} is newer than this code ({cls.SCHEMA})")
    data = msgspec.msgpack.decode(payload)
    for step in range(schema, cls.SCHEMA):
        fn = _UPCASTERS.get((type_name, step))
        if fn is None:
            raise LookupError(f"no upcaster for {type_name} schema {step} -> {step + 1}")
        data = fn(data)
    event: AnyEvent = msgspec.convert(data, AnyEvent)  # convert() types only a class, not a union
    return event
