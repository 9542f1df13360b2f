"""A version published on the ledger alone: the commands the publication driver records,
without engines or bytes (for tests of the ledger, its clients and its logs).

Works on every ledger face that executes commands: the in-process
:class:`~publisher.core.ledger.Ledger` and its remote clients (Ray, HTTP).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from publisher.core import commands as c
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Allocated, Outcome, Published


class Executes(Protocol):
    """A ledger face: anything that executes a command and answers its outcome."""

    async def execute(self, command: c.Command) -> Outcome: ...


def digest(version_id: int) -> str:
    """The digest the tests give version ``version_id`` (any fixed 64-hex string would do)."""
    return hashlib.sha256(f"v{version_id}".encode()).hexdigest()


def incarnation_of(ledger: Executes, engine: str) -> str:
    """The life of ``engine`` that receipts must name: the in-process ledger's state knows it;
    through a remote client, the engine is taken to be in its first life, ``{engine}-1`` (how
    the tests that use remote clients join their engines)."""
    if isinstance(ledger, Ledger):
        return ledger.state.engines[engine].incarnation
    return f"{engine}-1"


async def publish(ledger: Executes, version_id: int, *, owner: str = "trainer") -> Published:
    """Allocate ``version_id`` (with :func:`digest`) and deliver it (:func:`deliver`); an
    allocation refused or skipped fails the test."""
    allocated = await ledger.execute(c.Allocate(version_id=version_id, digest=digest(version_id)))
    assert isinstance(allocated, Allocated), allocated
    return await deliver(ledger, allocated, owner=owner)


async def deliver(ledger: Executes, allocated: Allocated, *, owner: str = "trainer") -> Published:
    """Claim the transport of an allocated attempt as ``owner``, record PREPARED and READY from
    every engine of its fleet, and commit: the publication driver's record of a delivery that
    went well everywhere."""
    version_id, attempt = allocated.version_id, allocated.attempt
    await ledger.execute(c.ClaimTransport(version_id=version_id, attempt=attempt, owner=owner))
    for engine in allocated.fleet:
        for step in (c.RecordPrepared, c.RecordReady):
            receipt = step(
                version_id=version_id,
                attempt=attempt,
                engine=engine,
                incarnation=incarnation_of(ledger, engine),
                digest=allocated.digest,
                lora_name=allocated.lora_name,
            )
            await ledger.execute(receipt)
    published = await ledger.execute(c.Commit(version_id=version_id, attempt=attempt))
    assert isinstance(published, Published), published
    return published
