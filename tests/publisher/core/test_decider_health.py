"""Engine health in the decider: suspension, resumption, removal, lost adapters and the
write-only-changes rule for inventories (docs/state-machine.md, "Engine health").

Every rule is driven through :class:`Book` (decide + evolve, invariants checked after every
step), so each test also proves the folded state stays lawful: a suspended engine is never
routable, a routable one holds every needed version it took part in or has it recorded lost.
"""

from __future__ import annotations

import pytest

from evlog.errors import LoraLedgerError
from evlog.events import (
    AdapterLost,
    CanaryRecorded,
    EngineLeft,
    EngineRepaired,
    EngineResumed,
    EngineSuspended,
    FatalResolved,
    InventoryObserved,
    ServedContentMismatch,
    VersionReclaimed,
)
from projections.registry import VersionState
from publisher.core import commands as c
from publisher.core.errors import Code
from tests.publisher.core.book import Book

ENGINES = ("e0", "e1", "e2")


def _fleet() -> Book:
    book = Book().bootstrap(capacity=4, engines=ENGINES)
    book.publish(1)
    return book


def _suspend(book: Book, engine: str, cause: str = "unhealthy") -> list[object]:
    before = len(book.events)
    book.run(c.SuspendEngine(engine=engine, cause=cause, detail="probes failed for 5.0 s"))
    return list(book.events[before:])


def _inventory(book: Book, engine: str, *versions: int) -> list[object]:
    before = len(book.events)
    names = tuple(book.state.versions[v].lora_name for v in versions)
    book.run(
        c.ObserveInventory(engine=engine, incarnation=book.incarnation(engine), adapters=names)
    )
    return list(book.events[before:])


def test_a_suspended_engine_leaves_routing_at_once_and_once() -> None:
    book = _fleet()
    name = book.state.versions[1].lora_name
    events = _suspend(book, "e2")
    assert events == [
        EngineSuspended(
            engine="e2", incarnation="e2-i1", cause="unhealthy", detail="probes failed for 5.0 s"
        )
    ]
    assert book.state.holders(name) == ("e0", "e1")
    assert book.state.routable_engines() == ("e0", "e1")
    assert _suspend(book, "e2", cause="operator") == []  # already suspended: no-op


def test_publication_commits_on_the_active_engines_when_a_member_is_suspended_mid_attempt() -> None:
    book = _fleet()
    allocated = book.allocate(2)
    assert allocated.fleet == ENGINES
    v = book.state.versions[2]
    book.claim(2)
    for engine in ("e0", "e1"):
        for receipt in (c.RecordPrepared, c.RecordReady):
            book.run(receipt(version_id=2, attempt=1, engine=engine, incarnation=f"{engine}-i1",
                             digest=v.digest, lora_name=v.lora_name))  # fmt: skip
    book.refuse(c.Commit(version_id=2, attempt=1), Code.NOT_READY)  # e2 still waited for
    _suspend(book, "e2")
    published = book.run(c.Commit(version_id=2, attempt=1))
    assert published.version_id == 2 and book.state.default == 2
    # the next allocation's fleet is the active, routable engines
    assert book.allocate(3).fleet == ("e0", "e1")


def test_a_fatal_attempt_waits_only_for_the_active_engines_and_the_suspended_one_owes_it() -> None:
    book = _fleet()
    book.allocate(2)
    book.claim(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="e2 hung"))
    _inventory(book, "e0", 1)
    _inventory(book, "e1", 1)
    assert book.state.versions[2].state is VersionState.FAILED_FATAL  # e2 never proved absence
    events = _suspend(book, "e2")
    assert isinstance(events[0], EngineSuspended)
    assert events[1:] == [FatalResolved(version_id=2, attempt=1, owed_by=("e2",))]
    name = book.state.versions[2].lora_name
    assert book.state.engines["e2"].owes == {name: 1}
    assert book.state.blocked_by() == []
    book.publish(3)  # publication goes on with e2 suspended
    # e2 comes back: it must drop what it owes before it may serve again
    book.run(c.RestoreVersion(version_id=3, engine="e2", incarnation="e2-i1"))
    book.refuse(c.RepairEngine(engine="e2", incarnation="e2-i1"), Code.NOT_READY)
    _inventory(book, "e2", 1, 3)
    assert book.state.engines["e2"].owes == {}
    book.run(c.RepairEngine(engine="e2", incarnation="e2-i1"))
    assert book.state.engines["e2"].routable and not book.state.engines["e2"].suspended


def test_a_clean_failure_ends_on_the_active_engines_proofs() -> None:
    book = _fleet()
    book.allocate(2)
    _suspend(book, "e2")
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=True, code="REFUSED", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    v = book.state.versions[2]
    assert v.state is VersionState.FAILED_RETRYABLE
    assert book.state.engines["e2"].owes == {v.lora_name: 1}


def test_reclaim_confirms_on_the_active_engines_and_records_what_the_suspended_one_owes() -> None:
    book = _fleet()
    book.publish(2)
    _suspend(book, "e2")
    granted = book.run(c.ClaimReclaim(version_id=1))
    assert granted.engines == ("e0", "e1")
    for engine in ("e0", "e1"):
        book.run(c.RecordUnloaded(version_id=1, engine=engine, incarnation=f"{engine}-i1"))
    assert book.events[-1] == VersionReclaimed(version_id=1, owed_by=("e2",))
    assert book.state.engines["e2"].owes == {book.state.versions[1].lora_name: 1}


def test_suspending_the_last_engine_a_reclaim_waits_for_completes_it() -> None:
    book = _fleet()
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    for engine in ("e0", "e1"):
        book.run(c.RecordUnloaded(version_id=1, engine=engine, incarnation=f"{engine}-i1"))
    assert book.state.versions[1].state is VersionState.RECLAIMING
    events = _suspend(book, "e2")
    assert events[1:] == [VersionReclaimed(version_id=1, owed_by=("e2",))]


def test_an_operator_suspension_is_lifted_only_by_an_operator_then_a_repair() -> None:
    book = _fleet()
    _suspend(book, "e1", cause="operator")
    book.refuse(c.RepairEngine(engine="e1", incarnation="e1-i1"), Code.ENGINE_SUSPENDED)
    book.refuse(c.ResumeEngine(engine="e1", cause="unhealthy"), Code.ENGINE_SUSPENDED)
    book.run(c.ResumeEngine(engine="e1"))
    assert book.events[-1] == EngineResumed(engine="e1", incarnation="e1-i1", cause="operator")
    assert not book.state.engines["e1"].routable  # not before the repair
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i1"))
    assert book.events[-1] == EngineRepaired(engine="e1", incarnation="e1-i1")
    assert book.state.engines["e1"].routable
    assert book.run(c.ResumeEngine(engine="e1")).no_op


def test_an_automatic_suspension_ends_with_the_repair() -> None:
    book = _fleet()
    _suspend(book, "e1", cause="unhealthy")
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i1"))
    member = book.state.engines["e1"]
    assert member.routable and not member.suspended and member.suspend_cause == ""


def test_suspension_checks_its_input() -> None:
    book = _fleet()
    book.refuse(c.SuspendEngine(engine="nope", cause="operator"), Code.UNKNOWN_ENGINE)
    book.refuse(c.SuspendEngine(engine="e0", cause="bored"), Code.INVALID_INPUT)
    book.refuse(
        c.SuspendEngine(engine="e0", cause="unhealthy", incarnation="e0-old"),
        Code.ENGINE_RESTARTED,
    )
    book.refuse(c.RemoveEngine(engine="e0", cause="bored"), Code.INVALID_INPUT)


def test_an_operator_removal_is_recorded_with_its_cause_and_frees_what_waited_for_it() -> None:
    book = _fleet()
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    for engine in ("e0", "e1"):
        book.run(c.RecordUnloaded(version_id=1, engine=engine, incarnation=f"{engine}-i1"))
    before = len(book.events)
    book.run(c.RemoveEngine(engine="e2"))
    assert book.events[before:] == [
        EngineLeft(engine="e2", cause="operator"),
        VersionReclaimed(version_id=1),  # a removed engine owes nothing: it is gone
    ]
    assert book.run(c.RemoveEngine(engine="e2")).no_op


def test_an_inventory_equal_to_what_the_ledger_knows_is_not_written() -> None:
    book = _fleet()
    assert _inventory(book, "e0", 1) == []
    outcome = book.run(
        c.ObserveInventory(
            engine="e0", incarnation="e0-i1", adapters=(book.state.versions[1].lora_name,)
        )
    )
    assert outcome.no_op
    stray = _fleet().state.lora_name(9, "f" * 64)
    events = book.run(
        c.ObserveInventory(
            engine="e0",
            incarnation="e0-i1",
            adapters=(book.state.versions[1].lora_name, stray),
        )
    )
    assert events.strays == (stray,) and not events.no_op
    assert isinstance(book.events[-1], InventoryObserved)


def test_an_inventory_that_proves_a_reclaim_is_written_even_when_holds_do_not_change() -> None:
    book = _fleet()
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    # e0's inventory shows only version 2: the ledger already knew it held 1 and 2, so the
    # proof of 1's absence is a change
    events = _inventory(book, "e0", 2)
    assert [type(e) for e in events] == [InventoryObserved]
    assert "e0" in book.state.versions[1].confirmed


def test_a_lost_adapter_is_one_incident_and_routing_stops_sending_the_version_there() -> None:
    book = _fleet()
    book.publish(2)
    book.run(c.RegisterOwner(owner="w2", ttl_s=10.0, now=0.0))
    book.run(c.Bind(session="s", owner="w1"))  # bound to 2
    book.publish(3)  # 2 RETIRED but needed (bound), 3 the default
    name2, name3 = (book.state.versions[v].lora_name for v in (2, 3))
    events = _inventory(book, "e1", 2)  # e1 lost the default
    assert events[0] == AdapterLost(version_id=3, engine="e1", incarnation="e1-i1")
    assert isinstance(events[1], InventoryObserved) and len(events) == 2
    assert book.state.holders(name3) == ("e0", "e2")
    assert book.state.holders(name2) == ("e0", "e1", "e2")  # the rest still served there
    assert book.state.engines["e1"].lacks == {name3: 3}
    assert _inventory(book, "e1", 2) == []  # the same inventory again: nothing new
    book.run(c.RestoreVersion(version_id=3, engine="e1", incarnation="e1-i1"))
    assert book.state.holders(name3) == ENGINES
    assert book.state.engines["e1"].lacks == {}


def test_an_unneeded_version_missing_is_no_incident() -> None:
    book = _fleet()
    book.publish(2)  # 1 RETIRED, nobody bound: not needed
    events = _inventory(book, "e0", 2)
    assert [type(e) for e in events] == [InventoryObserved]


def test_a_suspended_engine_losing_versions_is_no_incident_its_repair_reloads_them() -> None:
    book = _fleet()
    _suspend(book, "e2")
    events = _inventory(book, "e2")
    assert [type(e) for e in events] == [InventoryObserved]
    book.refuse(c.RepairEngine(engine="e2", incarnation="e2-i1"), Code.NOT_READY)


def test_a_repair_is_refused_while_the_engine_holds_a_stray() -> None:
    book = _fleet()
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    book.run(c.RestoreVersion(version_id=1, engine="e0", incarnation="e0-i2"))
    stray = book.state.lora_name(7, "a" * 64)
    names = (book.state.versions[1].lora_name, stray)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i2", adapters=names))
    book.refuse(c.RepairEngine(engine="e0", incarnation="e0-i2"), Code.NOT_READY)
    _inventory(book, "e0", 1)
    book.run(c.RepairEngine(engine="e0", incarnation="e0-i2"))


def test_a_ready_engine_whose_inventory_then_lacks_the_candidate_lost_it_at_commit() -> None:
    """READY, then an inventory without the candidate (lost, or read before the load landed),
    then the commit: the engine is recorded as having lost the version (routing keeps away,
    the reconciler restores it), never left routable as a holder it is not."""
    book = Book().bootstrap(engines=("e0",))
    book.allocate(1)
    book.ready_all(1)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    book.run(c.Commit(version_id=1, attempt=1))
    assert book.events[-1] == AdapterLost(version_id=1, engine="e0", incarnation="e0-i1")
    assert book.state.holders(book.state.versions[1].lora_name) == ()
    assert book.state.engines["e0"].lacks == {book.state.versions[1].lora_name: 1}


# --- written from the mutation rerun over the engine-health functions --------------------------


def test_suspension_checks_the_incarnation_it_names_and_caps_its_detail() -> None:
    """A probe's suspension names the life it saw fail: a stale one is refused (a restarted
    engine is judged afresh), the current one is accepted; the detail a person reads is kept
    to 2,000 characters, and a second suspension is a no-op that writes nothing."""
    book = _fleet()
    book.refuse(
        c.SuspendEngine(engine="e2", cause="unhealthy", incarnation="e2-i0"),
        Code.ENGINE_RESTARTED,
    )
    book.run(
        c.SuspendEngine(engine="e2", cause="unhealthy", detail="x" * 3000, incarnation="e2-i1")
    )
    event = book.events[-1]
    assert isinstance(event, EngineSuspended) and event.detail == "x" * 2000
    before = len(book.events)
    assert book.run(c.SuspendEngine(engine="e2", cause="operator")).no_op is True
    assert len(book.events) == before
    assert book.state.engines["e2"].suspend_cause == "unhealthy"


def test_a_bad_cause_is_refused_naming_the_field() -> None:
    book = _fleet()
    for command in (
        c.SuspendEngine(engine="e2", cause="bored"),
        c.ResumeEngine(engine="e2", cause="bored"),
        c.RemoveEngine(engine="e2", cause="unhealthy"),
    ):
        with pytest.raises(LoraLedgerError) as info:
            book.run(command)
        assert info.value.code == Code.INVALID_INPUT
        assert info.value.details == {"field": "cause"}


def test_a_resumption_records_its_cause_and_clears_the_suspension() -> None:
    book = _fleet()
    _suspend(book, "e2", cause="unhealthy")
    book.run(c.ResumeEngine(engine="e2", cause="unhealthy"))
    assert book.events[-1] == EngineResumed(engine="e2", incarnation="e2-i1", cause="unhealthy")
    member = book.state.engines["e2"]
    assert (member.suspended, member.suspend_cause, member.routable) == (False, "", False)
    assert book.state.active_engines() == set(ENGINES)


def test_an_operators_suspension_is_lifted_only_by_an_operator_naming_the_engine() -> None:
    book = _fleet()
    _suspend(book, "e2", cause="operator")
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.ResumeEngine(engine="e2", cause="unhealthy"))
    assert info.value.code == Code.ENGINE_SUSPENDED
    assert info.value.details == {"engine": "e2"}
    assert book.state.engines["e2"].suspended is True


def test_an_engine_removed_by_the_fleet_records_that_cause() -> None:
    book = _fleet()
    book.run(c.RemoveEngine(engine="e2", cause="fleet"))
    assert book.events[-1] == EngineLeft(engine="e2", cause="fleet")
    assert "e2" not in book.state.engines


def test_a_repair_names_the_operators_suspension_and_what_must_be_dropped_first() -> None:
    book = _fleet()
    _suspend(book, "e2", cause="operator")
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.RepairEngine(engine="e2", incarnation="e2-i1"))
    assert (info.value.code, info.value.details) == (Code.ENGINE_SUSPENDED, {"engine": "e2"})
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    stray = "agent@dep-99-x"
    v1 = book.state.versions[1].lora_name
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i2", adapters=(v1, stray)))
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.RepairEngine(engine="e1", incarnation="e1-i2"))
    assert (info.value.code, info.value.details) == (Code.NOT_READY, {"unwanted": [stray]})
    assert book.state.engines["e1"].routable is False


def test_a_fatal_entry_resolved_by_inventory_owes_only_where_the_candidate_can_be() -> None:
    """A suspended member owes a fatal candidate's drop only if it took part in the attempt or
    is known to hold the name: e3 (joined after, never showed it) owes nothing, e2 (its
    inventory listed the candidate) owes it."""
    book = _fleet()
    for engine in ("e3",):
        book.run(c.JoinEngine(engine=engine, incarnation=f"{engine}-i1"))  # not routable
    book.allocate(2)  # fleet e0, e1, e2
    book.claim(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="X", reason="r"))
    v1, v2 = (book.state.versions[v].lora_name for v in (1, 2))
    book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=(v1, v2)))
    _suspend(book, "e2")
    _suspend(book, "e3")
    _inventory(book, "e0", 1)
    events = _inventory(book, "e1", 1)
    assert events[-1] == FatalResolved(version_id=2, attempt=1, owed_by=("e2",))
    assert book.state.engines["e2"].owes == {v2: 1}
    assert book.state.engines["e3"].owes == {}


def test_a_reclaim_completed_by_inventory_records_every_suspended_member_as_owing() -> None:
    """A reclaim needs every member's proof, so every suspended member that gave none owes the
    drop, in the attempt's fleet or not; an inventory that shows exactly the owed name again,
    and nothing else new, writes nothing."""
    book = _fleet()
    book.publish(2)
    book.run(c.JoinEngine(engine="e3", incarnation="e3-i1"))  # joined after both versions
    _suspend(book, "e2")
    _suspend(book, "e3")
    book.run(c.ClaimReclaim(version_id=1))
    _inventory(book, "e0", 2)
    events = _inventory(book, "e1", 2)
    assert events[-1] == VersionReclaimed(version_id=1, owed_by=("e2", "e3"))
    v1 = book.state.versions[1].lora_name
    assert book.state.engines["e2"].owes == {v1: 1}
    assert len(_inventory(book, "e2", 1)) == 1  # the owed name still there: recorded once
    assert _inventory(book, "e2", 1) == []
    assert book.state.engines["e2"].owes == {v1: 1}


def test_a_proof_renewed_by_a_new_incarnation_is_recorded() -> None:
    """A member that proved a reclaimed name absent, restarted, and shows the same inventory
    in its new life: the proof now stands for the new incarnation, so the inventory is
    written although the names are the same."""
    book = _fleet()
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    _inventory(book, "e0", 2)
    assert book.state.versions[1].confirmed == {"e0": "e0-i1"}
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    events = _inventory(book, "e0")  # holds nothing: the same as after the restart
    assert [type(e) for e in events] == [InventoryObserved]
    assert book.state.versions[1].confirmed == {"e0": "e0-i2"}
    assert _inventory(book, "e0") == []


def test_an_inventory_that_proves_one_reclaim_of_several_is_recorded() -> None:
    """e2 joined after v1 and v2 (it never held them). Its inventory already proved v2 absent;
    the same inventory after v1's reclaim claim is a new proof for v1 only, and must be written
    although nothing changes for the later version."""
    book = Book().bootstrap(capacity=5)
    book.publish(1)
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))  # member, not routable
    book.publish(2)
    book.publish(3)
    book.run(c.ClaimReclaim(version_id=2))
    assert [type(e) for e in _inventory(book, "e2")] == [InventoryObserved]
    book.run(c.ClaimReclaim(version_id=1))
    assert [type(e) for e in _inventory(book, "e2")] == [InventoryObserved]
    assert book.state.versions[1].confirmed == {"e2": "e2-i1"}
    assert _inventory(book, "e2") == []


def test_a_reclaim_claimed_while_every_member_is_suspended_completes_owed_by_all() -> None:
    book = _fleet()
    book.publish(2)
    for engine in ENGINES:
        _suspend(book, engine)
    book.run(c.ClaimReclaim(version_id=1))
    assert book.events[-1] == VersionReclaimed(version_id=1, owed_by=ENGINES)
    name = book.state.versions[1].lora_name
    assert all(book.state.engines[e].owes == {name: 1} for e in ENGINES)


# --- served content: a committed name reported with another digest --------------------------


def _inventory_with_digests(book: Book, engine: str, digests: dict[int, str]) -> list[object]:
    before = len(book.events)
    names = {book.state.versions[v].lora_name: d for v, d in digests.items()}
    book.run(
        c.ObserveInventory(
            engine=engine,
            incarnation=book.incarnation(engine),
            adapters=tuple(sorted(names)),
            digests=tuple(sorted(names.items())),
        )
    )
    return list(book.events[before:])


def test_other_content_under_a_committed_name_is_one_incident_and_leaves_routing() -> None:
    """An engine listing the default's name with another digest serves other weights under it:
    recorded once (expected and seen digests), that engine stops serving the version while
    the name stays present, and only a restore brings it back; its repair is refused
    meanwhile (the version counts as missing there)."""
    book = _fleet()
    v1 = book.state.versions[1]
    other = "0" * 64
    events = _inventory_with_digests(book, "e1", {1: other})
    assert events[0] == ServedContentMismatch(
        version_id=1,
        engine="e1",
        incarnation="e1-i1",
        evidence="digest",
        expected=v1.digest,
        seen=other,
    )
    assert len(events) == 2 and isinstance(events[1], InventoryObserved)
    assert book.state.holders(v1.lora_name) == ("e0", "e2")
    assert book.state.engines["e1"].lacks == {v1.lora_name: 1}
    assert book.state.engines["e1"].strays == ()  # a committed name: repaired, not unloaded
    assert _inventory_with_digests(book, "e1", {1: other}) == []  # the same again: nothing
    assert _inventory(book, "e1", 1) == []  # no digest reported: proves nothing either way
    assert book.state.holders(v1.lora_name) == ("e0", "e2")
    book.run(c.RestoreVersion(version_id=1, engine="e1", incarnation="e1-i1"))
    assert book.state.holders(v1.lora_name) == ENGINES
    assert book.state.engines["e1"].mismatched == {}
    assert _inventory_with_digests(book, "e1", {1: v1.digest}) == []


def test_the_right_digest_is_no_incident_and_a_mismatch_on_a_restarted_engine_blocks_repair() -> (
    None
):
    book = _fleet()
    v1 = book.state.versions[1]
    assert _inventory_with_digests(book, "e0", {1: v1.digest}) == []
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    events = _inventory_with_digests(book, "e0", {1: "1" * 64})
    assert [type(e) for e in events] == [ServedContentMismatch, InventoryObserved]
    assert v1.lora_name not in book.state.engines["e0"].holds
    book.refuse(c.RepairEngine(engine="e0", incarnation="e0-i2"), Code.NOT_READY)
    # the name gone from the engine ends the mismatch: it is simply missing, restored as such
    _inventory(book, "e0")
    assert book.state.engines["e0"].mismatched == {}
    book.run(c.RestoreVersion(version_id=1, engine="e0", incarnation="e0-i2"))
    book.run(c.RepairEngine(engine="e0", incarnation="e0-i2"))
    assert book.state.holders(v1.lora_name) == ENGINES


def test_a_canary_answer_is_a_baseline_once_then_a_differing_one_is_an_incident() -> None:
    """The first answer of an engine life to a held version's canary is recorded as its
    baseline; the same answer again writes nothing; another answer is other content under the
    name (evidence ``canary``), out of routing there; a restart forgets the baseline."""
    book = _fleet()
    v1 = book.state.versions[1]

    def answer(text: str, engine: str = "e1") -> list[object]:
        before = len(book.events)
        check = c.CheckCanary(
            engine=engine, incarnation=book.incarnation(engine), version_id=1, answer=text
        )
        book.run(check)
        return list(book.events[before:])

    assert answer("5,6,7") == [
        CanaryRecorded(version_id=1, engine="e1", incarnation="e1-i1", answer="5,6,7")
    ]
    assert answer("5,6,7") == []
    assert answer("9,9,9") == [
        ServedContentMismatch(
            version_id=1,
            engine="e1",
            incarnation="e1-i1",
            evidence="canary",
            expected="5,6,7",
            seen="9,9,9",
        )
    ]
    assert book.state.holders(v1.lora_name) == ("e0", "e2")
    assert answer("1,1,1") == []  # not held any more: nothing to compare
    book.refuse(
        c.CheckCanary(engine="e0", incarnation="e0-i1", version_id=1, answer="1," * 600),
        Code.INVALID_INPUT,
    )
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    assert book.state.engines["e1"].canaries == {}
