"""Helpers shared by the Ray tests and the remote clients' tests: publish a version by
recording it (no engines needed when only the ledger is under test), and read what a remote
client learned of a life's renewals."""

from __future__ import annotations

import hashlib
from typing import Any

from evlog.errors import LoraLedgerError
from publisher.core import commands as c
from publisher.core.outcomes import Allocated, Published

ENGINES = ("e0", "e1")


async def create(ledger: Any, *, capacity: int = 4) -> None:
    """A deployment over two engines that joined and are routable."""
    await ledger.execute(c.CreateDeployment(deployment="dep", prefix="agent", capacity=capacity))
    for engine in ENGINES:
        await ledger.execute(c.JoinEngine(engine=engine, incarnation=f"{engine}-1"))
        await ledger.execute(c.RepairEngine(engine=engine, incarnation=f"{engine}-1"))


async def publish(ledger: Any, version_id: int) -> Published:
    """Allocate, claim, PREPARED and READY from every engine, commit: what the publication
    driver records."""
    digest = hashlib.sha256(f"v{version_id}".encode()).hexdigest()
    allocated = await ledger.execute(c.Allocate(version_id=version_id, digest=digest))
    assert isinstance(allocated, Allocated), allocated
    await ledger.execute(
        c.ClaimTransport(version_id=version_id, attempt=allocated.attempt, owner="test")
    )
    for engine in allocated.fleet:
        receipt = dict(
            version_id=version_id,
            attempt=allocated.attempt,
            engine=engine,
            incarnation=f"{engine}-1",
            digest=digest,
            lora_name=allocated.lora_name,
        )
        await ledger.execute(c.RecordPrepared(**receipt))  # type: ignore[arg-type]
        await ledger.execute(c.RecordReady(**receipt))  # type: ignore[arg-type]
    published = await ledger.execute(c.Commit(version_id=version_id, attempt=allocated.attempt))
    assert isinstance(published, Published), published
    return published


def renewal_refused(client: Any, owner: str, incarnation: str, code: str) -> bool:
    """Whether ``client`` (``RayLedger`` or ``HttpLedger``) already refuses a renewal of
    ``(owner, incarnation)`` with ``code``: what it learned from a forwarded one's answer."""
    try:
        client.renew_lease(owner, incarnation=incarnation)
    except LoraLedgerError as exc:
        return exc.code == code
    return False
