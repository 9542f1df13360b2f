"""A remote gateway's newly admitted request is counted by the ledger before it ends: the
executor records the owner's new in-flight count (``owner.report()``) before the attempt is
sent, and the remote client forwards it before the attempt leaves (the first count on a
version: publisher/remote/renewals.py) or within one renewal interval, not at the end of the
turn nor at the worker's next periodic renewal. Were the count forwarded only then, the ledger
would see no request in flight on the version for as long as the turn runs, and could unload it
under the request.

Real parts: serve's app over a real ledger (SQLite) on a loopback port, ``HttpLedger``, a
``RolloutWorker`` over it and the gateway's executor with a real local engine in its fleet. The
attempt's sender is the test's own: it holds the request "on the engine" until serve has
counted it, so the request is in flight for as long as the check takes."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from engines.local.engine import LocalEngine
from evlog.events import InFlight
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound
from publisher.drivers.fleet import Fleet
from publisher.gateway import Attempt, Gateway
from publisher.remote.http import HttpLedger
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import serve_app
from tests.publisher.ray.kit import create
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "inflight-at-admission-token"
# The client forwards at most one renewal per RENEW_INTERVAL_S; the worker's own periodic
# renewal comes every WORKER_RENEWS_EVERY_S, and the turn ends only once serve counted it. The
# test waits far longer than one renewal interval (a loaded machine is slow) and far less than
# the worker's period: only a count forwarded at admission arrives in time.
RENEW_INTERVAL_S = 0.2
COUNTED_WITHIN_S = 30.0
WORKER_RENEWS_EVERY_S = 600.0
LEASE_TTL_S = 3600.0


async def test_a_request_admitted_by_a_remote_gateway_is_counted_by_the_ledger_while_it_runs(
    tmp_path: Path,
) -> None:
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        Ledger.open(store) as ledger,
    ):
        await create(ledger)
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with (
            serve_app(app) as url,
            HttpLedger.connect(url, token=TOKEN, renew_interval=RENEW_INTERVAL_S) as remote,
            LocalEngine("e0") as engine,
        ):
            gateway = Gateway(Fleet([engine]), remote.view, gateway_id="gw")
            async with RolloutWorker.open(
                remote, gateway, owner="w", ttl_s=LEASE_TTL_S, renew_every=WORKER_RENEWS_EVERY_S
            ) as w:
                [bound] = await w.bind_many([w.session("s")])
                assert isinstance(bound, Bound) and bound.version_id == 1
                running = [InFlight(reporter="w", engine="e0", count=1, at=mock.ANY)]

                async def held_on_the_engine(attempt: Attempt) -> str:
                    await wait_for(
                        "serve to count the admitted request in flight",
                        lambda: ledger.inflight_evidence(1) == running,
                        timeout=COUNTED_WITHIN_S,
                    )
                    return attempt.engine_id

                assert await gateway.dispatch(bound, held_on_the_engine, owner=w) == "e0"
