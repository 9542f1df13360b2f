"""What a process beside the ledger may ask of it, written once for every transport: ``serve``'s
HTTP routes (``tools/http_app.py``) and the Ray ledger actor both call a :class:`LedgerService`.

Every answer that a remote gateway routes by carries the routing table when it changed since
the caller's ``mark`` (:mod:`publisher.remote.routing`), read right after the call was decided,
with no ``await`` between: a bind's reply routes to the version it bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import anyio
import msgspec

from engines.contract import EngineError
from evlog.errors import LoraLedgerError
from evlog.events import TurnFailures
from evlog.provenance_store import ProvenanceStore
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.gateway.provenance import ProvenanceRow, stored_row
from publisher.logs import get_logger
from publisher.remote.renewals import Life
from publisher.remote.routing import Mark, RoutingTable, RoutingTracker

log = get_logger("loraledger.remote")

# The longest a long poll for the routing is held open: an answer well within every client's
# request timeout, so a quiet ledger never looks like a lost one.
MAX_ROUTING_WAIT_S = 30.0


def _without_secret(owner: str) -> LedgerError:
    """A call for ``owner`` from another process that carries no secret: every life reached
    from outside the ledger's process proves itself by its secret (docs/sessions.md)."""
    return LedgerError(
        Code.OWNER_SECRET_MISMATCH,
        f"owner {owner}: a call from another process must carry the secret of the owner's "
        "current life (register one with a secret)",
        owner=owner,
    )


class TroubleBatch(msgspec.Struct, frozen=True, kw_only=True):
    """What comes with a remote gateway's trouble report: the engine's life it was routed to,
    how long ago the error was seen, the failed turns it counted per session since its last
    report, and who reports (its owners)."""

    incarnation: str = ""
    age_s: float = 0.0
    failures: tuple[TurnFailures, ...] = ()
    reporter: str = ""


class TroubleReceiver(Protocol):
    """The reconciler's ``engine_trouble``, as the service calls it."""

    def __call__(
        self,
        engine_id: str,
        error: EngineError,
        /,
        *,
        incarnation: str = "",
        failures: tuple[TurnFailures, ...] = (),
        age_s: float = 0.0,
        reporter: str = "",
    ) -> None: ...


class LedgerService:
    """A running ``ledger``, as remote callers reach it. ``fleet_version`` reads the version of
    the fleet's handles in this process (routing tables carry it); ``engine_trouble`` hears
    what remote gateways saw fail (the reconciler's ``engine_trouble``; None: nobody here
    watches the engines); ``provenance`` keeps the rows faces in other processes send (the
    store beside the log; None: this process keeps none, and says so)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        fleet_version: Callable[[], int] = lambda: 0,
        engine_trouble: TroubleReceiver | None = None,
        provenance: ProvenanceStore | None = None,
    ) -> None:
        self.ledger = ledger
        self._fleet_version = fleet_version
        self._engine_trouble = engine_trouble
        self._provenance = provenance
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

    async def wait_routing(self, mark: Mark | None, wait_s: float) -> RoutingTable | None:
        """The current table as soon as it is not the one ``mark`` names (at once if it is not
        already), or None when nothing changed within ``wait_s`` seconds (at most
        :data:`MAX_ROUTING_WAIT_S`): the long poll by which a remote view hears of an outage,
        a repair or a publication as it is recorded, not with its next reply."""
        with anyio.move_on_after(min(max(0.0, wait_s), MAX_ROUTING_WAIT_S)):
            while True:
                table = self.routing(mark)
                if table is not None:
                    return table
                await self.ledger.wait_committed(self.ledger.state.last_seq)
        return None

    def status(self) -> LedgerStatus:
        return self.ledger.status()

    async def execute(
        self, commands: Sequence[c.Command], mark: Mark | None = None
    ) -> tuple[list[Outcome | LoraLedgerError], RoutingTable | None]:
        """Decide ``commands`` in order (refusals in place), and the routing after them. A
        bind or release without its owner's secret is refused here, undecided: a life
        registered without one (an older log's) is not reachable from another process."""
        results: list[Outcome | LoraLedgerError | None] = [
            self._unproven(x.owner, x.secret) if isinstance(x, c.Bind | c.Release) else None
            for x in commands
        ]
        decided = iter(
            await self.ledger.execute_many(
                [x for x, r in zip(commands, results, strict=True) if r is None]
            )
        )
        return [next(decided) if r is None else r for r in results], self.routing(mark)

    def _unproven(self, owner: str, secret: str) -> LedgerError | None:
        """The refusal of a call for a registered ``owner`` that carries no secret (an
        unknown owner is the ledger's to refuse, ``UNKNOWN_OWNER``)."""
        return _without_secret(owner) if not secret and owner in self.ledger.state.owners else None

    async def register(
        self,
        owner: str,
        ttl_s: float,
        incarnation: str,
        sessions_idle_s: float | None = None,
        *,
        secret: str,
    ) -> Done:
        if not secret:
            raise _without_secret(owner)
        return await self.ledger.register_owner(
            owner,
            ttl_s=ttl_s,
            incarnation=incarnation,
            sessions_idle_s=sessions_idle_s,
            secret=secret,
        )

    async def deregister(self, owner: str, incarnation: str, *, secret: str) -> Deregistered:
        if (refusal := self._unproven(owner, secret)) is not None:
            raise refusal
        return await self.ledger.deregister_owner(owner, incarnation=incarnation, secret=secret)

    def renew(
        self,
        lives: Mapping[Life, Mapping[tuple[str, int], int]],
        mark: Mark | None = None,
        sessions: Mapping[Life, Sequence[str]] | None = None,
        *,
        secrets: Mapping[Life, str],
    ) -> tuple[dict[Life, LoraLedgerError], RoutingTable | None]:
        """Renew each life ``(owner, incarnation)``, proven by its secret (``secrets``), with
        its in-flight counts and (a relay's) the client-held sessions it had a turn of; the
        lives the ledger refused come back by name, with their refusal."""
        lost: dict[Life, LoraLedgerError] = {}
        touched = sessions or {}
        for (owner, incarnation), inflight in lives.items():
            try:
                self.renew_one(
                    owner,
                    inflight,
                    incarnation,
                    touched.get((owner, incarnation), ()),
                    secret=secrets.get((owner, incarnation), ""),
                )
            except LoraLedgerError as exc:
                lost[(owner, incarnation)] = exc
        return lost, self.routing(mark)

    def renew_one(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int],
        incarnation: str,
        sessions: Sequence[str] = (),
        *,
        secret: str,
    ) -> None:
        """One owner's renewal, by the life's ``secret``: only the life that dispatched its
        requests reports them in flight; raises its refusal."""
        if (refusal := self._unproven(owner, secret)) is not None:
            raise refusal
        self.ledger.renew_lease(
            owner, inflight, incarnation=incarnation, sessions=sessions, secret=secret
        )

    def trouble(self, engine: str, error: EngineError, batch: TroubleBatch | None = None) -> bool:
        """A remote gateway's generation on ``engine`` failed with ``error``: handed to the
        reconciler as the in-process gateway hands it (an engine that could not be reached gets
        its outage recorded now, a missing adapter the engine's inventory read now, anything
        else a probe now), with the ``batch`` of failures it counted. Only a hint: the probe
        and the inventory decide. Whether anyone here heard it."""
        if self._engine_trouble is None:
            return False
        batch = batch or TroubleBatch()
        log.info("remote.engine_trouble_reported", engine=engine, code=error.code)
        self._engine_trouble(
            engine,
            error,
            incarnation=batch.incarnation,
            failures=batch.failures,
            age_s=batch.age_s,
            reporter=batch.reporter or "remote gateway",
        )
        return True

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> int:
        """Keep provenance rows a face in another process sent, durably, before answering
        (it drops them once answered); how many were new (a batch sent again after a lost
        reply stores nothing twice: the store keys rows by ``row_id``)."""
        if self._provenance is None:
            raise LedgerError(
                Code.INVALID_STATE,
                "this ledger's process keeps no provenance store: send the rows elsewhere "
                "(a JSON-lines file) or run a ledger that keeps one",
            )
        return await self._provenance.add([stored_row(row) for row in rows])
