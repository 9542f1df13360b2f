"""Owner incarnations and clean deregistration over HTTP: serve's app on a loopback port, the
``HttpLedger`` client and a real ``RolloutWorker`` over it (what ``loraledger gateway`` runs).
A clean exit deregisters through ``POST /owners/{owner}/deregister`` (recorded as a clean end,
never an incident); a second incarnation of a live owner releases the first one's sessions,
and the first one is fenced out on its next call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from unittest import mock

import httpx
import pytest

from evlog.errors import LoraLedgerError
from evlog.events import (
    InFlight,
    OwnerDeregistered,
    OwnerLeaseExpired,
    OwnerRegistered,
    SessionReleased,
)
from evlog.sqlite import SQLiteStore
from projections.incidents import incidents
from publisher.core.commands import Bind
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway
from publisher.remote.http import HttpLedger
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import serve_app
from tests.publisher.ray.kit import create, renewal_refused
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "owner-routes-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@asynccontextmanager
async def served(store: SQLiteStore) -> AsyncIterator[tuple[Ledger, str, HttpLedger]]:
    """serve's app over a ledger with version 1 committed, on a loopback port, and an
    ``HttpLedger`` client of it renewing every 50 ms."""
    async with Ledger.open(store) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with (
            serve_app(app) as url,
            HttpLedger.connect(url, token=TOKEN, renew_interval=0.05) as remote,
        ):
            yield ledger, url, remote


async def test_a_clean_exit_and_a_restart_over_http(tmp_path: Path) -> None:
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        async with served(store) as (ledger, url, remote):
            gateway = Gateway(Fleet(), remote.view, gateway_id="gw")
            # a worker that exits cleanly: its unclosed sessions are released at once
            async with RolloutWorker.open(remote, gateway, owner="clean") as worker:
                bound = await worker.bind_many([worker.session(s) for s in ("c1", "c2")])
                assert [getattr(b, "version_id", b) for b in bound] == [1, 1]
                await worker.session("c1").close()
            assert worker.deregistered is not None and worker.deregistered.released == 1
            with pytest.raises(LoraLedgerError) as after:
                worker.ensure_live()
            assert after.value.code == Code.OWNER_DEREGISTERED

            # a restart: a second incarnation of a live owner takes over
            async with RolloutWorker.open(remote, gateway, owner="w") as first:
                await first.session("f1").bind()
                async with RolloutWorker.open(remote, gateway, owner="w") as second:
                    assert second.incarnation != first.incarnation
                    assert ledger.state.sessions.get("f1") is None  # released at once
                    with pytest.raises(LoraLedgerError) as zombie:
                        await first.session("f2").bind()  # its bind names its incarnation
                    assert zombie.value.code == Code.OWNER_RESTARTED
                    assert first.lost is not None
                    assert first.lost.code == Code.OWNER_RESTARTED
                    await second.session("g1").bind()
                assert first.deregistered is None  # the zombie could not end its successor

            # the routes as a client sends them: a stale incarnation is a 409 with its code
            async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
                one, two = "1" * 64, "2" * 64  # each life's secret
                body = {"owner": "h", "ttl_s": 60, "incarnation": "one", "secret": one}
                assert (await http.post("/owners", json=body, headers=AUTH)).status_code == 200
                body.update(incarnation="two", secret=two)
                assert (await http.post("/owners", json=body, headers=AUTH)).status_code == 200
                stale = await http.post(
                    "/owners/h/deregister", json={"incarnation": "one", "secret": one}, headers=AUTH
                )
                assert (stale.status_code, stale.json()["code"]) == (409, "OWNER_RESTARTED")
                done = await http.post(
                    "/owners/h/deregister", json={"incarnation": "two", "secret": two}, headers=AUTH
                )
                assert done.json() == {"type": "Deregistered", "owner": "h", "released": 0,
                                       "no_op": False}  # fmt: skip
        records = [record async for record in store.iterate(after=0)]
    lives = OwnerRegistered | OwnerDeregistered | OwnerLeaseExpired
    owners = [(type(r.event).__name__, r.event.owner) for r in records
              if isinstance(r.event, lives)]  # fmt: skip
    assert owners == [
        ("OwnerRegistered", "clean"),
        ("OwnerDeregistered", "clean"),
        ("OwnerRegistered", "w"),
        ("OwnerRegistered", "w"),  # the second incarnation: it replaced the first
        ("OwnerDeregistered", "w"),  # the second one's clean exit
        ("OwnerRegistered", "h"),
        ("OwnerRegistered", "h"),
        ("OwnerDeregistered", "h"),
    ]
    causes = {r.event.session: r.event.cause for r in records
              if isinstance(r.event, SessionReleased)}  # fmt: skip
    assert causes == {
        "c1": "closed",
        "c2": "owner_exited",
        "f1": "owner_restarted",
        "g1": "owner_exited",
    }
    found = incidents(records)
    assert {(i.kind, i.subject) for i in found if "owner" in i.subject} == {
        ("owner_restarted", "owner w"),
        ("owner_restarted", "owner h"),
    }


async def test_one_client_carrying_two_lives_of_an_owner_charges_each_its_own(
    tmp_path: Path,
) -> None:
    """A worker restarted in the same process shares the HttpLedger with its predecessor,
    which may still renew (a zombie). The zombie's refusal is its own: the successor's renewals
    go on, and its in-flight counts reach serve even when the zombie renewed in the same
    window (CI once saw the successor refused ``OWNER_RESTARTED`` for its predecessor)."""
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        served(store) as (ledger, _, remote),
    ):
        await remote.register_owner("w", incarnation="one")
        await remote.register_owner("w", incarnation="two")  # replaces "one"
        remote.renew_lease("w", {("e0", 1): 2}, incarnation="two")
        remote.renew_lease("w", {("e0", 1): 5}, incarnation="one")  # the same window
        await wait_for(
            "the client to learn that renewals of life one are refused",
            lambda: renewal_refused(remote, "w", "one", Code.OWNER_RESTARTED),
        )
        remote.renew_lease("w", {("e0", 1): 2}, incarnation="two")  # never refused
        counted = [InFlight(reporter="w", engine="e0", count=2, at=mock.ANY)]
        await wait_for(
            "serve to count life two's two requests in flight",
            lambda: ledger.inflight_evidence(1) == counted,
        )
        [bound] = await remote.execute_many([Bind(session="s", owner="w", incarnation="two")])
        assert isinstance(bound, Bound) and bound.version_id == 1
