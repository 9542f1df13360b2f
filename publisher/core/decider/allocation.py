"""``Allocate``: whether a new publication attempt may start, and who holds the slots.

Its checks, in the check-order table's order: the input, a no-op or resumed answer for an id
already completed or loading, an id ``FAILED_FATAL`` (blocked, before anything else is said of
it), a regression below the default (refused unless ``allow_rollback``, and recorded), the
fleet block, capacity, another attempt loading, a routable fleet. A refusal that makes the
trainer wait is recorded once per stall (``PublicationBlocked``), so a trainer retrying in a
loop does not grow the log; a full capacity after the first commit is a recorded skip
(``PublicationSkipped``), not an error, so training goes on. ``slot_holders`` says who holds
each capacity slot and why.
"""

from __future__ import annotations

from typing import Any

from evlog.events import (
    AttemptStarted,
    Event,
    PublicationBlocked,
    PublicationSkipped,
    SlotHolder,
    VersionAllocated,
)
from projections.registry import (
    COMPLETED_STATES,
    HOLDABLE_STATES,
    RegistryState,
    Stall,
    VersionRecord,
    VersionState,
)
from publisher.core import commands as c
from publisher.core.decider.checks import _deployment, _digest, _version_id
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Allocated, Skipped


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
        if existing.state is VersionState.FAILED_FATAL:
            # The state step comes before the regression check: whatever its id says about a
            # rollback, this version cannot be published until inventories prove it absent.
            return _fleet_blocked(s, cmd)
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
    if s.blocked_by():
        return _fleet_blocked(s, cmd)
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


def _fleet_blocked(s: RegistryState, cmd: c.Allocate) -> Decision:
    """``PUBLICATION_BLOCKED`` by every version whose fatal failure or ambiguous unload is
    unresolved (``blocked_by``, not empty here), recorded once per stall."""
    blocked = s.blocked_by()
    cause = "; ".join(_block_cause(s.versions[b]) for b in blocked)
    message = f"unresolved fatal/ambiguous versions {blocked}: reconcile inventories first"
    return _stalled(s, cmd, Code.PUBLICATION_BLOCKED, blocked, cause, message)


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
