"""A remote client's turn is confirmed by the ledger before it is sent
(``RemoteLedger.confirm_lease``, with ``confirm_timeout`` set): a life the ledger has ended is
refused although the client's memory still says live, and a ledger that does not answer
leaves the last answer standing, so bound sessions keep generating through an outage.

Real parts: serve's app over a real ledger (SQLite) on a loopback port, and ``HttpLedger``.
The one stand-in is the network: a partition in front of the app that holds every request
until it heals (the ledger itself stays up, as behind a cut link)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from evlog.errors import LoraLedgerError
from evlog.sqlite import SQLiteStore
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.remote.http import HttpLedger
from tests.publisher.openai_kit import serve_app
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "lease-confirmation-token"
CONFIRM_TIMEOUT_S = 2.0


class Partition:
    """An ASGI app in front of serve's: while cut, every request waits until it heals."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.healed = anyio.Event()
        self.healed.set()

    def cut(self) -> None:
        self.healed = anyio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self.healed.wait()
        await self.app(scope, receive, send)


@asynccontextmanager
async def served(path: Path) -> AsyncIterator[tuple[HttpLedger, Partition]]:
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0",))
        await ledger.join_engine("e0", "life-1")
        await ledger.repair_engine("e0", "life-1")
        await publish(ledger, 1)
        link = Partition(build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN))
        async with (
            serve_app(link) as url,
            HttpLedger.connect(
                url, token=TOKEN, confirm_timeout=CONFIRM_TIMEOUT_S, deregister_on_exit=False
            ) as remote,
        ):
            try:
                yield remote, link
            finally:
                link.healed.set()


async def test_a_replaced_life_is_refused_by_the_ledger_not_by_the_clients_memory(
    tmp_path: Path,
) -> None:
    """The successor registered (the old life's sessions released): the client's memory of
    the old life still says live, so only the ledger's answer can refuse its next turn."""
    async with served(tmp_path / "ledger.db") as (remote, _):
        await remote.register_owner("w", incarnation="one")
        await remote.bind("s1", "w", incarnation="one")
        await remote.confirm_lease("w", incarnation="one")  # live: answered
        await remote.register_owner("w", incarnation="two")  # the successor
        remote.renew_lease("w", incarnation="one")  # memory: still live
        with pytest.raises(LoraLedgerError) as refused:
            await remote.confirm_lease("w", incarnation="one")
        assert refused.value.code == Code.OWNER_RESTARTED
        await remote.confirm_lease("w", incarnation="two")  # the successor is untouched
        assert remote.unconfirmed == 0


async def test_an_unanswered_confirmation_goes_on_under_the_last_answer(tmp_path: Path) -> None:
    """Cut off, a confirmation waits ``confirm_timeout`` once, then turns go on without
    waiting (a ledger outage must not stop bound sessions); healed, confirmations wait for
    the ledger's answer again and a refusal decided meanwhile reaches the old life."""
    async with served(tmp_path / "ledger.db") as (remote, link):
        await remote.register_owner("w", incarnation="one")
        await remote.confirm_lease("w", incarnation="one")
        link.cut()
        await remote.confirm_lease("w", incarnation="one")  # waited, then went on
        assert remote.unconfirmed == 1
        with anyio.fail_after(CONFIRM_TIMEOUT_S / 2):  # nothing to wait for: no second timeout
            await remote.confirm_lease("w", incarnation="one")
        assert remote.unconfirmed == 2
        answered = remote.renewals_sent
        link.healed.set()
        await wait_for("a renewal answered again", lambda: remote.renewals_sent > answered)
        await remote.register_owner("w", incarnation="two")  # decided once the link is back
        with pytest.raises(LoraLedgerError) as refused:
            await remote.confirm_lease("w", incarnation="one")
        assert refused.value.code == Code.OWNER_RESTARTED
