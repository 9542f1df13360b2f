"""The routing tables a remote gateway routes by: each controller's come after every earlier
controller's, whatever their serials.

A gateway keeps the newest table it saw (by mark). A fenced ``serve`` still answers for a
moment (``fenced_linger_s``) with a state rebuilt from the log, which shows its rival's epoch;
its tables must not then outrank the rival's own, or a gateway that read it would ignore the
new controller's routing -- versions published after the failover refused ``NO_ROUTE`` -- until
the new serials caught up with the old ones."""

from __future__ import annotations

import pytest

from evlog.memory import MemoryStore
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.remote.client import RemoteView
from publisher.remote.routing import RoutingTracker
from publisher.remote.service import LedgerService
from tests.support.ledger import publish

pytestmark = pytest.mark.anyio


async def _create(ledger: Ledger) -> None:
    await ledger.create_deployment("dep", prefix="agent", capacity=8, fleet=("e0",))
    await ledger.join_engine("e0", "life-1")
    await ledger.repair_engine("e0", "life-1")


async def test_a_fenced_controllers_tables_rank_before_its_successors() -> None:
    store = MemoryStore()
    async with Ledger.open(store) as first:
        await _create(first)
        old = LedgerService(first)
        for version in (1, 2, 3):  # many changes: the old controller's serial runs ahead
            await publish(first, version)
            old.table()
        async with Ledger.open(store) as second:
            new = LedgerService(second)
            await publish(second, 4)
            newest = new.table()
            # the first learns it was fenced (its state is rebuilt and shows epoch 2)
            with pytest.raises(LedgerError) as fenced:
                await first.register_owner("late")
            assert fenced.value.code == Code.FENCED
            assert first.fenced is not None and first.state.epoch == second.epoch
            stale = old.table()
            assert stale.mark < newest.mark, (stale.mark, newest.mark)
            assert stale.serial > newest.serial  # the case the marks must survive
            view = RemoteView(transport=None)  # type: ignore[arg-type]  # only take() is used
            view.take(stale)
            view.take(newest)
            assert view.default_revision == newest.default_revision == 4


async def test_a_table_is_rebuilt_only_when_routing_changed_and_says_all_a_gateway_reads() -> None:
    """The serial counts the tables from 1; a state whose routing did not change gives the
    same table (no serial spent); the holders of an adapter are the serving engines, by name;
    the table carries the staleness bound, each engine's life and the fleet's version."""
    async with Ledger.open(MemoryStore()) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=8, fleet=("e1", "e0"))
        for engine in ("e1", "e0"):  # joined out of name order
            await ledger.join_engine(engine, f"{engine}-life")
            await ledger.repair_engine(engine, f"{engine}-life")
        await ledger.configure_deployment(max_staleness=3)
        v1 = await publish(ledger, 1)
        tracker = RoutingTracker()
        first = tracker.current(ledger.state, epoch=5)
        assert (first.mark, first.fleet_version, first.default_revision) == ((5, 1), 0, 1)
        assert first.holders == {v1.lora_name: ("e0", "e1")}
        assert first.max_staleness == 3
        assert first.incarnations == {"e0": "e0-life", "e1": "e1-life"}
        await ledger.register_owner("w")  # not routing: the same table
        assert tracker.current(ledger.state, epoch=5) is first
        assert tracker.newer_than(ledger.state, first.mark, epoch=5) is None
        assert tracker.newer_than(ledger.state, None, epoch=5) is first
        assert tracker.newer_than(ledger.state, (5, 0), epoch=5) is first
        moved = tracker.newer_than(ledger.state, first.mark, epoch=5, fleet_version=2)
        assert moved is not None and (moved.mark, moved.fleet_version) == ((5, 2), 2)
        await ledger.report_unreachable(
            "e1", "e1-life", at=ledger.clock(), error="ENGINE_UNREACHABLE: x", source="probe"
        )
        outage = tracker.current(ledger.state, epoch=5, fleet_version=2)
        assert (outage.serial, outage.holders) == (3, {v1.lora_name: ("e0",)})
        assert outage.incarnations == {"e0": "e0-life", "e1": "e1-life"}  # still a member
