"""Engine reachability: an outage, decided from the evidence that an engine could not be reached.

An engine that cannot be reached must leave routing at once, everywhere, and the log must say so
while it happens (not only when the durable suspension comes, ``suspend_after_s`` later). The
evidence arrives as data: a failed probe of the reconciler, or a generation refused a
connection (or found the engine gone) before it was sent, each dated on the ledger's clock.

* ``ReportUnreachable`` opens the outage: ``EngineUnreachable``, once per outage, with its first
  error. A second report while it is open writes nothing (faces and probes report the same
  outage many times). A report about an earlier process life of the engine writes nothing: that
  life is over, and its failures say nothing of the current one. A report dated before the end
  of the last outage writes nothing either: it is late (sent before, or delayed in transit),
  and the probe that answered since is newer evidence.
* ``CountDispatchFailures`` records what the faces counted against the open outage, per
  session (``DispatchFailures``); without an open outage of that life the counts are late and
  write nothing.
* ``ReportReachable`` ends the outage (``EngineReachable``) when a probe of the same life
  answered. A new life ends it through the restart instead (``EngineRestarted``), so a report
  naming a life the ledger has not recorded is refused (``ENGINE_RESTARTED``): the restart
  must be observed first.

An outage alone changes routing only: reclaim keeps waiting for the engine until the durable
suspension (``SuspendEngine``, cause ``unhealthy``) says otherwise; a publication stops waiting
earlier, when its call to the engine also went unanswered past the control timeout
(``SuspendUnanswered``, cause ``unanswered``, in ``fleet``).
"""

from __future__ import annotations

from evlog.events import DispatchFailures, EngineReachable, EngineUnreachable, TurnFailures
from projections.registry import RegistryState
from publisher.core import commands as c
from publisher.core.decider.checks import _deployment, _key, _member, _time
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Done

UNREACHABLE_SOURCES = frozenset({"probe", "dispatch"})
_NOTHING = Decision(outcome=Done(no_op=True))


def _report_unreachable(s: RegistryState, cmd: c.ReportUnreachable) -> Decision:
    _deployment(s)
    member = _member(s, cmd.engine)
    _key(cmd.incarnation, "incarnation")
    at = _time(cmd.at, "at")
    if cmd.source not in UNREACHABLE_SOURCES:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"source {cmd.source!r} must be one of {sorted(UNREACHABLE_SOURCES)}",
            field="source",
        )
    if cmd.incarnation != member.incarnation or at < member.reachable_at:
        return _NOTHING  # an earlier life's failure, or one older than the last answer
    if member.unreachable is not None:
        return _NOTHING  # the outage is open: recorded once, with its first error
    event = EngineUnreachable(
        engine=cmd.engine,
        incarnation=cmd.incarnation,
        at=at,
        error=cmd.error[:2000],
        source=cmd.source,
        reporter=cmd.reporter[:200],
    )
    return Decision((event,), Done())


def _count_dispatch_failures(s: RegistryState, cmd: c.CountDispatchFailures) -> Decision:
    _deployment(s)
    member = _member(s, cmd.engine)
    _key(cmd.incarnation, "incarnation")
    failures = _checked(cmd.failures)
    outage = member.unreachable
    if outage is None or cmd.incarnation != member.incarnation or not failures:
        return _NOTHING  # late (the outage ended), an earlier life's, or nothing to count
    event = DispatchFailures(
        engine=cmd.engine, incarnation=cmd.incarnation, since=outage.since, failures=failures
    )
    return Decision((event,), Done())


def _report_reachable(s: RegistryState, cmd: c.ReportReachable) -> Decision:
    _deployment(s)
    member = _member(s, cmd.engine)
    _key(cmd.incarnation, "incarnation")
    at = _time(cmd.at, "at")
    outage = member.unreachable
    if outage is None:
        return _NOTHING
    if cmd.incarnation != member.incarnation:
        raise LedgerError(
            Code.ENGINE_RESTARTED,
            f"engine {cmd.engine} answered as {cmd.incarnation}, but the ledger knows "
            f"{member.incarnation}: observe the restart (it ends the outage)",
            engine=cmd.engine,
        )
    event = EngineReachable(
        engine=cmd.engine, incarnation=cmd.incarnation, at=max(at, outage.since), since=outage.since
    )
    return Decision((event,), Done())


def _checked(failures: tuple[TurnFailures, ...]) -> tuple[TurnFailures, ...]:
    """The counts worth recording (sessions in order, zero rows dropped), or the refusal of a
    malformed one: a session must be a key, the counts non-negative."""
    kept: dict[str, tuple[int, int]] = {}
    for f in failures:
        _key(f.session, "session")
        if f.not_run < 0 or f.ambiguous < 0:
            raise LedgerError(
                Code.INVALID_INPUT,
                f"failure counts of session {f.session!r} must be >= 0",
                field="failures",
            )
        not_run, ambiguous = kept.get(f.session, (0, 0))
        kept[f.session] = (not_run + f.not_run, ambiguous + f.ambiguous)
    return tuple(
        TurnFailures(session=session, not_run=n, ambiguous=a)
        for session, (n, a) in sorted(kept.items())
        if n or a
    )
