"""``loraledger gateway``: the HTTP ledger port it stands on, and two gateway processes (real
subprocesses, port 0, stopped by PID) in front of one ``serve``, with the official client.

* one session's turns, alternating between the processes while a new version publishes, all
  land on the same version and the same engine (one bind in the ledger, rendezvous routing);
* a request in flight on a gateway process holds back the reclaim of its version after its
  session was released: the count travels with the process's lease renewals to serve."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from engines.local.server import running_server
from evlog.errors import Refused
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.outcomes import Bound, Forgotten, Released
from publisher.remote.http import HttpLedger, RemoteLedgerError
from publisher.remote.wire import WireCode
from tests.publisher.plane_kit import LIMITS
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.paths import REPO
from tests.support.processes import listening_process
from tests.support.waiting import wait_for
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir
from tools.service_options import parse_engine

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
TOKEN = "gateway-process-token"
ROOT = REPO


@asynccontextmanager
async def gateway_process(
    ledger: str,
    token_file: Path,
    tmp_path: Path,
    name: str,
    *,
    refresh_s: float = 0.2,
    copy: bool = True,
    cwd: Path = ROOT,
) -> AsyncIterator[str]:
    """``loraledger gateway`` on port 0 in a subprocess (in ``cwd``); yield its URL (read
    from its JSON ``listening`` row); SIGTERM it by PID on exit and check it stopped cleanly.
    ``copy``: it also writes a JSON-lines copy of its provenance rows in ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LORALEDGER_TOKEN", None)
    args = [
        "gateway",
        "--ledger",
        ledger,
        "--token-file",
        str(token_file),
        "--port",
        "0",
        "--owner",
        name,
        "--refresh-s",
        str(refresh_s),
        *(("--provenance", str(tmp_path / f"{name}.provenance.jsonl")) if copy else ()),
        "--json",
    ]
    started = listening_process(args, env=env, cwd=cwd, ready_within=60, stop_with=signal.SIGTERM)
    async with started as (process, row):
        assert row["owner"] == name
        url: str = row["url"]
        yield url
    assert process.returncode == 0, f"{name} exited {process.returncode}"


async def _inflight(http: httpx.AsyncClient) -> int:
    text = (await http.get("/metrics")).text
    return sum(
        int(float(n)) for n in re.findall(r"^loraledger_inflight_requests\{.*\} (\S+)$", text, re.M)
    )


SWEEPS, WAKES = "loraledger_reclaim_sweeps_total", "loraledger_health_wakes_total"


async def _counter(http: httpx.AsyncClient, name: str) -> int:
    """A counter of serve's ``/metrics`` (``loraledger_reclaim_sweeps_total``, ...)."""
    text = (await http.get("/metrics")).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, f"no {name} in serve's /metrics"
    return int(float(found.group(1)))


async def _counted_past(http: httpx.AsyncClient, name: str, count: int) -> bool:
    return await _counter(http, name) > count


async def _state(http: httpx.AsyncClient, version_id: int) -> str:
    status = (await http.get("/status")).json()
    state: str = next(v["state"] for v in status["versions"] if v["version_id"] == version_id)
    return state


async def test_two_gateway_processes_serve_one_session_and_hold_reclaim(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with AsyncExitStack() as stack:
        engines = {}
        specs = []
        for engine_id in ("e0", "e1"):
            engine, url = await stack.enter_async_context(running_server(engine_id, limits=LIMITS))
            engines[engine_id] = engine
            specs.append(parse_engine(f"{engine_id}=local:{url}"))
        ledger = await stack.enter_async_context(
            serving(tmp_path / "ledger.db", token=TOKEN, engines=tuple(specs))
        )
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=60, headers=auth)
        )
        reply = await http.post(
            "/versions", json={"version_id": 1, "adapter_dir": str(adapters[0])}
        )
        assert reply.status_code == 200, reply.text
        url_a = await stack.enter_async_context(
            gateway_process(ledger, token_file, tmp_path, "gw-a")
        )
        url_b = await stack.enter_async_context(
            gateway_process(ledger, token_file, tmp_path, "gw-b")
        )
        clients = [
            await stack.enter_async_context(openai.AsyncOpenAI(base_url=u + "/v1", api_key=TOKEN))
            for u in (url_a, url_b)
        ]

        # Concurrent first turns of one session through both processes: one binding.
        async def turn(client: openai.AsyncOpenAI, out: list[tuple[str, str]]) -> None:
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                extra_headers={"x-session-id": "shared"},
            )
            out.append((raw.headers["x-loraledger-version"], raw.headers["x-loraledger-engine"]))

        seen: list[tuple[str, str]] = []
        async with anyio.create_task_group() as tg:
            for client in clients * 2:
                tg.start_soon(turn, client, seen)
        reply = await http.post(
            "/versions", json={"version_id": 2, "adapter_dir": str(adapters[1])}
        )
        assert reply.status_code == 200, reply.text
        for i in range(4):
            await turn(clients[i % 2], seen)
        assert len(seen) == 8 and len(set(seen)) == 1 and seen[0][0] == "1", seen
        engine_of_shared = seen[0][1]

        # A newcomer binds v2 through either process.
        raw = await clients[1].chat.completions.with_raw_response.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert raw.headers["x-loraledger-version"] == "2"
        # Renewals are forwarded at most every renew_s: wait until serve heard that the
        # newcomer's request ended, so the count awaited below is the stream's, not its.
        with anyio.fail_after(10):
            while await _inflight(http) != 0:  # noqa: ASYNC110 -- B's renewal reached serve
                await anyio.sleep(0.05)

        # Reclaim waits for a request in flight on gateway process B.
        stream = await clients[1].chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "the quick brown fox"}],
            max_tokens=300,
            extra_body={"ignore_eos": True},
            stream=True,
            extra_headers={"x-session-id": "shared"},
        )
        chunks = stream.__aiter__()
        await chunks.__anext__()
        engines[engine_of_shared].pause_generation()  # the request stays in flight, mid-stream
        with anyio.fail_after(10):
            while await _inflight(http) != 1:  # noqa: ASYNC110 -- B's renewal reached serve
                await anyio.sleep(0.05)
        # Release the session through process A (the binding no longer holds v1): only the
        # count does.
        reply = await http.post(f"{url_a}/v1/sessions/shared/release")
        assert reply.status_code == 200 and reply.json()["released"] is True, reply.text
        # Sweep n+1 starts after the release; n+2 starting means it ended: serve's reclaim
        # driver has looked at the released state and, held by the count, left v1 alone.
        sweeps = await _counter(http, SWEEPS)
        await wait_for(
            "two more reclaim sweeps of serve",
            lambda: _counted_past(http, SWEEPS, sweeps + 1),
            timeout=30,
        )
        assert await _state(http, 1) == "RETIRED"
        engines[engine_of_shared].continue_generation()
        got = 1
        async for _ in chunks:
            got += 1
        assert got > 10
        with anyio.fail_after(30):
            while await _state(http, 1) != "RECLAIMED":  # noqa: ASYNC110 -- a remote state
                await anyio.sleep(0.1)
        assert await _inflight(http) == 0

    # Every request of both processes has its provenance row, v1 for the session.
    rows = [
        json.loads(line)
        for name in ("gw-a", "gw-b")
        for line in (tmp_path / f"{name}.provenance.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 10
    assert {r["version_id"] for r in rows if r["session"] == "shared"} == {1}


async def behind_a_gateway(
    stack: AsyncExitStack, tmp_path: Path, name: str
) -> tuple[Any, httpx.AsyncClient, str, openai.AsyncOpenAI]:
    """One local engine, serve over it with v1 published, a gateway process ``name`` in front:
    the engine, a token holder's client of serve, the gateway's URL and an OpenAI client of
    it, all closed with ``stack``."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    engine, engine_url = await stack.enter_async_context(running_server("e0", limits=LIMITS))
    ledger = await stack.enter_async_context(
        serving(
            tmp_path / "ledger.db",
            token=TOKEN,
            engines=(parse_engine(f"e0=local:{engine_url}"),),
        )
    )
    http = await stack.enter_async_context(
        httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=60, headers=auth)
    )
    reply = await http.post(
        "/versions", json={"version_id": 1, "adapter_dir": str(_adapter_dir(tmp_path, 1))}
    )
    assert reply.status_code == 200, reply.text
    url = await stack.enter_async_context(gateway_process(ledger, token_file, tmp_path, name))
    client = await stack.enter_async_context(
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
    )
    return engine, http, url, client


async def test_a_gateway_process_reports_a_lost_adapter_to_serve(tmp_path: Path) -> None:
    """An adapter unloaded behind the ledger's back is found within moments of the next request
    through a separate gateway process: the engine refuses the turn, the process posts the
    refusal to serve (``/engines/{e}/trouble``) and serve's reconciler reads that engine's
    inventory at once. Serve's own probes do not read inventories and its full pass is 30 s
    away, so without the report the loss would stay unseen for this test's whole life."""
    async with AsyncExitStack() as stack:
        engine, http, _, client = await behind_a_gateway(stack, tmp_path, "gw")

        async def turn(session: str) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                extra_headers={"x-session-id": session},
            )
            return raw.headers["x-loraledger-engine"]

        async def holders() -> list[str]:
            status = (await http.get("/status")).json()
            (v1,) = (v for v in status["versions"] if v["version_id"] == 1)
            return list(v1["holders"])

        assert await turn("before") == "e0"
        lora_name = (await http.get("/status")).json()["versions"][0]["lora_name"]
        await engine.unload(lora_name, attempt=1)  # someone else's hand, not the ledger's
        # Two whole probes of serve after the unload: none of them reads the inventory.
        wakes = await _counter(http, WAKES)
        await wait_for(
            "two more health-loop wakes of serve",
            lambda: _counted_past(http, WAKES, wakes + 2),
            timeout=30,
        )
        assert await holders() == ["e0"]
        with pytest.raises(openai.APIStatusError):  # refused by the engine, never resent
            await turn("after")
        with anyio.fail_after(20):  # at once after the report; the full pass is 30 s away
            while "e0" in await holders():  # noqa: ASYNC110 -- a remote state
                await anyio.sleep(0.05)

        # The route itself: a fleet member and a well-formed error, from a token holder.
        report = {"code": "TIMEOUT", "clean": False, "message": "no reply in 30 s"}
        reply = await http.post("/engines/e0/trouble", json=report)
        assert (reply.status_code, reply.json()) == (200, {"heard": True})
        reply = await http.post("/engines/ghost/trouble", json=report)
        assert (reply.status_code, reply.json()["code"]) == (404, "UNKNOWN_ENGINE")
        reply = await http.post("/engines/e0/trouble", json={**report, "code": "no spaces"})
        assert (reply.status_code, reply.json()["code"]) == (400, "INVALID_INPUT")
        reply = await http.post("/engines/e0/trouble", json=report, headers={"Authorization": ""})
        assert reply.status_code == 401


async def test_a_gateway_process_refuses_models_before_binding_when_it_safely_can(
    tmp_path: Path,
) -> None:
    """A gateway process sees the ledger through a snapshot that lists no sessions. An
    unknown model is a 404 and a one-turn request naming a non-default version a 409, before
    any bind; a named session's first turn naming one is a 409 from the ledger's bind, which
    binds nothing; a session bound through ``serve`` keeps its own version name here (the bind
    answers the existing binding); a version published after the snapshot is not refused (the
    snapshot is read again first). Requests outside the routes answer in OpenAI's shape."""
    from evlog.events import SessionBound, SessionReleased
    from evlog.sqlite import SQLiteStore

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    hello: list[Any] = [{"role": "user", "content": "hello"}]
    async with AsyncExitStack() as stack:
        _, engine_url = await stack.enter_async_context(running_server("e0", limits=LIMITS))
        ledger = await stack.enter_async_context(
            serving(
                tmp_path / "ledger.db",
                token=TOKEN,
                engines=(parse_engine(f"e0=local:{engine_url}"),),
            )
        )
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=60, headers=auth)
        )

        async def publish(version_id: int) -> str:
            adapter = str(_adapter_dir(tmp_path, version_id))
            reply = await http.post(
                "/versions", json={"version_id": version_id, "adapter_dir": adapter}
            )
            assert reply.status_code == 200, reply.text
            name: str = reply.json()["lora_name"]
            return name

        v1 = await publish(1)
        on_serve = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=ledger + "/v1", api_key=TOKEN, max_retries=0)
        )
        await on_serve.chat.completions.create(
            model="policy",
            messages=hello,
            max_tokens=2,
            extra_headers={"x-session-id": "elsewhere"},
        )
        await publish(2)
        # A refresh period longer than the test: the process's snapshot stays the one it read
        # at start, unless a refusal makes it read again.
        url = await stack.enter_async_context(
            gateway_process(ledger, token_file, tmp_path, "gw", refresh_s=600)
        )
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
        )
        v3 = await publish(3)

        raw = await client.chat.completions.with_raw_response.create(
            model=v3, messages=hello, max_tokens=2
        )  # one-turn, named after a version newer than the snapshot: read again, accepted
        assert raw.headers["x-loraledger-version"] == "3"
        raw = await client.chat.completions.with_raw_response.create(
            model=v1, messages=hello, max_tokens=2, extra_headers={"x-session-id": "elsewhere"}
        )
        assert raw.headers["x-loraledger-version"] == "1"
        for session in (None, "fresh"):
            with pytest.raises(openai.NotFoundError) as missing:
                await client.chat.completions.create(
                    model="gpt-4o",
                    messages=hello,
                    extra_headers={"x-session-id": session} if session else None,
                )
            assert missing.value.code == "model_not_found"
        with pytest.raises(openai.ConflictError) as unbound:
            await client.chat.completions.create(model=v1, messages=hello)
        assert unbound.value.code == "VERSION_NOT_BOUND" and v3 in unbound.value.message
        # a named session this process cannot know unbound: the ledger's bind refuses it, and
        # binds nothing (it used to be bound to the default, then refused)
        with pytest.raises(openai.ConflictError) as first:
            await client.chat.completions.create(
                model=v1, messages=hello, extra_headers={"x-session-id": "fresh-named"}
            )
        assert first.value.code == "VERSION_NOT_BOUND" and v3 in first.value.message
        assert (await client.models.retrieve(v1)).id == v1

        plain = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=auth)
        )
        for method, path, status in [
            ("GET", "/v1/chat/completions", 405),
            ("POST", "/v1/chat/completions/", 404),
            ("POST", "/v1/embeddings", 404),
            ("GET", "/", 404),
        ]:
            response = await plain.request(method, path)
            assert response.status_code == status, (path, response.text)
            assert response.json()["error"]["code"] in ("METHOD_NOT_ALLOWED", "UNKNOWN_ROUTE")
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        bound = [r.event.session for r in await store.read() if isinstance(r.event, SessionBound)]
        released = {
            r.event.session for r in await store.read() if isinstance(r.event, SessionReleased)
        }
    # elsewhere, and the one-turn request that was served: the refused ones left nothing
    assert bound[0] == "elsewhere" and len(bound) == 2 and bound[1].startswith("gw-once-"), bound
    assert released <= set(bound), released


async def test_the_http_ledger_answers_like_the_ledger(tmp_path: Path) -> None:
    """The port a gateway process uses: outcomes and refusals in place with the ledger's own
    classes and codes, a lost lease learned from a renewal, forget over the new route, and a
    wrong token refused at once."""
    adapter = _adapter_dir(tmp_path, 1)
    async with (
        running_server("e0", limits=LIMITS) as (_, u0),
        serving(
            tmp_path / "ledger.db", token=TOKEN, engines=(parse_engine(f"e0=local:{u0}"),)
        ) as url,
        HttpLedger.connect(url, token=TOKEN, refresh_interval=0.1, renew_interval=0.05) as ledger,
    ):
        await ledger.register_owner("w", ttl_s=30)
        (early,) = await ledger.execute_many([c.Bind(session="s0", owner="w")])
        assert isinstance(early, Refused) and early.code == Code.NO_PUBLISHED_VERSION
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as h:
            reply = await h.post(
                "/versions", json={"version_id": 1, "adapter_dir": str(adapter)}, timeout=60
            )
            assert reply.status_code == 200, reply.text
        bound, again, stranger = await ledger.execute_many(
            [
                c.Bind(session="s1", owner="w"),
                c.Bind(session="s1", owner="w"),
                c.Bind(session="s2", owner="nobody"),
            ]
        )
        assert isinstance(bound, Bound) and isinstance(again, Bound)
        assert bound.version_id == again.version_id == 1 and {bound.new, again.new} == {True, False}
        assert isinstance(stranger, Refused) and stranger.code == Code.UNKNOWN_OWNER
        await ledger.refresh()
        view = ledger.view
        assert view.holders(bound.lora_name) == ("e0",) and view.default_revision == 1
        assert view.incarnation("e0") and view.status().sessions_bound == 1

        released, forgotten = await ledger.execute_many(
            [c.Release(session="s1", owner="w", cause="idle"), c.Forget(sessions=("s0",))]
        )
        assert isinstance(released, Released) and released.released
        assert isinstance(forgotten, Forgotten)
        (forget,) = await ledger.execute_many([c.Forget(sessions=("s1",))])
        assert isinstance(forget, Forgotten) and forget.count == 1

        ledger.renew_lease("ghost", {("e0", 1): 1})  # never registered: the ledger says so
        with anyio.fail_after(5), pytest.raises(Refused) as lost:  # noqa: PT012
            while True:
                ledger.renew_lease("ghost")
                await anyio.sleep(0.05)
        assert lost.value.code == Code.UNKNOWN_OWNER

        async with HttpLedger.connect(url, token="wrong") as stranger_client:
            with pytest.raises(RemoteLedgerError) as refused:
                await stranger_client.register_owner("x")
            assert refused.value.code == WireCode.LEDGER_ANSWER


def test_gateway_options_are_refused_before_anything_starts() -> None:
    from tools.exitcodes import Exit, ToolError
    from tools.gateway import GatewayOptions, check_options

    with pytest.raises(ToolError) as unsafe:
        check_options(GatewayOptions(ledger="http://127.0.0.1:1", host="0.0.0.0"))
    assert unsafe.value.exit_code == Exit.UNSAFE
    for bad in (
        GatewayOptions(ledger="http://127.0.0.1:1"),  # no token: it could not bind
        GatewayOptions(ledger="127.0.0.1:1", token="t"),
        GatewayOptions(ledger="http://127.0.0.1:1", token="t", refresh_s=0),
        GatewayOptions(ledger="http://127.0.0.1:1", token="t", session_idle_s=-1),
    ):
        with pytest.raises(ToolError) as usage:
            check_options(bad)
        assert usage.value.exit_code == Exit.USAGE, bad

    from tools.gateway import GatewayOptions as G
    from tools.gateway import run_gateway

    with pytest.raises(ToolError) as nobody:  # nothing listens there: exit 10, said so
        anyio.run(lambda: run_gateway(G(ledger="http://127.0.0.1:9", token="t", port=0), stop=None))
    assert (
        nobody.value.exit_code == Exit.UNREACHABLE and "cannot be reached" in nobody.value.message
    )

    from tools.serve import ServeOptions
    from tools.serve import check_options as check_serve

    check_serve(ServeOptions(db="x.db", session_idle_s=0))  # 0: never
    with pytest.raises(ToolError) as idle:
        check_serve(ServeOptions(db="x.db", session_idle_s=float("inf")))
    assert idle.value.exit_code == Exit.USAGE and "--session-idle-s" in idle.value.message


def test_default_owner_ids_differ_where_host_and_pid_repeat() -> None:
    """Containers on the host's network share its name and are each pid 1: their gateways'
    default owner ids must still differ (one id would make them two lives of one owner, the
    second fencing the first out), and stay the same within one process."""
    probe = (
        "import os, socket\n"
        "os.getpid = lambda: 1\n"
        "socket.gethostname = lambda: 'node'\n"
        "from tools.gateway import GatewayOptions\n"
        "a, b = GatewayOptions(ledger='x'), GatewayOptions(ledger='y')\n"
        "assert a.owner_id == b.owner_id, (a.owner_id, b.owner_id)\n"
        "print(a.owner_id)\n"
    )
    ids = [
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.strip()
        for _ in range(2)
    ]
    assert all(i.startswith("gateway-node-1-") for i in ids), ids
    assert ids[0] != ids[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_a_gateway_follows_an_engine_that_came_back_behind_another_address(
    tmp_path: Path,
) -> None:
    """Engines come back at new addresses (a rescheduled pod): serve, restarted with the
    engine's new URL, records it with the restart, and a gateway process started without
    ``--engine`` (it read the old address from the ledger) follows it at its next status
    read. The session keeps its version, served by the new process; nobody restarts the
    gateway."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    adapter = _adapter_dir(tmp_path, 1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    port = _free_port()
    db = tmp_path / "ledger.db"
    async with AsyncExitStack() as stack:
        before = AsyncExitStack()  # the engine's first life and the first serve
        _, old_url = await before.enter_async_context(running_server("e0", limits=LIMITS))
        spec = parse_engine(f"e0=local:{old_url}")
        ledger = await before.enter_async_context(
            serving(db, token=TOKEN, engines=(spec,), port=port)
        )
        async with httpx.AsyncClient(base_url=ledger, trust_env=False, headers=auth) as http:
            reply = await http.post(
                "/versions", json={"version_id": 1, "adapter_dir": str(adapter)}
            )
            assert reply.status_code == 200, reply.text
        gateway = await stack.enter_async_context(
            gateway_process(ledger, token_file, tmp_path, "gw")  # no --engine
        )
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=TOKEN, max_retries=0)
        )

        async def turn() -> dict[str, str]:
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                extra_headers={"x-session-id": "s"},
            )
            return dict(raw.headers)

        assert (await turn())["x-loraledger-version"] == "1"
        await before.aclose()  # serve and the engine's first life are gone

        _, new_url = await stack.enter_async_context(running_server("e0", limits=LIMITS))
        spec = parse_engine(f"e0=local:{new_url}")
        again = await stack.enter_async_context(
            serving(db, token=TOKEN, engines=(spec,), port=port)
        )
        assert again == ledger
        async with httpx.AsyncClient(base_url=ledger, trust_env=False) as http:
            with anyio.fail_after(30):
                while True:
                    [e0] = (await http.get("/status")).json()["engines"]
                    if e0["routable"] and e0["endpoint"] == new_url:
                        break
                    await anyio.sleep(0.1)
        refusals: list[int] = []
        with anyio.fail_after(30):
            while True:  # the gateway reads the status every 0.2 s (--refresh-s)
                try:
                    headers = await turn()
                    break
                except openai.APIStatusError as exc:
                    refusals.append(exc.status_code)  # NO_ROUTE until it follows
                    await anyio.sleep(0.1)
        assert set(refusals) <= {503}, refusals
        assert (headers["x-loraledger-version"], headers["x-loraledger-engine"]) == ("1", "e0")
