"""Helpers shared by the Ray tests and the remote clients' tests: a deployment whose engines
are in their first life (what :func:`tests.support.ledger.publish` assumes of a remote client),
and what a remote client learned of a life's renewals."""

from __future__ import annotations

from typing import Any

from evlog.errors import LoraLedgerError
from publisher.core import commands as c

ENGINES = ("e0", "e1")


async def create(ledger: Any, *, capacity: int = 4) -> None:
    """A deployment over two engines that joined and are routable."""
    await ledger.execute(c.CreateDeployment(deployment="dep", prefix="agent", capacity=capacity))
    for engine in ENGINES:
        await ledger.execute(c.JoinEngine(engine=engine, incarnation=f"{engine}-1"))
        await ledger.execute(c.RepairEngine(engine=engine, incarnation=f"{engine}-1"))


def renewal_refused(client: Any, owner: str, incarnation: str, code: str) -> bool:
    """Whether ``client`` (``RayLedger`` or ``HttpLedger``) already refuses a renewal of
    ``(owner, incarnation)`` with ``code``: what it learned from a forwarded one's answer."""
    try:
        client.renew_lease(owner, incarnation=incarnation)
    except LoraLedgerError as exc:
        return exc.code == code
    return False
