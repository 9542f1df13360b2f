"""The record envelope around an event, and the hash chain that links records.

A record is what the store keeps: the encoded event plus its position (``seq``, gap-free,
assigned inside the write transaction), a unique time-ordered ``event_id`` (the idempotency
key of an append), the ``stream`` it belongs to, ``recorded_at`` (wall time at the edge; data
for humans and tools, never read by a decision unless copied into the payload), and the chain:
``hash = SHA-256(prev_hash || canonical(seq, event_id, stream, type, schema, recorded_at,
payload))``. Changing any byte of any earlier record changes every later hash, so ``verify``
names the first record that does not match.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence

import msgspec

from evlog.errors import StoreCode, StoreError
from evlog.events import AnyEvent, Event, decode_event, encode_event, stream_of

GENESIS_HASH = bytes(32)

_canonical = msgspec.msgpack.Encoder()


class Pending(msgspec.Struct, frozen=True, kw_only=True):
    """An event ready to append: everything but its position and chain."""

    event_id: bytes
    stream: str
    type: str
    schema: int
    recorded_at: float
    payload: bytes


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """A stored event. ``event`` is decoded (and upcast) from ``payload`` on read."""

    seq: int
    event_id: bytes
    stream: str
    type: str
    schema: int
    recorded_at: float
    payload: bytes
    prev_hash: bytes
    hash: bytes
    event: AnyEvent


def chain_hash(
    prev_hash: bytes,
    seq: int,
    event_id: bytes,
    stream: str,
    type_name: str,
    schema: int,
    recorded_at: float,
    payload: bytes,
) -> bytes:
    """The hash of one record given its predecessor's hash. The single definition of the chain."""
    canonical = _canonical.encode((seq, event_id, stream, type_name, schema, recorded_at, payload))
    return hashlib.sha256(prev_hash + canonical).digest()


def new_event_id(now: float | None = None) -> bytes:
    """A UUIDv7-style id: 48-bit millisecond time, then random bits, so ids are unique and
    roughly time-ordered (a random id under a UNIQUE index makes group commit 2.3-2.5x slower
    once the table grows; docs/identities.md)."""
    ms = int((time.time() if now is None else now) * 1000) & ((1 << 48) - 1)
    rand = bytearray(os.urandom(10))
    rand[0] = (rand[0] & 0x0F) | 0x70  # version 7
    rand[2] = (rand[2] & 0x3F) | 0x80  # RFC 4122 variant
    return ms.to_bytes(6, "big") + bytes(rand)


def new_event_ids(count: int, now: float) -> list[bytes]:
    """``count`` ids for one batch: the same millisecond and one random 48-bit batch prefix
    (with the version and variant bits), then a 32-bit counter. As unique and as time-ordered
    as :func:`new_event_id`, for one ``urandom`` call per batch instead of one per event."""
    ms = (int(now * 1000) & ((1 << 48) - 1)).to_bytes(6, "big")
    rand = bytearray(os.urandom(6))
    rand[0] = (rand[0] & 0x0F) | 0x70  # version 7
    rand[2] = (rand[2] & 0x3F) | 0x80  # RFC 4122 variant
    head = ms + bytes(rand)
    return [head + i.to_bytes(4, "big") for i in range(count)]


def pending_many(events: Sequence[Event], recorded_at: float) -> list[Pending]:
    """Wrap a batch of events decided together (one clock reading, one id prefix)."""
    ids = new_event_ids(len(events), recorded_at)
    return [
        Pending(
            event_id=event_id,
            stream=stream_of(event),
            type=type(event).__name__,
            schema=type(event).SCHEMA,
            recorded_at=recorded_at,
            payload=encode_event(event),
        )
        for event_id, event in zip(ids, events, strict=True)
    ]


def pending(
    event: Event, *, event_id: bytes | None = None, recorded_at: float | None = None
) -> Pending:
    """Wrap an event for appending. ``event_id`` and ``recorded_at`` come from the edge (the
    service), never from a decision."""
    now = time.time() if recorded_at is None else recorded_at
    return Pending(
        event_id=new_event_id(now) if event_id is None else event_id,
        stream=stream_of(event),
        type=type(event).__name__,
        schema=type(event).SCHEMA,
        recorded_at=now,
        payload=encode_event(event),
    )


Row = tuple[int, bytes, str, str, int, float, bytes, bytes, bytes]
"""A stored record as a flat tuple in column order: ``(seq, event_id, stream, type, schema,
recorded_at, payload, prev_hash, hash)``. Both stores keep exactly this, so one function seals
it (:func:`seal_row`) and one verifies and decodes it (:func:`open_row`)."""


def seal_row(p: Pending, seq: int, prev_hash: bytes) -> Row:
    """Give ``p`` its position and link it to its predecessor's hash."""
    return (
        seq,
        p.event_id,
        p.stream,
        p.type,
        p.schema,
        p.recorded_at,
        p.payload,
        prev_hash,
        chain_hash(
            prev_hash, seq, p.event_id, p.stream, p.type, p.schema, p.recorded_at, p.payload
        ),
    )


def open_row(row: Row, prev_seq: int, prev_hash: bytes) -> Record:
    """Verify ``row`` against its predecessor (``prev_seq``, ``prev_hash``) and decode it.

    The checks run in the order that names the most precise culprit: a missing position first
    (``CHAIN_BROKEN`` naming the missing seq), then the row's own content against its hash
    (``CORRUPT_RECORD``: the row was altered), then the link (``CHAIN_BROKEN``: the row is intact
    but its predecessor is not the record it was chained to, i.e. an earlier record was
    rewritten consistently or removed). A payload that hashes correctly but does not decode is
    ``CORRUPT_RECORD`` too (it was stored that way); one this code cannot read (unknown type, a
    schema newer than this code, a missing upcaster) is ``UNKNOWN_SCHEMA``: the log is fine,
    the code is too old.
    """
    if tuple(map(type, row)) != _ROW_TYPES:
        _check_types(row, prev_seq)
    seq, event_id, stream, type_name, schema, recorded_at, payload, stored_prev, stored_hash = row
    if seq != prev_seq + 1:
        raise _missing(prev_seq, seq)
    if (
        chain_hash(stored_prev, seq, event_id, stream, type_name, schema, recorded_at, payload)
        != stored_hash
    ):
        raise StoreError(
            StoreCode.CORRUPT_RECORD, f"record {seq} does not match its hash (altered)", seq=seq
        )
    if stored_prev != prev_hash:
        raise StoreError(
            StoreCode.CHAIN_BROKEN,
            f"record {seq} is not chained to record {prev_seq} (an earlier record was rewritten)",
            seq=seq,
        )
    try:
        event = decode_event(payload, type_name, schema)
    except LookupError as exc:
        raise StoreError(StoreCode.UNKNOWN_SCHEMA, f"record {seq}: {exc}", seq=seq) from exc
    except (ValueError, TypeError) as exc:  # msgspec.DecodeError/ValidationError are ValueErrors
        raise StoreError(
            StoreCode.CORRUPT_RECORD, f"record {seq} payload does not decode: {exc}", seq=seq
        ) from exc
    except RecursionError as exc:  # a crafted payload nested deeper than any event is
        raise StoreError(
            StoreCode.CORRUPT_RECORD, f"record {seq} payload is nested too deep to decode", seq=seq
        ) from exc
    if type(event).__name__ != type_name:
        raise StoreError(
            StoreCode.CORRUPT_RECORD,
            f"record {seq} says {type_name} but its payload is {type(event).__name__}",
            seq=seq,
        )
    return Record(
        seq=seq,
        event_id=event_id,
        stream=stream,
        type=type_name,
        schema=schema,
        recorded_at=recorded_at,
        payload=payload,
        prev_hash=stored_prev,
        hash=stored_hash,
        event=event,
    )


_ROW_TYPES = (int, bytes, str, str, int, float, bytes, bytes, bytes)
_COLUMN_NAMES = (
    "seq",
    "event_id",
    "stream",
    "type",
    "schema",
    "recorded_at",
    "payload",
    "prev_hash",
    "hash",
)


def _missing(prev_seq: int, next_seq: int) -> StoreError:
    return StoreError(
        StoreCode.CHAIN_BROKEN,
        f"record {prev_seq + 1} is missing (the next stored record is {next_seq})",
        seq=prev_seq + 1,
    )


def _check_types(row: tuple[object, ...], prev_seq: int) -> None:
    """The slow path of :func:`open_row`'s type check. The ledger's table is STRICT, so a
    column of another type (or text that is not UTF-8, which the SQLite store hands over as
    bytes) was put there by something else: ``CORRUPT_RECORD`` naming the record, before the
    hash code or the decoder trip over it. An integral ``recorded_at`` is accepted (a
    caller-built row may carry one; the hash covers it as it is)."""
    seq = prev_seq + 1
    if len(row) and type(row[0]) is int and row[0] != seq:
        raise _missing(prev_seq, row[0])  # the missing position first, as in open_row
    if len(row) != len(_ROW_TYPES):
        raise StoreError(
            StoreCode.CORRUPT_RECORD, f"record {seq} has {len(row)} columns, not 9", seq=seq
        )
    for name, value, expected in zip(_COLUMN_NAMES, row, _ROW_TYPES, strict=True):
        if type(value) is expected or (name == "recorded_at" and type(value) is int):
            continue
        what = (
            "is not UTF-8 text"
            if expected is str and isinstance(value, bytes)
            else f"holds {type(value).__name__}, not {expected.__name__}"
        )
        raise StoreError(StoreCode.CORRUPT_RECORD, f"record {seq}: column {name} {what}", seq=seq)
