"""A publication attempt after its allocation: claim, receipts, commit, failure.

Every command here names an attempt and is fenced on it right after its input (``_fenced``: a
message for another attempt than the version's latest is stale, whatever the state), then on
the version's state (``_loading`` for claim, receipts and commit), then -- claim and commit
only -- on the fleet block (``_not_blocked``: the default never moves while what the engines
hold is unknown). Receipts and failure reports are evidence: never blocked, since no error
path may leave a version ``LOADING``; a refused receipt and a contradicting verdict are recorded
(``ReceiptRejected``, ``VerdictConflict``).
"""

from __future__ import annotations

from evlog.events import (
    AdapterLost,
    AttemptFailed,
    EnginePrepared,
    EngineReady,
    Event,
    ReceiptRejected,
    TransportClaimed,
    VerdictConflict,
    VersionPublished,
)
from projections.registry import COMPLETED_STATES, RegistryState, VersionRecord, VersionState
from publisher.core import commands as c
from publisher.core.decider.checks import _deployment, _key, _member, _members, _version
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import AttemptEnded, Claimed, Done, Published


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
    if cmd.engine not in v.loading_fleet:  # the fleet by engine: O(1) per receipt
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
