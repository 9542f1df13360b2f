"""What a process beside the ledger may ask of it, written once for every transport: ``serve``'s
HTTP routes (``tools/http_app.py``) and the Ray ledger actor both call a :class:`LedgerService`.

Every answer that a remote gateway routes by carries the routing table when it changed since
the caller's ``mark`` (:mod:`publisher.remote.routing`), read right after the call was decided,
with no ``await`` between: a bind's reply routes to the version it bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from engines.contract import EngineError
from evlog.errors import LoraLedgerError
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.logs import get_logger
from publisher.remote.renewals import Counts, Life
from publisher.remote.routing import Mark, RoutingTable, RoutingTracker

log = get_logger("loraledger.remote")


class LedgerService:
    """A running ``ledger``, as remote callers reach it. ``fleet_version`` reads the version of
    the fleet's handles in this process (routing tables carry it); ``engine_trouble`` hears
    what remote gateways saw fail (the reconciler's ``engine_trouble``; None: nobody here
    watches the engines)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        fleet_version: Callable[[], int] = lambda: 0,
        engine_trouble: Callable[[str, EngineError], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self._fleet_version = fleet_version
        self._engine_trouble = engine_trouble
        self._tracker = RoutingTracker()

    def routing(self, mark: Mark | None = None) -> RoutingTable | None:
        """The current table, or None when it is the one the caller holds (``mark``)."""
        return self._tracker.newer_than(
            self.ledger.state, mark, epoch=self.ledger.epoch, fleet_version=self._fleet_version()
        )

    def table(self) -> RoutingTable:
        """The current table, whatever the caller holds."""
        return self._tracker.current(
            self.ledger.state, epoch=self.ledger.epoch, fleet_version=self._fleet_version()
        )

    def status(self) -> LedgerStatus:
        return self.ledger.status()

    async def execute(
        self, commands: Sequence[c.Command], mark: Mark | None = None
    ) -> tuple[list[Outcome | LoraLedgerError], RoutingTable | None]:
        """Decide ``commands`` in order (refusals in place), and the routing after them."""
        results = await self.ledger.execute_many(commands)
        return results, self.routing(mark)

    async def register(
        self, owner: str, ttl_s: float, incarnation: str, sessions_idle_s: float | None = None
    ) -> Done:
        return await self.ledger.register_owner(
            owner, ttl_s=ttl_s, incarnation=incarnation, sessions_idle_s=sessions_idle_s
        )

    async def deregister(self, owner: str, incarnation: str) -> Deregistered:
        return await self.ledger.deregister_owner(owner, incarnation=incarnation)

    def renew(
        self,
        lives: Mapping[Life, Mapping[tuple[str, int], int]],
        mark: Mark | None = None,
        sessions: Mapping[Life, Sequence[str]] | None = None,
    ) -> tuple[dict[Life, LoraLedgerError], RoutingTable | None]:
        """Renew each life ``(owner, incarnation)`` with its in-flight counts and (a relay's)
        the client-held sessions it had a turn of; the lives the ledger refused come back by
        name, with their refusal."""
        lost: dict[Life, LoraLedgerError] = {}
        touched = sessions or {}
        for (owner, incarnation), inflight in lives.items():
            try:
                self.ledger.renew_lease(
                    owner,
                    inflight,
                    incarnation=incarnation,
                    sessions=touched.get((owner, incarnation), ()),
                )
            except LoraLedgerError as exc:
                lost[(owner, incarnation)] = exc
        return lost, self.routing(mark)

    def renew_one(
        self, owner: str, inflight: Counts, incarnation: str, sessions: Sequence[str] = ()
    ) -> None:
        """One owner's renewal; raises its refusal."""
        self.ledger.renew_lease(owner, inflight, incarnation=incarnation, sessions=sessions)

    def trouble(self, engine: str, error: EngineError) -> bool:
        """A remote gateway's generation on ``engine`` failed with ``error``: handed to the
        reconciler as the in-process gateway hands it (a missing adapter gets the engine's
        inventory read now, anything else a probe now). Only a hint: the probe and the
        inventory decide. Whether anyone here heard it."""
        if self._engine_trouble is None:
            return False
        log.info("remote.engine_trouble_reported", engine=engine, code=error.code)
        self._engine_trouble(engine, error)
        return True
