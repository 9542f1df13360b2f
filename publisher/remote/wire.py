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

from evlog.errors import InvalidInput, LoraLedgerError, Refused, StoreError, Unavailable
from evlog.events import TurnFailures
from publisher.core import commands as c
from publisher.core.errors import LedgerError
from publisher.core.outcomes import Bound, Forgotten, Released
from publisher.drivers.publication import PublicationError
from publisher.gateway.provenance import ProvenanceRow
from publisher.remote.routing import Mark, RoutingTable


class WireCode:
    LEDGER_ANSWER = "LEDGER_ANSWER"  # serve answered something that is not a ledger decision


class Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request body: strict, keyword-only."""


# --- owners and leases -------------------------------------------------------------------------
# Every call for an owner's life carries the life's ``secret`` (its worker made it and
# registered it; the ledger keeps its digest): a body without one is refused, so a caller that
# only knows an owner id and incarnation cannot act for it (docs/sessions.md#owner-secrets).
Secret = Annotated[str, msgspec.Meta(min_length=32, max_length=256)]


class RegisterOwner(Body, frozen=True):
    owner: str
    secret: Secret  # this life's (printable ASCII: secrets.token_hex(32))
    ttl_s: float = 30.0
    incarnation: str = ""  # this life of the owner (docs/sessions.md#owner-incarnations)
    sessions_idle_s: float | None = None  # a relay's: its sessions are client-held


class DeregisterOwner(Body, frozen=True):
    secret: Secret  # the current life's
    incarnation: str = ""  # "": whichever life is current


class InFlightCount(Body, frozen=True):
    engine: str
    version_id: int
    count: int


class RenewLease(Body, frozen=True):
    """``POST /owners/{owner}/renew``: one owner's renewal."""

    secret: Secret  # the life's
    inflight: list[InFlightCount] = msgspec.field(default_factory=list)
    incarnation: str = ""  # "": not checked
    sessions: list[str] = msgspec.field(default_factory=list)  # a relay's sessions with a turn


class LifeRenewal(Body, frozen=True):
    """One life ``(owner, incarnation)``, its requests in flight, and (a relay's) the
    client-held sessions it had a turn of since its last renewal."""

    owner: str
    secret: str = ""  # the life's (one life without it is refused alone, not the whole batch)
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
    secret: Secret  # the owner's current life's
    incarnation: str = ""  # "": not checked


class ReleaseSession(Body, frozen=True):
    owner: str
    secret: Secret  # the owner's current life's
    cause: str = "closed"  # one a caller may state (evlog.events.CALLER_RELEASE_CAUSES)
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
    # What the gateway saw of the engine's reachability (docs/operations.md, "Engine
    # outages"): whether the request may have left (False: provably never reached the engine),
    # the engine's life it was routed to, how long ago (seconds: only a duration crosses
    # between clocks) and the failed turns it counted per session since its last report.
    dispatched: bool = True
    incarnation: Annotated[str, msgspec.Meta(max_length=256)] = ""
    age_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    failures: Annotated[tuple[TurnFailures, ...], msgspec.Meta(max_length=4096)] = ()
    reporter: Annotated[str, msgspec.Meta(max_length=200)] = ""


class StoreProvenance(Body, frozen=True):
    """``POST /provenance``: provenance rows of generations a face in another process served,
    for the store beside the log. Sent at least once: the store keeps each ``row_id`` once."""

    rows: list[ProvenanceRow]


class PublishVersion(Body, frozen=True):
    """``POST /versions``: publish ``version_id`` from ``adapter_dir`` (a PEFT directory on the
    service's host) or ``digest`` (an adapter uploaded before: below), exactly one of them.
    ``request_id`` names one request across its retries: asked again, it answers what the
    first ask reached (the ledger records the steps under it)."""

    version_id: int
    adapter_dir: str | None = None
    digest: str | None = None
    allow_rollback: bool = False  # a version lower than the default, on purpose
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[!-~]{1,128}$")] | None = None


# --- adapter uploads (publisher/remote/uploads.py) ----------------------------------------------


class OfferAdapter(Body, frozen=True):
    """``POST /adapters/{digest}``: an upload's terms, the adapter config and the size of the
    weights file that ``PUT /adapters/{digest}/weights?offset=N`` then sends as its body."""

    config: dict[str, Any]
    size: int


class UploadState(msgspec.Struct, frozen=True, kw_only=True):
    """Where an upload stands: ``received`` bytes of ``size`` are on the service's disk;
    ``stored``: the artifact store holds the digest, verified (nothing more to send)."""

    digest: str
    size: int
    received: int
    stored: bool = False


class UploadCode:
    DIGEST_MISMATCH = "DIGEST_MISMATCH"  # the bytes received hash to another digest
    INVALID_ADAPTER = "INVALID_ADAPTER"  # not a LoRA adapter the store accepts
    UPLOAD_TOO_LARGE = "UPLOAD_TOO_LARGE"  # more bytes than offered, or than the store admits
    UPLOAD_OFFSET = "UPLOAD_OFFSET"  # a send that does not start where the received bytes end
    UNKNOWN_UPLOAD = "UNKNOWN_UPLOAD"  # a send without an offer
    ADAPTER_NOT_UPLOADED = "ADAPTER_NOT_UPLOADED"  # a publication of a digest not stored
    UPLOAD_IN_PROGRESS = "UPLOAD_IN_PROGRESS"  # another send of the digest is receiving


class UploadError(LoraLedgerError):
    """An upload refused; ``UploadError(code, ...)`` is the family class below."""


class UploadInvalid(
    UploadError,
    InvalidInput,
    codes=[UploadCode.DIGEST_MISMATCH, UploadCode.INVALID_ADAPTER, UploadCode.UPLOAD_TOO_LARGE],
):
    """The bytes or the terms sent are wrong: nothing was stored (send the right bytes)."""


class UploadRefused(
    UploadError,
    Refused,
    codes=[UploadCode.UPLOAD_OFFSET, UploadCode.UNKNOWN_UPLOAD, UploadCode.ADAPTER_NOT_UPLOADED],
):
    """Out of order: offer first, send from ``received``, publish once stored."""


class UploadBusy(UploadError, Unavailable, codes=[UploadCode.UPLOAD_IN_PROGRESS]):
    """Another send of the digest is receiving: retry shortly."""


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


class ProvenanceStored(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to :class:`StoreProvenance`, sent once the rows are durable: how many were
    new (the rest were stored before: a batch sent again)."""

    stored: int


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
    ``code`` is none of the ledger's, the store's or an upload's. A publication's refusal
    carries its ``kind`` and is rebuilt as the ``PublicationError`` it was, whatever its
    code."""
    owners: tuple[type[LoraLedgerError], ...] = (LedgerError, StoreError, UploadError)
    if "kind" in details:
        owners = (PublicationError, *owners)
    for owner in owners:
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
