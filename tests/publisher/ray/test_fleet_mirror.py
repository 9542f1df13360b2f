"""The pure parts of runtime membership on Ray, without a Ray instance: how a client's fleet
mirrors the ledger actor's view (in place, keeping a handle of the same actor), when a
routing table tells a client its mirror is behind, and that a reply's handles are mirrored
before its table is taken."""

from __future__ import annotations

import dataclasses

import pytest

from projections.registry import RegistryState
from publisher.drivers.fleet import Fleet
from publisher.ray.client import RayLedger, RayTransport, apply_view
from publisher.ray.ledger_actor import FleetView
from publisher.ray.link import ActorLink
from publisher.remote.routing import RoutingTable, RoutingTracker


@dataclasses.dataclass
class Handle:
    """Stands in for a ``RayEngine``: what ``apply_view`` reads of one (id and actor)."""

    engine_id: str
    actor_id: str
    gone: bool = False  # what a proxy learned from its calls (must survive a refresh)


def test_the_mirror_follows_adds_replacements_and_removals_in_place() -> None:
    fleet = Fleet([Handle("e0", "a0"), Handle("e1", "a1")])  # type: ignore[list-item]
    held = fleet["e1"]
    assert apply_view(fleet, [Handle("e0", "a0-new"), Handle("e1", "a1"), Handle("e2", "a2")])  # type: ignore[list-item]
    assert fleet.ids() == ["e0", "e1", "e2"]
    assert fleet["e0"].actor_id == "a0-new"  # type: ignore[attr-defined]
    assert fleet["e1"] is held  # same actor: the proxy (and what it learned) is kept
    assert apply_view(fleet, [Handle("e2", "a2")])  # type: ignore[list-item]
    assert fleet.ids() == ["e2"]


def test_an_unchanged_view_changes_nothing() -> None:
    fleet = Fleet([Handle("e0", "a0")])  # type: ignore[list-item]
    version = fleet.version
    assert not apply_view(fleet, [Handle("e0", "a0")])  # type: ignore[list-item]
    assert fleet.version == version


def test_every_fleet_change_bumps_its_version() -> None:
    fleet = Fleet()
    fleet.add(Handle("e0", "a0"))  # type: ignore[arg-type]
    fleet.replace(Handle("e0", "a1"))  # type: ignore[arg-type]
    fleet.remove("e0")
    assert fleet.version == 3
    fleet.remove("e0")  # nothing to remove: no change
    assert fleet.version == 3


def test_a_fleet_change_alone_makes_a_new_routing_table() -> None:
    """Replacing a handle changes nothing in the ledger's state until the reconciler records
    the restart; the table still announces the new fleet version, so clients fetch the view."""
    tracker = RoutingTracker()
    state = RegistryState()
    first = tracker.current(state, epoch=state.epoch, fleet_version=1)
    assert tracker.newer_than(state, first.mark, epoch=state.epoch, fleet_version=1) is None
    second = tracker.newer_than(state, first.mark, epoch=state.epoch, fleet_version=2)
    assert second is not None
    assert second.mark > first.mark
    assert (second.fleet_version, second.fleet_mark) == (2, (state.epoch, 2))


@pytest.mark.anyio
async def test_a_replies_handles_are_mirrored_before_its_table_is_read() -> None:
    """The table that routes to a replaced engine again and the replacement's handle come in
    one reply: once the client took it, a gateway reading routing and fleet (synchronously,
    as it does) finds the new actor's handle, with nothing left to fetch."""
    transport = RayTransport(ActorLink("not-started"))
    client = RayLedger(transport)
    client.fleet.add(Handle("e0", "dead-actor"))  # type: ignore[arg-type]
    transport.fleet_mark = (1, 1)
    table = RoutingTable(
        epoch=1, serial=7, default_revision=1, holders={"v1": ("e0",)}, fleet_version=2
    )
    view = FleetView(epoch=1, version=2, engines=(Handle("e0", "replacement"),))  # type: ignore[arg-type]
    client.view.take(transport.mirrored(table, view))  # as the client takes a reply
    assert client.view.holders("v1") == ("e0",)
    assert client.fleet["e0"].actor_id == "replacement"  # type: ignore[attr-defined]
    assert client.fleet_mark == table.fleet_mark
    assert not transport.fleet_wanted.is_set()  # nothing left to fetch

    # an older view crossing it (replies arrive out of order) changes nothing
    stale = FleetView(epoch=1, version=1, engines=(Handle("e0", "dead-actor"),))  # type: ignore[arg-type]
    client.view.take(transport.mirrored(None, stale))
    assert client.fleet["e0"].actor_id == "replacement"  # type: ignore[attr-defined]

    # a table ahead of the mirror without its view (never sent so): fetched as a safety net
    ahead = RoutingTable(epoch=2, serial=1, default_revision=1, holders={}, fleet_version=1)
    client.view.take(transport.mirrored(ahead))
    assert transport.fleet_wanted.is_set()
