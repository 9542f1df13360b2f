"""The registry fold, event by event: the exact refusal of every log that breaks the transitions
table or a paired fact, what each event records, what the queries answer, and every state of a
run read back whole from its snapshot.

Written from the mutation campaign's survivors (``python -m tests.mutation.campaign registry``):
each test holds a rule of ``projections/registry.py`` no other fast test read. A violation must
name who (the version or session), its state, the event and why, because a replay that stops
on a forged or buggy log is diagnosed from that one line; the fields an event records are what
``loraledger status`` shows and what a snapshot must carry into the next life.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from evlog.events import (
    AttemptFailed,
    AttemptStarted,
    EnginePrepared,
    EngineReady,
    EngineUnloaded,
    Event,
    FatalResolved,
    PublicationSkipped,
    ReceiptRejected,
    ReclaimAmbiguous,
    ReclaimClaimed,
    SessionBound,
    SessionReleased,
    TransportClaimed,
    TurnFailures,
    VerdictConflict,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)
from projections import invariants, registry
from projections.registry import (
    RegistryState,
    VersionState,
    decode_state,
    encode_state,
    evolve,
)
from projections.status import status_of
from projections.transitions import TransitionViolation
from publisher.core import commands as c
from publisher.core.errors import Code
from tests.publisher.core.book import Book, digest_of

# --- states the impossible events are applied to ----------------------------------------------


def _published_twice() -> Book:
    """v1 RETIRED (session s1 bound to it), v2 PUBLISHED (the default, revision 2)."""
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(2)
    return book


def _loading() -> Book:
    """... and v3 LOADING: attempt 1 started on e0 and e1, not claimed yet."""
    book = _published_twice()
    book.allocate(3)
    return book


def _failed(*, clean: bool) -> Book:
    """... and v3's attempt 1 failed: FAILED_RETRYABLE (absent everywhere) or FAILED_FATAL."""
    book = _loading()
    book.claim(3)
    absent = ("e0", "e1") if clean else ()
    book.run(
        c.FailAttempt(version_id=3, attempt=1, clean=clean, code="X", reason="r", absent_on=absent)
    )
    return book


def _allocated_only() -> RegistryState:
    """v3 allocated and nothing else: the state between an allocation and its AttemptStarted,
    which a replay stopped after the allocation's record (``recover(until=...)``) shows."""
    state = _published_twice().state
    name = state.lora_name(3, digest_of(3))
    evolve(
        state,
        VersionAllocated(version_id=3, digest=digest_of(3), lora_name=name),
        state.last_seq + 1,
    )
    return state


def _released() -> Book:
    book = _published_twice()
    book.run(c.Release(session="s1", owner="w1"))
    return book


def _state(builder: Callable[[], Book]) -> Callable[[], RegistryState]:
    return lambda: builder().state


def _absent(event: Event, name: str) -> tuple[str, Callable[[], RegistryState], Event, str]:
    message = f"version 9 is ABSENT: {name} is impossible (it was never allocated)"
    return (f"{name} of a version never allocated", _state(_published_twice), event, message)


def _not_current(
    event: Event, name: str, builder: Callable[[], Book] = _loading
) -> tuple[str, Callable[[], RegistryState], Event, str]:
    state = "FAILED_FATAL" if builder is not _loading else "LOADING"
    message = f"version 3 is {state}: {name}(attempt 2) is impossible (the current attempt is 1)"
    return (f"{name} of another attempt", _state(builder), event, message)


def _fatal() -> Book:
    return _failed(clean=False)


def _retryable() -> Book:
    return _failed(clean=True)


FLEET = ("e0", "e1")
RECEIPT = {"engine": "e0", "incarnation": "e0-i1"}
READY = {**RECEIPT, "digest": "d", "lora_name": "n"}
LAST = "was the last one allocated or started"
RELEASE_WHY = "a release names the session's binding, once"

VIOLATIONS: list[tuple[str, Callable[[], RegistryState], Event, str]] = [
    # every event that names a version, for a version the log never allocated
    _absent(AttemptStarted(version_id=9, attempt=1, fleet=FLEET), "AttemptStarted"),
    _absent(TransportClaimed(version_id=9, attempt=1, owner="t"), "TransportClaimed"),
    _absent(EnginePrepared(version_id=9, attempt=1, **RECEIPT), "EnginePrepared"),
    _absent(EngineReady(version_id=9, attempt=1, **READY), "EngineReady"),
    _absent(VersionPublished(version_id=9, attempt=1, revision=3, retired=2), "VersionPublished"),
    _absent(
        AttemptFailed(version_id=9, attempt=1, clean=True, code="X", reason="r"), "AttemptFailed"
    ),
    _absent(FatalResolved(version_id=9, attempt=1), "FatalResolved"),
    _absent(VersionRestored(version_id=9, **RECEIPT), "VersionRestored"),
    _absent(ReclaimClaimed(version_id=9), "ReclaimClaimed"),
    _absent(EngineUnloaded(version_id=9, **RECEIPT), "EngineUnloaded"),
    _absent(VersionReclaimed(version_id=9), "VersionReclaimed"),
    _absent(ReclaimAmbiguous(version_id=9, engine="e0", reason="r"), "ReclaimAmbiguous"),
    _absent(SessionBound(session="s9", owner="w1", version_id=9, revision=2), "SessionBound"),
    _absent(SessionReleased(session="s9", owner="w1", version_id=9), "SessionReleased"),
    # a receipt or an ending that names another attempt than the current one
    _not_current(TransportClaimed(version_id=3, attempt=2, owner="t"), "TransportClaimed"),
    _not_current(EnginePrepared(version_id=3, attempt=2, **RECEIPT), "EnginePrepared"),
    _not_current(EngineReady(version_id=3, attempt=2, **READY), "EngineReady"),
    _not_current(
        VersionPublished(version_id=3, attempt=2, revision=3, retired=2), "VersionPublished"
    ),
    _not_current(
        AttemptFailed(version_id=3, attempt=2, clean=True, code="X", reason="r"), "AttemptFailed"
    ),
    _not_current(FatalResolved(version_id=3, attempt=2), "FatalResolved", _fatal),
    # attempts open one after another: 1 with the allocation, then one more per retry
    (
        "the allocation's attempt started as attempt 2",
        _allocated_only,
        AttemptStarted(version_id=3, attempt=2, fleet=FLEET),
        f"version 3 is LOADING: AttemptStarted(attempt 2) is impossible (attempt 1 {LAST})",
    ),
    (
        "attempt 1 started twice",
        _state(_loading),
        AttemptStarted(version_id=3, attempt=1, fleet=FLEET),
        f"version 3 is LOADING: AttemptStarted(attempt 1) is impossible (attempt 1 {LAST})",
    ),
    (
        "a retry that skips an attempt",
        _state(_retryable),
        AttemptStarted(version_id=3, attempt=3, fleet=FLEET),
        "version 3 is FAILED_RETRYABLE: AttemptStarted(attempt 3) is impossible "
        f"(attempt 1 {LAST})",
    ),
    (
        "an attempt of a published version",
        _state(_published_twice),
        AttemptStarted(version_id=2, attempt=2, fleet=FLEET),
        "version 2 is PUBLISHED: AttemptStarted is impossible "
        "(not a transition of the version lifecycle)",
    ),
    # a commit retires exactly the current default and takes the next revision
    (
        "a commit that retires another version than the default",
        _state(_loading),
        VersionPublished(version_id=3, attempt=1, revision=3, retired=1),
        "version 3 is LOADING: VersionPublished(revision 3, retired 1) is impossible "
        "(the default is 2 at revision 2)",
    ),
    (
        "a commit that reuses the default's revision",
        _state(_loading),
        VersionPublished(version_id=3, attempt=1, revision=2, retired=2),
        "version 3 is LOADING: VersionPublished(revision 2, retired 2) is impossible "
        "(the default is 2 at revision 2)",
    ),
    # bindings: once each, released once, a release names the binding
    (
        "a session bound twice",
        _state(_published_twice),
        SessionBound(session="s1", owner="w1", version_id=2, revision=2),
        "session s1 is bound to version 1: SessionBound is impossible (a session binds once)",
    ),
    (
        "a released session bound again",
        _state(_released),
        SessionBound(session="s1", owner="w1", version_id=2, revision=2),
        "session s1 is released: SessionBound is impossible (a session binds once)",
    ),
    (
        "a release of a session never bound that names a version",
        _state(_published_twice),
        SessionReleased(session="ghost", owner="w1", version_id=1),
        f"session ghost is not bound: SessionReleased(1) is impossible ({RELEASE_WHY})",
    ),
    (
        "a release that names another version than the binding",
        _state(_published_twice),
        SessionReleased(session="s1", owner="w1", version_id=2),
        f"session s1 is bound to version 1: SessionReleased(2) is impossible ({RELEASE_WHY})",
    ),
    (
        "a reclaim of a version sessions are bound to",
        _state(_published_twice),
        ReclaimClaimed(version_id=1),
        "version 1 is RETIRED: ReclaimClaimed is impossible (1 sessions bound)",
    ),
]


@pytest.mark.parametrize(
    ("what", "build", "event", "message"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS]
)
def test_an_impossible_log_is_refused_with_who_state_event_and_why(
    what: str, build: Callable[[], RegistryState], event: Event, message: str
) -> None:
    state = build()
    before = encode_state(state)
    with pytest.raises(TransitionViolation) as info:
        evolve(state, event, state.last_seq + 1)
    assert str(info.value) == message, what
    assert encode_state(state) == before, f"{what}: a refused record changed the state"


def test_a_record_out_of_seq_order_names_both_seqs() -> None:
    state = _published_twice().state
    last = state.last_seq
    event = ReclaimClaimed(version_id=9)
    for seq in (last, last + 2):
        with pytest.raises(TransitionViolation) as info:
            evolve(state, event, seq)
        assert str(info.value) == (
            f"the state is at seq {last}: ReclaimClaimed at seq {seq} is impossible "
            "(records apply once each, in seq order)"
        )
    assert state.last_seq == last


# --- what each event records ------------------------------------------------------------------


def test_controller_starts_and_joins_record_what_status_shows() -> None:
    book = Book().bootstrap()
    book.run(c.StartController(code_version="build-7"))
    book.run(c.StartController(code_version="build-8"))
    book.run(
        c.JoinEngine(engine="e2", incarnation="e2-i1", endpoint="http://127.0.0.1:9", kind="sglang")
    )
    state = book.state
    assert (state.epoch, state.code_version) == (2, "build-8")
    status = status_of(state)
    assert status.epoch == 2
    e2 = next(e for e in status.engines if e.engine == "e2")
    assert (e2.incarnation, e2.endpoint, e2.kind, e2.routable) == (
        "e2-i1",
        "http://127.0.0.1:9",
        "sglang",
        False,
    )


def test_an_allocation_alone_opens_attempt_1_of_a_loading_version() -> None:
    """Every single-event prefix of the log is a consistent state (an allocation is followed by
    its AttemptStarted in the same decision, but a replay may stop between the two)."""
    state = RegistryState()
    evolve(state, VersionAllocated(version_id=4, digest="d" * 64, lora_name="n4", size_bytes=1234))
    v = state.versions[4]
    assert (v.state, v.attempt, v.size_bytes, v.fleet, v.lora_name) == (
        VersionState.LOADING,
        1,
        1234,
        (),
        "n4",
    )
    assert invariants.violations(state) == []


def test_receipts_record_the_incarnation_that_sent_them() -> None:
    book = _loading()
    book.ready_all(3)
    v = book.state.versions[3]
    assert v.claimed_by == "trainer"
    assert v.prepared == v.ready == {"e0": "e0-i1", "e1": "e1-i1"}


def test_a_failure_records_its_verdict_and_a_retry_starts_clean() -> None:
    book = _loading()
    book.claim(3)
    book.run(
        c.FailAttempt(
            version_id=3, attempt=1, clean=True, code="LOAD_FAILED", reason="oom", absent_on=FLEET
        )
    )
    v = book.state.versions[3]
    assert (v.state, v.failure_code, v.failure_reason) == (
        VersionState.FAILED_RETRYABLE,
        "LOAD_FAILED",
        "oom",
    )
    assert v.claimed_by is None  # no transport drives an ended attempt
    book.allocate(3)
    v = book.state.versions[3]
    assert (v.state, v.attempt, v.fleet) == (VersionState.LOADING, 2, FLEET)
    assert (v.failure_code, v.failure_reason, v.claimed_by) == (None, None, None)
    assert v.prepared == v.ready == v.confirmed == {}


def test_a_fatal_attempt_collects_absence_proofs_from_its_fleet_only_then_drops_them() -> None:
    book = _fatal()
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))  # joined after the attempt
    book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=()))
    v = book.state.versions[3]
    assert v.confirmed == {}  # e2 was never asked to load it: its absence proves nothing
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    assert v.confirmed == {"e0": "e0-i1"}
    assert book.state.blocked_by() == [3]
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert (v.state, v.confirmed) == (VersionState.FAILED_RETRYABLE, {})
    assert book.state.blocked_by() == []


def test_owners_and_tombstones_record_who_and_when() -> None:
    book = _published_twice()
    book.run(c.RegisterOwner(owner="w2", ttl_s=5.0, now=12.5))
    owner = book.state.owners["w2"]
    assert (owner.ttl_s, owner.registered_at, owner.expired) == (5.0, 12.5, False)
    book.run(c.Release(session="s1", owner="w1"))
    assert book.state.tombstones == {"s1": "w1"}  # who closed it, for the audit


def test_refused_publications_and_rejected_receipts_are_counted() -> None:
    book = Book().bootstrap(capacity=3)
    book.publish(2)
    for _ in range(2):  # a rollback refused twice: both asks are on record
        book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.VERSION_REGRESSION)
    book.allocate(3)
    name = book.state.versions[3].lora_name
    ready = c.RecordReady(
        version_id=3,
        attempt=1,
        engine="e0",
        incarnation="e0-i1",
        digest=digest_of(3),
        lora_name=name,
    )
    for _ in range(3):  # READY before any claim: rejected and recorded, each time
        book.refuse(ready, Code.RECEIPT_OUT_OF_ORDER)
    book.claim(3)
    book.run(c.FailAttempt(version_id=3, attempt=1, clean=False, code="LOAD_TIMEOUT", reason="r"))
    clean_report = c.FailAttempt(
        version_id=3, attempt=1, clean=True, code="GONE", reason="g", absent_on=("e0", "e1")
    )
    for _ in range(2):  # a clean verdict about a fatal attempt: recorded, not applied, twice
        book.refuse(clean_report, Code.VERDICT_CONFLICT)
    state = book.state
    assert (state.skipped, state.rejected_receipts, state.verdict_conflicts) == (2, 3, 2)
    assert len([e for e in book.events if isinstance(e, PublicationSkipped)]) == 2
    assert len([e for e in book.events if isinstance(e, ReceiptRejected)]) == 3
    assert len([e for e in book.events if isinstance(e, VerdictConflict)]) == 2


def test_forgetting_some_sessions_keeps_the_others_closed() -> None:
    book = _published_twice()
    book.run(c.Bind(session="s2", owner="w1"))
    for session in ("s1", "s2"):
        book.run(c.Release(session=session, owner="w1"))
    book.run(c.Forget(sessions=("s1",)))
    assert book.state.tombstones == {"s2": "w1"}
    book.refuse(c.Bind(session="s2", owner="w1"), Code.SESSION_CLOSED)
    book.run(c.Forget(sessions=("s2",)))
    assert book.state.tombstones == {}


# --- queries ----------------------------------------------------------------------------------


def test_needed_versions_are_the_default_and_the_bound_ones_only() -> None:
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    book.publish(2)
    book.run(c.Bind(session="s1", owner="w1"))  # on v2
    book.publish(3)
    states = {vid: v.state for vid, v in book.state.versions.items()}
    assert states == {1: VersionState.RETIRED, 2: VersionState.RETIRED, 3: VersionState.PUBLISHED}
    assert book.state.needed_versions() == [2, 3]  # v1 is retired and nobody is bound to it


def test_a_version_is_found_by_its_engine_side_name_only() -> None:
    """How the reconciler reads an inventory: a name the ledger allocated maps to its version,
    any other name (a stray) to nothing."""
    state = _published_twice().state
    for version_id in (1, 2):
        found = state.version_by_name(state.versions[version_id].lora_name)
        assert found is not None and found.version_id == version_id
    assert state.version_by_name(state.lora_name(3, digest_of(3))) is None


def _retired_twice() -> Book:
    """v1 RETIRED with no session bound (reclaimable), v2 PUBLISHED; engines e0, e1, and e2,
    which joined after both publications and holds neither."""
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    book.publish(2)
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))
    return book


def test_a_reclaim_blocks_publication_only_once_ambiguous_and_ends_unambiguous() -> None:
    book = _retired_twice()
    v1 = book.state.versions[1]
    book.run(c.ClaimReclaim(version_id=1))
    assert (v1.state, v1.ambiguous, book.state.blocked_by()) == (VersionState.RECLAIMING, False, [])
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason="unload timed out"))
    assert (v1.ambiguous, book.state.blocked_by()) == (True, [1])
    for engine in ("e0", "e1", "e2"):
        book.run(c.RecordUnloaded(version_id=1, engine=engine, incarnation=f"{engine}-i1"))
    assert (v1.state, v1.ambiguous, book.state.blocked_by()) == (VersionState.RECLAIMED, False, [])


def test_each_unload_proof_drops_the_name_from_that_engine_at_once() -> None:
    book = _retired_twice()
    name = book.state.versions[1].lora_name
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e2", incarnation="e2-i1"))  # never held it
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert book.state.holders(name, routable_only=False) == ("e1",)
    assert book.state.versions[1].confirmed == {"e2": "e2-i1", "e0": "e0-i1"}


def test_an_inventory_proves_absence_for_a_reclaim_and_only_for_versions_awaiting_proof() -> None:
    book = _retired_twice()
    v1, v2 = book.state.versions[1], book.state.versions[2]
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e2", incarnation="e2-i1"))
    # e0 lost everything (the reconciler will restore v2): that proves v1 absent there, and
    # says nothing about v2, whose absence nobody is waiting for
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    assert v1.confirmed == {"e2": "e2-i1", "e0": "e0-i1"}
    assert v2.confirmed == {}
    outcome = book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    assert outcome.reclaimed and v1.state is VersionState.RECLAIMED


def test_a_reclaim_recorded_without_every_unload_still_leaves_no_holder() -> None:
    """A log written by other code (an older decider, a repair by hand) may complete a reclaim
    the current decider would not have: the fold still makes "reclaimed" mean gone from every
    engine, the invariant that no engine holds a RECLAIMED version."""
    book = _retired_twice()
    name = book.state.versions[1].lora_name
    book.run(c.ClaimReclaim(version_id=1))
    state = book.state
    evolve(state, VersionReclaimed(version_id=1), state.last_seq + 1)
    assert state.holders(name, routable_only=False) == ()
    assert invariants.violations(state) == []


# --- snapshots --------------------------------------------------------------------------------


def _eventful_run() -> list[Event]:
    """A run that applies every event type the fold knows, with non-default values in each
    field: v2 published, retired and reclaimed (ambiguously first), v3 the default, v4 failed
    fatally and resolved, v1 a refused rollback; an engine restarted, repaired and one left."""
    book = Book().bootstrap(capacity=3, engines=("e0", "e1"))
    book.run(c.StartController(code_version="build-1", command_id="start-1"))
    book.run(c.ConfigureDeployment(max_staleness=2))
    book.run(
        c.JoinEngine(engine="e2", incarnation="e2-i1", endpoint="http://127.0.0.1:7", kind="vllm")
    )
    book.run(c.Allocate(version_id=2, digest=digest_of(2), size_bytes=4096))
    book.ready_all(2)
    book.run(c.Commit(version_id=2, attempt=1))
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(3)
    book.run(c.Release(session="s1", owner="w1"))
    book.run(c.Forget(sessions=("s1",)))
    book.run(c.Release(session="early", owner="w1"))  # closed before it ever bound
    book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.VERSION_REGRESSION)
    v3 = book.state.versions[3].lora_name
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=("agent@dep-99-x",)))
    book.run(c.RestoreVersion(version_id=3, engine="e0", incarnation="e0-i2"))
    # the stray must be gone before the repair (a routable engine holds only what is wanted)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=(v3,)))
    book.run(c.RepairEngine(engine="e0", incarnation="e0-i2"))
    book.run(c.ClaimReclaim(version_id=2))
    book.run(c.MarkReclaimAmbiguous(version_id=2, engine="e1", reason="timed out"))
    for engine, incarnation in (("e0", "e0-i2"), ("e1", "e1-i1"), ("e2", "e2-i1")):
        book.run(c.RecordUnloaded(version_id=2, engine=engine, incarnation=incarnation))
    book.allocate(4)
    v4 = book.state.versions[4].lora_name
    echo = c.RecordReady(
        version_id=4, attempt=1, engine="e0", incarnation="e0-i2", digest=digest_of(4), lora_name=v3
    )
    book.refuse(echo, Code.READY_MISMATCH)  # echoes another version's name
    book.claim(4)
    book.run(
        c.RecordPrepared(
            version_id=4,
            attempt=1,
            engine="e0",
            incarnation="e0-i2",
            digest=digest_of(4),
            lora_name=v4,
        )
    )
    book.run(c.FailAttempt(version_id=4, attempt=1, clean=False, code="LOAD_TIMEOUT", reason="r"))
    book.refuse(
        c.FailAttempt(
            version_id=4, attempt=1, clean=True, code="GONE", reason="g", absent_on=("e0", "e1")
        ),
        Code.VERDICT_CONFLICT,
    )
    book.refuse(c.Allocate(version_id=5, digest=digest_of(5)), Code.PUBLICATION_BLOCKED)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=(v3,)))
    # e1 suspended: v4 resolves on e0's proof alone, and e1 owes the drop until its inventory
    book.run(c.SuspendEngine(engine="e1", cause="unhealthy", detail="probes failed"))
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=(v3,)))
    book.run(c.ResumeEngine(engine="e1", cause="unhealthy"))
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i1"))
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=()))  # v3 lost there
    book.run(c.RestoreVersion(version_id=3, engine="e0", incarnation="e0-i2"))
    # e0's canary baseline for v3, then other weights under v3's name there: out of routing
    # while present, then restored
    book.run(c.CheckCanary(engine="e0", incarnation="e0-i2", version_id=3, answer="5,6"))
    impostor = ((v3, digest_of("other")),)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=(v3,), digests=impostor))
    book.run(c.RestoreVersion(version_id=3, engine="e0", incarnation="e0-i2"))
    book.run(c.RegisterOwner(owner="w2", ttl_s=1.0, now=5.0))
    book.run(c.Bind(session="s2", owner="w2"))
    book.run(c.ExpireOwner(owner="w2", now=9.0, last_seen=5.0))
    # owner incarnations: a restart releases the predecessor's session, a clean exit the rest
    book.run(c.RegisterOwner(owner="w3", ttl_s=60.0, now=10.0, incarnation="a"))
    book.run(c.Bind(session="s3", owner="w3", incarnation="a"))
    book.run(c.RegisterOwner(owner="w3", ttl_s=60.0, now=11.0, incarnation="b"))
    book.run(c.Bind(session="s4", owner="w3", incarnation="b"))
    book.run(c.DeregisterOwner(owner="w3", now=12.0, incarnation="b"))
    # an outage of e1: opened, its sessions' failures counted, ended by a probe that answered
    book.run(
        c.ReportUnreachable(
            engine="e1", incarnation="e1-i1", at=13.0, error="E: x", source="probe", reporter="r"
        )
    )
    failures = (TurnFailures(session="s4", not_run=2, ambiguous=1),)
    book.run(c.CountDispatchFailures(engine="e1", incarnation="e1-i1", failures=failures))
    book.run(c.ReportReachable(engine="e1", incarnation="e1-i1", at=14.5))
    book.run(c.LeaveEngine(engine="e2"))
    return book.events


def test_every_state_of_a_run_reads_back_from_its_snapshot() -> None:
    """A snapshot (``encode_state``) of the state after any record decodes to that state, and
    the fold continued from it ends where the fold from the start ends: a new life that starts
    from a snapshot sees what a full replay sees. The run reaches every event type the fold
    applies, so a field recorded with the wrong type (``None`` for a count) fails here."""
    events = _eventful_run()
    assert {type(e) for e in events} == set(registry._APPLY)  # every event the fold applies
    end = RegistryState()
    for seq, event in enumerate(events, 1):
        evolve(end, event, seq)
    state = RegistryState()
    for seq, event in enumerate(events, 1):
        evolve(state, event, seq)
        assert invariants.violations(state) == [], (seq, type(event).__name__)
        restored = decode_state(encode_state(state))
        assert restored == state, (seq, type(event).__name__)
        for later, rest in enumerate(events[seq:], seq + 1):
            evolve(restored, rest, later)
        assert encode_state(restored) == encode_state(end), (seq, type(event).__name__)


# --- written from the mutation rerun over the engine-health fold ------------------------------


def test_the_fold_withdraws_a_proof_when_the_adapter_is_seen_again() -> None:
    book = _published_twice()
    book.run(c.Release(session="s1", owner="w1"))
    book.run(c.ClaimReclaim(version_id=1))
    v2 = book.state.versions[2].lora_name
    v1 = book.state.versions[1].lora_name
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(v2,)))
    assert book.state.versions[1].confirmed == {"e0": "e0-i1"}
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(v1, v2)))
    assert book.state.versions[1].confirmed == {}


def test_a_reclaimed_version_is_no_longer_lacking_anywhere() -> None:
    """A member that lost a retired version lacks it until restored; once the version is
    reclaimed there is nothing to restore, so the lack goes with it."""
    book = _published_twice()
    v1, v2 = (book.state.versions[v].lora_name for v in (1, 2))
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(v2,)))
    assert book.state.engines["e0"].lacks == {v1: 1}  # needed: s1 is bound to it
    book.run(c.Release(session="s1", owner="w1"))
    book.reclaim(1)
    assert book.state.versions[1].state is VersionState.RECLAIMED
    assert book.state.engines["e0"].lacks == {}


def test_a_suspended_member_that_proved_the_candidate_absent_owes_nothing() -> None:
    book = Book().bootstrap(capacity=3, engines=("e0", "e1", "e2"))
    book.publish(1)
    book.allocate(2)
    book.claim(2)
    book.run(c.SuspendEngine(engine="e2", cause="unhealthy"))
    book.run(c.SuspendEngine(engine="e1", cause="unhealthy"))
    book.run(
        c.FailAttempt(
            version_id=2, attempt=1, clean=True, code="X", reason="r", absent_on=("e0", "e2")
        )
    )
    assert book.state.versions[2].state is VersionState.FAILED_RETRYABLE
    name = book.state.versions[2].lora_name
    assert book.state.engines["e2"].owes == {}  # proved it absent
    assert book.state.engines["e1"].owes == {name: 1}  # gave no proof
