"""Routing state across processes: what a remote gateway needs to choose an engine.

The gateway reads routing synchronously (``RoutingView.holders`` / ``default_revision``) on
every generation, between its lease check and its in-flight increment, so a remote gateway
cannot ask the ledger actor each time. Instead the actor piggybacks a
:class:`RoutingTable` on its replies whenever routing changed since the table the caller
says it has (a ``mark``), and the client keeps the newest one in a :class:`RemoteRouting`.

Freshness guarantee: routing is at least as new as the caller's last reply from the ledger. In
particular a session's bind reply carries the routing computed after that bind was committed,
so the version it was bound to is routable in the table the gateway reads next. Later
changes (an engine restarting, a new commit) arrive with the next reply or lease renewal; a
generation routed on a table a moment old meets the same race an in-process gateway meets
between choosing an engine and the engine answering, and fails the same clean way.
"""

from __future__ import annotations

import msgspec

from projections.registry import RegistryState

Mark = tuple[int, int]  # (controller epoch, serial within that epoch): totally ordered


class RoutingTable(msgspec.Struct, frozen=True, kw_only=True):
    """Routable holders per adapter name, and the head revision, as of one ledger state."""

    epoch: int
    serial: int
    default_revision: int
    holders: dict[str, tuple[str, ...]]
    max_staleness: int | None = None
    # The ledger actor's fleet version (handles added, replaced, removed). A reply that carries
    # a table from a fleet newer than the caller's mirror carries that fleet's handles too
    # (publisher/ray/ledger_actor.py, _Service.fleet_for).
    fleet_version: int = 0

    @property
    def mark(self) -> Mark:
        return (self.epoch, self.serial)

    @property
    def fleet_mark(self) -> Mark:
        return (self.epoch, self.fleet_version)


class RoutingTracker:
    """Actor side: the current table, rebuilt only when the routing-relevant part of the
    state changed (engines, what they hold, whether they are routable, the head revision) or
    the fleet's handles did (``fleet_version``)."""

    def __init__(self) -> None:
        self._key: object = None
        self._table: RoutingTable | None = None
        self._serial = 0

    def current(self, state: RegistryState, fleet_version: int = 0) -> RoutingTable:
        key = (
            fleet_version,
            state.epoch,
            state.default_revision,
            state.max_staleness,
            tuple((e.engine, e.routable, tuple(e.holds)) for e in state.engines.values()),
        )
        if self._table is None or key != self._key:
            holders: dict[str, list[str]] = {}
            for member in sorted(state.engines.values(), key=lambda e: e.engine):
                if member.routable:
                    for lora_name in member.holds:
                        holders.setdefault(lora_name, []).append(member.engine)
            self._serial += 1
            self._key = key
            self._table = RoutingTable(
                epoch=state.epoch,
                serial=self._serial,
                default_revision=state.default_revision,
                holders={name: tuple(engines) for name, engines in holders.items()},
                max_staleness=state.max_staleness,
                fleet_version=fleet_version,
            )
        return self._table

    def newer_than(
        self, state: RegistryState, mark: Mark | None, fleet_version: int = 0
    ) -> RoutingTable | None:
        """The current table if the caller's ``mark`` is not it, else None (nothing to
        send)."""
        table = self.current(state, fleet_version)
        return None if mark == table.mark else table


class RemoteRouting:
    """Client side: a :class:`publisher.gateway.RoutingView` over the newest table seen."""

    def __init__(self) -> None:
        self._table: RoutingTable | None = None

    @property
    def mark(self) -> Mark | None:
        return None if self._table is None else self._table.mark

    @property
    def table(self) -> RoutingTable | None:
        return self._table

    def update(self, table: RoutingTable | None) -> None:
        """Keep ``table`` if it is newer than the one held (replies can arrive out of
        order when several calls are in flight)."""
        if table is None:
            return
        if self._table is None or table.mark > self._table.mark:
            self._table = table

    def holders(self, lora_name: str) -> tuple[str, ...]:
        if self._table is None:
            return ()
        return self._table.holders.get(lora_name, ())

    @property
    def default_revision(self) -> int:
        return 0 if self._table is None else self._table.default_revision

    @property
    def max_staleness(self) -> int | None:
        return None if self._table is None else self._table.max_staleness
