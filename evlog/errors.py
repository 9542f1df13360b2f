"""One error type for the whole ledger, with a stable machine code.

Callers branch on ``.code`` (a string constant below), never on the message: the message is for
humans and may be reworded, the code is part of the API. The ledger's codes keep the seed
registry's spelling so existing users recognise them (docs/errors.md).
"""

from __future__ import annotations

from typing import Any


class Code:
    """Namespace of the stable error codes."""

    # allocate / publication (docs/state-machine.md, in the order allocate checks them)
    INVALID_VERSION = "INVALID_VERSION"
    VERSION_CONFLICT = "VERSION_CONFLICT"
    PUBLICATION_BLOCKED = "PUBLICATION_BLOCKED"
    CAPACITY_ERROR = "CAPACITY_ERROR"
    PUBLICATION_IN_PROGRESS = "PUBLICATION_IN_PROGRESS"
    # receipts and commit
    READY_MISMATCH = "READY_MISMATCH"
    ENGINE_RESTARTED = "ENGINE_RESTARTED"
    ATTEMPT_CONFLICT = "ATTEMPT_CONFLICT"
    FLEET_MISMATCH = "FLEET_MISMATCH"
    NOT_READY = "NOT_READY"
    UNKNOWN_VERSION = "UNKNOWN_VERSION"
    INVALID_STATE = "INVALID_STATE"
    # sessions and owners
    SESSION_CLOSED = "SESSION_CLOSED"
    NO_PUBLISHED_VERSION = "NO_PUBLISHED_VERSION"
    SESSION_STILL_BOUND = "SESSION_STILL_BOUND"
    UNKNOWN_OWNER = "UNKNOWN_OWNER"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    # generation (the gateway)
    AMBIGUOUS_DISPATCH = "AMBIGUOUS_DISPATCH"  # sent, outcome unknown: never resent for you
    NO_ROUTE = "NO_ROUTE"  # no routable engine holds the session's version
    GENERATION_FAILED = "GENERATION_FAILED"  # the engine refused cleanly (nothing generated)
    # publication (the driver, reported to the trainer)
    PUBLICATION_FAILED = "PUBLICATION_FAILED"
    # reclaim
    NOT_RECLAIMABLE = "NOT_RECLAIMABLE"
    REQUESTS_IN_FLIGHT = "REQUESTS_IN_FLIGHT"
    # fleet
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE"
    ENGINE_EXISTS = "ENGINE_EXISTS"
    # deployment and commands
    NOT_INITIALIZED = "NOT_INITIALIZED"
    ALREADY_INITIALIZED = "ALREADY_INITIALIZED"
    COMMAND_CONFLICT = "COMMAND_CONFLICT"
    INVALID_INPUT = "INVALID_INPUT"
    # the store
    SEQ_CONFLICT = "SEQ_CONFLICT"
    CHAIN_BROKEN = "CHAIN_BROKEN"
    CORRUPT_RECORD = "CORRUPT_RECORD"
    STORE_CLOSED = "STORE_CLOSED"
    # the file is not a readable ledger (not a database, fails its integrity check, foreign
    # layout); distinct from CORRUPT_RECORD, which names one record
    CORRUPT_STORE = "CORRUPT_STORE"
    # a write failed below the ledger (I/O error, disk full, lock timeout): the batch may or may
    # not be durable, so the caller retries with the same event ids (appends are idempotent)
    STORE_FAILED = "STORE_FAILED"
    UNKNOWN_SCHEMA = "UNKNOWN_SCHEMA"
    # the service
    LEDGER_CLOSED = "LEDGER_CLOSED"
    FENCED = "FENCED"  # another controller appended to this log: this one must stop


class LedgerError(Exception):
    """A refusal or failure with a stable ``code`` and a human ``message``.

    ``details`` carries structured context (the seq that broke the chain, the version that holds
    the capacity, ...) so tools can print it without parsing the message.
    """

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep code/message/details across pickling (Ray ships exceptions between processes).
        return (_rebuild_error, (type(self), self.code, self.message, self.details))


def _rebuild_error(
    cls: type[LedgerError], code: str, message: str, details: dict[str, Any]
) -> LedgerError:
    return cls(code, message, **details)
