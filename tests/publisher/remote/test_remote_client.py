"""The one remote ledger client (publisher/remote/client.py), rule by rule: coalesced round
trips, forwarded renewals and their refusals, engine trouble reports, provenance resends, the
routing copy, a clean exit.

Real parts: serve's app over a real ledger (SQLite) and ``HttpLedger``'s transport, the app
reached in process through httpx's ASGI transport (no socket, no server to stop: seconds per
test, so the mutation campaign can run them for every mutant)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from evlog.sqlite import SQLiteStore
from publisher.core import commands as c
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound
from publisher.remote.http import HttpLedger, HttpTransport, ServiceClient
from tests.support.ledger import publish
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "remote-client-token"
URL = "http://127.0.0.1"


@asynccontextmanager
async def ledger_at(path: Path) -> AsyncIterator[Ledger]:
    """A ledger with engine e0 serving version 1."""
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0",))
        await ledger.join_engine("e0", "life-1")
        await ledger.repair_engine("e0", "life-1")
        await publish(ledger, 1)
        yield ledger


def in_process(app: Any) -> ServiceClient:
    """A service client of ``app`` through httpx's ASGI transport."""
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url=URL,
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    return ServiceClient(URL, token=TOKEN, client=http)


@asynccontextmanager
async def remote_of(
    ledger: Ledger, *, deregister_on_exit: bool = True, **options: Any
) -> AsyncIterator[HttpLedger]:
    """An ``HttpLedger`` of serve's app over ``ledger``, running."""
    service = in_process(build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN))
    remote = HttpLedger(HttpTransport(service), **options)
    try:
        async with remote.running(deregister_on_exit=deregister_on_exit):
            yield remote
    finally:
        await service.aclose()


async def test_callers_queued_behind_a_round_trip_share_one_and_each_hears_its_own(
    tmp_path: Path,
) -> None:
    """With one round trip allowed in flight, ten callers at once are sent as ONE execute, and
    each caller gets the outcomes of its own commands, in its order."""
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, max_in_flight=1) as remote,
    ):
        await remote.register_owner("w")
        before = remote.round_trips
        answers: dict[int, list[Any]] = {}

        async def caller(k: int) -> None:
            answers[k] = await remote.execute_many(
                [c.Bind(session=f"s{k}-a", owner="w"), c.Bind(session=f"s{k}-b", owner="w")]
            )

        async with anyio.create_task_group() as tg:
            for k in range(10):
                tg.start_soon(caller, k)
        assert remote.round_trips - before == 1
        for k in range(10):
            assert [r.session for r in answers[k] if isinstance(r, Bound)] == [
                f"s{k}-a",
                f"s{k}-b",
            ]
