"""The deployment, the controller and the engine fleet.

The fleet is data: engines join, restart and leave as events, at any size >= 1. A member is
known at one incarnation (a receipt or an observation from another is stale), serves only
after its repair proves it holds every needed version and nothing it must drop, and may be
suspended (quarantined from routing) and resumed; an operator's suspension is lifted only by an
operator. Its inventories are the evidence of what it holds: a routable member that lost a
needed version is recorded (``AdapterLost``) before anything routes there again, and so is a
committed version's name served with another digest than the version's
(``ServedContentMismatch``: other weights loaded under a managed name). A departure,
a suspension or an inventory may complete a fatal entry or a reclaim that waited only for this
engine's proof (``absence_proofs``).
"""

from __future__ import annotations

import msgspec

from evlog.events import (
    AdapterLost,
    CanaryRecorded,
    ControllerStarted,
    DeploymentConfigured,
    DeploymentCreated,
    EngineJoined,
    EngineLeft,
    EngineRepaired,
    EngineRestarted,
    EngineResumed,
    EngineSuspended,
    Event,
    FatalResolved,
    InventoryObserved,
    ServedContentMismatch,
    VersionReclaimed,
    VersionRestored,
)
from projections.registry import HOLDABLE_STATES, SERVING_STATES, RegistryState, VersionState
from publisher.core import commands as c
from publisher.core.decider.absence_proofs import (
    _completed_by_leaving,
    _completed_without,
    _held_elsewhere,
    _owed_by,
)
from publisher.core.decider.checks import (
    _current_incarnation,
    _deployment,
    _ident,
    _key,
    _member,
    _members,
    _time,
    _version,
)
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Done, InventoryRecorded

# --- deployment, controller ------------------------------------------------------------------


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


# --- engine membership and repair -------------------------------------------------------------


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


UNANSWERED = "unanswered"


def _suspend_unanswered(s: RegistryState, cmd: c.SuspendUnanswered) -> Decision:
    """The publication in flight (the LOADING version) stops waiting for an engine that does
    not answer: suspended (cause
    ``unanswered``), it leaves the attempt's target set -- the commit counts active members
    only -- and routing, and serves again only after its repair loaded what is needed.

    Two pieces of evidence, both required: the attempt's call waited at least the control
    timeout (given as data, so a replay decides the same), and the engine's probes failed too
    (an outage of the same life is open). A slow engine that answers probes -- a large load --
    keeps its place; a frozen one is out within the timeout instead of ``suspend_after_s``
    later. Late evidence writes nothing: the attempt ended, the engine left it, restarted, or
    is suspended already."""
    _deployment(s)
    member = _member(s, cmd.engine)
    _key(cmd.incarnation, "incarnation")
    _key(cmd.call, "call")
    waited, timeout = _time(cmd.waited_s, "waited_s"), _time(cmd.timeout_s, "timeout_s")
    if timeout <= 0 or waited < timeout:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"engine {cmd.engine}'s {cmd.call} waited {waited:.1f} s, not the control timeout "
            f"({timeout:.1f} s): no evidence that it does not answer",
            field="waited_s",
        )
    v = s.loading()
    outage = member.unreachable
    if (
        v is None
        or cmd.engine not in v.fleet
        or member.suspended
        or cmd.incarnation != member.incarnation
        or outage is None
    ):
        return Decision(outcome=Done(no_op=True))
    detail = (
        f"its {cmd.call} of version {v.version_id} went unanswered for {waited:.1f} s "
        f"(control timeout {timeout:.1f} s) and it is unreachable ({outage.source}: "
        f"{outage.error})"
    )
    event = EngineSuspended(
        engine=cmd.engine, incarnation=member.incarnation, cause=UNANSWERED, detail=detail[:2000]
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
    impostors = _served_other_content(s, cmd, present)
    observed = InventoryObserved(
        engine=cmd.engine, incarnation=cmd.incarnation, adapters=tuple(sorted(present))
    )
    # Lost adapters: a routable engine that held a needed version no longer has it. Recorded
    # once (the fold drops the name from ``holds``, so the next inventory does not see it as
    # held), before the inventory, so that routing never sends the version there again.
    lost: list[Event] = list(impostors)
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
    mismatched = set(member.mismatched)
    holdable = {v.lora_name for v in s.versions.values() if v.state in HOLDABLE_STATES}
    holds = (holdable & present) - mismatched  # other content under a name is not holding it
    unchanged = (
        not lost
        and not events
        and not proofs_change
        and holds == set(member.holds)
        and strays == member.strays
        and not ((set(member.lacks) - mismatched) & present)
        and set(member.owes) <= present
        and mismatched <= present
    )
    if unchanged:
        # Only changes are written: an inventory equal to what the ledger knows is no event.
        return Decision(outcome=msgspec.structs.replace(outcome, no_op=True))
    return Decision((*lost, observed, *events), outcome)


def _served_other_content(
    s: RegistryState, cmd: c.ObserveInventory, present: set[str]
) -> list[ServedContentMismatch]:
    """Committed versions whose name the engine lists with a digest other than the version's:
    other weights were loaded under a managed name (by whoever reached the engine's control
    routes). Each is recorded once, until the version is restored there, the name leaves the
    engine or the engine restarts (``EngineMember.mismatched``); a name reported without a
    digest proves nothing either way."""
    member = s.engines[cmd.engine]
    reported = dict(cmd.digests)
    found = []
    for v in s.versions.values():
        seen = reported.get(v.lora_name)
        if (
            v.state not in SERVING_STATES
            or seen is None
            or seen == v.digest
            or v.lora_name not in present
            or v.lora_name in member.mismatched
        ):
            continue
        found.append(
            ServedContentMismatch(
                version_id=v.version_id,
                engine=cmd.engine,
                incarnation=cmd.incarnation,
                evidence="digest",
                expected=v.digest,
                seen=seen,
            )
        )
    return found


# Answers longer than this are not a canary's handful of token ids: refused, never recorded.
CANARY_ANSWER_LIMIT = 1000


def _check_canary(s: RegistryState, cmd: c.CheckCanary) -> Decision:
    """The first answer of an engine life to a held version's canary is its baseline; another
    answer later is other content under the name (the engine reports no content digest, so
    this is the evidence). Answers for a version the engine is not known to hold, or already
    recorded as served with other content, change nothing."""
    _deployment(s)
    _current_incarnation(s, cmd.engine, cmd.incarnation)
    v = _version(s, cmd.version_id)
    if len(cmd.answer) > CANARY_ANSWER_LIMIT:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"a canary answer is at most {CANARY_ANSWER_LIMIT} characters, got {len(cmd.answer)}",
        )
    member = s.engines[cmd.engine]
    if v.state not in SERVING_STATES or v.lora_name not in member.holds:
        return Decision(outcome=Done(no_op=True))
    baseline = member.canaries.get(v.lora_name)
    if baseline is None:
        recorded = CanaryRecorded(
            version_id=v.version_id,
            engine=cmd.engine,
            incarnation=cmd.incarnation,
            answer=cmd.answer,
        )
        return Decision((recorded,), Done())
    if baseline == cmd.answer:
        return Decision(outcome=Done(no_op=True))
    mismatch = ServedContentMismatch(
        version_id=v.version_id,
        engine=cmd.engine,
        incarnation=cmd.incarnation,
        evidence="canary",
        expected=baseline,
        seen=cmd.answer,
    )
    return Decision((mismatch,), Done())
