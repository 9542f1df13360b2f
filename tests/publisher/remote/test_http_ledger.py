"""The remote ledger over serve's HTTP routes: what its HTTP transport adds to the one remote
client -- bodies kept under serve's cap, refusals in place, a refresh's failure heard by every
caller that waited for it.

Real parts: serve's app over a real ledger (SQLite), on a loopback port, and ``HttpLedger``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from evlog.errors import INVALID_INPUT, LoraLedgerError
from evlog.sqlite import SQLiteStore
from publisher.core import commands as c
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound
from publisher.remote.http import HttpLedger, HttpTransport, LedgerUnreachable, ServiceClient
from tests.publisher.openai_kit import serve_app
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "http-ledger-token"


@asynccontextmanager
async def served(path: Path) -> AsyncIterator[HttpLedger]:
    """serve's app over a ledger with version 1 committed, and an ``HttpLedger`` of it."""
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0",))
        await ledger.join_engine("e0", "life-1")
        await ledger.repair_engine("e0", "life-1")
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with serve_app(app) as url, HttpLedger.connect(url, token=TOKEN) as remote:
            yield remote


async def test_a_burst_larger_than_one_body_is_sent_in_several_in_order(tmp_path: Path) -> None:
    """5,000 first turns at once with session ids of 200 characters: one coalesced group is
    well over serve's 1 MiB cap on a ledger route, which would refuse the whole group (413,
    not retryable: every caller's first turn failed). The transport sends it in bodies under
    the cap; every bind is answered."""
    async with served(tmp_path / "ledger.db") as remote:
        await remote.register_owner("w")
        sessions = [f"{k:05d}-" + "s" * 194 for k in range(5000)]
        results = await remote.execute_many([c.Bind(session=s, owner="w") for s in sessions])
        assert all(isinstance(r, Bound) and r.version_id == 1 for r in results)
        assert [r.session for r in results if isinstance(r, Bound)] == sessions


async def test_a_relays_renewal_brings_every_session_it_touched_under_the_cap(
    tmp_path: Path,
) -> None:
    """A relay (an OpenAI face, ``sessions_idle_s`` given) names the client-held sessions it
    had a turn of with its renewal: 5,000 at once with ids of 200 characters are over serve's
    1 MiB cap on one body, so the transport sends them in several; every one reaches the
    ledger's process, which keeps its last turn (soft state, nothing logged)."""
    async with SQLiteStore.open(tmp_path / "ledger.db") as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0",))
        await ledger.join_engine("e0", "life-1")
        await ledger.repair_engine("e0", "life-1")
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with serve_app(app) as url, HttpLedger.connect(url, token=TOKEN) as remote:
            await remote.register_owner("face", incarnation="a", sessions_idle_s=60.0)
            assert ledger.state.owners["face"].sessions_idle_s == 60.0
            sessions = [f"{k:05d}-" + "s" * 194 for k in range(5000)]
            bound = await remote.execute_many(
                [c.Bind(session=s, owner="face", incarnation="a") for s in sessions]
            )
            assert all(isinstance(b, Bound) for b in bound)
            seq = ledger.state.last_seq
            remote.renew_lease("face", {("e0", 1): 3}, incarnation="a", sessions=sessions)
            await wait_for("every session's turn heard", lambda: len(ledger.activity) == 5000)
            assert ledger.state.last_seq == seq  # nothing logged for a turn
            assert ledger.inflight_evidence(1)[0].count == 3


async def test_a_command_a_gateway_does_not_send_is_refused_in_place(tmp_path: Path) -> None:
    """Only that command is refused: the binds beside it in the group are answered."""
    async with served(tmp_path / "ledger.db") as remote:
        await remote.register_owner("w")
        bound, stray, again = await remote.execute_many(
            [
                c.Bind(session="s1", owner="w"),
                c.Allocate(version_id=2, digest="0" * 64),
                c.Bind(session="s2", owner="w"),
            ]
        )
        assert isinstance(bound, Bound) and isinstance(again, Bound)
        assert isinstance(stray, LoraLedgerError) and stray.code == INVALID_INPUT


async def test_a_refresh_that_fails_fails_every_caller_that_waited_for_it() -> None:
    """Callers during a refresh wait for that one read; when it fails they hear it too, never
    returning as if their copy were fresh (the OpenAI face would judge a model on it)."""
    release = anyio.Event()

    async def hang_up(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.receive()  # the request is in
            await release.wait()  # ... and never answered

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    service = ServiceClient(f"http://127.0.0.1:{port}", token=None, timeout_s=30)
    view = HttpLedger(HttpTransport(service)).view
    heard: list[str] = []

    async def refresh(who: str) -> None:
        try:
            await view.refresh()
            heard.append(f"{who}: fresh")
        except LedgerUnreachable:
            heard.append(f"{who}: unreachable")

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hang_up)
        async with anyio.create_task_group() as callers:
            callers.start_soon(refresh, "leader")
            await anyio.wait_all_tasks_blocked()
            callers.start_soon(refresh, "follower")
            await anyio.wait_all_tasks_blocked()
            release.set()
        tg.cancel_scope.cancel()
    await service.aclose()
    assert sorted(heard) == ["follower: unreachable", "leader: unreachable"]
    assert view.refreshes == 0


async def test_a_remote_view_hears_of_an_outage_within_a_second_without_a_reply(
    tmp_path: Path,
) -> None:
    """A gateway process learns routing with its replies and its periodic status read (here an
    hour apart); the long poll on ``GET /routing`` brings an engine's outage as the ledger
    records it, and answers 204 while nothing changes."""
    async with SQLiteStore.open(tmp_path / "ledger.db") as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0", "e1"))
        for engine in ("e0", "e1"):
            await ledger.join_engine(engine, f"{engine}-life-1")
            await ledger.repair_engine(engine, f"{engine}-life-1")
        v1 = await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with (
            serve_app(app) as url,
            HttpLedger.connect(url, token=TOKEN, refresh_interval=3600.0) as remote,
        ):
            await remote.refresh()
            assert remote.view.holders(v1.lora_name) == ("e0", "e1")
            unchanged = await remote.transport.wait_routing(remote.view.mark, 0.2)
            assert unchanged is None  # 204: the table the caller has is the current one
            at = ledger.clock()
            await ledger.report_unreachable(
                "e1", "e1-life-1", at=at, error="ENGINE_UNREACHABLE: refused", source="probe"
            )
            await wait_for(
                "the remote view routes around e1",
                lambda: remote.view.holders(v1.lora_name) == ("e0",),
                timeout=10,
            )
            print(f"\noutage recorded -> remote view: {ledger.clock() - at:.3f} s")
            await ledger.report_reachable("e1", "e1-life-1", at=ledger.clock())
            await wait_for(
                "e1 back in the remote view",
                lambda: remote.view.holders(v1.lora_name) == ("e0", "e1"),
            )


async def test_a_long_poll_with_a_bad_wait_or_mark_is_refused(tmp_path: Path) -> None:
    """``GET /routing?wait=W&epoch=E&serial=S``: a wait that is not a finite number of seconds
    >= 0, or a mark that is not two integers, is a 400 naming the parameters."""
    async with served(tmp_path / "ledger.db") as remote:
        service = remote.transport.service
        for query in ("wait=-1", "wait=nan", "wait=x", "wait=1&epoch=1", "wait=1&epoch=a&serial=1"):
            with pytest.raises(LoraLedgerError) as refused:
                await service.get(f"/routing?{query}", dict)
            assert refused.value.code == INVALID_INPUT, query
        table = await service.get_optional("/routing?wait=0", dict)
        assert table is not None and "holders" in table
