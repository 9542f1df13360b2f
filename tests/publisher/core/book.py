"""A pure in-test ledger: decide + evolve with no store, checking invariants after every step.

Used by the decider tests and as the reference bootstrap for other pure tests.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from evlog.errors import LoraLedgerError
from evlog.events import Event
from projections import invariants
from projections.registry import RegistryState, evolve
from publisher.core import commands as c
from publisher.core.decider import decide
from publisher.core.outcomes import Allocated, Published


def digest_of(label: Any) -> str:
    return hashlib.sha256(str(label).encode()).hexdigest()


class CountedFleet(tuple[str, ...]):
    """An attempt's fleet that counts the membership questions put to it (each one a scan of
    the tuple): put in place of ``VersionRecord.fleet``, it shows whether a check costs
    O(engines) per event."""

    scans = 0

    def __contains__(self, engine: object) -> bool:
        type(self).scans += 1
        return super().__contains__(engine)


class Book:
    def __init__(self) -> None:
        self.state = RegistryState()
        self.events: list[Event] = []

    def run(self, command: c.Command) -> Any:
        """The command's outcome. Typed ``Any``: its class follows the command's, and each test
        reads the fields it asserts (``allocate``/``publish`` below narrow the common ones)."""
        decision = decide(self.state, command)
        for event in decision.events:
            evolve(self.state, event, len(self.events) + 1)
            self.events.append(event)
        invariants.check(self.state)
        if decision.error is not None:
            raise decision.error
        assert decision.outcome is not None
        return decision.outcome

    def refuse(self, command: c.Command, code: str) -> list[Event]:
        """Assert the command is refused with ``code``; return the events it recorded."""
        before = len(self.events)
        self.refusal(command, code)
        return self.events[before:]

    def refusal(self, command: c.Command, code: str) -> LoraLedgerError:
        """Assert the command is refused with ``code``; return the error, whose details a
        caller's retry logic reads (the version, the owner, the field at fault)."""
        with pytest.raises(LoraLedgerError) as info:
            self.run(command)
        assert info.value.code == code, info.value
        # every refusal names its problem for a person too, not only by code
        assert isinstance(info.value.message, str) and info.value.message, info.value
        return info.value

    # --- scenario helpers ---------------------------------------------------------------------

    def bootstrap(self, *, capacity: int = 2, engines: tuple[str, ...] = ("e0", "e1")) -> Book:
        self.run(c.CreateDeployment(deployment="dep", prefix="agent", capacity=capacity))
        for engine in engines:
            self.run(c.JoinEngine(engine=engine, incarnation=f"{engine}-i1"))
            self.run(c.RepairEngine(engine=engine, incarnation=f"{engine}-i1"))
        self.run(c.RegisterOwner(owner="w1", ttl_s=10.0, now=0.0))
        return self

    def incarnation(self, engine: str) -> str:
        return self.state.engines[engine].incarnation

    def allocate(self, version_id: int) -> Allocated:
        outcome = self.run(c.Allocate(version_id=version_id, digest=digest_of(version_id)))
        assert isinstance(outcome, Allocated), outcome
        return outcome

    def claim(self, version_id: int, owner: str = "trainer") -> None:
        attempt = self.state.versions[version_id].attempt
        self.run(c.ClaimTransport(version_id=version_id, attempt=attempt, owner=owner))

    def ready_all(self, version_id: int) -> None:
        """Claim the attempt (unless claimed), then PREPARED and READY from every engine."""
        v = self.state.versions[version_id]
        if v.claimed_by is None:
            self.claim(version_id)
        for engine in v.fleet:
            incarnation = self.incarnation(engine)
            for receipt in (c.RecordPrepared, c.RecordReady):
                self.run(
                    receipt(
                        version_id=version_id,
                        attempt=v.attempt,
                        engine=engine,
                        incarnation=incarnation,
                        digest=v.digest,
                        lora_name=v.lora_name,
                    )
                )

    def publish(self, version_id: int) -> Published:
        allocated = self.allocate(version_id)
        self.ready_all(version_id)
        outcome = self.run(c.Commit(version_id=version_id, attempt=allocated.attempt))
        assert isinstance(outcome, Published)
        return outcome

    def reclaim(self, version_id: int) -> None:
        self.run(c.ClaimReclaim(version_id=version_id))
        for engine in list(self.state.engines):
            self.run(
                c.RecordUnloaded(
                    version_id=version_id, engine=engine, incarnation=self.incarnation(engine)
                )
            )
