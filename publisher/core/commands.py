"""Commands: what callers ask the ledger to decide, as plain data.

A command carries every input of its decision, including time (``now``) and engine replies
(incarnations, inventories, in-flight evidence): the decider reads nothing else, so the same
command against the same state always decides the same way, and a replay never has to ask.

``command_id`` is an optional client idempotency key: the same id always yields the same
outcome (a different command under a used id is refused with ``COMMAND_CONFLICT``).
"""

from __future__ import annotations

import msgspec

from evlog.events import InFlight, TurnFailures


class Command(msgspec.Struct, frozen=True, kw_only=True, tag=True, forbid_unknown_fields=True):
    command_id: str | None = None


# --- deployment, controller, fleet -----------------------------------------------------------


class CreateDeployment(Command, frozen=True):
    deployment: str
    prefix: str
    capacity: int
    fleet: tuple[str, ...] = ()


class ConfigureDeployment(Command, frozen=True):
    """Set the deployment's tunable rules (``DeploymentConfigured``); the same values again
    are a no-op. ``max_staleness``: see docs/sessions.md#staleness (None: unbounded)."""

    max_staleness: int | None = None


class StartController(Command, frozen=True):
    code_version: str


class JoinEngine(Command, frozen=True):
    engine: str
    incarnation: str
    endpoint: str = ""
    kind: str = "local"


class ObserveRestart(Command, frozen=True):
    """A new incarnation was seen (health probe or a receipt): the engine lost everything.
    ``endpoint`` and ``kind``: the handle's, recorded if they changed (``None``: unknown)."""

    engine: str
    incarnation: str
    endpoint: str | None = None
    kind: str | None = None


class RestoreVersion(Command, frozen=True):
    """Repair loaded a still-needed version on a joined/restarted engine."""

    version_id: int
    engine: str
    incarnation: str


class RepairEngine(Command, frozen=True):
    """Mark an engine routable: refused (NOT_READY) until it holds every needed version."""

    engine: str
    incarnation: str


class LeaveEngine(Command, frozen=True):
    engine: str


class SuspendEngine(Command, frozen=True):
    """Quarantine an engine: ``cause`` ``unhealthy`` (probes failed for the configured time),
    ``lost_adapter`` or ``operator`` (``unanswered`` is decided by :class:`SuspendUnanswered`).
    ``incarnation`` empty: whatever it is now (operators)."""

    engine: str
    cause: str
    detail: str = ""
    incarnation: str = ""


class SuspendUnanswered(Command, frozen=True):
    """Take an engine out of the LOADING version's attempt (and out of routing) because it did
    not answer: its ``call`` has been outstanding for ``waited_s`` while the control timeout
    is ``timeout_s``. Suspends it (cause ``unanswered``) only if it waited at least the timeout
    and the engine's probes failed too (an open outage of ``incarnation``): a busy engine that
    still answers probes is slow, not frozen."""

    engine: str
    incarnation: str
    call: str
    waited_s: float
    timeout_s: float


class ResumeEngine(Command, frozen=True):
    """Lift a suspension (an operator's, or any): the reconciler then repairs the engine."""

    engine: str
    cause: str = "operator"


class RemoveEngine(Command, frozen=True):
    """An operator removes an engine from the fleet (``EngineLeft`` with its cause)."""

    engine: str
    cause: str = "operator"


class ObserveInventory(Command, frozen=True):
    """What a fresh inventory showed. ``digests``: (name, digest) for each name whose engine
    reports the digest of the bytes it loaded; a committed version's name reported with
    another digest is served content that is not the version's (``ServedContentMismatch``).
    An engine that reports no digest for a name says nothing about its content here."""

    engine: str
    incarnation: str
    adapters: tuple[str, ...]
    digests: tuple[tuple[str, str], ...] = ()


class CheckCanary(Command, frozen=True):
    """An engine life's answer to a held version's canary prompt (``answer``: its greedy token
    ids, comma-separated). The first answer of that life is the baseline
    (``CanaryRecorded``); another one later is other content under the version's name
    (``ServedContentMismatch``, evidence ``canary``); the same one is a no-op."""

    engine: str
    incarnation: str
    version_id: int
    answer: str


class ReportUnreachable(Command, frozen=True):
    """The engine could not be reached at ``at`` (the ledger's clock): a failed probe
    (``source`` ``probe``) or a generation refused a connection before it was sent
    (``dispatch``). Opens an outage (``EngineUnreachable``) unless one is open, the report is
    about an earlier life, or the engine answered a probe after ``at``."""

    engine: str
    incarnation: str
    at: float
    error: str
    source: str
    reporter: str = ""


class CountDispatchFailures(Command, frozen=True):
    """Generations that failed on the engine, per session, as the faces counted them: recorded
    (``DispatchFailures``) against the outage open at this incarnation, if any."""

    engine: str
    incarnation: str
    failures: tuple[TurnFailures, ...]


class ReportReachable(Command, frozen=True):
    """A probe of the engine's life ``incarnation`` answered at ``at``: ends its outage
    (``EngineReachable``), if one is open."""

    engine: str
    incarnation: str
    at: float


# --- publication -----------------------------------------------------------------------------


class Allocate(Command, frozen=True):
    """Open an attempt of ``version_id``. A version id lower than the default's would roll the
    policy back: refused (``VERSION_REGRESSION``, recorded) unless ``allow_rollback``."""

    version_id: int
    digest: str
    size_bytes: int = 0
    allow_rollback: bool = False


class ClaimTransport(Command, frozen=True):
    version_id: int
    attempt: int
    owner: str


class EngineReceipt(Command, frozen=True):
    """What an engine answered for one step of an attempt, fenced by attempt and incarnation.
    Never sent as itself: the step is the subclass (the tag names it)."""

    version_id: int
    attempt: int
    engine: str
    incarnation: str
    digest: str
    lora_name: str


class RecordPrepared(EngineReceipt, frozen=True):
    """The engine staged the attempt's adapter."""


class RecordReady(EngineReceipt, frozen=True):
    """The engine loaded the attempt's adapter and echoed its name and digest."""


class Commit(Command, frozen=True):
    version_id: int
    attempt: int


class FailAttempt(Command, frozen=True):
    """End an attempt. It is recorded clean (FAILED_RETRYABLE, slot freed) only if ``clean``
    and ``absent_on`` covers every engine of the attempt still in the fleet; otherwise it is
    recorded FAILED_FATAL. Never refused for the current attempt: no error path may leave a
    version LOADING."""

    version_id: int
    attempt: int
    clean: bool
    code: str
    reason: str
    absent_on: tuple[str, ...] = ()


# --- owners and sessions ---------------------------------------------------------------------


class RegisterOwner(Command, frozen=True):
    """Start (or, same ``incarnation`` again, confirm) a life of ``owner``. ``incarnation`` is
    the caller's token for this process life (a uuid made when the worker starts; ``""``:
    the one unnamed life of callers that never name one). Another incarnation of a live owner
    replaces it and releases its sessions (``owner_restarted``).

    ``sessions_idle_s``: None, the owner holds the sessions it binds (they end with its life);
    a number >= 0, it relays client-held sessions, which outlive it and are released by the
    ledger's process after that long without a turn (0: never for idleness).

    ``secret``: the life's secret, made by the caller (256 random bits, kept by it, never
    logged: the event records its digest). Every later bind, renewal, release and
    deregistration for this life must carry it (``OWNER_SECRET_MISMATCH``); ``""``: a life
    registered without one (in process only: every remote call carries a secret)."""

    owner: str
    ttl_s: float
    now: float
    incarnation: str = ""
    sessions_idle_s: float | None = None
    secret: str = ""


class DeregisterOwner(Command, frozen=True):
    """A clean exit: end ``owner``'s life ``incarnation`` (``""``: whichever is current) and
    release its sessions still bound (``owner_exited``), without waiting for its lease.
    ``secret``: the current life's (``RegisterOwner.secret``)."""

    owner: str
    now: float
    incarnation: str = ""
    secret: str = ""


class ExpireOwner(Command, frozen=True):
    """Record that ``owner`` stopped renewing (evidence: ``last_seen``, ``now``).
    ``incarnation``: the life whose lease ran out (``""``: whichever is current); a newer one
    registered meanwhile is not expired (``OWNER_RESTARTED``)."""

    owner: str
    now: float
    last_seen: float
    incarnation: str = ""


class Bind(Command, frozen=True):
    """``incarnation`` (``""``: not checked) fences a stale life of the owner out.

    ``expect_version``: the version the caller's turn names (an OpenAI ``model`` that is a
    version's name). An existing binding is answered whatever it is (the caller checks it);
    a new one is made only if the default is that version, else ``VERSION_NOT_BOUND`` and
    nothing is written: a refused request never leaves a session bound. None: any default."""

    session: str
    owner: str
    incarnation: str = ""
    expect_version: int | None = None
    secret: str = ""  # the owner's current life's (RegisterOwner.secret)


class Release(Command, frozen=True):
    """``incarnation`` (``""``: not checked) fences a stale life of the owner out; ``secret``
    (the owner's current life's) proves the caller is that life. ``cause`` is one a caller
    may state (``CALLER_RELEASE_CAUSES``): the causes that say an owner's life ended are the
    ledger's own to record."""

    session: str
    owner: str
    cause: str = "closed"
    incarnation: str = ""
    secret: str = ""


class ReleaseIdle(Command, frozen=True):
    """The ledger's process releases a client-held session that had no turn for its idle
    bound: ``last_turn`` (the evidence, soft state of the ledger's process) and ``now`` are
    data. Refused (``INVALID_INPUT``) while ``now - last_turn`` is under the bound, as
    ``ExpireOwner`` refuses a live lease."""

    session: str
    now: float
    last_turn: float


class Forget(Command, frozen=True):
    sessions: tuple[str, ...]


# --- reclaim ---------------------------------------------------------------------------------


class ClaimReclaim(Command, frozen=True):
    version_id: int
    evidence: tuple[InFlight, ...] = ()


class RecordUnloaded(Command, frozen=True):
    version_id: int
    engine: str
    incarnation: str


class MarkReclaimAmbiguous(Command, frozen=True):
    version_id: int
    engine: str
    reason: str


AnyCommand = (
    CreateDeployment
    | ConfigureDeployment
    | StartController
    | JoinEngine
    | ObserveRestart
    | RestoreVersion
    | RepairEngine
    | LeaveEngine
    | SuspendEngine
    | SuspendUnanswered
    | ResumeEngine
    | RemoveEngine
    | ObserveInventory
    | CheckCanary
    | Allocate
    | ClaimTransport
    | RecordPrepared
    | RecordReady
    | Commit
    | FailAttempt
    | RegisterOwner
    | DeregisterOwner
    | ExpireOwner
    | Bind
    | Release
    | ReleaseIdle
    | Forget
    | ClaimReclaim
    | RecordUnloaded
    | MarkReclaimAmbiguous
)
