"""A remote owner's in-flight counts ride the renewal timer, except a count the ledger may hold
at zero: that one reaches the ledger before its request is sent (publisher/remote/renewals.py).

A count that reached the ledger only at the next tick would leave a window, up to one renewal
interval, in which a reclaim could unload a version with a request running on it (a session
released while its turn runs, an owner life replaced). So the sender of each attempt here looks
at serve's evidence *at once*, without waiting: what the reclaim would read at that moment.

Real parts: serve's app over a real ledger (SQLite) on a loopback port, ``HttpLedger``, a
``RolloutWorker`` over it and the gateway's executor with a real local engine in its fleet; the
attempt's sender is the test's own (it only looks, and holds a request while told to)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import pytest

from engines.local.engine import LocalEngine
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
TOKEN = "counts-ride-the-timer-token"
WORKER_RENEWS_EVERY_S = 600.0  # the worker's own periodic renewal never comes in a test
LEASE_TTL_S = 3600.0


def counted(ledger: Ledger, version_id: int) -> int:
    """What serve's reclaim would read now: the requests reported in flight on the version."""
    return sum(report.count for report in ledger.inflight_evidence(version_id))


@asynccontextmanager
async def remote_worker(
    tmp_path: Path, renew_interval: float
) -> AsyncIterator[tuple[Ledger, HttpLedger, Gateway, RolloutWorker, Bound]]:
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        Ledger.open(store) as ledger,
    ):
        await create(ledger)
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with (
            serve_app(app) as url,
            HttpLedger.connect(url, token=TOKEN, renew_interval=renew_interval) as remote,
            LocalEngine("e0") as engine,
        ):
            gateway = Gateway(Fleet([engine]), remote.view, gateway_id="gw")
            async with RolloutWorker.open(
                remote, gateway, owner="w", ttl_s=LEASE_TTL_S, renew_every=WORKER_RENEWS_EVERY_S
            ) as w:
                [bound] = await w.bind_many([w.session("s")])
                assert isinstance(bound, Bound) and bound.version_id == 1
                yield ledger, remote, gateway, w, bound


async def test_a_first_count_is_on_the_ledger_when_the_request_is_sent_and_later_ones_batch(
    tmp_path: Path,
) -> None:
    """An interval far longer than the test: the first request on the version waits for its
    renewal's answer; a second one while the first runs rides the timer (no round trip of its
    own), and the ledger still counts the version held all along."""
    async with remote_worker(tmp_path, renew_interval=600.0) as (ledger, remote, gateway, w, b):
        release_first = anyio.Event()
        seen_at_send: list[tuple[int, int]] = []  # (counted by serve, renewals sent)

        async def held(attempt: Attempt) -> str:
            seen_at_send.append((counted(ledger, 1), remote.renewals_sent))
            await release_first.wait()
            return attempt.engine_id

        async def looked(attempt: Attempt) -> str:
            seen_at_send.append((counted(ledger, 1), remote.renewals_sent))
            return attempt.engine_id

        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(gateway.dispatch, b, held, owner=w))
            await wait_for("the first request to be sent", lambda: len(seen_at_send) == 1)
            assert seen_at_send[0][0] == 1, "the first count was not on the ledger at its send"
            assert await gateway.dispatch(b, looked, owner=w) == "e0"
            release_first.set()
        [first, second] = seen_at_send
        assert second[0] >= 1, "the version looked idle to serve while a request ran on it"
        assert second[1] == first[1], "a request on a version the ledger counts cost a renewal"


async def test_after_the_ledger_heard_zero_the_next_count_is_on_it_before_the_send(
    tmp_path: Path,
) -> None:
    """A short interval: once a tick told serve the version has nothing in flight, the next
    request on it is that version's first again. A client that kept the version as counted
    would send it with serve still reading zero until the next tick."""
    async with remote_worker(tmp_path, renew_interval=0.05) as (ledger, _, gateway, w, b):
        at_send: list[int] = []

        async def looked(attempt: Attempt) -> str:
            at_send.append(counted(ledger, 1))
            return attempt.engine_id

        for turn in range(3):
            assert await gateway.dispatch(b, looked, owner=w) == "e0"
            w.report()  # as a session's turn does when it ends: the count fell to zero
            await wait_for(
                f"a tick to tell serve that turn {turn} ended", lambda: counted(ledger, 1) == 0
            )
        assert at_send == [1, 1, 1], "a request was sent while serve counted nothing on it"
