"""Sessions: bind, release, forget.

A session is pinned at its first bind to the default of that moment, for good; a release ends
the binding, and a release before any bind tombstones the id so that it can never bind. Only
tombstones are forgotten, never a bound session. Binds and releases are the ledger's hot path:
ids already in the state were validated when they entered it, so only new ones are checked in
full.

A client-held session (bound through a relay) is also released by the ledger's process when
idle (``ReleaseIdle``): the command carries the last turn it relied on, and is refused while
the session is not idle by that evidence, as an expiry is refused for a live lease.
"""

from __future__ import annotations

from evlog.events import (
    CALLER_RELEASE_CAUSES,
    IDLE_CAUSE,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
)
from projections.registry import RegistryState
from projections.staleness import TOO_STALE, staleness, too_stale
from publisher.core import commands as c
from publisher.core.decider.checks import _deployment, _is_str, _key, _time
from publisher.core.decider.decision import Decision
from publisher.core.decider.owners import _fence_incarnation, check_lease
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound, Forgotten, Released


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
    check_lease(s, cmd.owner, required=False, incarnation=cmd.incarnation, secret=cmd.secret)
    binding = s.sessions.get(cmd.session)
    if binding is not None:
        return Decision(
            outcome=_bound(s, cmd.session, binding.version_id, binding.revision, new=False)
        )
    if cmd.session in s.tombstones:
        raise _closed(s, cmd.session)
    _key(cmd.session, "session")
    if cmd.owner not in s.owners:  # a known owner passed the lease rule just above
        check_lease(s, cmd.owner, required=True, incarnation=cmd.incarnation, secret=cmd.secret)
    if s.default is None:
        raise LedgerError(Code.NO_PUBLISHED_VERSION, "no version has been published yet")
    if cmd.expect_version is not None and cmd.expect_version != s.default:
        raise _not_the_default(s, cmd.session, cmd.expect_version)
    event = SessionBound(
        session=cmd.session, owner=cmd.owner, version_id=s.default, revision=s.default_revision
    )
    return Decision((event,), _bound(s, cmd.session, s.default, s.default_revision, new=True))


def _closed(s: RegistryState, session: str) -> LedgerError:
    """``SESSION_CLOSED`` for a tombstoned session; one the ledger released for idleness says
    so (``details.cause`` ``idle``): its client went quiet, it did not close it."""
    if session in s.idle_released:
        return LedgerError(
            Code.SESSION_CLOSED,
            f"session {session} was released after a time without a turn (cause idle): its "
            "version may be reclaimed; start a new session id",
            session=session,
            cause=IDLE_CAUSE,
        )
    return LedgerError(Code.SESSION_CLOSED, f"session {session} was released", session=session)


def _not_the_default(s: RegistryState, session: str, named: int) -> LedgerError:
    """A first turn that names a version other than the default: the ledger's answer, on its
    own state (a face's copy may be old), before anything is written."""
    assert s.default is not None
    default = s.versions[s.default]
    return LedgerError(
        Code.VERSION_NOT_BOUND,
        f"session {session} is not bound yet, and a first turn binds to the current default, "
        f"{default.lora_name} (version {s.default}); version {named} is served only to "
        "sessions already bound to it",
        session=session,
        version_id=named,
        default=s.default,
    )


def _release(s: RegistryState, cmd: c.Release) -> Decision:
    """A release by a live owner's current life (its secret), with a cause a caller may state:
    the log's causes are claims, so one that says an owner's life ended is the ledger's alone
    to write, ``too_stale`` only of a session that is, and ``idle`` only by the owner of an
    owner-held session (a client-held one goes idle by the ledger's ``ReleaseIdle``)."""
    _deployment(s)
    _is_str(cmd.session, "session")
    cause = cmd.cause
    if not isinstance(cause, str) or cause not in CALLER_RELEASE_CAUSES:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"a release's cause is one of {', '.join(CALLER_RELEASE_CAUSES)}; the others are "
            "recorded by the ledger itself",
        )
    _is_str(cmd.owner, "owner")
    _fence_incarnation(s, cmd.owner, cmd.incarnation)
    binding = s.sessions.get(cmd.session)
    if binding is None and cmd.session not in s.tombstones:  # a new id: checked in full
        _key(cmd.session, "session")
        _key(cmd.owner, "owner")
    if binding is not None or cmd.session not in s.tombstones:
        check_lease(s, cmd.owner, required=True, incarnation=cmd.incarnation, secret=cmd.secret)
    if binding is not None:
        if cause == IDLE_CAUSE and (binding.idle_s is not None or binding.owner != cmd.owner):
            raise LedgerError(
                Code.INVALID_INPUT,
                f"session {cmd.session} is released as {IDLE_CAUSE} only by its own owner "
                "(a client-held session goes idle by the ledger's own release)",
                session=cmd.session,
            )
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
        released = Released(
            session=cmd.session, released=True, version_id=binding.version_id, tombstoned=True
        )
        return Decision((event,), released)
    if cmd.session in s.tombstones:
        return Decision(outcome=Released(session=cmd.session, released=False))
    # Closed before its first bind: tombstone it so it can never bind.
    event = SessionReleased(session=cmd.session, owner=cmd.owner, version_id=None, cause=cmd.cause)
    return Decision((event,), Released(session=cmd.session, released=False, tombstoned=True))


def _release_idle(s: RegistryState, cmd: c.ReleaseIdle) -> Decision:
    """The ledger's idle release of a client-held session, on the evidence the command
    carries. No binding any more (released meanwhile): a no-op. An owner-held session is
    its owner's to end, and one within its idle bound is not idle: both refused."""
    _deployment(s)
    _is_str(cmd.session, "session")
    binding = s.sessions.get(cmd.session)
    if binding is None:
        return Decision(outcome=Released(session=cmd.session, released=False))
    now, last_turn = _time(cmd.now, "now"), _time(cmd.last_turn, "last_turn")
    idle_s = binding.idle_s
    if not idle_s:  # None: owner-held; 0: a relay whose sessions never go idle
        raise LedgerError(
            Code.INVALID_INPUT,
            f"session {cmd.session} is not released for idleness: "
            + ("its owner's life ends it" if idle_s is None else "its idle bound is 0 (never)"),
            session=cmd.session,
        )
    if now - last_turn < idle_s:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"session {cmd.session} is not idle ({now - last_turn:.3f}s since its last turn "
            f"< {idle_s:g}s)",
            session=cmd.session,
        )
    event = SessionReleased(
        session=cmd.session,
        owner=binding.owner,
        version_id=binding.version_id,
        cause=IDLE_CAUSE,
        last_turn=last_turn,
        idle_s=idle_s,
        at=now,
    )
    released = Released(
        session=cmd.session, released=True, version_id=binding.version_id, tombstoned=True
    )
    return Decision((event,), released)


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
