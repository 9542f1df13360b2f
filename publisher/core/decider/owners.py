"""Owner lives: registration, a clean exit, lease expiry, and the one lease rule.

An owner (a rollout worker) holds sessions, and so pins their versions, only while it lives.
An owner id has lives (incarnations): a new life replaces the live one at once and releases its
sessions, and a replaced life may never act again (``OWNER_RESTARTED``). ``check_lease`` is
the rule "an expired owner may not act", written once for the session commands and for the
ledger's unlogged lease renewals (``Ledger.renew_lease``).

Every life has a secret, made by the caller that registers it (256 random bits), of which the
log keeps only the digest (``OwnerRegistered.secret_digest``): a bind, renewal, release or
deregistration for the life must carry the secret (``check_secret``), so a caller that merely
knows an owner id and its incarnation (both appear in the log and in refusals) cannot act for
it. Hashing is pure, so the check replays like any other rule. A life registered without a
secret (before secrets existed, or in process) accepts only calls without one, and every remote
call carries one: such a life must re-register to be reached from another process.

A *relay* (an OpenAI face, registered with ``sessions_idle_s``) binds client-held sessions:
the end of any of its lives releases none of them (``_release_all`` leaves them), since the
client, not the process that relayed its turns, holds the episode (docs/sessions.md, "Who
owns a session").
"""

from __future__ import annotations

import hashlib
import hmac

from evlog.events import (
    LEASE_EXPIRED_CAUSE,
    OWNER_EXITED_CAUSE,
    OWNER_RESTARTED_CAUSE,
    OwnerDeregistered,
    OwnerLeaseExpired,
    OwnerRegistered,
    SessionReleased,
)
from projections.registry import RegistryState
from publisher.core import commands as c
from publisher.core.decider.checks import _deployment, _is_str, _key, _time
from publisher.core.decider.decision import Decision
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Deregistered, Done, Expired

# A life's secret is at least this long (a 256-bit one in hex is 64 chars) and printable ASCII.
SECRET_MIN_CHARS, SECRET_MAX_CHARS = 32, 256


def secret_digest(secret: str) -> str:
    """What the log records of a life's secret: its SHA-256, hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _valid_secret(secret: object) -> str:
    if (
        not isinstance(secret, str)
        or not SECRET_MIN_CHARS <= len(secret) <= SECRET_MAX_CHARS
        or not (secret.isascii() and secret.isprintable())
    ):
        raise LedgerError(
            Code.INVALID_INPUT,
            f"an owner's secret must be {SECRET_MIN_CHARS}-{SECRET_MAX_CHARS} printable ASCII "
            "characters (e.g. secrets.token_hex(32))",
        )
    return secret


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
    idle_s = cmd.sessions_idle_s
    if idle_s is not None and _time(idle_s, "sessions_idle_s") < 0:
        raise LedgerError(Code.INVALID_INPUT, f"sessions_idle_s {idle_s} must be >= 0 or None")
    digest = secret_digest(_valid_secret(cmd.secret)) if cmd.secret else ""
    owner = s.owners.get(cmd.owner)
    if owner is not None:
        if owner.incarnation == cmd.incarnation:
            check_secret(s, cmd.owner, cmd.secret)  # a retry carries the life's own secret
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
        sessions_idle_s=None if idle_s is None else float(idle_s),
        secret_digest=digest,
    )
    released = (
        () if owner is None or not owner.live else _release_all(s, cmd.owner, OWNER_RESTARTED_CAUSE)
    )
    return Decision((event, *released), Done())


def _release_all(s: RegistryState, owner: str, cause: str) -> tuple[SessionReleased, ...]:
    """A release of every session ``owner`` holds bound, with the ledger's ``cause``. Only
    owner-held ones: a client-held session (bound through a relay, ``Binding.idle_s`` set)
    outlives every life of the process that relayed it."""
    return tuple(
        SessionReleased(session=session, owner=owner, version_id=binding.version_id, cause=cause)
        for session, binding in s.sessions.items()
        if binding.owner == owner and binding.idle_s is None
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


def check_secret(s: RegistryState, owner_id: str, secret: str) -> None:
    """Refuse a call for ``owner_id`` (known) that does not carry its current life's secret
    (``OWNER_SECRET_MISMATCH``, naming the owner, never the secret). A life registered without
    one takes only calls without one."""
    owner = s.owners.get(owner_id)
    if owner is None or (not owner.secret_digest and not secret):
        return
    given = secret_digest(secret) if isinstance(secret, str) else ""
    if owner.secret_digest and hmac.compare_digest(given, owner.secret_digest):
        return
    why = (
        "was registered without a secret: register a new incarnation to act for it"
        if not owner.secret_digest
        else "takes only calls carrying the secret it registered with"
    )
    raise LedgerError(
        Code.OWNER_SECRET_MISMATCH,
        f"owner {owner_id}: its current life (incarnation {owner.incarnation!r}) {why}",
        owner=owner_id,
    )


def check_lease(
    s: RegistryState, owner_id: str, *, required: bool, incarnation: str = "", secret: str = ""
) -> None:
    """The lease rule, for commands and for the ledger's (unlogged) lease renewals alike: a
    replaced incarnation is refused (``OWNER_RESTARTED``), and so is a call without the current
    life's secret (``OWNER_SECRET_MISMATCH``), an owner whose lease expired
    (``LEASE_EXPIRED``: its sessions were released), one that deregistered
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
    check_secret(s, owner_id, secret)
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
    successor (``OWNER_RESTARTED``), and only the current life, by its secret, can end it
    (``OWNER_SECRET_MISMATCH``)."""
    _deployment(s)
    _is_str(cmd.owner, "owner")
    owner = s.owners.get(cmd.owner)
    if owner is None:
        raise LedgerError(
            Code.UNKNOWN_OWNER, f"owner {cmd.owner!r} is not registered", owner=cmd.owner
        )
    _fence_incarnation(s, cmd.owner, cmd.incarnation)
    check_secret(s, cmd.owner, cmd.secret)
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
