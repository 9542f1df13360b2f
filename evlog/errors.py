"""Error families shared by every layer, and the event store's own errors.

Every error loraledger raises is a :class:`LoraLedgerError` with a stable machine ``code``
(a string: part of the API, printed, sent over HTTP, branched on by tools and users), a human
``message`` (may be reworded) and structured ``details``. Two questions, two handles:

* *may I retry, and how?* -- answered by the **family** (the class), so a caller can
  ``except Unavailable:`` without listing codes:

  =================  ==========================================================================
  ``Refused``        a clean "no": nothing was applied; asking the same again gets the same no
  ``InvalidInput``   (a ``Refused``) the caller's arguments are malformed: fix the call
  ``Ambiguous``      sent, no answer: the outcome is unknown; never resend blindly, find out
  ``Unavailable``    a component could not be reached or used (closed, fenced, a failed write,
                     no route): retry later, with the same ids (a failed write may have landed)
  ``Corrupt``        the stored log cannot be trusted or decoded by this code: an operator
                     must look; retrying never helps
  =================  ==========================================================================

* *what exactly happened?* -- answered by ``.code``.

Each layer owns its vocabulary: this module holds the families and the store's codes; the
ledger's codes live in ``publisher.core.errors``, the gateway's in ``publisher.gateway``, the
publication driver's in ``publisher.drivers.publication``. A code has one family, declared once with
the owner's error class (like ``OSError(errno.ENOENT, ...)`` giving a ``FileNotFoundError``,
``StoreError(StoreCode.STORE_CLOSED, ...)`` is a ``StoreUnavailable``), so no raise site can
disagree with it. docs/errors.md lists every code with its family.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Self


class LoraLedgerError(Exception):
    """Base of every loraledger error: a ``code``, a ``message`` and ``details``.

    ``details`` carries structured context (the seq that broke the chain, the version that holds
    the capacity, ...) so tools can print it without parsing the message. ``str()`` is
    ``"CODE: message"``. Errors pickle with all three (Ray ships exceptions between processes).

    An owner's error class (``StoreError``, ``publisher.core.errors.LedgerError``) is the first base
    of one subclass per family, each declared with its codes::

        class StoreUnavailable(StoreError, Unavailable, codes=[StoreCode.STORE_CLOSED]): ...

    and constructing the owner's class builds the subclass its code belongs to.
    """

    code: str
    message: str
    details: dict[str, Any]
    _family_class_of: ClassVar[dict[str, type[LoraLedgerError]]]  # only on an owner's class

    def __init_subclass__(cls, *, codes: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        codes = tuple(codes)
        if not codes:
            return
        bases = cls.__bases__
        owner = bases[0]
        if (
            len(bases) != 2
            or owner in FAMILIES
            or bases[1] not in FAMILIES
            or not issubclass(owner, LoraLedgerError)
        ):
            raise TypeError(f"{cls.__name__}: declare codes as class X(Owner, Family, codes=...)")
        table = owner.__dict__.get("_family_class_of")
        if table is None:
            table = {}
            owner._family_class_of = table
        for code in codes:
            if code in table:
                raise TypeError(f"{owner.__name__}: code {code} is declared twice")
            table[code] = cls

    def __new__(cls, code: str, message: str, **details: Any) -> Self:
        table: dict[str, type[Self]] | None = cls.__dict__.get("_family_class_of")
        if table is None:
            return super().__new__(cls, code, message)
        try:
            family_class = table[code]
        except KeyError:
            raise ValueError(f"{cls.__name__} has no code {code!r}") from None
        return super().__new__(family_class, code, message)

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep code/message/details (and the exact class) across pickling.
        return (_rebuild_error, (type(self), self.code, self.message, self.details))


def _rebuild_error(
    cls: type[LoraLedgerError], code: str, message: str, details: dict[str, Any]
) -> LoraLedgerError:
    return cls(code, message, **details)


# --- the families ---------------------------------------------------------------------------


class Refused(LoraLedgerError):
    """A clean "no": the request was not applied (at most its refusal was recorded). The same
    request gets the same answer until something else changes."""


class InvalidInput(Refused):
    """The caller's arguments are malformed (a wrong type, a value out of range): the call
    itself must change."""


class Ambiguous(LoraLedgerError):
    """The request was sent and no answer came back: it may or may not have acted. Resending it
    may act twice, so it is never resent blindly; the outcome must be found out first."""


class Unavailable(LoraLedgerError):
    """A component could not be reached or used: closed, fenced, a write that failed below, no
    engine to route to. Retry later (or elsewhere); a failed write may have landed, so a retry
    carries the same ids (the log's appends are idempotent)."""


class Corrupt(LoraLedgerError):
    """The stored log cannot be trusted or decoded by this code: a record that does not match
    its hash, a broken chain, a file that is not a ledger, a schema newer than this code.
    Retrying never helps; an operator must look."""


FAMILIES: tuple[type[LoraLedgerError], ...] = (
    Refused,
    InvalidInput,
    Ambiguous,
    Unavailable,
    Corrupt,
)

# The generic code of an InvalidInput, shared by every layer (a more precise one, such as the
# ledger's INVALID_VERSION, is used where it exists).
INVALID_INPUT = "INVALID_INPUT"


# --- the event store ------------------------------------------------------------------------


class StoreCode:
    """The event store's codes (besides ``INVALID_INPUT`` for its own arguments)."""

    SEQ_CONFLICT = "SEQ_CONFLICT"  # the log does not end at the expected seq: nothing appended
    STORE_CLOSED = "STORE_CLOSED"
    # a write failed below the store (I/O error, disk full, lock timeout): the batch may or may
    # not be durable, so the caller retries with the same event ids (appends are idempotent)
    STORE_FAILED = "STORE_FAILED"
    CHAIN_BROKEN = "CHAIN_BROKEN"  # a record is missing, or not chained to its predecessor
    CORRUPT_RECORD = "CORRUPT_RECORD"  # one record does not match its hash or does not decode
    # the file is not a readable ledger (not a database, fails its integrity check, foreign
    # layout); distinct from CORRUPT_RECORD, which names one record
    CORRUPT_STORE = "CORRUPT_STORE"
    UNKNOWN_SCHEMA = "UNKNOWN_SCHEMA"  # written by a newer loraledger than this one


class StoreError(LoraLedgerError):
    """An error of an event store; ``StoreError(code, ...)`` is the family class below."""


class StoreRefused(StoreError, Refused, codes=[StoreCode.SEQ_CONFLICT]):
    """An append the store refused; nothing was written."""


class StoreInvalidInput(StoreError, InvalidInput, codes=[INVALID_INPUT]):
    """A store method called with malformed arguments."""


class StoreUnavailable(
    StoreError, Unavailable, codes=[StoreCode.STORE_CLOSED, StoreCode.STORE_FAILED]
):
    """The store is closed, or a read or write failed below it."""


class StoreCorrupt(
    StoreError,
    Corrupt,
    codes=[
        StoreCode.CHAIN_BROKEN,
        StoreCode.CORRUPT_RECORD,
        StoreCode.CORRUPT_STORE,
        StoreCode.UNKNOWN_SCHEMA,
    ],
):
    """The stored log is damaged, tampered with, or newer than this code."""
