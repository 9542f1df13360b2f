"""The one remote ledger client (publisher/remote/client.py), rule by rule: coalesced round
trips, forwarded renewals and their refusals, engine trouble reports, provenance resends, the
routing copy, a clean exit.

Real parts: serve's app over a real ledger (SQLite) and ``HttpLedger``'s transport, the app
reached in process through httpx's ASGI transport (no socket, no server to stop: seconds per
test, so the mutation campaign can run them for every mutant)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import pytest
import structlog.testing

from engines.contract import AmbiguousReply, CleanRefusal, EngineError, ErrorCode
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, StoreCode
from evlog.provenance_store import open_provenance
from evlog.sqlite import SQLiteStore
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound
from publisher.remote.client import Answered, RemoteLedger, RemoteView, Renewed, Transport
from publisher.remote.http import HttpLedger, HttpTransport, LedgerUnreachable, ServiceClient
from publisher.remote.renewals import Counts, Life
from publisher.remote.routing import Mark, RoutingTable
from publisher.remote.service import TroubleBatch
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tests.tools.test_audit import _row
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


class Link:
    """The network between the client and serve's app, in process. A path ``hold``-ed waits
    until released (the request is in, not answered); a path ``cut`` raises a connection
    error (no reply: the client cannot tell whether it ran); a path ``refuse``-d answers the
    given error body. Every request's path is kept, in order (``seen``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.real = httpx.ASGITransport(app=app)
        self.held: dict[str, anyio.Event] = {}
        self.cut: set[str] = set()
        self.drops: dict[str, int] = {}  # path -> how many requests more get no reply
        self.refused: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.seen: list[str] = []
        # path (or "poll": the routing's long poll) -> its replies held until the event is set
        self.late: dict[str, anyio.Event] = {}

    def hold(self, path: str) -> None:
        self.held[path] = anyio.Event()

    def release(self, path: str) -> None:
        self.held.pop(path).set()

    def refuse(self, path: str, code: str, times: int = 1, status: int = 503) -> None:
        body = {"code": code, "message": f"{code} for the test", "details": {}}
        self.refused.setdefault(path, []).extend([(status, body)] * times)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.seen.append(path)
        if path in self.cut or self.drops.get(path, 0) > 0:
            self.drops[path] = self.drops.get(path, 0) - 1
            raise httpx.ConnectError(f"{path}: the link is cut", request=request)
        if self.refused.get(path):
            status, body = self.refused[path].pop(0)
            return httpx.Response(status, content=json.dumps(body).encode())
        gate = self.held.get(path)
        if gate is not None:
            await gate.wait()
            if path in self.cut:
                raise httpx.ReadError(f"{path}: the reply was lost", request=request)
        reply = await self.real.handle_async_request(request)
        poll = path == "/routing" and "wait" in request.url.params
        while (late := self.late.get("poll" if poll else path)) is not None:
            await late.wait()  # answered there, not back yet
        return reply


class Recording(HttpTransport):
    """``HttpLedger``'s own transport, keeping what the client hands it: each execute's mark
    and each trouble report's batch (what the wire then carries is the transport's affair)."""

    def __init__(self, service: ServiceClient) -> None:
        super().__init__(service)
        self.marks: list[Mark | None] = []
        self.renewal_marks: list[Mark | None] = []
        self.renewal_sessions: list[dict[Life, tuple[str, ...]]] = []
        self.batches: list[TroubleBatch] = []

    async def renew(
        self,
        lives: Mapping[Life, Counts],
        mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]],
        secrets: Mapping[Life, str],
    ) -> Renewed:
        self.renewal_marks.append(mark)
        self.renewal_sessions.append({life: tuple(ids) for life, ids in sessions.items()})
        return await super().renew(lives, mark, sessions, secrets)

    async def execute(self, commands: Sequence[c.Command], mark: Mark | None) -> Answered:
        self.marks.append(mark)
        return await super().execute(commands, mark)

    async def report_trouble(self, engine_id: str, error: EngineError, batch: TroubleBatch) -> None:
        self.batches.append(batch)
        await super().report_trouble(engine_id, error, batch)


class _Transport(httpx.AsyncBaseTransport):
    def __init__(self, link: Link) -> None:
        self.link = link

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.link.handle_async_request(request)


def app_of(ledger: Ledger, **options: Any) -> Any:
    return build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN, **options)


@asynccontextmanager
async def remote_of(
    target: Ledger | Link, *, deregister_on_exit: bool = True, **options: Any
) -> AsyncIterator[HttpLedger]:
    """An ``HttpLedger`` of serve's app (over ``target``, a ledger or the link to its app),
    running."""
    link = target if isinstance(target, Link) else Link(app_of(target))
    http = httpx.AsyncClient(
        transport=_Transport(link),
        base_url=URL,
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    service = ServiceClient(URL, token=TOKEN, client=http)
    remote = HttpLedger(Recording(service), **options)
    try:
        async with remote.running(deregister_on_exit=deregister_on_exit):
            yield remote
    finally:
        await service.aclose()


NO_TRANSPORT = cast(Transport, object())  # for what the client decides before any call


def table(serial: int, holders: dict[str, tuple[str, ...]], *, epoch: int = 1) -> RoutingTable:
    return RoutingTable(epoch=epoch, serial=serial, default_revision=serial, holders=holders)


# --- construction -----------------------------------------------------------------------------


def test_the_documented_defaults() -> None:
    remote = RemoteLedger(NO_TRANSPORT)
    assert (remote.max_in_flight, remote.max_batch) == (2, 4096)
    assert (remote.renew_interval, remote.refresh_interval) == (0.5, 1.0)
    assert (remote.confirm_timeout, remote.count_timeout) == (None, 2.0)
    assert remote.provenance_resend_s == (0.1, 5.0)
    assert (remote.round_trips, remote.renewals_sent, remote.provenance_round_trips) == (0, 0, 0)
    assert (remote.routing_polls, remote.unconfirmed) == (0, 0)


@pytest.mark.parametrize("name", ["max_in_flight", "max_batch"])
def test_a_bound_under_one_is_refused(name: str) -> None:
    RemoteLedger(NO_TRANSPORT, **{name: 1})  # one is enough
    with pytest.raises(InvalidInput) as refused:
        RemoteLedger(NO_TRANSPORT, **{name: 0})
    assert refused.value.code == INVALID_INPUT
    assert refused.value.message == "max_in_flight and max_batch must be >= 1"


@pytest.mark.parametrize(
    "name", ["renew_interval", "refresh_interval", "confirm_timeout", "count_timeout"]
)
def test_a_time_that_is_not_a_finite_number_from_zero_is_refused(name: str) -> None:
    zero: dict[str, Any] = {name: 0.0}
    assert getattr(RemoteLedger(NO_TRANSPORT, **zero), name) == 0.0
    for bad in (-0.001, math.nan, math.inf):
        options: dict[str, Any] = {name: bad}
        with pytest.raises(InvalidInput) as refused:
            RemoteLedger(NO_TRANSPORT, **options)
        assert refused.value.code == INVALID_INPUT
        assert refused.value.message == f"{name} must be a finite number >= 0", bad


@pytest.mark.parametrize("name", ["refresh_interval", "confirm_timeout"])
def test_none_turns_a_timer_off(name: str) -> None:
    off: dict[str, Any] = {name: None}
    assert getattr(RemoteLedger(NO_TRANSPORT, **off), name) is None


# --- the routing copy -------------------------------------------------------------------------


def test_a_view_that_read_nothing_yet_routes_nowhere_and_has_no_status() -> None:
    view = RemoteView(NO_TRANSPORT)
    assert (view.mark, view.table, view.holders("a"), view.incarnation("e0")) == (
        None,
        None,
        (),
        "",
    )
    assert (view.default_revision, view.max_staleness, view.refreshes) == (0, None, 0)
    with pytest.raises(LedgerError) as closed:
        view.status()
    assert closed.value.code == Code.LEDGER_CLOSED
    assert closed.value.message == "no status read from the ledger yet"
    assert not view.knows_unbound("s1")  # the status lists no sessions


def test_a_view_keeps_the_newest_table_whatever_order_replies_arrive_in() -> None:
    view = RemoteView(NO_TRANSPORT)
    view.take(None)
    assert view.table is None
    second = RoutingTable(
        epoch=1,
        serial=2,
        default_revision=7,
        holders={"a": ("e0", "e1")},
        max_staleness=3,
        incarnations={"e0": "life-1"},
    )
    view.take(second)
    assert view.table is second and view.mark == (1, 2)
    assert (view.holders("a"), view.holders("b"), view.default_revision) == (("e0", "e1"), (), 7)
    assert (view.max_staleness, view.incarnation("e0"), view.incarnation("e9")) == (
        3,
        "life-1",
        "",
    )
    view.take(table(1, {}))  # an older reply, arriving late
    view.take(table(2, {}))  # the same mark: the same table
    view.take(None)  # unchanged since the caller's mark
    assert view.table is second
    newer = table(1, {"a": ("e1",)}, epoch=2)  # a later controller's first table
    view.take(newer)
    assert view.table is newer


# --- commands ---------------------------------------------------------------------------------


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


@pytest.mark.parametrize(("max_batch", "round_trips"), [(3, 4), (4, 2), (8, 1)])
async def test_a_round_trip_carries_whole_callers_up_to_max_batch_commands(
    tmp_path: Path, max_batch: int, round_trips: int
) -> None:
    """Four callers of two commands each: as many callers per round trip as ``max_batch``
    holds (a caller's commands are never split); a caller larger than it still goes alone."""
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, max_in_flight=1, max_batch=max_batch) as remote,
    ):
        await remote.register_owner("w")
        before = remote.round_trips
        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(
                    remote.execute_many,
                    [c.Bind(session=f"s{k}-a", owner="w"), c.Bind(session=f"s{k}-b", owner="w")],
                )
        assert remote.round_trips - before == round_trips
        big = [c.Bind(session=f"big-{k}", owner="w") for k in range(max_batch + 1)]
        results = await remote.execute_many(big)
        assert all(isinstance(r, Bound) for r in results) and len(results) == len(big)
        assert remote.round_trips - before == round_trips + 1


async def test_no_commands_cost_no_round_trip_and_a_client_not_running_refuses(
    tmp_path: Path,
) -> None:
    remote = RemoteLedger(NO_TRANSPORT)
    assert await remote.execute_many([]) == []
    with pytest.raises(LedgerError) as closed:
        await remote.execute_many([c.Bind(session="s1", owner="w")])
    assert closed.value.code == Code.LEDGER_CLOSED
    assert closed.value.message == "the ledger client is not connected"
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        async with remote_of(ledger) as running:
            before = running.round_trips
            assert await running.execute_many([]) == []
            assert running.round_trips == before
        with pytest.raises(LedgerError) as after:
            await running.execute_many([c.Bind(session="s1", owner="w")])
        assert after.value.code == Code.LEDGER_CLOSED


async def test_execute_returns_the_outcome_or_raises_the_refusal(tmp_path: Path) -> None:
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, refresh_interval=None) as remote,
    ):
        await remote.register_owner("w")
        bound = await remote.execute(c.Bind(session="s1", owner="w"))
        assert isinstance(bound, Bound) and bound.version_id == 1
        with pytest.raises(LoraLedgerError) as refused:
            await remote.execute(c.Allocate(version_id=2, digest="0" * 64))
        assert refused.value.code == INVALID_INPUT
        assert remote.view.status().sessions_bound == 0  # the copy read at connect
        status = await remote.status()  # read now, not the view's copy
        assert (status.sessions_bound, status.last_seq) == (1, ledger.state.last_seq)


async def test_a_round_trip_with_no_reply_fails_every_caller_of_it_and_the_next_goes_on(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, max_in_flight=1) as remote:
            await remote.register_owner("w")
            link.cut.add("/sessions/commands")
            heard: list[str] = []

            async def caller(k: int) -> None:
                try:
                    await remote.execute_many([c.Bind(session=f"s{k}", owner="w")])
                    heard.append("answered")
                except LedgerUnreachable:
                    heard.append("unreachable")

            async with anyio.create_task_group() as tg:
                for k in range(3):
                    tg.start_soon(caller, k)
            assert heard == ["unreachable"] * 3
            assert link.seen.count("/sessions/commands") == 1  # one group, sent once
            link.cut.clear()
            assert isinstance(await remote.execute(c.Bind(session="s0", owner="w")), Bound)


# --- engine trouble ---------------------------------------------------------------------------


class Heard:
    """The reconciler's ``engine_trouble``, as serve's service calls it: every report kept,
    with when it arrived."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def __call__(
        self,
        engine_id: str,
        error: EngineError,
        /,
        *,
        incarnation: str = "",
        failures: tuple[Any, ...] = (),
        age_s: float = 0.0,
        reporter: str = "",
    ) -> None:
        self.reports.append(
            {
                "engine": engine_id,
                "code": error.code,
                "clean": error.clean,
                "dispatched": error.dispatched,
                "incarnation": incarnation,
                "failures": [(f.session, f.not_run, f.ambiguous) for f in failures],
                "age_s": age_s,
                "reporter": reporter,
                "at": time.monotonic(),
            }
        )

    def by_code(self) -> dict[str, dict[str, Any]]:
        return {r["code"]: r for r in self.reports}


TROUBLE = "/engines/e0/trouble"


async def test_engine_trouble_goes_one_report_per_engine_and_kind_at_a_time(
    tmp_path: Path,
) -> None:
    """While a report of one kind is on its way, the next errors of that kind wait and their
    failed turns are counted per session, to go with the next report (dated by its first
    error); a report of another kind (could not reach it, lacks the adapter) does not wait.
    Each report names the life it was routed to and the owners that report."""
    heard = Heard()
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger, report_trouble=heard))
        async with remote_of(link) as remote:
            await remote.register_owner("w2")
            await remote.register_owner("w1")
            link.hold(TROUBLE)
            failed_at = {"TIMEOUT": time.monotonic()}
            remote.engine_failed("e0", AmbiguousReply("TIMEOUT", "no answer"), session="s1")
            await wait_for("the first report sent", lambda: link.seen.count(TROUBLE) == 1)
            failed_at["ENGINE_5XX"] = time.monotonic()
            later = AmbiguousReply("ENGINE_5XX", "HTTP 502")
            remote.engine_failed("e0", later, session="s1", incarnation="life-1")
            seen_by = time.monotonic()  # the error's time is between the two
            remote.engine_failed("e0", AmbiguousReply("OTHER", "x"), session="s2")
            remote.engine_failed("e0", later, session="s1", incarnation="life-9")
            failed_at[ErrorCode.ENGINE_UNREACHABLE] = time.monotonic()
            refused = AmbiguousReply(ErrorCode.ENGINE_UNREACHABLE, "refused", dispatched=False)
            remote.engine_failed("e0", refused, session="s3", incarnation="life-1")
            failed_at[ErrorCode.NOT_LOADED] = time.monotonic()
            missing = CleanRefusal(ErrorCode.NOT_LOADED, "no such adapter")
            remote.engine_failed("e0", missing, session="s4", incarnation="life-1")
            await wait_for("three kinds on their way", lambda: link.seen.count(TROUBLE) == 3)
            released_at = time.monotonic()
            link.release(TROUBLE)
            await wait_for("the fourth report", lambda: len(heard.reports) == 4)
            reports = heard.by_code()
            assert reports["TIMEOUT"]["failures"] == [("s1", 0, 1)]
            assert reports["TIMEOUT"]["incarnation"] == ""
            # the errors that came while it was on its way: one report, the first error's life
            assert reports["ENGINE_5XX"]["failures"] == [("s1", 0, 2), ("s2", 0, 1)]
            assert reports["ENGINE_5XX"]["incarnation"] == "life-1"
            waited = released_at - seen_by  # before it could leave at all
            assert 0.0 <= waited <= reports["ENGINE_5XX"]["age_s"]
            assert "OTHER" not in reports
            unreachable = reports[ErrorCode.ENGINE_UNREACHABLE]
            assert (unreachable["failures"], unreachable["dispatched"]) == ([("s3", 1, 0)], False)
            lacking = reports[ErrorCode.NOT_LOADED]
            assert (lacking["failures"], lacking["clean"]) == ([], True)  # proved, not a failure
            for code, report in reports.items():
                assert report["engine"] == "e0"
                assert report["reporter"] == "w1, w2"
                assert 0.0 <= report["age_s"] <= report["at"] - failed_at[code], code
            # nothing pending: the next error is a report of its own, at once
            remote.engine_failed("e0", AmbiguousReply("TIMEOUT", "again"), session="s5")
            await wait_for("a fifth report", lambda: len(heard.reports) == 5)
            assert heard.reports[-1]["failures"] == [("s5", 0, 1)]


async def test_a_lost_trouble_report_is_logged_and_the_next_one_is_sent(tmp_path: Path) -> None:
    heard = Heard()
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger, report_trouble=heard))
        async with remote_of(link) as remote:
            long_names = ["a" * 150, "b" * 150]
            for owner in long_names:
                await remote.register_owner(owner)
            link.drops[TROUBLE] = 1
            with structlog.testing.capture_logs() as logs:
                remote.engine_failed("e0", AmbiguousReply("TIMEOUT", "lost"), session="s1")
                await wait_for("the report's loss logged", lambda: len(logs) > 0)
            assert [x["event"] for x in logs] == ["remote.trouble_report_failed"]
            remote.engine_failed("e0", AmbiguousReply("TIMEOUT", "heard"), session="s2")
            await wait_for("the next report", lambda: len(heard.reports) == 1)
            assert heard.reports[0]["failures"] == [("s2", 0, 1)]  # the lost one's are gone
            assert heard.reports[0]["reporter"] == ", ".join(long_names)[:200]


def test_engine_trouble_outside_a_running_client_is_dropped_without_raising() -> None:
    RemoteLedger(NO_TRANSPORT).engine_failed("e0", AmbiguousReply("TIMEOUT", "x"), session="s")


# --- provenance -------------------------------------------------------------------------------

PROVENANCE = "/provenance"


@asynccontextmanager
async def with_store(path: Path) -> AsyncIterator[tuple[Link, Any]]:
    async with (
        SQLiteStore.open(path) as store,
        Ledger.open(store) as ledger,
        open_provenance(path) as provenance,
    ):
        yield Link(app_of(ledger, provenance=provenance)), provenance


def _rows(n: int, prefix: str = "row") -> list[Any]:
    return [_row("s", k, 1, started=1000.0 + k, row_id=f"{prefix}-{k}") for k in range(n)]


async def test_provenance_is_sent_again_after_a_wait_that_doubles_up_to_the_longest(
    tmp_path: Path,
) -> None:
    async with with_store(tmp_path / "ledger.db") as (link, store):
        async with remote_of(link) as remote:
            remote.provenance_resend_s = (0.01, 0.03)
            link.drops[PROVENANCE] = 4
            with structlog.testing.capture_logs() as logs:
                await remote.store_provenance(_rows(2))
            assert remote.provenance_round_trips == 5
        waits = [x["in_s"] for x in logs if x["event"] == "remote.provenance_resend"]
        assert waits == [0.01, 0.02, 0.03, 0.03]
        assert await store.count() == 2


@pytest.mark.parametrize(
    "code",
    [Code.LEDGER_CLOSED, Code.FENCED, StoreCode.STORE_FAILED, StoreCode.STORE_CLOSED],
)
async def test_provenance_refused_for_now_is_sent_again(tmp_path: Path, code: str) -> None:
    async with with_store(tmp_path / "ledger.db") as (link, store):
        async with remote_of(link) as remote:
            remote.provenance_resend_s = (0.01, 0.01)
            link.refuse(PROVENANCE, code, times=2)
            await remote.store_provenance(_rows(1))
            assert remote.provenance_round_trips == 3
        assert await store.count() == 1


async def test_provenance_refused_for_good_is_raised_at_once(tmp_path: Path) -> None:
    async with with_store(tmp_path / "ledger.db") as (link, store):
        async with remote_of(link) as remote:
            link.refuse(PROVENANCE, StoreCode.CORRUPT_STORE, status=500)
            with pytest.raises(LoraLedgerError) as refused:
                await remote.store_provenance(_rows(1))
            assert refused.value.code == StoreCode.CORRUPT_STORE
            assert remote.provenance_round_trips == 1
            await remote.store_provenance(_rows(1, "next"))  # the client goes on
        assert await store.count() == 1


async def test_no_rows_cost_no_round_trip_and_a_client_not_running_refuses(
    tmp_path: Path,
) -> None:
    with pytest.raises(LedgerError) as closed:
        await RemoteLedger(NO_TRANSPORT).store_provenance(_rows(1))
    assert closed.value.code == Code.LEDGER_CLOSED
    assert closed.value.message == "the ledger client is not connected"
    async with with_store(tmp_path / "ledger.db") as (link, store):
        async with remote_of(link) as remote:
            await remote.store_provenance([])
            assert remote.provenance_round_trips == 0
            await remote.provenance_sink().write(_rows(3))  # a recorder's sink: the same call
            assert remote.provenance_round_trips == 1
        assert await store.count() == 3


# --- a clean exit -----------------------------------------------------------------------------


async def test_a_clean_exit_ends_the_owners_registered_through_the_client(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link) as remote:
            await remote.register_owner("w1", incarnation="a")
            await remote.register_owner("w2")
            await remote.register_owner("w3")
            await remote.deregister_owner("w3")  # ended already: not asked again
            await remote.execute(c.Bind(session="s1", owner="w1", incarnation="a"))
        owners = ledger.state.owners
        assert owners["w1"].exited and owners["w2"].exited and owners["w3"].exited
        assert "s1" not in ledger.state.sessions
        assert link.seen.count("/owners/w3/deregister") == 1
        async with remote_of(link, deregister_on_exit=False) as remote:
            await remote.register_owner("kept")
        assert ledger.state.owners["kept"].live


async def test_an_exit_on_an_error_leaves_the_owners_to_their_leases(tmp_path: Path) -> None:
    async def fail_inside(ledger: Ledger) -> None:
        async with remote_of(ledger) as remote:
            await remote.register_owner("w")
            raise RuntimeError("the process fails")

    async with ledger_at(tmp_path / "ledger.db") as ledger:
        with pytest.raises(BaseExceptionGroup) as failed:
            await fail_inside(ledger)
        assert failed.group_contains(RuntimeError)
        assert ledger.state.owners["w"].live


async def test_an_exit_tolerates_owners_ended_elsewhere_and_a_ledger_out_of_reach(
    tmp_path: Path,
) -> None:
    """A life replaced by another process has nothing to end (said nowhere); a ledger out of
    reach leaves the rest to their leases, logged; the exit itself never fails for either."""
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        with structlog.testing.capture_logs() as logs:
            async with remote_of(link) as remote:
                await remote.register_owner("replaced", incarnation="a", secret="s" * 64)
                await remote.register_owner("cut-off")
                await ledger.register_owner("replaced", incarnation="b", secret="t" * 64)
                link.cut.add("/owners/cut-off/deregister")
        failed = [x for x in logs if x["event"] == "remote.deregister_failed"]
        assert [x["owner"] for x in failed] == ["cut-off"], logs
        assert ledger.state.owners["cut-off"].live


# --- renewals, in-flight counts, confirmations --------------------------------------------------

RENEW = "/leases/renew"
KEY = ("e0", 1)


def counted(ledger: Ledger, owner: str = "w") -> int:
    """What serve's ledger counts in flight on version 1 from ``owner``'s lives."""
    return sum(x.count for x in ledger.inflight_evidence(1) if x.reporter == owner)


async def test_a_first_count_is_on_the_ledger_before_the_confirmation_returns(
    tmp_path: Path,
) -> None:
    """A count on a key the ledger may hold at zero is forwarded now and waited for; later
    counts on it ride the renewal interval (here an hour), not a round trip each."""
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, renew_interval=3600.0, refresh_interval=None) as remote:
            await remote.register_owner("w")
            remote.renew_lease("w")
            await wait_for("the first renewal", lambda: remote.renewals_sent == 1)
            remote.renew_lease("w", {KEY: 1})
            await remote.confirm_lease("w")
            assert counted(ledger) == 1
            sent = remote.renewals_sent
            assert sent == link.seen.count(RENEW) >= 2  # each one answered, counted once
            remote.renew_lease("w", {KEY: 2})
            await remote.confirm_lease("w")  # seen by the ledger already: from memory
            assert (remote.renewals_sent, counted(ledger), remote.unconfirmed) == (sent, 1, 0)
            marks = cast(Recording, remote.transport).renewal_marks
            assert marks and set(marks) == {remote.view.mark}  # the table the view holds


async def test_a_first_count_waits_for_the_ledger_at_most_count_timeout(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, count_timeout=0.2, refresh_interval=None) as remote:
            await remote.register_owner("w")
            link.hold(RENEW)
            remote.renew_lease("w", {KEY: 1})
            with anyio.fail_after(30):
                await remote.confirm_lease("w")  # unanswered: goes on under the last answer
            assert remote.unconfirmed == 1
            link.release(RENEW)
            await wait_for("the count reaches the ledger", lambda: counted(ledger) == 1)


async def test_the_last_counts_are_forwarded_when_the_client_exits(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        async with remote_of(
            ledger, renew_interval=3600.0, refresh_interval=None, deregister_on_exit=False
        ) as remote:
            await remote.register_owner("w")
            remote.renew_lease("w", {KEY: 1})
            await remote.confirm_lease("w")
            assert counted(ledger) == 1
            remote.renew_lease("w", {KEY: 0})
        assert counted(ledger) == 0


async def test_a_renewal_with_no_reply_is_sent_again_with_the_newest_counts(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, renew_interval=0.05, refresh_interval=None) as remote:
            await remote.register_owner("w")
            remote.renew_lease("w")
            await wait_for("a renewal answered", lambda: remote.renewals_sent > 0)
            link.drops[RENEW] = 1
            with structlog.testing.capture_logs() as logs:
                remote.renew_lease("w", {KEY: 3})
                await wait_for("the count reaches the ledger", lambda: counted(ledger) == 3)
            assert "remote.renew_failed" in [x["event"] for x in logs]


async def test_a_life_the_ledger_ended_is_refused_by_the_next_renewal_and_then_from_memory(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, renew_interval=0.05, refresh_interval=None) as remote:
            await remote.register_owner("w", incarnation="a")
            await ledger.register_owner("w", incarnation="b", secret="b" * 64)

            def refused() -> bool:
                try:
                    remote.renew_lease("w", incarnation="a")
                except LoraLedgerError as exc:
                    return exc.code == Code.OWNER_RESTARTED
                return False

            await wait_for("the renewal's refusal heard", refused)
            asked = link.seen.count(RENEW)
            with pytest.raises(LoraLedgerError) as known:
                await remote.confirm_lease("w", incarnation="a")
            assert known.value.code == Code.OWNER_RESTARTED
            assert link.seen.count(RENEW) == asked  # known: not asked again


async def test_a_refusal_that_does_not_end_the_life_is_heard_by_a_confirmation_only(
    tmp_path: Path,
) -> None:
    """A renewal refused for its secret is logged; the life goes on (the next renewal, with
    the right secret, is answered), and a confirmation waiting for it hears that refusal."""
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, confirm_timeout=10.0, refresh_interval=None) as remote,
    ):
        await remote.register_owner("w", secret="s" * 64)
        await remote.confirm_lease("w")
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(LoraLedgerError) as refused:
                await remote.confirm_lease("w", secret="x" * 64)
            assert refused.value.code == Code.OWNER_SECRET_MISMATCH
            remote.renew_lease("w", secret="x" * 64)  # nothing known that ends it
        assert "remote.renew_refused" in [x["event"] for x in logs]
        await remote.confirm_lease("w", secret="s" * 64)
        assert remote.unconfirmed == 0


async def test_an_unanswered_confirmation_lets_the_next_ones_go_on_until_a_renewal_is_answered(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, confirm_timeout=30.0, refresh_interval=None) as remote:
            await remote.register_owner("w")
            await remote.confirm_lease("w")
            assert remote.unconfirmed == 0
            remote.confirm_timeout = 0.2  # to wait for a forward that is not answered
            sent = remote.renewals_sent
            link.hold(RENEW)
            await remote.confirm_lease("w")  # waited confirm_timeout, then went on
            assert remote.unconfirmed == 1
            remote.confirm_timeout = 3600.0
            with anyio.fail_after(30):  # out of reach: the next ones do not wait
                await remote.confirm_lease("w")
                await remote.confirm_lease("w")
            assert remote.unconfirmed == 3
            link.release(RENEW)
            await wait_for("a renewal answered again", lambda: remote.renewals_sent > sent)
            with anyio.fail_after(30):
                await remote.confirm_lease("w")  # answered again: waits for the ledger
            assert remote.unconfirmed == 3


async def test_a_confirmation_needs_a_running_client() -> None:
    idle = RemoteLedger(NO_TRANSPORT)
    await idle.confirm_lease("w")  # nothing to confirm: from memory, as renew_lease
    with pytest.raises(LedgerError) as closed:
        await RemoteLedger(NO_TRANSPORT, confirm_timeout=1.0).confirm_lease("w")
    assert closed.value.code == Code.LEDGER_CLOSED
    assert closed.value.message == "the ledger client is not connected"


# --- the view's reads -------------------------------------------------------------------------


async def test_callers_during_a_refresh_share_its_read_and_its_failure(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=None) as remote:
            refreshes = remote.view.refreshes
            link.hold("/status")
            async with anyio.create_task_group() as tg:
                tg.start_soon(remote.refresh)
                await wait_for("the read under way", lambda: "/status" in link.held)
                await wait_for("its status asked", lambda: link.seen.count("/status") == 2)
                tg.start_soon(remote.refresh)
                await anyio.wait_all_tasks_blocked()
                link.release("/status")
            assert remote.view.refreshes == refreshes + 1
            assert link.seen.count("/status") == 2  # connect's, and the shared one
            link.hold("/status")
            heard: list[str] = []

            async def refresh() -> None:
                try:
                    await remote.refresh()
                except LedgerUnreachable:
                    heard.append("unreachable")

            async with anyio.create_task_group() as tg:
                tg.start_soon(refresh)
                await wait_for("the read under way", lambda: link.seen.count("/status") == 3)
                link.cut.add("/status")  # its reply is lost
                tg.start_soon(refresh)
                await anyio.wait_all_tasks_blocked()
                link.release("/status")
            assert heard == ["unreachable", "unreachable"]
            assert link.seen.count("/status") == 3  # one read, failed for both
            assert remote.view.refreshes == refreshes + 1


async def test_a_cancelled_refresh_is_heard_as_closed_by_whoever_waited_for_it(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=None) as remote:
            link.hold("/status")
            heard: list[str] = []

            async def follower() -> None:
                try:
                    await remote.refresh()
                except LedgerError as exc:
                    heard.append(f"{exc.code}: {exc.message}")

            leader = anyio.CancelScope()

            async def lead() -> None:
                with leader:
                    await remote.refresh()

            async with anyio.create_task_group() as tg:
                tg.start_soon(lead)
                await wait_for("the read under way", lambda: link.seen.count("/status") == 2)
                tg.start_soon(follower)
                await anyio.wait_all_tasks_blocked()
                leader.cancel()
            assert heard == ["LEDGER_CLOSED: the refresh was cancelled"]
            link.release("/status")
            await remote.refresh()  # the next one reads again


async def test_the_view_is_read_every_refresh_interval_and_a_failed_read_is_logged(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=0.05) as remote:
            await wait_for("two refreshes", lambda: remote.view.refreshes >= 2)
            with structlog.testing.capture_logs() as logs:
                link.cut.add("/status")
                await wait_for("a failed refresh logged", lambda: len(logs) > 0)
                link.cut.clear()
                again = remote.view.refreshes
                await wait_for("refreshed again", lambda: remote.view.refreshes > again)
            assert "remote.refresh_failed" in [x["event"] for x in logs]


async def test_the_long_poll_brings_every_routing_change_and_rides_over_a_failure(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        lora = ledger.state.versions[1].lora_name
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=None) as remote:
            assert remote.view.holders(lora) == ("e0",)
            await ledger.report_unreachable(
                "e0", "life-1", at=ledger.clock(), error="ENGINE_UNREACHABLE: x", source="probe"
            )
            await wait_for("the outage routed", lambda: remote.view.holders(lora) == ())
            await ledger.report_reachable("e0", "life-1", at=ledger.clock())
            await wait_for("the repair routed", lambda: remote.view.holders(lora) == ("e0",))
            await publish(ledger, 2)
            await wait_for("the publication routed", lambda: remote.view.default_revision == 2)
            # every poll answered is counted once (connect's read, and one poll in flight)
            seen = link.seen.count("/routing")
            assert seen - 2 <= remote.routing_polls <= seen - 1, (seen, remote.routing_polls)
            await ledger.report_unreachable(
                "e0", "life-1", at=ledger.clock(), error="ENGINE_UNREACHABLE: x", source="probe"
            )
            await wait_for("the outage routed", lambda: remote.view.holders(lora) == ())
            with structlog.testing.capture_logs() as logs:
                link.cut.add("/routing")
                await wait_for("a failed poll logged", lambda: len(logs) > 0)
                assert logs[0]["event"] == "remote.routing_watch_failed"
                link.cut.clear()
                await ledger.report_reachable("e0", "life-1", at=ledger.clock())
                await wait_for("the repair routed", lambda: remote.view.holders(lora) == ("e0",))


# --- the client's life ------------------------------------------------------------------------


async def test_calls_under_way_when_the_client_exits_hear_it_was_closed(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        heard: list[str] = []

        async def caller(remote: HttpLedger, session: str) -> None:
            try:
                await remote.execute_many([c.Bind(session=session, owner="w")])
            except LedgerError as exc:
                heard.append(f"{session}: {exc.code}: {exc.message}")

        async with (
            anyio.create_task_group() as tg,
            remote_of(link, max_in_flight=1, deregister_on_exit=False) as remote,
        ):
            await remote.register_owner("w")
            link.hold("/sessions/commands")
            tg.start_soon(caller, remote, "sent")
            await wait_for("sent", lambda: "/sessions/commands" in link.seen)
            tg.start_soon(caller, remote, "queued")
            await anyio.wait_all_tasks_blocked()
        assert sorted(heard) == [
            "queued: LEDGER_CLOSED: the ledger client was closed",
            "sent: LEDGER_CLOSED: the ledger client was closed",
        ]


async def test_a_client_that_cannot_read_the_view_does_not_start(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        link.refuse("/routing", "UNAUTHORIZED", status=401)
        with pytest.raises(LoraLedgerError):
            async with remote_of(link):
                pass
        assert link.seen == ["/routing"]


async def test_binds_and_releases_carry_the_lives_secret(tmp_path: Path) -> None:
    """serve refuses a bind or release from another process without the life's secret: the
    client adds the one it keeps (its life named by the command, or the one registered here),
    and never replaces one the caller gave."""
    async with ledger_at(tmp_path / "ledger.db") as ledger, remote_of(ledger) as remote:
        await remote.register_owner("w", incarnation="a")
        await remote.register_owner("v")
        assert isinstance(await remote.execute(c.Bind(session="s1", owner="w")), Bound)
        assert isinstance(
            await remote.execute(c.Bind(session="s2", owner="w", incarnation="a")), Bound
        )
        assert isinstance(await remote.execute(c.Bind(session="s3", owner="v")), Bound)
        await remote.execute(c.Release(session="s1", owner="w", cause="closed"))
        assert "s1" not in ledger.state.sessions
        with pytest.raises(LoraLedgerError) as wrong:
            await remote.execute(c.Bind(session="s4", owner="w", secret="x" * 64))
        assert wrong.value.code == Code.OWNER_SECRET_MISMATCH
        digests = {ledger.state.owners[o].secret_digest for o in ("w", "v")}
        assert len(digests) == 2 and "" not in digests  # a secret of its own, made here


# --- what the client hands its transport ---------------------------------------------------------

COMMANDS = "/sessions/commands"


@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_at_most_max_in_flight_round_trips_are_under_way(
    tmp_path: Path, max_in_flight: int
) -> None:
    """Callers beyond ``max_in_flight`` round trips under way wait, and go together in the
    next one; twice over (a round trip that ended frees its place, no more)."""
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, max_in_flight=max_in_flight) as remote:
            await remote.register_owner("w")
            for again in range(2):
                sent = link.seen.count(COMMANDS)
                link.hold(COMMANDS)
                async with anyio.create_task_group() as tg:
                    for k in range(max_in_flight):
                        tg.start_soon(remote.execute, c.Bind(session=f"a{again}{k}", owner="w"))
                        expected = sent + k + 1
                        await wait_for(
                            "sent",
                            lambda n=expected: link.seen.count(COMMANDS) == n,  # type: ignore[misc]
                        )
                    for k in range(3):
                        tg.start_soon(remote.execute, c.Bind(session=f"b{again}{k}", owner="w"))
                    await anyio.wait_all_tasks_blocked()
                    assert link.seen.count(COMMANDS) == sent + max_in_flight
                    link.release(COMMANDS)
                assert link.seen.count(COMMANDS) == sent + max_in_flight + 1
            assert all(f"b1{k}" in ledger.state.sessions for k in range(3))


async def test_a_reply_brings_the_routing_it_was_decided_under(tmp_path: Path) -> None:
    """Each round trip names the table the view holds; a bind's reply carries the routing
    after it (here a publication the long poll has not brought yet), so the gateway routes to
    the version bound."""
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=None) as remote:
            await remote.register_owner("w")
            link.late["poll"] = anyio.Event()  # the long poll's answers stay away
            await publish(ledger, 2)
            assert remote.view.default_revision == 1
            mark = remote.view.mark
            bound = await remote.execute(c.Bind(session="s1", owner="w"))
            assert isinstance(bound, Bound) and bound.version_id == 2
            assert remote.view.default_revision == 2
            assert cast(Recording, remote.transport).marks[-1] == mark
            link.late.pop("poll").set()


async def test_trouble_batches_carry_the_reporters_and_no_session_when_none_was_named(
    tmp_path: Path,
) -> None:
    heard = Heard()
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger, report_trouble=heard))
        async with remote_of(link) as remote:
            owners = ["b" * 150, "a" * 150]
            for owner in owners:
                await remote.register_owner(owner)
            remote.engine_failed("e0", AmbiguousReply("TIMEOUT", "no answer"))
            await wait_for("the report", lambda: len(heard.reports) == 1)
        (batch,) = cast(Recording, remote.transport).batches
        assert batch.reporter == ("a" * 150 + ", " + "b" * 150)[:200]
        assert batch.failures == ()  # a failure of no session counts no turn


async def test_concurrent_provenance_goes_one_round_trip_at_a_time(tmp_path: Path) -> None:
    async with with_store(tmp_path / "ledger.db") as (link, store):
        async with remote_of(link) as remote:
            link.hold(PROVENANCE)
            async with anyio.create_task_group() as tg:
                tg.start_soon(remote.store_provenance, _rows(1, "first"))
                await wait_for("sent", lambda: link.seen.count(PROVENANCE) == 1)
                for k in range(4):
                    tg.start_soon(remote.store_provenance, _rows(1, f"next{k}"))
                await anyio.wait_all_tasks_blocked()
                assert link.seen.count(PROVENANCE) == 1
                link.release(PROVENANCE)
            assert remote.provenance_round_trips == 2
        assert await store.count() == 5


async def test_an_owner_registered_with_its_defaults_and_a_relays_idle_bound(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger, remote_of(ledger) as remote:
        await remote.register_owner("w")
        await remote.register_owner("relay", sessions_idle_s=60.0, ttl_s=5.0)
        owners = ledger.state.owners
        assert (owners["w"].ttl_s, owners["w"].sessions_idle_s) == (30.0, None)
        assert (owners["relay"].ttl_s, owners["relay"].sessions_idle_s) == (5.0, 60.0)


async def test_a_registration_makes_an_earlier_refusal_of_the_life_moot(tmp_path: Path) -> None:
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, renew_interval=0.05, refresh_interval=None) as remote,
    ):

        def refused() -> bool:
            try:
                remote.renew_lease("late")  # never registered
            except LoraLedgerError as exc:
                return exc.code == Code.UNKNOWN_OWNER
            return False

        await wait_for("the renewal's refusal heard", refused)
        await remote.register_owner("late")
        remote.renew_lease("late")  # raises no more


async def test_an_owner_not_registered_here_deregisters_and_its_life_is_forwarded_no_more(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, renew_interval=3600.0, refresh_interval=None) as remote:
            await ledger.register_owner("local", secret="l" * 64)  # in serve's process
            await remote.deregister_owner("local", secret="l" * 64)
            assert ledger.state.owners["local"].exited
            await remote.register_owner("w")
            remote.renew_lease("w")
            await wait_for("a renewal answered", lambda: remote.renewals_sent == 1)
            remote.renew_lease("w", {KEY: 0})  # pending until the next tick (an hour)
            await remote.deregister_owner("w")
            renewals = link.seen.count(RENEW)
        assert link.seen.count(RENEW) == renewals  # the exit's last forward had nothing of w


async def test_a_refresh_and_a_renewal_bring_the_routing_too(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, refresh_interval=None, renew_interval=0.05) as remote:
            await remote.register_owner("w")
            link.late["poll"] = anyio.Event()  # the long poll's answers stay away
            await publish(ledger, 2)
            await remote.refresh()
            assert remote.view.default_revision == 2
            await publish(ledger, 3)
            remote.renew_lease("w")
            sent = remote.renewals_sent
            await wait_for("a renewal answered", lambda: remote.renewals_sent > sent)
            assert remote.view.default_revision == 3
            link.late.pop("poll").set()


async def test_a_renewal_with_no_reply_lets_confirmations_go_on(tmp_path: Path) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, confirm_timeout=3600.0, refresh_interval=None) as remote:
            await remote.register_owner("w")
            link.cut.add(RENEW)
            with structlog.testing.capture_logs() as logs:
                remote.renew_lease("w")
                await wait_for("the forward failed", lambda: len(logs) > 0)
            assert logs[0]["event"] == "remote.renew_failed"
            link.cut.clear()
            link.hold(RENEW)  # the next forward is not answered either
            with anyio.fail_after(30):  # out of reach: not an hour
                await remote.confirm_lease("w")
            assert remote.unconfirmed == 1
            link.release(RENEW)


async def test_a_relays_sessions_of_a_renewal_with_no_reply_go_with_the_next(
    tmp_path: Path,
) -> None:
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, renew_interval=0.05, refresh_interval=None) as remote:
            await remote.register_owner("relay", sessions_idle_s=60.0)
            link.drops[RENEW] = 1
            remote.renew_lease("relay", sessions=["s1", "s2"])
            sent = cast(Recording, remote.transport).renewal_sessions
            await wait_for("sent again", lambda: remote.renewals_sent == 1)
            assert sent[0] == sent[-1] == {("relay", ""): ("s1", "s2")}


async def test_a_life_that_ended_here_is_never_sent_its_secret_again(tmp_path: Path) -> None:
    """The client forgets a life's secret when it deregisters: a later bind for it goes
    without one (and is refused for that), never proving an ended life."""
    async with ledger_at(tmp_path / "ledger.db") as ledger, remote_of(ledger) as remote:
        await remote.register_owner("w")
        await remote.deregister_owner("w")
        with pytest.raises(LoraLedgerError) as refused:
            await remote.execute(c.Bind(session="s1", owner="w"))
        assert refused.value.code == Code.OWNER_SECRET_MISMATCH


async def test_a_life_registered_elsewhere_is_proven_by_the_secret_its_renewal_gave(
    tmp_path: Path,
) -> None:
    """A life this client did not register (its worker registered it in serve's process):
    its renewal goes with the secret the caller gave, and that secret proves the life's binds
    as well. One without a secret is refused alone, not the forward it went in."""
    async with (
        ledger_at(tmp_path / "ledger.db") as ledger,
        remote_of(ledger, renew_interval=0.05, refresh_interval=None) as remote,
    ):
        await ledger.register_owner("w", secret="s" * 64)
        await ledger.register_owner("plain")
        with structlog.testing.capture_logs() as logs:
            remote.renew_lease("plain", {KEY: 2})
            remote.renew_lease("w", {KEY: 1}, secret="s" * 64)
            await wait_for("w's count", lambda: counted(ledger) == 1)
        refused = [x for x in logs if x["event"] == "remote.renew_refused"]
        assert refused and refused[0]["owner"] == "plain"
        assert refused[0]["code"] == Code.OWNER_SECRET_MISMATCH
        assert isinstance(await remote.execute(c.Bind(session="s1", owner="w")), Bound)


async def test_a_first_count_is_waited_for_count_timeout_not_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``confirm_timeout``, a first count waits for the ledger ``count_timeout``
    (here a quarter of a second), the bound given, whatever it is. Read from the waits the
    client asks anyio for: the wall clock would depend on the scheduler."""
    waits: list[float | None] = []
    real = anyio.move_on_after

    def move_on_after(delay: float | None, shield: bool = False) -> anyio.CancelScope:
        waits.append(delay)
        return real(delay, shield=shield)

    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(
            link, count_timeout=0.25, renew_interval=3600.0, refresh_interval=None
        ) as remote:
            await remote.register_owner("w")
            link.hold(RENEW)
            monkeypatch.setattr(anyio, "move_on_after", move_on_after)
            remote.renew_lease("w", {KEY: 1})
            await remote.confirm_lease("w")
            monkeypatch.undo()
            assert 0.25 in waits and remote.unconfirmed == 1
            link.release(RENEW)


async def test_a_refusal_an_earlier_renewal_brought_ends_a_confirmation_left_unanswered(
    tmp_path: Path,
) -> None:
    """The confirmation's own renewal got no reply, but the forward before it (under way when
    the confirmation began) brought the ledger's refusal of the life: that is raised."""
    async with ledger_at(tmp_path / "ledger.db") as ledger:
        link = Link(app_of(ledger))
        async with remote_of(link, confirm_timeout=10.0, refresh_interval=None) as remote:
            await remote.register_owner("w", incarnation="a")
            link.hold(RENEW)
            remote.renew_lease("w", incarnation="a")
            await wait_for("a forward under way", lambda: RENEW in link.seen)
            await ledger.register_owner("w", incarnation="b", secret="b" * 64)
            async with anyio.create_task_group() as tg:
                heard: list[str] = []

                async def confirm() -> None:
                    try:
                        await remote.confirm_lease("w", incarnation="a")
                    except LoraLedgerError as exc:
                        heard.append(exc.code)

                tg.start_soon(confirm)
                await anyio.wait_all_tasks_blocked()
                link.drops[RENEW] = 1  # the confirmation's own forward: no reply
                link.release(RENEW)
            assert heard == [Code.OWNER_RESTARTED]
            assert link.seen.count(RENEW) == 2
