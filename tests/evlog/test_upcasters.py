"""The upcasters of the event schemas this code has moved past: a record written by older code
is read into today's class, with the meaning it had when it was written."""

from __future__ import annotations

import msgspec

from evlog.events import EngineRestarted, VersionPublished, decode_event, encode_event


def test_a_schema_1_version_published_reads_as_no_rollback() -> None:
    """Schema 2 added ``rollback``: every commit recorded before it moved the default forward
    (a lower version could not be published on purpose), so it reads as ``False``."""
    old = msgspec.msgpack.encode(
        {"type": "VersionPublished", "version_id": 5, "attempt": 1, "revision": 2, "retired": 4}
    )
    event = decode_event(old, "VersionPublished", 1)
    assert event == VersionPublished(version_id=5, attempt=1, revision=2, retired=4)
    assert event.rollback is False
    new = VersionPublished(version_id=5, attempt=1, revision=3, retired=12, rollback=True)
    assert decode_event(encode_event(new), "VersionPublished", VersionPublished.SCHEMA) == new


def test_a_schema_1_engine_restart_reads_as_the_same_address() -> None:
    """Schema 2 added ``endpoint`` and ``kind`` to ``EngineRestarted``: a restart recorded
    before it said nothing about where the new life served, which reads as unchanged."""
    old = msgspec.msgpack.encode(
        {"type": "EngineRestarted", "engine": "e0", "old": "a", "new": "b"}
    )
    event = decode_event(old, "EngineRestarted", 1)
    assert event == EngineRestarted(engine="e0", old="a", new="b")
    assert (event.endpoint, event.kind) == (None, None)
    moved = EngineRestarted(engine="e0", old="b", new="c", endpoint="http://h:1", kind="vllm")
    assert decode_event(encode_event(moved), "EngineRestarted", EngineRestarted.SCHEMA) == moved
