"""Routing across processes: what a remote gateway needs to choose an engine, sent by the
ledger's process with its replies.

The gateway reads routing synchronously (``LedgerView.holders`` / ``default_revision``) on
every attempt, between its lease check and its in-flight increment, so a gateway in another
process cannot ask the ledger each time. Instead the ledger's service piggybacks a
:class:`RoutingTable` on its replies whenever routing changed since the table the caller says
it has (a ``mark``), and the client keeps the newest one (``RemoteView``).

Freshness guarantee: routing is at least as new as the caller's last reply from the ledger. In
particular a session's bind reply carries the routing computed after that bind was committed,
so the version it was bound to is routable in the table the gateway reads next. Later
changes (an engine restarting, a new commit) arrive with the next reply or lease renewal, or
the next refresh; a generation routed on a table a moment old meets the same race an
in-process gateway meets between choosing an engine and the engine answering, and fails the
same clean way.
"""

from __future__ import annotations

import msgspec

from projections.registry import RegistryState

# (the serving controller's epoch, serial within that controller's life): totally ordered, and a
# later controller's tables always come after an earlier one's, whatever their serials.
Mark = tuple[int, int]


class RoutingTable(msgspec.Struct, frozen=True, kw_only=True):
    """Routable holders per adapter name, the head revision and each engine's process life, as
    of one ledger state."""

    epoch: int
    serial: int
    default_revision: int
    holders: dict[str, tuple[str, ...]]
    max_staleness: int | None = None
    # engine -> its incarnation (provenance rows name the process life that served them)
    incarnations: dict[str, str] = msgspec.field(default_factory=dict)
    # The ledger process's fleet version (handles added, replaced, removed). On Ray a reply
    # that carries a table from a fleet newer than the caller's mirror carries that fleet's
    # handles too (publisher/ray/ledger_actor.py, _Service.fleet_for).
    fleet_version: int = 0

    @property
    def mark(self) -> Mark:
        return (self.epoch, self.serial)

    @property
    def fleet_mark(self) -> Mark:
        return (self.epoch, self.fleet_version)


class RoutingTracker:
    """The ledger's side: the current table, rebuilt only when the routing-relevant part of the
    state changed (engines, their lives, what they hold, whether they are routable, the head
    revision) or the fleet's handles did (``fleet_version``).

    ``epoch`` is the serving controller's own epoch, never ``state.epoch``: a fenced controller
    (still answering for a moment) rebuilds its state from the log, which then shows its
    rival's epoch; were its marks taken from that, they would outrank the rival's own tables,
    and a client that read the fenced one would ignore the new controller's routing until its
    serials caught up."""

    def __init__(self) -> None:
        self._key: object = None
        self._table: RoutingTable | None = None
        self._serial = 0

    def current(self, state: RegistryState, *, epoch: int, fleet_version: int = 0) -> RoutingTable:
        key = (
            fleet_version,
            epoch,
            state.default_revision,
            state.max_staleness,
            tuple(
                (e.engine, e.incarnation, e.serving, tuple(e.holds)) for e in state.engines.values()
            ),
        )
        if self._table is None or key != self._key:
            holders: dict[str, list[str]] = {}
            for member in sorted(state.engines.values(), key=lambda e: e.engine):
                if member.serving:  # repaired and reachable: an outage takes it out at once
                    for lora_name in member.holds:
                        holders.setdefault(lora_name, []).append(member.engine)
            self._serial += 1
            self._key = key
            self._table = RoutingTable(
                epoch=epoch,
                serial=self._serial,
                default_revision=state.default_revision,
                holders={name: tuple(engines) for name, engines in holders.items()},
                max_staleness=state.max_staleness,
                incarnations={e.engine: e.incarnation for e in state.engines.values()},
                fleet_version=fleet_version,
            )
        return self._table

    def newer_than(
        self, state: RegistryState, mark: Mark | None, *, epoch: int, fleet_version: int = 0
    ) -> RoutingTable | None:
        """The current table if the caller's ``mark`` is not it, else None (nothing to
        send)."""
        table = self.current(state, epoch=epoch, fleet_version=fleet_version)
        return None if mark is not None and tuple(mark) == table.mark else table
