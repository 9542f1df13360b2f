"""Helpers shared by the Ray tests: publish a version by recording it (no engines needed when
only the ledger is under test)."""

from __future__ import annotations

import hashlib
from typing import Any

from publisher import commands as c
from publisher.outcomes import Allocated, Published

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
