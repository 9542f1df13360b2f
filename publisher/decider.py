"""The decider: ``decide(state, command) -> Decision``, a pure function.

It reads the registry state and the command, nothing else (no clock, no engine, no store), and
never mutates the state. A decision is the events to append plus the outcome to answer, or a
refusal (a ``LedgerError`` with a stable code). Most refusals write nothing; refused engine
receipts are recorded (``ReceiptRejected``) so an incident replay shows them.

The semantics, the order of the checks and the error codes are those of docs/state-machine.md
(its check-order table; they match the seed registry, Relax PR #382), extended by deliberate
improvements: an N-engine fleet that changes, fatal/ambiguous entries resolved by inventory
evidence, owner leases, recorded skips.

A stale or duplicate input is an outcome too: it either returns the earlier outcome (no event)
or is refused; it never changes the state twice.

Why one module of ~900 lines: ``decide`` is one function over every command, and a reader
follows docs/state-machine.md's check-order table command by command here, with the shared
validators (``_ident``, ``_version``, ``_member``, ...) private to it. Splitting by command
family would put the one check order in several files.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from evlog.events import (
    LEASE_EXPIRED_CAUSE,
    OWNER_EXITED_CAUSE,
    OWNER_RESTARTED_CAUSE,
    AdapterLost,
    AttemptFailed,
    AttemptStarted,
    CommandRecorded,
    ControllerStarted,
    DeploymentConfigured,
    DeploymentCreated,
    EngineJoined,
    EngineLeft,
    EnginePrepared,
    EngineReady,
    EngineRepaired,
    EngineRestarted,
    EngineResumed,
    EngineSuspended,
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
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    SlotHolder,
    TransportClaimed,
    VerdictConflict,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)
from projections.registry import (
    COMPLETED_STATES,
    HOLDABLE_STATES,
    SERVING_STATES,
    EngineMember,
    RegistryState,
    Stall,
    VersionRecord,
    VersionState,
)
from projections.staleness import TOO_STALE, staleness, too_stale
from publisher import commands as c
from publisher.errors import Code, LedgerError
from publisher.outcomes import (
    Allocated,
    AttemptEnded,
    Bound,
    Claimed,
    Deregistered,
    Done,
    Expired,
    Forgotten,
    InventoryRecorded,
    Outcome,
    Published,
    ReclaimGranted,
    Released,
    Skipped,
    UnloadRecorded,
    decode_outcome,
    encode_outcome,
)


class Decision(msgspec.Struct, frozen=True):
    """Events to append (possibly empty), and either an outcome or a refusal."""

    events: tuple[Event, ...] = ()
    outcome: Outcome | None = None
    error: LedgerError | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None


def decide(state: RegistryState, command: c.Command) -> Decision:
    """Decide one command against the state. Never raises for a refusal: returns it."""
    try:
        command = _well_typed(command)
    except LedgerError as refusal:
        return Decision(error=refusal)
    command_id = command.command_id
    fingerprint = ""
    if command_id is not None:
        fingerprint = _fingerprint(command)
        recorded = state.commands.get(command_id)
        if recorded is not None:
            if recorded.fingerprint != fingerprint:
                return Decision(
                    error=LedgerError(
                        Code.COMMAND_CONFLICT,
                        f"command id {command_id!r} was used for a different command",
                        command_id=command_id,
                    )
                )
            return Decision(outcome=decode_outcome(recorded.outcome))
    try:
        decision = _HANDLERS[type(command)](state, command)
    except LedgerError as refusal:
        return Decision(error=refusal)
    if command_id is not None and decision.error is None and decision.events:
        assert decision.outcome is not None
        record = CommandRecorded(
            command_id=command_id,
            fingerprint=fingerprint,
            outcome=encode_outcome(decision.outcome),
        )
        decision = Decision((*decision.events, record), decision.outcome)
    return decision


_command_encoder = msgspec.msgpack.Encoder()
_command_decoders: dict[type[c.Command], msgspec.msgpack.Decoder[c.Command]] = {}


def _well_typed(command: c.Command) -> c.Command:
    """The command with every field of its declared type (tuples as tuples), or the refusal.

    Commands built in Python are not type-checked by their constructor. A field of the wrong
    type (``Forget(sessions=None)``, a list where a string belongs, an int beyond 64 bits)
    used to raise inside a handler -- which stops the ledger's writer for every caller -- or
    to be written into an event that no longer decodes, so the log could not be replayed.
    A msgpack round trip checks the declared types and the encodable ranges in ~0.3 us."""
    cls = type(command)
    decoder = _command_decoders.get(cls)
    if decoder is None:
        decoder = _command_decoders[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(_command_encoder.encode(command))
    except (msgspec.ValidationError, OverflowError, TypeError, ValueError) as exc:
        code = Code.INVALID_VERSION if "$.version_id" in str(exc) else Code.INVALID_INPUT
        raise LedgerError(code, f"{cls.__name__}: {exc}", command=cls.__name__) from None


# Optional fields a command gained after logs existed. At their default they are left out of
# the fingerprint, so a ``command_id`` recorded before the field existed still names the same
# command when it is sent again (and is not refused as COMMAND_CONFLICT).
_FIELDS_ADDED_LATER: dict[str, object] = {"allow_rollback": False}
# ``incarnation`` came later to the owner and session commands only (the engine commands
# always had theirs, and their fingerprints include it).
_OWNER_FIELDS_ADDED_LATER: dict[str, object] = {"incarnation": ""}
_GAINED_AN_INCARNATION = (c.RegisterOwner, c.ExpireOwner, c.Bind, c.Release)


def _fingerprint(command: c.Command) -> str:
    body = msgspec.to_builtins(msgspec.structs.replace(command, command_id=None))
    later = dict(_FIELDS_ADDED_LATER)
    if isinstance(command, _GAINED_AN_INCARNATION):
        later.update(_OWNER_FIELDS_ADDED_LATER)
    for name, default in later.items():
        if name in body and body[name] == default:
            del body[name]
    return hashlib.sha256(msgspec.msgpack.encode(body)).hexdigest()[:32]


# --- validation helpers ----------------------------------------------------------------------

_IDENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _ident(value: Any, what: str) -> str:
    """Deployment, prefix and engine names: they end up inside immutable engine-side names,
    which must never contain ':' or '/' (or '@', the separator of the name itself)."""
    if not isinstance(value, str) or not _IDENT.match(value):
        raise LedgerError(
            Code.INVALID_INPUT, f"{what} {value!r} must match {_IDENT.pattern}", field=what
        )
    return value


def _key(value: Any, what: str) -> str:
    """Session and owner ids: any printable string up to 256 characters."""
    if not isinstance(value, str) or not value or len(value) > 256 or not value.isprintable():
        raise LedgerError(
            Code.INVALID_INPUT,
            f"{what} must be a non-empty printable string of at most 256 characters",
            field=what,
        )
    return value


def _is_str(value: Any, what: str) -> None:
    """The cheap part of :func:`_key`, enough before a lookup (an unhashable id must be a
    refusal, not a TypeError)."""
    if not isinstance(value, str):
        raise LedgerError(Code.INVALID_INPUT, f"{what} must be a string", field=what)


def _version_id(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LedgerError(
            Code.INVALID_VERSION, f"version id {value!r} must be a positive int", version_id=value
        )
    return value


def _digest(value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise LedgerError(Code.INVALID_INPUT, f"digest {value!r} is not 64 lowercase hex")
    return value


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LedgerError(Code.INVALID_INPUT, f"{what} {value!r} must be a finite number")
    return float(value)


def _deployment(s: RegistryState) -> None:
    if s.deployment is None:
        raise LedgerError(Code.NOT_INITIALIZED, "no deployment: create one first")


def _version(s: RegistryState, version_id: Any) -> VersionRecord:
    v = s.versions.get(_version_id(version_id))
    if v is None:
        raise LedgerError(Code.UNKNOWN_VERSION, f"version {version_id} is not known")
    return v


def _member(s: RegistryState, engine: Any) -> EngineMember:
    member = s.engines.get(engine)
    if member is None:
        raise LedgerError(Code.UNKNOWN_ENGINE, f"engine {engine!r} is not a fleet member")
    return member


def _current_incarnation(s: RegistryState, engine: str, incarnation: str) -> None:
    member = _member(s, engine)
    if member.incarnation != incarnation:
        raise LedgerError(
            Code.ENGINE_RESTARTED,
            f"engine {engine} is at incarnation {member.incarnation}, not {incarnation}",
            engine=engine,
        )


def _members(s: RegistryState, fleet: tuple[str, ...]) -> set[str]:
    """The engines of ``fleet`` that are still fleet members."""
    return {e for e in fleet if e in s.engines}


# --- deployment, controller, fleet -----------------------------------------------------------


def _create_deployment(s: RegistryState, cmd: c.CreateDeployment) -> Decision:
    _ident(cmd.deployment, "deployment")
    _ident(cmd.prefix, "prefix")
    if not isinstance(cmd.capacity, int) or isinstance(cmd.capacity, bool) or cmd.capacity < 1:
        raise LedgerError(Code.INVALID_INPUT, f"capacity {cmd.capacity!r} must be an int >= 1")
    for engine in cmd.fleet:
        _ident(engine, "engine")
    if s.deployment is not None:
        same = (s.deployment, s.prefix, s.capacity, s.declared_fleet) == (
            cmd.deployment,
            cmd.prefix,
            cmd.capacity,
            cmd.fleet,
        )
        if same:
            return Decision(outcome=Done(no_op=True))
        raise LedgerError(
            Code.ALREADY_INITIALIZED, f"this log already holds deployment {s.deployment!r}"
        )
    event = DeploymentCreated(
        deployment=cmd.deployment, prefix=cmd.prefix, capacity=cmd.capacity, fleet=cmd.fleet
    )
    return Decision((event,), Done())


def _configure_deployment(s: RegistryState, cmd: c.ConfigureDeployment) -> Decision:
    _deployment(s)
    limit = cmd.max_staleness
    if limit is not None and limit < 0:
        raise LedgerError(
            Code.INVALID_INPUT, f"max_staleness {limit} must be >= 0 (or None: unbounded)"
        )
    if limit == s.max_staleness:
        return Decision(outcome=Done(no_op=True))
    return Decision((DeploymentConfigured(max_staleness=limit),), Done())


def _start_controller(s: RegistryState, cmd: c.StartController) -> Decision:
    event = ControllerStarted(epoch=s.epoch + 1, code_version=cmd.code_version)
    return Decision((event,), Done())


def _join_engine(s: RegistryState, cmd: c.JoinEngine) -> Decision:
    _deployment(s)
    _ident(cmd.engine, "engine")
    _key(cmd.incarnation, "incarnation")
    member = s.engines.get(cmd.engine)
    if member is not None:
        if member.incarnation == cmd.incarnation:
            return Decision(outcome=Done(no_op=True))
        raise LedgerError(
            Code.ENGINE_EXISTS,
            f"engine {cmd.engine} is already a member (a new incarnation is a restart)",
        )
    event = EngineJoined(
        engine=cmd.engine, incarnation=cmd.incarnation, endpoint=cmd.endpoint, kind=cmd.kind
    )
    return Decision((event,), Done())


def _observe_restart(s: RegistryState, cmd: c.ObserveRestart) -> Decision:
    _deployment(s)
    member = _member(s, cmd.engine)
    _key(cmd.incarnation, "incarnation")
    if member.incarnation == cmd.incarnation:
        return Decision(outcome=Done(no_op=True))
    event = EngineRestarted(
        engine=cmd.engine,
        old=member.incarnation,
        new=cmd.incarnation,
        endpoint=cmd.endpoint if cmd.endpoint != member.endpoint else None,
        kind=cmd.kind if cmd.kind != member.kind else None,
    )
    return Decision((event,), Done())


def _restore_version(s: RegistryState, cmd: c.RestoreVersion) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    _current_incarnation(s, cmd.engine, cmd.incarnation)
    if v.state not in SERVING_STATES:
        raise LedgerError(
            Code.INVALID_STATE, f"version {v.version_id} is {v.state}: nothing to restore"
        )
    if v.lora_name in s.engines[cmd.engine].holds:
        return Decision(outcome=Done(no_op=True))
    event = VersionRestored(version_id=v.version_id, engine=cmd.engine, incarnation=cmd.incarnation)
    return Decision((event,), Done())


def _repair_engine(s: RegistryState, cmd: c.RepairEngine) -> Decision:
    _deployment(s)
    _current_incarnation(s, cmd.engine, cmd.incarnation)
    member = s.engines[cmd.engine]
    if member.routable:
        return Decision(outcome=Done(no_op=True))
    if member.suspended and member.suspend_cause == OPERATOR:
        raise LedgerError(
            Code.ENGINE_SUSPENDED,
            f"engine {cmd.engine} was suspended by an operator: resume it first",
            engine=cmd.engine,
        )
    missing = [vid for vid in s.needed_versions() if s.versions[vid].lora_name not in member.holds]
    if missing:
        raise LedgerError(
            Code.NOT_READY,
            f"engine {cmd.engine} does not hold needed versions {missing} yet",
            missing=missing,
        )
    # Exactly the routable versions: nothing reclaimed, resolved or failed may be left on it
    # (what it owes, the strays its last inventory showed, an unresolved fatal candidate or a
    # version being reclaimed), or a router could send a request to a name the ledger has let
    # go of.
    unwanted = set(member.owes) | set(member.strays)
    unwanted |= {
        name
        for name, vid in member.holds.items()
        if s.versions[vid].state in (VersionState.FAILED_FATAL, VersionState.RECLAIMING)
    }
    if unwanted:
        raise LedgerError(
            Code.NOT_READY,
            f"engine {cmd.engine} still holds names it must drop: {sorted(unwanted)}",
            unwanted=sorted(unwanted),
        )
    event = EngineRepaired(engine=cmd.engine, incarnation=cmd.incarnation)
    return Decision((event,), Done())


def _held_elsewhere(s: RegistryState, lora_name: str, engine: str) -> bool:
    """Whether an active member other than ``engine`` is known (by its last inventory or
    receipt) to hold ``lora_name``. A fatal candidate is resolved only when no current member
    holds it, whether the member was in the attempt's fleet or joined after it: resolving it
    while one does would leave an engine holding a ``FAILED_RETRYABLE`` name that nothing
    fences any more. A suspended member is not waited for: the resolution records that it owes
    the drop (``owed_by``), and its repair unloads the name before it serves again."""
    return any(
        lora_name in m.holds for e, m in s.engines.items() if e != engine and not m.suspended
    )


def _owed_by(s: RegistryState, v: VersionRecord, active: set[str]) -> tuple[str, ...]:
    """Members left out of ``active`` that did not prove ``v`` gone: each owes the drop. For a
    fatal candidate, only engines of its attempt or known to hold it can have it."""
    confirmed = set(v.confirmed)
    return tuple(
        sorted(
            e
            for e, m in s.engines.items()
            if e not in active
            and e not in confirmed
            and (v.state is not VersionState.FAILED_FATAL or e in v.fleet or v.lora_name in m.holds)
        )
    )


def _completed_without(s: RegistryState, engine: str, *, leaving: bool) -> list[Event]:
    """Fatal entries and reclaims whose only missing proof was from ``engine``, which leaves
    (an engine that is no longer a member cannot hold anything the fleet serves) or is
    suspended (it owes the drop instead: ``owed_by``)."""
    active = s.active_engines() - {engine}
    events: list[Event] = []
    for v in s.versions.values():
        confirmed = set(v.confirmed)
        if v.state is VersionState.FAILED_FATAL:
            if _members(s, v.fleet) & active <= confirmed and not _held_elsewhere(
                s, v.lora_name, engine
            ):
                owed = tuple(e for e in _owed_by(s, v, active) if not (leaving and e == engine))
                events.append(
                    FatalResolved(version_id=v.version_id, attempt=v.attempt, owed_by=owed)
                )
        elif v.state is VersionState.RECLAIMING and active <= confirmed:
            owed = tuple(e for e in _owed_by(s, v, active) if not (leaving and e == engine))
            events.append(VersionReclaimed(version_id=v.version_id, owed_by=owed))
    return events


def _completed_by_leaving(s: RegistryState, engine: str) -> list[Event]:
    return _completed_without(s, engine, leaving=True)


def _leave_engine(s: RegistryState, cmd: c.LeaveEngine) -> Decision:
    _deployment(s)
    if cmd.engine not in s.engines:
        return Decision(outcome=Done(no_op=True))
    follow = _completed_by_leaving(s, cmd.engine)
    return Decision((EngineLeft(engine=cmd.engine), *follow), Done())


# --- engine health: suspension, resumption, removal --------------------------------------------

OPERATOR = "operator"
SUSPEND_CAUSES = frozenset({"unhealthy", "lost_adapter", OPERATOR})


def _cause(value: str, allowed: frozenset[str]) -> str:
    if value not in allowed:
        raise LedgerError(
            Code.INVALID_INPUT, f"cause {value!r} must be one of {sorted(allowed)}", field="cause"
        )
    return value


def _suspend_engine(s: RegistryState, cmd: c.SuspendEngine) -> Decision:
    """Quarantine: the engine leaves routing at once, and every fatal entry or reclaim that
    waited only for its proof completes now (it owes the drop). A LOADING attempt stops
    waiting for it too: the commit rule counts only active members."""
    _deployment(s)
    member = _member(s, cmd.engine)
    if cmd.incarnation:
        _current_incarnation(s, cmd.engine, cmd.incarnation)
    cause = _cause(cmd.cause, SUSPEND_CAUSES)
    if member.suspended:
        return Decision(outcome=Done(no_op=True))
    event = EngineSuspended(
        engine=cmd.engine, incarnation=member.incarnation, cause=cause, detail=cmd.detail[:2000]
    )
    follow = _completed_without(s, cmd.engine, leaving=False)
    return Decision((event, *follow), Done())


def _resume_engine(s: RegistryState, cmd: c.ResumeEngine) -> Decision:
    _deployment(s)
    member = _member(s, cmd.engine)
    cause = _cause(cmd.cause, SUSPEND_CAUSES)
    if not member.suspended:
        return Decision(outcome=Done(no_op=True))
    if member.suspend_cause == OPERATOR and cause != OPERATOR:
        raise LedgerError(
            Code.ENGINE_SUSPENDED,
            f"engine {cmd.engine} was suspended by an operator: only an operator resumes it",
            engine=cmd.engine,
        )
    event = EngineResumed(engine=cmd.engine, incarnation=member.incarnation, cause=cause)
    return Decision((event,), Done())


def _remove_engine(s: RegistryState, cmd: c.RemoveEngine) -> Decision:
    _deployment(s)
    cause = _cause(cmd.cause, frozenset({OPERATOR, "fleet"}))
    if cmd.engine not in s.engines:
        return Decision(outcome=Done(no_op=True))
    follow = _completed_by_leaving(s, cmd.engine)
    return Decision((EngineLeft(engine=cmd.engine, cause=cause), *follow), Done())


def _observe_inventory(s: RegistryState, cmd: c.ObserveInventory) -> Decision:
    _deployment(s)
    _current_incarnation(s, cmd.engine, cmd.incarnation)
    for name in cmd.adapters:
        _key(name, "adapter name")
    present = set(cmd.adapters)
    member = s.engines[cmd.engine]
    observed = InventoryObserved(
        engine=cmd.engine, incarnation=cmd.incarnation, adapters=tuple(sorted(present))
    )
    # Lost adapters: a routable engine that held a needed version no longer has it. Recorded
    # once (the fold drops the name from ``holds``, so the next inventory does not see it as
    # held), before the inventory, so that routing never sends the version there again.
    lost: list[Event] = []
    if member.routable:
        for version_id in s.needed_versions():
            name = s.versions[version_id].lora_name
            if name in member.holds and name not in present:
                lost.append(
                    AdapterLost(
                        version_id=version_id, engine=cmd.engine, incarnation=cmd.incarnation
                    )
                )
    events: list[Event] = []
    resolved: list[int] = []
    reclaimed: list[int] = []
    active = s.active_engines()
    proofs_change = False
    for v in s.versions.values():
        if v.state not in (VersionState.FAILED_FATAL, VersionState.RECLAIMING):
            continue
        # A fatal candidate's absence proofs come from its attempt's fleet (the fold records
        # only those), but any member's inventory can tell that it still holds the name.
        confirmed = set(v.confirmed)
        if v.state is VersionState.RECLAIMING or cmd.engine in v.fleet:
            if v.lora_name in present:
                confirmed.discard(cmd.engine)
            else:
                confirmed.add(cmd.engine)
            proofs_change |= (cmd.engine in v.confirmed) != (cmd.engine in confirmed) or (
                cmd.engine in confirmed and v.confirmed[cmd.engine] != cmd.incarnation
            )
        if v.state is VersionState.FAILED_FATAL:
            absent_everywhere = v.lora_name not in present and not _held_elsewhere(
                s, v.lora_name, cmd.engine
            )
            if _members(s, v.fleet) & active <= confirmed and absent_everywhere:
                events.append(
                    FatalResolved(
                        version_id=v.version_id,
                        attempt=v.attempt,
                        owed_by=_owed_by(s, v, active | {cmd.engine}),
                    )
                )
                resolved.append(v.version_id)
        elif active <= confirmed:
            owed = _owed_by(s, v, active | {cmd.engine})
            events.append(VersionReclaimed(version_id=v.version_id, owed_by=owed))
            reclaimed.append(v.version_id)
    legit = {v.lora_name for v in s.versions.values() if v.state in HOLDABLE_STATES}
    strays = tuple(sorted(present - legit))
    outcome = InventoryRecorded(
        engine=cmd.engine, resolved=tuple(resolved), reclaimed=tuple(reclaimed), strays=strays
    )
    holds = {v.lora_name for v in s.versions.values() if v.state in HOLDABLE_STATES} & present
    unchanged = (
        not lost
        and not events
        and not proofs_change
        and holds == set(member.holds)
        and strays == member.strays
        and not (set(member.lacks) & present)
        and set(member.owes) <= present
    )
    if unchanged:
        # Only changes are written: an inventory equal to what the ledger knows is no event.
        return Decision(outcome=msgspec.structs.replace(outcome, no_op=True))
    return Decision((*lost, observed, *events), outcome)


# --- publication -----------------------------------------------------------------------------


def _allocate(s: RegistryState, cmd: c.Allocate) -> Decision:
    _deployment(s)
    version_id = _version_id(cmd.version_id)
    digest = _digest(cmd.digest)
    existing = s.versions.get(version_id)
    if existing is not None and existing.digest != digest:
        raise LedgerError(
            Code.VERSION_CONFLICT,
            f"version {version_id} was published with digest {existing.digest[:16]}, "
            f"not {digest[:16]}",
            version_id=version_id,
        )
    if existing is not None:
        if existing.state in COMPLETED_STATES:
            return Decision(outcome=_allocated(existing, no_op=True))
        if existing.state is VersionState.LOADING:
            return Decision(outcome=_allocated(existing, resumed=True))
    if s.default is not None and version_id < s.default and not cmd.allow_rollback:
        # Publishing it would silently roll the policy back: refused, and recorded so the
        # log shows the trainer asked (an explicit rollback passes ``allow_rollback``).
        message = (
            f"version {version_id} is lower than the default {s.default}: publishing it would "
            "roll the policy back (pass allow_rollback=True to mean it)"
        )
        refused = PublicationSkipped(
            version_id=version_id, digest=digest, code=Code.VERSION_REGRESSION, message=message
        )
        error = LedgerError(
            Code.VERSION_REGRESSION, message, version_id=version_id, default=s.default
        )
        return Decision((refused,), error=error)
    blocked = s.blocked_by()
    if blocked:
        cause = "; ".join(_block_cause(s.versions[b]) for b in blocked)
        message = f"unresolved fatal/ambiguous versions {blocked}: reconcile inventories first"
        return _stalled(s, cmd, Code.PUBLICATION_BLOCKED, blocked, cause, message)
    # A new id, or a retry of a cleanly failed one: both take a capacity slot again.
    used = s.capacity_used()
    if used >= s.capacity:
        holders = slot_holders(s)
        message = f"capacity {s.capacity} is full: " + ", ".join(map(_holder_words, holders))
        if s.default is None:
            ids = tuple(h.version_id for h in holders)
            return _stalled(s, cmd, Code.CAPACITY_ERROR, ids, message, message, capacity=s.capacity)
        skipped = PublicationSkipped(
            version_id=version_id,
            digest=digest,
            code=Code.CAPACITY_ERROR,
            message=message,
            holders=holders,
        )
        return Decision(
            (skipped,), Skipped(version_id=version_id, code=Code.CAPACITY_ERROR, message=message)
        )
    loading = s.loading()
    if loading is not None:
        cause = f"version {loading.version_id} is LOADING (attempt {loading.attempt})"
        return _stalled(
            s,
            cmd,
            Code.PUBLICATION_IN_PROGRESS,
            (loading.version_id,),
            cause,
            cause,
            version_id=loading.version_id,
        )
    fleet = s.routable_engines()
    if not fleet:
        cause = "no routable engine to publish to" + (
            f" (members not routable: {', '.join(sorted(s.engines))})" if s.engines else ""
        )
        return _stalled(s, cmd, Code.FLEET_MISMATCH, (), cause, cause)
    events: list[Event] = []
    if existing is None:
        lora_name = s.lora_name(version_id, digest)
        events.append(
            VersionAllocated(
                version_id=version_id,
                digest=digest,
                lora_name=lora_name,
                size_bytes=max(0, int(cmd.size_bytes)),
            )
        )
        attempt = 1
    else:
        lora_name = existing.lora_name
        attempt = existing.attempt + 1
    events.append(AttemptStarted(version_id=version_id, attempt=attempt, fleet=fleet))
    outcome = Allocated(
        version_id=version_id,
        lora_name=lora_name,
        digest=digest,
        attempt=attempt,
        fleet=fleet,
        state=VersionState.LOADING,
    )
    return Decision(tuple(events), outcome)


def _stalled(
    s: RegistryState,
    cmd: c.Allocate,
    code: str,
    blocked_by: tuple[int, ...] | list[int],
    cause: str,
    message: str,
    **details: Any,
) -> Decision:
    """An allocation that must wait: refused, and recorded (``PublicationBlocked``) so the log
    explains the stall -- once. The same refusal of the same version, while nothing it depends
    on changed (same code, same blockers), writes nothing: a trainer retrying in a loop must
    not grow the log."""
    blockers = tuple(blocked_by)
    details = {"versions": list(blockers), "cause": cause, **details}
    refusal = LedgerError(code, message, **details)
    if s.stalls.get(cmd.version_id) == Stall(code, blockers):
        return Decision(error=refusal)
    event = PublicationBlocked(
        version_id=cmd.version_id,
        digest=cmd.digest,
        code=code,
        blocked_by=blockers,
        cause=cause[:2000],
    )
    return Decision((event,), error=refusal)


def _block_cause(v: VersionRecord) -> str:
    """Why one version blocks the fleet, in words."""
    if v.state is VersionState.FAILED_FATAL:
        return (
            f"version {v.version_id} attempt {v.attempt} ended FAILED_FATAL "
            f"({v.failure_code}): it may be loaded somewhere until inventories prove it absent"
        )
    return (
        f"version {v.version_id}'s unload was ambiguous: it may still be loaded until "
        "inventories prove it absent"
    )


def slot_holders(s: RegistryState) -> tuple[SlotHolder, ...]:
    """Every version taking a capacity slot and why it still holds it, oldest first."""
    holders = []
    for v in sorted(s.versions.values(), key=lambda x: x.version_id):
        if v.state not in HOLDABLE_STATES:
            continue
        if v.state is VersionState.PUBLISHED:
            reason = "default"
        elif v.state is VersionState.RETIRED:
            reason = "sessions_bound" if v.bound else "awaiting_reclaim"
        elif v.state is VersionState.RECLAIMING:
            reason = "ambiguous" if v.ambiguous else "reclaim_in_progress"
        elif v.state is VersionState.LOADING:
            reason = "loading"
        else:
            reason = "failed_fatal"
        holders.append(
            SlotHolder(version_id=v.version_id, state=v.state, bound=v.bound, reason=reason)
        )
    return tuple(holders)


_HOLDER_WORDS = {
    "default": "the default",
    "sessions_bound": "retired, sessions bound",
    "awaiting_reclaim": "retired, unbound: awaiting reclaim (requests in flight or unclaimed)",
    "reclaim_in_progress": "reclaim in progress",
    "ambiguous": "unload ambiguous",
    "loading": "loading",
    "failed_fatal": "failed fatal, may be loaded",
}


def _holder_words(h: SlotHolder) -> str:
    words = _HOLDER_WORDS.get(h.reason, h.reason)
    if h.bound:
        words += f" ({h.bound} sessions)"
    return f"v{h.version_id} {words}"


def _not_blocked(s: RegistryState) -> None:
    """The fleet block: while a fatal failure or an ambiguous unload is unresolved, what the
    engines hold is unknown, so nothing may start a publication or move the default
    (allocate, claim, commit). Receipts and failures are still recorded: they are evidence."""
    blocked = s.blocked_by()
    if blocked:
        raise LedgerError(
            Code.PUBLICATION_BLOCKED,
            f"unresolved fatal/ambiguous versions {blocked}: reconcile inventories first",
            versions=blocked,
        )


def _allocated(v: VersionRecord, *, no_op: bool = False, resumed: bool = False) -> Allocated:
    return Allocated(
        version_id=v.version_id,
        lora_name=v.lora_name,
        digest=v.digest,
        attempt=v.attempt,
        fleet=v.fleet,
        state=v.state,
        no_op=no_op,
        resumed=resumed,
    )


def _fenced(v: VersionRecord, attempt: int) -> None:
    """Attempt fencing, the step after the input in every command that names an attempt: a
    message for another attempt than the version's latest is stale, whatever the state."""
    if attempt != v.attempt:
        raise LedgerError(
            Code.ATTEMPT_CONFLICT,
            f"attempt {attempt} of version {v.version_id} is not current "
            f"(it is {v.state} at attempt {v.attempt})",
            version_id=v.version_id,
        )


def _loading(v: VersionRecord, step: str) -> None:
    """The state step of a publication step (claim, receipt, commit) at the current attempt:
    only a LOADING version goes on. A FAILED_FATAL one blocks publication until inventories
    resolve it (``PUBLICATION_BLOCKED``); any other state is ``INVALID_STATE``."""
    if v.state is VersionState.LOADING:
        return
    if v.state is VersionState.FAILED_FATAL:
        raise LedgerError(
            Code.PUBLICATION_BLOCKED,
            f"{step}: attempt {v.attempt} of version {v.version_id} ended FAILED_FATAL; "
            "it blocks publication until inventories prove it absent",
            versions=[v.version_id],
        )
    raise LedgerError(
        Code.INVALID_STATE,
        f"{step}: version {v.version_id} is {v.state} at attempt {v.attempt}, not LOADING",
        version_id=v.version_id,
    )


def _claim_transport(s: RegistryState, cmd: c.ClaimTransport) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    _key(cmd.owner, "owner")
    _fenced(v, cmd.attempt)
    if v.state is VersionState.LOADING and v.claimed_by == cmd.owner:
        return Decision(
            outcome=Claimed(version_id=v.version_id, attempt=v.attempt, owner=cmd.owner)
        )
    _loading(v, "claim")
    _not_blocked(s)
    if v.claimed_by is not None:
        raise LedgerError(
            Code.PUBLICATION_IN_PROGRESS,
            f"attempt {v.attempt} of version {v.version_id} is driven by {v.claimed_by}",
            owner=v.claimed_by,
        )
    event = TransportClaimed(version_id=v.version_id, attempt=v.attempt, owner=cmd.owner)
    return Decision((event,), Claimed(version_id=v.version_id, attempt=v.attempt, owner=cmd.owner))


def _receipt_refusal(
    s: RegistryState, v: VersionRecord, cmd: c.EngineReceipt
) -> tuple[str, str] | None:
    """The first check a receipt fails, in the table's order (attempt fencing, state, then the
    receipt's own: fleet, incarnation, echo, protocol order), or None."""
    ready = isinstance(cmd, c.RecordReady)
    try:
        _fenced(v, cmd.attempt)
        _loading(v, "READY" if ready else "PREPARED")
    except LedgerError as refusal:
        return refusal.code, refusal.message
    incarnation = s.engines[cmd.engine].incarnation
    if cmd.engine not in v.fleet:
        return Code.FLEET_MISMATCH, f"{cmd.engine} is not in the attempt's fleet {v.fleet}"
    if cmd.incarnation != incarnation:
        return (
            Code.ENGINE_RESTARTED,
            f"receipt from incarnation {cmd.incarnation}, engine is at {incarnation}",
        )
    if (cmd.digest, cmd.lora_name) != (v.digest, v.lora_name):
        return (
            Code.READY_MISMATCH,
            f"receipt echoes {cmd.lora_name}/{cmd.digest[:16]}, "
            f"expected {v.lora_name}/{v.digest[:16]}",
        )
    if v.claimed_by is None:
        # The claim makes exactly one transport the owner of the attempt: a receipt before it
        # comes from no driver the ledger knows of.
        return (
            Code.RECEIPT_OUT_OF_ORDER,
            f"no transport claimed attempt {v.attempt} of version {v.version_id}",
        )
    if ready and v.prepared.get(cmd.engine) != cmd.incarnation:
        # READY means "what I prepared at this incarnation is loaded".
        return (
            Code.RECEIPT_OUT_OF_ORDER,
            f"READY from {cmd.engine} at {cmd.incarnation} without a PREPARED at that "
            f"incarnation for attempt {v.attempt}",
        )
    return None


def _receipt(s: RegistryState, cmd: c.EngineReceipt) -> Decision:
    """Shared fencing of PREPARED and READY receipts (docs/state-machine.md): version,
    attempt, fleet, incarnation, digest and name must all match the current attempt, and the
    receipts come in order (claim -> PREPARED at this incarnation -> READY). A mismatch is
    recorded (``ReceiptRejected``) and refused; a duplicate of an applied receipt is a no-op."""
    _deployment(s)
    v = _version(s, cmd.version_id)
    member = _member(s, cmd.engine)
    ready = isinstance(cmd, c.RecordReady)
    applied = v.ready if ready else v.prepared
    duplicate = (
        cmd.attempt == v.attempt
        and applied.get(cmd.engine) == cmd.incarnation
        and cmd.incarnation == member.incarnation
        and (cmd.digest, cmd.lora_name) == (v.digest, v.lora_name)
    )
    if duplicate:
        return Decision(outcome=Done(no_op=True))
    refusal = _receipt_refusal(s, v, cmd)
    if refusal is None:
        if ready:
            event: Event = EngineReady(
                version_id=v.version_id,
                attempt=v.attempt,
                engine=cmd.engine,
                incarnation=cmd.incarnation,
                digest=v.digest,
                lora_name=v.lora_name,
            )
        else:
            event = EnginePrepared(
                version_id=v.version_id,
                attempt=v.attempt,
                engine=cmd.engine,
                incarnation=cmd.incarnation,
            )
        return Decision((event,), Done())
    code, detail = refusal
    rejected = ReceiptRejected(
        code=code,
        version_id=v.version_id,
        attempt=cmd.attempt,
        engine=cmd.engine,
        incarnation=cmd.incarnation,
        detail=detail,
    )
    return Decision((rejected,), error=LedgerError(code, detail, version_id=v.version_id))


def _commit(s: RegistryState, cmd: c.Commit) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    _fenced(v, cmd.attempt)
    if v.state in COMPLETED_STATES:
        # A replay of a committed version returns it; the default never rolls back.
        return Decision(
            outcome=Published(
                version_id=v.version_id,
                lora_name=v.lora_name,
                revision=v.revision or 0,
                retired=None,
                no_op=True,
            )
        )
    _loading(v, "commit")
    _not_blocked(s)
    # A member suspended during the attempt is no longer waited for: it is repaired (the
    # committed version loaded, or the engine kept out of routing) before it serves again.
    required = _members(s, v.fleet) & s.active_engines()
    missing = sorted(e for e in required if v.ready.get(e) != s.engines[e].incarnation)
    if missing or not required:
        raise LedgerError(
            Code.NOT_READY,
            f"version {v.version_id} attempt {v.attempt} lacks READY from "
            f"{missing or 'any engine'}",
            missing=missing,
        )
    revision = s.default_revision + 1
    # Lower than the default: only an allocation with allow_rollback gets here (the default
    # cannot move while this version is LOADING), and the commit records it as a rollback.
    rollback = s.default is not None and v.version_id < s.default
    event = VersionPublished(
        version_id=v.version_id,
        attempt=v.attempt,
        revision=revision,
        retired=s.default,
        rollback=rollback,
    )
    # A member that answered READY and whose later inventory no longer lists the candidate
    # (lost, or read just before the load landed) is recorded as having lost it: routing keeps
    # away from it and the reconciler restores it, rather than calling it a holder it is not.
    lost = tuple(
        AdapterLost(version_id=v.version_id, engine=e, incarnation=s.engines[e].incarnation)
        for e in sorted(required)
        if s.engines[e].routable and v.lora_name not in s.engines[e].holds
    )
    outcome = Published(
        version_id=v.version_id, lora_name=v.lora_name, revision=revision, retired=s.default
    )
    return Decision((event, *lost), outcome)


def _failed_again(v: VersionRecord, cmd: c.FailAttempt, clean: bool) -> Decision:
    """A failure report for an attempt that already ended. The same verdict (or a resend of
    the very report that ended it) is a no-op; a contradicting one -- fatal evidence about an
    attempt proven absent everywhere, or a clean report about one that may be loaded -- is
    refused (``VERDICT_CONFLICT``) and recorded, so the evidence is never dropped silently."""
    ended = AttemptEnded(version_id=v.version_id, attempt=v.attempt, state=v.state)
    resend = (cmd.code, cmd.reason[:2000]) == (v.failure_code, v.failure_reason)
    if resend or clean == (v.state is VersionState.FAILED_RETRYABLE):
        return Decision(outcome=ended)
    verdict = "clean" if clean else "fatal"
    detail = (
        f"a {verdict} failure report ({cmd.code}) for attempt {v.attempt} of version "
        f"{v.version_id}, which already ended {v.state} ({v.failure_code}): recorded, not applied"
    )
    conflict = VerdictConflict(
        version_id=v.version_id,
        attempt=v.attempt,
        state=v.state,
        clean=clean,
        code=cmd.code[:200],
        reason=cmd.reason[:2000],
        absent_on=tuple(sorted(set(cmd.absent_on))),
    )
    refusal = LedgerError(Code.VERDICT_CONFLICT, detail, version_id=v.version_id, state=v.state)
    return Decision((conflict,), error=refusal)


def _fail_attempt(s: RegistryState, cmd: c.FailAttempt) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    _fenced(v, cmd.attempt)
    # Suspended members cannot prove absence; they owe the drop instead (see the fold).
    clean = bool(cmd.clean) and _members(s, v.fleet) & s.active_engines() <= set(cmd.absent_on)
    if v.state in (VersionState.FAILED_RETRYABLE, VersionState.FAILED_FATAL):
        return _failed_again(v, cmd, clean)
    if v.state is not VersionState.LOADING:
        raise LedgerError(
            Code.INVALID_STATE,
            f"attempt {v.attempt} of version {v.version_id} cannot fail: it committed "
            f"(the version is {v.state})",
            version_id=v.version_id,
        )
    event = AttemptFailed(
        version_id=v.version_id,
        attempt=v.attempt,
        clean=clean,
        code=cmd.code,
        reason=cmd.reason[:2000],
        absent_on=tuple(sorted(set(cmd.absent_on))),
    )
    state = VersionState.FAILED_RETRYABLE if clean else VersionState.FAILED_FATAL
    return Decision((event,), AttemptEnded(version_id=v.version_id, attempt=v.attempt, state=state))


# --- owners and sessions ---------------------------------------------------------------------


def _register_owner(s: RegistryState, cmd: c.RegisterOwner) -> Decision:
    """A new life of an owner id replaces the live one at once: a worker restarted under the
    same id (a Ray actor with ``max_restarts``) must not leave its predecessor's sessions
    pinning their versions until a lease runs out. The same incarnation again is a retry of a
    lost reply (a no-op, nothing released); an incarnation that was replaced may never come
    back (``OWNER_RESTARTED``), or a late retry of a dead worker's registration would release
    the sessions of the live one."""
    _deployment(s)
    _key(cmd.owner, "owner")
    ttl = _time(cmd.ttl_s, "ttl_s")
    if ttl <= 0:
        raise LedgerError(Code.INVALID_INPUT, f"lease ttl {ttl} must be > 0")
    if cmd.incarnation:
        _key(cmd.incarnation, "incarnation")
    owner = s.owners.get(cmd.owner)
    if owner is not None:
        if owner.incarnation == cmd.incarnation:
            if owner.expired:
                raise LedgerError(
                    Code.LEASE_EXPIRED,
                    f"owner {cmd.owner} lost its lease; register a new incarnation "
                    "(or under a new owner id)",
                    owner=cmd.owner,
                )
            if owner.exited:
                raise _deregistered(cmd.owner, owner.incarnation)
            return Decision(outcome=Done(no_op=True))
        if cmd.incarnation in owner.retired:
            raise _replaced(cmd.owner, cmd.incarnation, owner.incarnation)
    event = OwnerRegistered(
        owner=cmd.owner,
        ttl_s=ttl,
        at=_time(cmd.now, "now"),
        incarnation=cmd.incarnation,
        replaced=None if owner is None else owner.incarnation,
    )
    released = (
        () if owner is None or not owner.live else _release_all(s, cmd.owner, OWNER_RESTARTED_CAUSE)
    )
    return Decision((event, *released), Done())


def _release_all(s: RegistryState, owner: str, cause: str) -> tuple[SessionReleased, ...]:
    """A release of every session ``owner`` holds bound, with the ledger's ``cause``."""
    return tuple(
        SessionReleased(session=session, owner=owner, version_id=binding.version_id, cause=cause)
        for session, binding in s.sessions.items()
        if binding.owner == owner
    )


def _replaced(owner: str, incarnation: str, current: str) -> LedgerError:
    return LedgerError(
        Code.OWNER_RESTARTED,
        f"owner {owner} was restarted: incarnation {incarnation!r} was replaced by "
        f"{current!r} and its sessions were released",
        owner=owner,
    )


def _deregistered(owner: str, incarnation: str) -> LedgerError:
    return LedgerError(
        Code.OWNER_DEREGISTERED,
        f"owner {owner} (incarnation {incarnation!r}) deregistered: its sessions were "
        "released; register a new incarnation to act again",
        owner=owner,
    )


def _fence_incarnation(s: RegistryState, owner_id: str, incarnation: str) -> None:
    """Refuse a life of ``owner_id`` that is not its current one (``""`` is not checked): a
    replaced one is ``OWNER_RESTARTED``, one never registered ``UNKNOWN_OWNER``."""
    if not incarnation:
        return
    owner = s.owners.get(owner_id)
    if owner is None or owner.incarnation == incarnation:
        return
    if incarnation in owner.retired:
        raise _replaced(owner_id, incarnation, owner.incarnation)
    raise LedgerError(
        Code.UNKNOWN_OWNER,
        f"owner {owner_id!r} has no incarnation {incarnation!r}",
        owner=owner_id,
    )


def check_lease(s: RegistryState, owner_id: str, *, required: bool, incarnation: str = "") -> None:
    """The lease rule, for commands and for the ledger's (unlogged) lease renewals alike: a
    replaced incarnation is refused (``OWNER_RESTARTED``), and so is an owner whose lease
    expired (``LEASE_EXPIRED``: its sessions were released), one that deregistered
    (``OWNER_DEREGISTERED``), and an unknown one where ``required`` (``UNKNOWN_OWNER``).
    ``incarnation`` ``""``: any life of the owner (callers that never name one)."""
    owner = s.owners.get(owner_id)
    if owner is None:
        if required:
            raise LedgerError(
                Code.UNKNOWN_OWNER, f"owner {owner_id!r} is not registered", owner=owner_id
            )
        return
    _fence_incarnation(s, owner_id, incarnation)
    if owner.expired:
        raise LedgerError(
            Code.LEASE_EXPIRED,
            f"owner {owner_id} lost its lease: its sessions were released",
            owner=owner_id,
        )
    if owner.exited:
        raise _deregistered(owner_id, owner.incarnation)


def _deregister_owner(s: RegistryState, cmd: c.DeregisterOwner) -> Decision:
    """A clean exit ends the owner's life now, not one lease later, and is recorded as a
    clean end (never an incident). Idempotent: a life that already ended (deregistered, or
    its lease expired first) answers ``no_op``. A replaced life cannot deregister its
    successor (``OWNER_RESTARTED``)."""
    _deployment(s)
    _is_str(cmd.owner, "owner")
    owner = s.owners.get(cmd.owner)
    if owner is None:
        raise LedgerError(
            Code.UNKNOWN_OWNER, f"owner {cmd.owner!r} is not registered", owner=cmd.owner
        )
    _fence_incarnation(s, cmd.owner, cmd.incarnation)
    if not owner.live:
        return Decision(outcome=Deregistered(owner=cmd.owner, released=0, no_op=True))
    event = OwnerDeregistered(
        owner=cmd.owner, incarnation=owner.incarnation, at=_time(cmd.now, "now")
    )
    released = _release_all(s, cmd.owner, OWNER_EXITED_CAUSE)
    return Decision((event, *released), Deregistered(owner=cmd.owner, released=len(released)))


def _expire_owner(s: RegistryState, cmd: c.ExpireOwner) -> Decision:
    _deployment(s)
    owner = s.owners.get(cmd.owner)
    if owner is None:
        raise LedgerError(Code.UNKNOWN_OWNER, f"owner {cmd.owner!r} is not registered")
    _fence_incarnation(s, cmd.owner, cmd.incarnation)
    if not owner.live:  # expired already, or it deregistered before its lease ran out
        return Decision(outcome=Expired(owner=cmd.owner, released=0))
    now, last_seen = _time(cmd.now, "now"), _time(cmd.last_seen, "last_seen")
    if now - last_seen < owner.ttl_s:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"lease of {cmd.owner} is still valid ({now - last_seen:.3f}s < {owner.ttl_s}s)",
        )
    released = _release_all(s, cmd.owner, LEASE_EXPIRED_CAUSE)
    event = OwnerLeaseExpired(owner=cmd.owner, at=now, last_seen=last_seen)
    return Decision((event, *released), Expired(owner=cmd.owner, released=len(released)))


def _bound(s: RegistryState, session: str, version_id: int, revision: int, new: bool) -> Bound:
    v = s.versions[version_id]
    return Bound(
        session=session,
        version_id=version_id,
        lora_name=v.lora_name,
        digest=v.digest,
        revision=revision,
        new=new,
    )


def _bind(s: RegistryState, cmd: c.Bind) -> Decision:
    # Ids already in the state were validated when they entered it: only new ones are checked
    # in full (binds and releases are the hot path of the ledger).
    _deployment(s)
    _is_str(cmd.session, "session")
    _is_str(cmd.owner, "owner")
    check_lease(s, cmd.owner, required=False, incarnation=cmd.incarnation)
    binding = s.sessions.get(cmd.session)
    if binding is not None:
        return Decision(
            outcome=_bound(s, cmd.session, binding.version_id, binding.revision, new=False)
        )
    if cmd.session in s.tombstones:
        raise LedgerError(
            Code.SESSION_CLOSED, f"session {cmd.session} was released", session=cmd.session
        )
    _key(cmd.session, "session")
    check_lease(s, cmd.owner, required=True, incarnation=cmd.incarnation)
    if s.default is None:
        raise LedgerError(Code.NO_PUBLISHED_VERSION, "no version has been published yet")
    event = SessionBound(
        session=cmd.session, owner=cmd.owner, version_id=s.default, revision=s.default_revision
    )
    return Decision((event,), _bound(s, cmd.session, s.default, s.default_revision, new=True))


def _release(s: RegistryState, cmd: c.Release) -> Decision:
    _deployment(s)
    _is_str(cmd.session, "session")
    cause = cmd.cause
    if not isinstance(cause, str) or not 0 < len(cause) <= 64 or not cause.isprintable():
        raise LedgerError(Code.INVALID_INPUT, "cause must be a printable string of 1-64 chars")
    _is_str(cmd.owner, "owner")
    _fence_incarnation(s, cmd.owner, cmd.incarnation)
    binding = s.sessions.get(cmd.session)
    if binding is not None:
        if cause == TOO_STALE and not too_stale(
            binding.revision, s.default_revision, s.max_staleness
        ):
            # The cause is a claim about the log: a session released as too stale was.
            behind = staleness(binding.revision, s.default_revision)
            raise LedgerError(
                Code.INVALID_INPUT,
                f"session {cmd.session} is {behind} versions behind the default, within "
                f"max_staleness {s.max_staleness}: not released as {TOO_STALE}",
                session=cmd.session,
            )
        event = SessionReleased(
            session=cmd.session,
            owner=binding.owner,
            version_id=binding.version_id,
            cause=cmd.cause,
        )
        return Decision(
            (event,), Released(session=cmd.session, released=True, version_id=binding.version_id)
        )
    if cmd.session in s.tombstones:
        return Decision(outcome=Released(session=cmd.session, released=False))
    # Closed before its first bind: tombstone it so it can never bind.
    _key(cmd.session, "session")
    _key(cmd.owner, "owner")
    check_lease(s, cmd.owner, required=True, incarnation=cmd.incarnation)
    event = SessionReleased(session=cmd.session, owner=cmd.owner, version_id=None, cause=cmd.cause)
    return Decision((event,), Released(session=cmd.session, released=False))


def _forget(s: RegistryState, cmd: c.Forget) -> Decision:
    _deployment(s)
    still_bound = [session for session in cmd.sessions if session in s.sessions]
    if still_bound:
        raise LedgerError(
            Code.SESSION_STILL_BOUND,
            f"{len(still_bound)} sessions are still bound (e.g. {still_bound[0]}); "
            "nothing forgotten",
            sessions=still_bound[:20],
        )
    tombstoned = tuple(dict.fromkeys(x for x in cmd.sessions if x in s.tombstones))
    if not tombstoned:
        return Decision(outcome=Forgotten(count=0))
    return Decision((SessionsForgotten(sessions=tombstoned),), Forgotten(count=len(tombstoned)))


# --- reclaim ---------------------------------------------------------------------------------


def _claim_reclaim(s: RegistryState, cmd: c.ClaimReclaim) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    if v.state is not VersionState.RETIRED:
        raise LedgerError(Code.NOT_RECLAIMABLE, f"version {v.version_id} is {v.state}, not RETIRED")
    if v.bound:
        raise LedgerError(
            Code.NOT_RECLAIMABLE,
            f"version {v.version_id} still has {v.bound} sessions bound",
            bound=v.bound,
        )
    busy = [f"{x.engine}:{x.count}@{x.reporter}" for x in cmd.evidence if x.count != 0]
    if busy:
        raise LedgerError(
            Code.REQUESTS_IN_FLIGHT,
            f"version {v.version_id} has requests in flight: {', '.join(busy)}",
        )
    events: list[Event] = [ReclaimClaimed(version_id=v.version_id, evidence=cmd.evidence)]
    # Only active members confirm; a suspended one owes the drop once the reclaim completes.
    engines = tuple(sorted(s.active_engines()))
    if not engines:
        owed = tuple(sorted(s.engines))
        events.append(VersionReclaimed(version_id=v.version_id, owed_by=owed))
    outcome = ReclaimGranted(version_id=v.version_id, lora_name=v.lora_name, engines=engines)
    return Decision(tuple(events), outcome)


def _record_unloaded(s: RegistryState, cmd: c.RecordUnloaded) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    if v.state is VersionState.RECLAIMED:
        return Decision(
            outcome=UnloadRecorded(version_id=v.version_id, engine=cmd.engine, reclaimed=True)
        )
    if v.state is not VersionState.RECLAIMING:
        raise LedgerError(Code.INVALID_STATE, f"version {v.version_id} is {v.state}")
    _current_incarnation(s, cmd.engine, cmd.incarnation)
    if v.confirmed.get(cmd.engine) == cmd.incarnation:
        return Decision(
            outcome=UnloadRecorded(version_id=v.version_id, engine=cmd.engine, reclaimed=False)
        )
    events: list[Event] = [
        EngineUnloaded(version_id=v.version_id, engine=cmd.engine, incarnation=cmd.incarnation)
    ]
    active = s.active_engines()
    done = active <= set(v.confirmed) | {cmd.engine}
    if done:
        owed = _owed_by(s, v, active | {cmd.engine})
        events.append(VersionReclaimed(version_id=v.version_id, owed_by=owed))
    return Decision(
        tuple(events),
        UnloadRecorded(version_id=v.version_id, engine=cmd.engine, reclaimed=done),
    )


def _mark_reclaim_ambiguous(s: RegistryState, cmd: c.MarkReclaimAmbiguous) -> Decision:
    _deployment(s)
    v = _version(s, cmd.version_id)
    if v.state is not VersionState.RECLAIMING:
        raise LedgerError(Code.INVALID_STATE, f"version {v.version_id} is {v.state}")
    event = ReclaimAmbiguous(version_id=v.version_id, engine=cmd.engine, reason=cmd.reason[:2000])
    return Decision((event,), Done())


_HANDLERS: dict[type[c.Command], Callable[[RegistryState, Any], Decision]] = {
    c.CreateDeployment: _create_deployment,
    c.ConfigureDeployment: _configure_deployment,
    c.StartController: _start_controller,
    c.JoinEngine: _join_engine,
    c.ObserveRestart: _observe_restart,
    c.RestoreVersion: _restore_version,
    c.RepairEngine: _repair_engine,
    c.LeaveEngine: _leave_engine,
    c.SuspendEngine: _suspend_engine,
    c.ResumeEngine: _resume_engine,
    c.RemoveEngine: _remove_engine,
    c.ObserveInventory: _observe_inventory,
    c.Allocate: _allocate,
    c.ClaimTransport: _claim_transport,
    c.RecordPrepared: _receipt,
    c.RecordReady: _receipt,
    c.Commit: _commit,
    c.FailAttempt: _fail_attempt,
    c.RegisterOwner: _register_owner,
    c.DeregisterOwner: _deregister_owner,
    c.ExpireOwner: _expire_owner,
    c.Bind: _bind,
    c.Release: _release,
    c.Forget: _forget,
    c.ClaimReclaim: _claim_reclaim,
    c.RecordUnloaded: _record_unloaded,
    c.MarkReclaimAmbiguous: _mark_reclaim_ambiguous,
}
