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
counted it, so the request is in flight for as long as the check takes.

A count rides the renewal timer only where the ledger already counts a request on that engine
and version from this owner's life; a count the ledger may hold at zero reaches it before its
request is sent (publisher/remote/renewals.py). A count that reached the ledger only at the next
tick would leave a window, up to one renewal interval, in which a reclaim could unload a version
with a request running on it (a session released while its turn runs, an owner life replaced):
the later tests' senders look at serve's evidence at once, without waiting, as a reclaim would
read it at that moment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from unittest import mock

import anyio
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


def counted(ledger: Ledger, version_id: int) -> int:
    """What serve's reclaim would read now: the requests reported in flight on the version."""
    return sum(report.count for report in ledger.inflight_evidence(version_id))


@asynccontextmanager
async def remote_worker(
    tmp_path: Path, renew_interval: float
) -> AsyncIterator[tuple[Ledger, HttpLedger, Gateway, RolloutWorker, Bound]]:
    """serve's app over a real ledger with one version, an ``HttpLedger`` renewing every
    ``renew_interval``, a worker over it with session ``s`` bound, and the gateway."""
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


async def test_a_request_admitted_by_a_remote_gateway_is_counted_by_the_ledger_while_it_runs(
    tmp_path: Path,
) -> None:
    async with remote_worker(tmp_path, RENEW_INTERVAL_S) as (ledger, _, gateway, w, bound):
        running = [InFlight(reporter="w", engine="e0", count=1, at=mock.ANY)]

        async def held_on_the_engine(attempt: Attempt) -> str:
            await wait_for(
                "serve to count the admitted request in flight",
                lambda: ledger.inflight_evidence(1) == running,
                timeout=COUNTED_WITHIN_S,
            )
            return attempt.engine_id

        assert await gateway.dispatch(bound, held_on_the_engine, owner=w) == "e0"


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
