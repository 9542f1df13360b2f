"""The ledger's wire: every request and reply body of ``serve``'s ledger routes, as msgspec
structs, written once and used by the server (``tools/http_app.py``) and every client (the
remote ledger's HTTP transport, ``loraledger status`` and ``fleet``).

Bodies are strict (unknown fields refused, so a typo is a 400, not a silent default). A refusal
keeps the ledger's machine code: :class:`Refusal` is ``{"code", "message", "details"}`` both as
an HTTP error body and in place in a batch reply, and :func:`error_of` rebuilds the same
exception class the ledger raised (:class:`~publisher.core.errors.LedgerError` or
:class:`~evlog.errors.StoreError`), so a remote caller catches exactly what an in-process one
does.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from evlog.errors import LoraLedgerError, StoreError
from publisher.core import commands as c
from publisher.core.errors import LedgerError
from publisher.core.outcomes import Bound, Forgotten, Released
from publisher.remote.routing import Mark, RoutingTable


class WireCode:
    LEDGER_ANSWER = "LEDGER_ANSWER"  # serve answered something that is not a ledger decision


class Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request body: strict, keyword-only."""


# --- owners and leases -------------------------------------------------------------------------


class RegisterOwner(Body, frozen=True):
    owner: str
    ttl_s: float = 30.0
    incarnation: str = ""  # this life of the owner (docs/sessions.md#owner-incarnations)
    sessions_idle_s: float | None = None  # a relay's: its sessions are client-held


class DeregisterOwner(Body, frozen=True):
    incarnation: str = ""  # "": whichever life is current


class InFlightCount(Body, frozen=True):
    engine: str
    version_id: int
    count: int


class RenewLease(Body, frozen=True):
    """``POST /owners/{owner}/renew``: one owner's renewal."""

    inflight: list[InFlightCount] = msgspec.field(default_factory=list)
    incarnation: str = ""  # "": not checked
    sessions: list[str] = msgspec.field(default_factory=list)  # a relay's sessions with a turn


class LifeRenewal(Body, frozen=True):
    """One life ``(owner, incarnation)``, its requests in flight, and (a relay's) the
    client-held sessions it had a turn of since its last renewal."""

    owner: str
    incarnation: str = ""
    inflight: list[InFlightCount] = msgspec.field(default_factory=list)
    sessions: list[str] = msgspec.field(default_factory=list)


class RenewLeases(Body, frozen=True):
    """``POST /leases/renew``: every life a client forwards, in one round trip."""

    lives: list[LifeRenewal]
    mark: Mark | None = None  # the routing table the caller holds


# --- sessions ----------------------------------------------------------------------------------


class BindSession(Body, frozen=True):
    owner: str
    incarnation: str = ""  # "": not checked


class ReleaseSession(Body, frozen=True):
    owner: str
    cause: str = "closed"
    incarnation: str = ""  # "": not checked


class ForgetSessions(Body, frozen=True):
    sessions: list[str]


SessionCommand = c.Bind | c.Release | c.Forget
SessionOutcome = Bound | Released | Forgotten


class ExecuteSessions(Body, frozen=True):
    """``POST /sessions/commands``: binds, releases and forgets of many sessions in one round
    trip, decided in the order given (a gateway's coalesced calls)."""

    commands: list[SessionCommand]
    mark: Mark | None = None  # the routing table the caller holds


# --- engines and versions ----------------------------------------------------------------------


class EngineAction(Body, frozen=True):
    """An operator's action on an engine; ``detail`` is recorded with a suspension."""

    detail: str = ""


class TroubleReport(Body, frozen=True):
    """A failed generation as a gateway process saw it: the engine's error code, whether the
    engine answered cleanly (a refusal) or not (unreachable, timed out, a lost reply, a 5xx),
    and its message for the log. Only a hint: the reconciler's probe and inventory decide."""

    code: Annotated[str, msgspec.Meta(pattern=r"^[!-~]{0,64}$")]  # printable ASCII, no space
    clean: bool
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class PublishVersion(Body, frozen=True):
    version_id: int
    adapter_dir: str
    allow_rollback: bool = False  # a version lower than the default, on purpose


# --- replies -----------------------------------------------------------------------------------


class Refusal(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A refusal in place in a batch answer (tagged ``"type": "Refusal"``, so that it stands
    beside outcomes in a list), and how a client reads an HTTP error body (:func:`error_body`,
    the same fields without the tag)."""

    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class SessionsAnswered(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to :class:`ExecuteSessions`: each command's outcome or refusal, in order,
    and the routing if it changed since the caller's mark."""

    results: list[Bound | Released | Forgotten | Refusal]
    routing: RoutingTable | None = None


class LostLife(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    incarnation: str
    refusal: Refusal


class LeasesRenewed(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to :class:`RenewLeases`: the lives the ledger refused (``LEASE_EXPIRED``,
    ``OWNER_RESTARTED``, ...) and the routing if it changed since the caller's mark."""

    lost: list[LostLife] = msgspec.field(default_factory=list)
    routing: RoutingTable | None = None


class Renewed(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool = True


class Heard(msgspec.Struct, frozen=True, kw_only=True):
    """Whether anyone in the ledger's process watches the engines (a reconciler)."""

    heard: bool


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A refusal as an HTTP error body: ``{"code", "message", "details"}`` (without the tag a
    batch answer carries; a client decodes it as a :class:`Refusal` all the same)."""
    return {"code": code, "message": message, "details": msgspec.to_builtins(details or {})}


def refusal(error: LoraLedgerError) -> Refusal:
    details: dict[str, Any] = msgspec.to_builtins(error.details)
    return Refusal(code=error.code, message=error.message, details=details)


def error_of(code: str, message: str, details: dict[str, Any]) -> LoraLedgerError | None:
    """The ledger's own exception for a refusal it sent (its class and code), or None when
    ``code`` is none of the ledger's or the store's."""
    for owner in (LedgerError, StoreError):
        try:
            return owner(code, message, **details)
        except (ValueError, TypeError):
            continue
    return None


def counts(inflight: list[InFlightCount]) -> dict[tuple[str, int], int]:
    return {(x.engine, x.version_id): x.count for x in inflight}


def inflight(counts: dict[tuple[str, int], int]) -> list[InFlightCount]:
    return [
        InFlightCount(engine=engine, version_id=version, count=n)
        for (engine, version), n in sorted(counts.items())
    ]
