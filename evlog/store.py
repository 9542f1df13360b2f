"""The ``EventStore`` contract every backend honours (SQLite, memory).

The contract is written once here and tested once in ``tests/evlog/contract.py``; each backend
only supplies a factory, the way the ``eventsourcing`` library reuses its recorder tests.

Guarantees:

* ``append`` is atomic per call: all new events of the batch are stored, in order, or none.
  ``seq`` is gap-free and assigned inside the write transaction.
* Idempotent by ``event_id``: an event whose id is already stored is not stored again; its
  original ``seq`` is returned, forever (the UNIQUE constraint lives in the log itself).
* ``expected_seq``: if given and the store's last seq differs, the call is refused with
  ``SEQ_CONFLICT`` (unless every event of the batch is a duplicate: a retried append of an
  already committed batch returns the original seqs).
* A caller is answered only after its events are durable (COMMIT returned).
* Reads verify every record they return: a record whose hash does not match its content
  (``CORRUPT_RECORD``) or whose ``prev_hash`` does not match its predecessor
  (``CHAIN_BROKEN``) raises ``StoreError`` naming the seq.
* ``follow`` yields committed records after a seq and wakes on new commits (no polling).

How a group of append calls resolves against the log (duplicates, ``expected_seq``,
positions, chain) is defined once, in :mod:`evlog.append_plan`; every backend calls it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

import anyio
import msgspec

from evlog.record import Pending, Record

SNAPSHOTS_KEPT = 2
"""Snapshots kept per code version (the newest ones). A snapshot is a cache that saves replay
time; keeping every one would grow the store by a projection's size per save."""


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of a full-chain check. ``ok`` is False with the first bad seq named.

    ``records``, ``last_seq`` and ``head_hash`` describe the verified prefix: everything up to
    ``last_seq`` is trustworthy even when ``ok`` is False.
    """

    ok: bool
    records: int
    last_seq: int
    head_hash: bytes
    first_bad_seq: int | None = None
    code: str | None = None
    message: str = ""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A projection snapshot: a cache, never a source of truth. Ignored when ``code_version``
    differs from the running projection code."""

    code_version: str
    seq: int
    state: bytes


@runtime_checkable
class EventStore(Protocol):
    @property
    def last_seq(self) -> int:
        """Seq of the newest committed record (0 for an empty log)."""
        ...

    @property
    def head_hash(self) -> bytes:
        """Hash of the newest committed record (``GENESIS_HASH`` for an empty log)."""
        ...

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        """Append atomically; return one seq per pending event (original seq for duplicates)."""
        ...

    async def read(
        self, after: int = 0, until: int | None = None, limit: int | None = None
    ) -> list[Record]:
        """Committed records with ``after < seq <= until`` in seq order, verified."""
        ...

    def iterate(self, after: int = 0, until: int | None = None) -> AsyncIterator[Record]:
        """Like ``read`` but streamed in bounded chunks (replaying a million-event log)."""
        ...

    def follow(self, after: int = 0) -> AsyncIterator[Record]:
        """Records after ``after``, then every new commit as it lands. Never ends by itself; ends
        cleanly when the store closes."""
        ...

    async def verify(self) -> VerifyReport:
        """Walk the whole chain; never raises for a bad record, reports it."""
        ...

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot`` (refused with ``INVALID_INPUT`` if its seq is beyond the log); only
        the newest ``SNAPSHOTS_KEPT`` per code version are retained."""
        ...

    async def load_snapshot(self, code_version: str) -> Snapshot | None:
        """The newest snapshot written by ``code_version``, if any."""
        ...

    async def close(self) -> None: ...


class CommitSignal:
    """How followers wait for the next commit without polling: one event per wait round,
    replaced once it fires. A follower takes :meth:`next` *before* reading, so a commit that
    lands during its read sets the very event it then waits on (no lost wake-up)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def next(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None
