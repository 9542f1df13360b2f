"""The upcasters of the event schemas this code has moved past: a record written by older code
is read into today's class, with the meaning it had when it was written."""

from __future__ import annotations

import msgspec

from evlog.events import (
    EngineRestarted,
    OwnerRegistered,
    SessionReleased,
    VersionPublished,
    decode_event,
    encode_event,
)


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


def test_a_schema_2_owner_registration_reads_as_owner_held_sessions() -> None:
    """Schema 3 added ``sessions_idle_s`` to ``OwnerRegistered``: every owner registered before
    held its sessions itself (they ended with its life), which reads as None."""
    old = msgspec.msgpack.encode(
        {"type": "OwnerRegistered", "owner": "openai-serve", "ttl_s": 30.0, "at": 5.0,
         "incarnation": "a", "replaced": None}
    )  # fmt: skip
    event = decode_event(old, "OwnerRegistered", 2)
    assert event == OwnerRegistered(owner="openai-serve", ttl_s=30.0, at=5.0, incarnation="a")
    assert event.sessions_idle_s is None
    schema_1 = msgspec.msgpack.encode({"type": "OwnerRegistered", "owner": "w", "ttl_s": 5.0,
                                       "at": 1.0})  # fmt: skip
    oldest = decode_event(schema_1, "OwnerRegistered", 1)  # 1 -> 2 -> 3
    assert isinstance(oldest, OwnerRegistered) and oldest.sessions_idle_s is None
    relay = OwnerRegistered(owner="gw", ttl_s=30.0, at=6.0, incarnation="b", sessions_idle_s=0.0)
    assert decode_event(encode_event(relay), "OwnerRegistered", OwnerRegistered.SCHEMA) == relay


def test_a_schema_3_owner_registration_reads_as_a_life_without_a_secret() -> None:
    """Schema 4 added ``secret_digest`` to ``OwnerRegistered``: a life registered before had
    no secret, which reads as ``""`` (no remote call can act for it: it must re-register)."""
    old = msgspec.msgpack.encode(
        {"type": "OwnerRegistered", "owner": "gw", "ttl_s": 30.0, "at": 5.0,
         "incarnation": "a", "replaced": None, "sessions_idle_s": 0.0}
    )  # fmt: skip
    event = decode_event(old, "OwnerRegistered", 3)
    assert event == OwnerRegistered(
        owner="gw", ttl_s=30.0, at=5.0, incarnation="a", sessions_idle_s=0.0
    )
    assert event.secret_digest == ""
    schema_1 = msgspec.msgpack.encode({"type": "OwnerRegistered", "owner": "w", "ttl_s": 5.0,
                                       "at": 1.0})  # fmt: skip
    oldest = decode_event(schema_1, "OwnerRegistered", 1)  # 1 -> 2 -> 3 -> 4
    assert isinstance(oldest, OwnerRegistered) and oldest.secret_digest == ""
    proven = OwnerRegistered(owner="gw", ttl_s=30.0, at=6.0, secret_digest="d" * 64)
    assert decode_event(encode_event(proven), "OwnerRegistered", OwnerRegistered.SCHEMA) == proven


def test_a_schema_1_session_release_reads_as_no_idle_evidence() -> None:
    """Schema 2 added ``last_turn``, ``idle_s`` and ``at`` to ``SessionReleased``: no release
    before it was the ledger's idle release, so they read as None."""
    old = msgspec.msgpack.encode(
        {"type": "SessionReleased", "session": "s", "owner": "w", "version_id": 3,
         "cause": "idle"}
    )  # fmt: skip
    event = decode_event(old, "SessionReleased", 1)
    assert event == SessionReleased(session="s", owner="w", version_id=3, cause="idle")
    assert (event.last_turn, event.idle_s, event.at) == (None, None, None)
    idle = SessionReleased(
        session="s", owner="w", version_id=3, cause="idle", last_turn=1.5, idle_s=60.0, at=70.0
    )
    assert decode_event(encode_event(idle), "SessionReleased", SessionReleased.SCHEMA) == idle
