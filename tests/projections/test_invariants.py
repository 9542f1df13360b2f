"""The invariants the ledger checks after every batch cost what the state's size does, not its
square: a publication to hundreds of engines runs the check after each of its batches."""

from __future__ import annotations

from projections import invariants
from tests.publisher.core.book import Book, CountedFleet


def test_the_routable_members_check_reads_each_needed_fleet_once() -> None:
    engines = tuple(f"e{i}" for i in range(8))
    book = Book().bootstrap(capacity=3, engines=engines)
    book.publish(1)
    state = book.state
    v = state.versions[1]
    v.fleet = CountedFleet(v.fleet)
    CountedFleet.scans = 0
    assert invariants.violations(state) == []
    assert CountedFleet.scans == 0  # not one scan per member: O(engines), not O(engines^2)

    # and the check still finds a routable member that lacks a needed version
    del state.engines["e3"].holds[v.lora_name]
    assert invariants.violations(state) == ["routable engine e3 lacks needed versions [1]"]
