"""``decide`` and the handler table: the one entry of the decider, on one screen.

Every command goes through the common steps first (docs/state-machine.md, "Common steps"): its
fields have their declared types, and a ``command_id`` used before answers its recorded outcome
(or ``COMMAND_CONFLICT`` for a different command). Then the handler of its aggregate runs the
command's own checks in the check-order table's order; the first that fails answers. An
accepted command with a ``command_id`` that wrote events is recorded (``CommandRecorded``), so
the same id answers the same outcome forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from evlog.events import CommandRecorded
from projections.registry import RegistryState
from publisher.core import commands as c
from publisher.core.decider.allocation import _allocate
from publisher.core.decider.checks import _fingerprint, _well_typed
from publisher.core.decider.decision import Decision
from publisher.core.decider.fleet import (
    _check_canary,
    _configure_deployment,
    _create_deployment,
    _join_engine,
    _leave_engine,
    _observe_inventory,
    _observe_restart,
    _remove_engine,
    _repair_engine,
    _restore_version,
    _resume_engine,
    _start_controller,
    _suspend_engine,
    _suspend_unanswered,
)
from publisher.core.decider.owners import _deregister_owner, _expire_owner, _register_owner
from publisher.core.decider.publication import _claim_transport, _commit, _fail_attempt, _receipt
from publisher.core.decider.reachability import (
    _count_dispatch_failures,
    _report_reachable,
    _report_unreachable,
)
from publisher.core.decider.reclaim import (
    _claim_reclaim,
    _mark_reclaim_ambiguous,
    _record_unloaded,
)
from publisher.core.decider.sessions import _bind, _forget, _release, _release_idle
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import decode_outcome, encode_outcome


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
    c.CheckCanary: _check_canary,
    c.ReportUnreachable: _report_unreachable,
    c.CountDispatchFailures: _count_dispatch_failures,
    c.ReportReachable: _report_reachable,
    c.SuspendUnanswered: _suspend_unanswered,
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
    c.ReleaseIdle: _release_idle,
    c.Forget: _forget,
    c.ClaimReclaim: _claim_reclaim,
    c.RecordUnloaded: _record_unloaded,
    c.MarkReclaimAmbiguous: _mark_reclaim_ambiguous,
}
