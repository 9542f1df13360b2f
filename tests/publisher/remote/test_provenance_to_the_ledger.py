"""Provenance rows of a process beside the ledger reach the store beside the log: at least
once (a batch whose reply was lost is sent again), stored once (the row id is the store's
key), and never holding an exit forever when the ledger is gone (rows it did not take are
logged, by id, as an error).

Real parts: serve's app over a real ledger (SQLite) with its provenance store, on a loopback
port, and ``HttpLedger``. The stand-in is the network under the client: it delivers the
request and drops the reply (the ledger stored the rows; the client never heard), or is down
for provenance -- a lost reply cannot be produced on demand otherwise."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import structlog.testing

from evlog.provenance_store import ProvenanceStore, open_provenance
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.gateway.provenance import ProvenanceRecorder, ProvenanceRow, decode_stored
from publisher.remote.http import HttpLedger, HttpTransport, ServiceClient
from tests.publisher.openai_kit import serve_app
from tests.tools.test_audit import _row
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "provenance-token"


class LossyNetwork(httpx.AsyncBaseTransport):
    """The loopback network, except for ``POST /provenance``: ``lose`` replies are dropped
    after the ledger answered (the request ran there), or, ``down``, nothing gets through."""

    def __init__(self, *, lose: int = 0, down: bool = False) -> None:
        self.real = httpx.AsyncHTTPTransport()
        self.lose = lose
        self.down = down
        self.posted = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/provenance":
            return await self.real.handle_async_request(request)
        self.posted += 1
        if self.down:
            raise httpx.ConnectError("the ledger is down", request=request)
        reply = await self.real.handle_async_request(request)
        await reply.aread()
        if self.lose > 0:
            self.lose -= 1
            await reply.aclose()
            raise httpx.ReadError("the reply was lost on the way back", request=request)
        return reply

    async def aclose(self) -> None:
        await self.real.aclose()


@asynccontextmanager
async def ledger_with_store(path: Path) -> AsyncIterator[tuple[str, ProvenanceStore]]:
    """serve's app over a ledger and its provenance store beside the log; yields its URL."""
    async with (
        SQLiteStore.open(path) as store,
        Ledger.open(store) as ledger,
        open_provenance(path) as provenance,
    ):
        app = build_app(
            ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN, provenance=provenance
        )
        async with serve_app(app) as url:
            yield url, provenance


@asynccontextmanager
async def remote(url: str, network: LossyNetwork) -> AsyncIterator[HttpLedger]:
    client = httpx.AsyncClient(
        base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, transport=network
    )
    service = ServiceClient(url, token=TOKEN, client=client)
    ledger = HttpLedger(HttpTransport(service))
    ledger.provenance_resend_s = (0.01, 0.05)
    try:
        async with ledger.running():
            yield ledger
    finally:
        await service.aclose()


def _rows(n: int) -> list[ProvenanceRow]:
    return [_row("s", turn, 1, started=1000.0 + turn, row_id=f"row-{turn}") for turn in range(n)]


async def test_a_batch_whose_reply_was_lost_is_sent_again_and_stored_once(
    tmp_path: Path,
) -> None:
    network = LossyNetwork(lose=2)
    async with ledger_with_store(tmp_path / "ledger.db") as (url, store):
        async with (
            remote(url, network) as ledger,
            ProvenanceRecorder(ledger.provenance_sink()) as recorder,
        ):
            for row in _rows(3):
                await recorder.record(row)
        assert recorder.written == 3 and recorder.abandoned == 0
        assert network.posted == 3  # sent, reply lost, twice; the third reply arrived
        assert ledger.provenance_round_trips == 3
        stored = decode_stored(await store.read())
    assert [r.row_id for r in stored] == ["row-0", "row-1", "row-2"]  # each once


async def test_rows_of_concurrent_callers_share_round_trips(tmp_path: Path) -> None:
    network = LossyNetwork()
    async with ledger_with_store(tmp_path / "ledger.db") as (url, store):
        async with remote(url, network) as ledger:
            async with anyio.create_task_group() as tg:
                for k in range(20):
                    tg.start_soon(
                        ledger.store_provenance, [_row(f"s{k}", 0, 1, started=1.0, row_id=f"{k}")]
                    )
            assert ledger.provenance_round_trips < 20
        assert await store.count() == 20


async def test_an_exit_does_not_wait_forever_for_a_ledger_that_is_gone(tmp_path: Path) -> None:
    """The recorder's drain timeout: the rows the ledger never took are counted and logged
    with their ids once it runs out, and the exit goes on."""
    network = LossyNetwork(down=True)
    async with ledger_with_store(tmp_path / "ledger.db") as (url, store):
        async with remote(url, network) as ledger:
            with anyio.fail_after(20), structlog.testing.capture_logs() as logs:
                async with ProvenanceRecorder(
                    ledger.provenance_sink(), drain_timeout_s=0.3
                ) as recorder:
                    for row in _rows(2):
                        await recorder.record(row)
        assert (recorder.written, recorder.abandoned, recorder.pending) == (0, 2, 0)
        assert network.posted >= 2  # it kept trying until the timeout
        assert await store.count() == 0
    unsent = [x for x in logs if x["event"] == "provenance.unsent"]
    assert len(unsent) == 1 and unsent[0]["log_level"] == "error", logs
    assert "row-0" in str(unsent[0]), unsent


async def test_a_ledger_without_a_store_refuses_and_the_recorder_fails_loudly(
    tmp_path: Path,
) -> None:
    """Not a reason to send again: the refusal fails the recorder's writer, which ends the
    recorder's block with that error (as a sink that cannot write does), rather than rows
    being buffered into nowhere."""

    async def record_and_wait(ledger: HttpLedger) -> None:
        async with ProvenanceRecorder(ledger.provenance_sink()) as recorder:
            await recorder.record(_rows(1)[0])
            await anyio.sleep_forever()  # until the writer's failure ends the block

    async with SQLiteStore.open(tmp_path / "ledger.db") as store, Ledger.open(store) as led:
        app = build_app(led, LedgerMetrics(lambda: led.state), token=TOKEN)
        async with serve_app(app) as url, remote(url, LossyNetwork()) as ledger:
            with anyio.fail_after(20), pytest.raises(BaseExceptionGroup) as info:
                await record_and_wait(ledger)
    assert "keeps no provenance store" in repr(info.value)
