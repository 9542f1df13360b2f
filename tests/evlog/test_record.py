"""Event ids, the wrapping of decided events and the checks of a stored row: what the store's
UNIQUE index, the ledger's batches and every read rely on (docs/identities.md, docs/stores.md)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from evlog.errors import StoreCode
from evlog.events import SessionBound, VersionAllocated, decode_event, stream_of
from evlog.record import (
    GENESIS_HASH,
    chain_hash,
    new_event_id,
    new_event_ids,
    open_row,
    pending,
    pending_many,
    seal_row,
)
from tests.evlog.contract import raises_code

NOW = 1_764_633_600.123  # 2025-12-02 00:00:00.123 UTC


def _is_uuid7(event_id: bytes) -> bool:
    u = uuid.UUID(bytes=event_id)
    return u.version == 7 and u.variant == uuid.RFC_4122


# The bits of an id after its 48-bit time that are not fixed by the layout (version 7 in the
# high nibble of byte 6, the RFC 4122 variant in the two high bits of byte 8).
_FIXED = {(6, b) for b in range(4, 8)} | {(8, 6), (8, 7)}


def _bits_that_vary(ids: list[bytes], span: range) -> set[tuple[int, int]]:
    return {
        (i, b)
        for i in span
        for b in range(8)
        if len({(event_id[i] >> b) & 1 for event_id in ids}) == 2
    }


def _random_bits_are_independent(ids: list[bytes], span: range) -> bool:
    """No random bit is a copy of another (each bit's values over ``ids``, as one integer, is
    distinct): a mask applied to the wrong byte would copy bits and lose entropy."""
    columns = [
        sum(((event_id[i] >> b) & 1) << k for k, event_id in enumerate(ids))
        for i in span
        for b in range(8)
        if (i, b) not in _FIXED
    ]
    return len(set(columns)) == len(columns)


def test_an_event_id_is_a_uuid7_led_by_its_millisecond() -> None:
    ids = [new_event_id(NOW) for _ in range(200)]
    assert all(len(i) == 16 and _is_uuid7(i) for i in ids)
    assert {int.from_bytes(i[:6], "big") for i in ids} == {int(NOW * 1000)}
    assert len(set(ids)) == 200
    assert new_event_id(NOW) < new_event_id(NOW + 0.002)  # time-ordered across milliseconds
    assert _is_uuid7(new_event_id())  # the clock is read when no time is given
    # Every random bit is random: none forced by the version and variant masks.
    random_bits = {(i, b) for i in range(6, 16) for b in range(8)} - _FIXED
    assert _bits_that_vary(ids, range(6, 16)) == random_bits
    assert _random_bits_are_independent(ids, range(6, 16))


def test_a_batch_shares_its_millisecond_and_prefix_and_counts_in_order() -> None:
    ids = new_event_ids(300, NOW)
    assert len(ids) == 300 and len(set(ids)) == 300
    assert all(len(i) == 16 and _is_uuid7(i) for i in ids)
    assert {i[:12] for i in ids} == {ids[0][:12]}
    assert int.from_bytes(ids[0][:6], "big") == int(NOW * 1000)
    assert [int.from_bytes(i[12:], "big") for i in ids] == list(range(300))
    assert ids == sorted(ids)  # the index sees them in batch order
    assert new_event_ids(0, NOW) == []
    later = new_event_ids(1, NOW + 0.002)
    assert later[0] > ids[-1]
    # Two batches of the same millisecond differ by their random prefix (48 bits), which holds
    # the version and variant whatever the random draw, and is random everywhere else.
    heads = [new_event_ids(1, NOW)[0] for _ in range(200)]
    assert len({h[:12] for h in heads}) == 200
    assert all(_is_uuid7(h) for h in heads)
    random_bits = {(i, b) for i in range(6, 12) for b in range(8)} - _FIXED
    assert _bits_that_vary(heads, range(6, 12)) == random_bits
    assert _random_bits_are_independent(heads, range(6, 12))


def test_a_time_past_48_bits_of_milliseconds_wraps_instead_of_failing() -> None:
    far = (2**48 + 5) / 1000
    assert int.from_bytes(new_event_id(far)[:6], "big") == 5
    assert int.from_bytes(new_event_ids(1, far)[0][:6], "big") == 5


def test_pending_many_wraps_each_event_with_its_stream_type_schema_and_one_clock() -> None:
    events = [
        VersionAllocated(version_id=1, digest="ab" * 32, lora_name="d-v1-abababab"),
        SessionBound(session="s", owner="w", version_id=1, revision=1),
    ]
    batch = pending_many(events, NOW)
    assert [p.type for p in batch] == ["VersionAllocated", "SessionBound"]
    assert [p.stream for p in batch] == [stream_of(e) for e in events]
    assert [p.schema for p in batch] == [type(e).SCHEMA for e in events]
    assert {p.recorded_at for p in batch} == {NOW}
    assert [decode_event(p.payload, p.type, p.schema) for p in batch] == events
    assert batch[0].event_id[:12] == batch[1].event_id[:12]
    assert [int.from_bytes(p.event_id[12:], "big") for p in batch] == [0, 1]


def test_pending_keeps_the_id_and_time_it_is_given_and_makes_them_otherwise() -> None:
    event = SessionBound(session="s", owner="w", version_id=1, revision=1)
    given = pending(event, event_id=b"\x01" * 16, recorded_at=NOW)
    assert (given.event_id, given.recorded_at) == (b"\x01" * 16, NOW)
    made = pending(event, recorded_at=NOW)
    assert _is_uuid7(made.event_id) and made.recorded_at == NOW
    assert int.from_bytes(made.event_id[:6], "big") == int(NOW * 1000)  # the id carries its time
    fresh = pending(event)
    assert fresh.recorded_at > NOW and _is_uuid7(fresh.event_id)
    assert int.from_bytes(fresh.event_id[:6], "big") == int(fresh.recorded_at * 1000)


# --- what a read checks of each row ------------------------------------------------------------

_EVENT = SessionBound(session="s", owner="w", version_id=1, revision=1)


def _row(seq: int = 1, prev: bytes = GENESIS_HASH, **columns: Any) -> tuple[Any, ...]:
    """A row as a store hands it over, with ``columns`` replaced and its hash recomputed."""
    row: list[Any] = list(seal_row(pending(_EVENT, recorded_at=NOW), seq, prev))
    names = ("seq", "event_id", "stream", "type", "schema", "recorded_at", "payload")
    for name, value in columns.items():
        row[names.index(name)] = value
    row[8] = chain_hash(row[7], *row[:7])
    return tuple(row)


def test_a_missing_record_names_the_next_one_stored() -> None:
    with raises_code(StoreCode.CHAIN_BROKEN, seq=3) as info:
        open_row(_row(seq=6), 2, GENESIS_HASH)
    assert "record 3 is missing (the next stored record is 6)" in info.value.message
    # Also when that next row is malformed too: the missing position comes first.
    with raises_code(StoreCode.CHAIN_BROKEN, seq=3) as info:
        open_row(_row(seq=6, stream=7), 2, GENESIS_HASH)
    assert "(the next stored record is 6)" in info.value.message


@pytest.mark.parametrize(
    ("columns", "says"),
    [
        ({"stream": 7}, "column stream holds int, not str"),
        ({"payload": "text"}, "column payload holds str, not bytes"),
        ({"stream": b"\xff\x00"}, "column stream is not UTF-8 text"),
        ({"schema": None}, "column schema holds NoneType, not int"),
    ],
)
def test_a_column_of_another_type_is_a_corrupt_record_naming_it(
    columns: dict[str, Any], says: str
) -> None:
    with raises_code(StoreCode.CORRUPT_RECORD, seq=1) as info:
        open_row(_row(**columns), 0, GENESIS_HASH)
    assert info.value.message == f"record 1: {says}"


def test_an_integral_time_is_accepted_and_a_short_row_is_corrupt() -> None:
    record = open_row(_row(recorded_at=1_764_633_600), 0, GENESIS_HASH)
    assert record.recorded_at == 1_764_633_600 and record.event == _EVENT
    with raises_code(StoreCode.CORRUPT_RECORD, seq=1) as info:
        open_row(_row()[:8], 0, GENESIS_HASH)
    assert info.value.message == "record 1 has 8 columns, not 9"


def test_a_payload_nested_deeper_than_any_event_is_a_corrupt_record() -> None:
    deep = b"\x81\xa7session" + b"\x91" * 100_000 + b"\xc0"  # a msgpack array 100,000 deep
    with raises_code(StoreCode.CORRUPT_RECORD, seq=1) as info:
        open_row(_row(payload=deep), 0, GENESIS_HASH)
    assert "nested too deep" in info.value.message
