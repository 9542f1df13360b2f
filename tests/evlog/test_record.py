"""Event ids and the wrapping of decided events: what the store's UNIQUE index and the ledger's
batches rely on (docs/identities.md)."""

from __future__ import annotations

import uuid

from evlog.events import SessionBound, VersionAllocated, decode_event, stream_of
from evlog.record import new_event_id, new_event_ids, pending_many

NOW = 1_764_633_600.123  # 2025-12-02 00:00:00.123 UTC


def _is_uuid7(event_id: bytes) -> bool:
    u = uuid.UUID(bytes=event_id)
    return u.version == 7 and u.variant == uuid.RFC_4122


def test_an_event_id_is_a_uuid7_led_by_its_millisecond() -> None:
    ids = [new_event_id(NOW) for _ in range(200)]
    assert all(len(i) == 16 and _is_uuid7(i) for i in ids)
    assert {int.from_bytes(i[:6], "big") for i in ids} == {int(NOW * 1000)}
    assert len(set(ids)) == 200
    assert new_event_id(NOW) < new_event_id(NOW + 0.002)  # time-ordered across milliseconds
    assert _is_uuid7(new_event_id())  # the clock is read when no time is given


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
    # Two batches of the same millisecond differ by their random prefix (48 bits).
    assert len({new_event_ids(1, NOW)[0][:12] for _ in range(50)}) == 50


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
