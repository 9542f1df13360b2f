"""Reclaim: a retired version unloaded from every engine, its capacity slot freed.

A ``RETIRED`` version with no session bound and no request in flight is handed out for
unloading (``ClaimReclaim``: the active members, which must each confirm); each unload
confirmation is recorded, and the reclaim completes when every active member proved the name
gone (``absence_proofs``: suspended members owe the drop). An unload whose outcome is unknown
marks the reclaim ambiguous, which blocks publication until inventories settle it: the mark
voids that engine's earlier proof (the fold drops it from ``confirmed``), so the completion
rule below waits for the engine's new proof (docs/publication.md, "Ambiguity").
"""

from __future__ import annotations

from evlog.events import (
    EngineUnloaded,
    Event,
    ReclaimAmbiguous,
    ReclaimClaimed,
    VersionReclaimed,
)
from projections.registry import RegistryState, VersionState
from publisher.core import commands as c
from publisher.core.decider.absence_proofs import _owed_by
from publisher.core.decider.checks import _current_incarnation, _deployment, _version
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Done, ReclaimGranted, UnloadRecorded


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
