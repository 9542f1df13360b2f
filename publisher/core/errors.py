"""The ledger's codes and its error class, by family.

These are the answers of the ledger service (the decider's refusals, the service's own states):
callers branch on the family for retry decisions (``except Unavailable:`` to wait and retry,
``except Refused:`` to give up on this request) and on ``.code`` for specifics. The families
and the store's codes are in ``evlog.errors``; the gateway's codes in ``publisher.gateway``,
the publication driver's in ``publisher.drivers.publication``.
"""

from __future__ import annotations

from evlog.errors import (
    INVALID_INPUT,
    InvalidInput,
    LoraLedgerError,
    Refused,
    Unavailable,
)


class Code:
    """The ledger's codes (stable strings: users, tools and the HTTP service branch on them)."""

    # allocate / publication (in the order allocate checks them)
    INVALID_VERSION = "INVALID_VERSION"
    VERSION_CONFLICT = "VERSION_CONFLICT"
    VERSION_REGRESSION = "VERSION_REGRESSION"  # lower than the default, without allow_rollback
    PUBLICATION_BLOCKED = "PUBLICATION_BLOCKED"
    CAPACITY_ERROR = "CAPACITY_ERROR"
    PUBLICATION_IN_PROGRESS = "PUBLICATION_IN_PROGRESS"
    # receipts and commit
    READY_MISMATCH = "READY_MISMATCH"
    RECEIPT_OUT_OF_ORDER = "RECEIPT_OUT_OF_ORDER"  # claim -> PREPARED -> READY, in that order
    ENGINE_RESTARTED = "ENGINE_RESTARTED"
    ATTEMPT_CONFLICT = "ATTEMPT_CONFLICT"
    FLEET_MISMATCH = "FLEET_MISMATCH"
    NOT_READY = "NOT_READY"
    VERDICT_CONFLICT = "VERDICT_CONFLICT"  # a failure report contradicts the recorded ending
    UNKNOWN_VERSION = "UNKNOWN_VERSION"
    INVALID_STATE = "INVALID_STATE"
    # sessions and owners
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_TOO_STALE = "SESSION_TOO_STALE"  # bound version beyond the deployment's max_staleness
    NO_PUBLISHED_VERSION = "NO_PUBLISHED_VERSION"
    SESSION_STILL_BOUND = "SESSION_STILL_BOUND"
    UNKNOWN_OWNER = "UNKNOWN_OWNER"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    OWNER_RESTARTED = "OWNER_RESTARTED"  # a newer incarnation of the owner replaced this one
    OWNER_DEREGISTERED = "OWNER_DEREGISTERED"  # this incarnation ended cleanly (DeregisterOwner)
    OWNER_SECRET_MISMATCH = "OWNER_SECRET_MISMATCH"  # a call without the owner life's secret
    VERSION_NOT_BOUND = "VERSION_NOT_BOUND"  # a first turn names a version that is not the default
    # reclaim
    NOT_RECLAIMABLE = "NOT_RECLAIMABLE"
    REQUESTS_IN_FLIGHT = "REQUESTS_IN_FLIGHT"
    # fleet membership
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE"
    ENGINE_EXISTS = "ENGINE_EXISTS"
    ENGINE_SUSPENDED = "ENGINE_SUSPENDED"  # repair of a suspended engine, or its resume by a probe
    # deployment and commands
    NOT_INITIALIZED = "NOT_INITIALIZED"
    ALREADY_INITIALIZED = "ALREADY_INITIALIZED"
    COMMAND_CONFLICT = "COMMAND_CONFLICT"
    INVALID_INPUT = INVALID_INPUT  # the shared input code, defined in evlog.errors
    # the service
    LEDGER_CLOSED = "LEDGER_CLOSED"
    FENCED = "FENCED"  # another controller appended to this log: this one must stop


class LedgerError(LoraLedgerError):
    """An answer of the ledger; ``LedgerError(code, ...)`` is the family class below."""


class LedgerRefused(
    LedgerError,
    Refused,
    codes=[
        Code.VERSION_CONFLICT,
        Code.VERSION_REGRESSION,
        Code.PUBLICATION_BLOCKED,
        Code.CAPACITY_ERROR,
        Code.PUBLICATION_IN_PROGRESS,
        Code.READY_MISMATCH,
        Code.RECEIPT_OUT_OF_ORDER,
        Code.ENGINE_RESTARTED,
        Code.ATTEMPT_CONFLICT,
        Code.FLEET_MISMATCH,
        Code.NOT_READY,
        Code.VERDICT_CONFLICT,
        Code.UNKNOWN_VERSION,
        Code.INVALID_STATE,
        Code.SESSION_CLOSED,
        Code.SESSION_TOO_STALE,
        Code.NO_PUBLISHED_VERSION,
        Code.SESSION_STILL_BOUND,
        Code.UNKNOWN_OWNER,
        Code.LEASE_EXPIRED,
        Code.OWNER_RESTARTED,
        Code.OWNER_DEREGISTERED,
        Code.OWNER_SECRET_MISMATCH,
        Code.VERSION_NOT_BOUND,
        Code.NOT_RECLAIMABLE,
        Code.REQUESTS_IN_FLIGHT,
        Code.UNKNOWN_ENGINE,
        Code.ENGINE_EXISTS,
        Code.ENGINE_SUSPENDED,
        Code.NOT_INITIALIZED,
        Code.ALREADY_INITIALIZED,
        Code.COMMAND_CONFLICT,
    ],
):
    """A command the ledger refused: the log holds no effect of it (at most its rejection)."""


class LedgerInvalidInput(
    LedgerError, InvalidInput, codes=[Code.INVALID_VERSION, Code.INVALID_INPUT]
):
    """A command or call whose arguments are malformed."""


class LedgerUnavailable(LedgerError, Unavailable, codes=[Code.LEDGER_CLOSED, Code.FENCED]):
    """The ledger is closed or stopped (its writer stopped, it was fenced by another
    controller, a remote ledger did not answer): nothing more is decided here."""
