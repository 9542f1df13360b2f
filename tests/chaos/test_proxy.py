"""The chaos proxy's faults, each against a real HTTP/1.1 server on loopback (keep-alive, one
request line per request counted where it arrives), showing what the caller sees and what the
server saw: a drop and a reset before the request never reach the server, a reset after it
ran loses only the answer, a black hole stalls the caller until its own timeout (and keeps the
connection stuck after the link heals), a partition cuts every link of one process at once."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.abc
import httpx
import openai
import pytest

from engines.local.server import running_server
from evlog.events import EngineReachable, EngineRestarted, EngineUnreachable
from evlog.sqlite import SQLiteStore
from tests.chaos.proxy import Fault, Network
from tests.publisher.plane_kit import LIMITS
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.paths import REPO
from tests.support.processes import listening_process
from tests.support.relay import listening, read_request
from tests.support.waiting import wait_for
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir
from tools.service_options import parse_engine

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class Server:
    """A keep-alive HTTP/1.1 server that answers every request ``200 ran <n>`` and records the
    request lines it received, with the connection each came on (the proxy's own idle watch
    of the server is a connection too, without requests)."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, bytes]] = []
        self.connections = 0

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        connection = self.connections
        async with stream:
            try:
                while True:
                    request = await read_request(stream)
                    self.requests.append((connection, request.split(b"\r\n", 1)[0]))
                    body = f"ran {len(self.requests)}".encode()
                    head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                    await stream.send(head + body)
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                return


@asynccontextmanager
async def world(*links: str) -> AsyncIterator[tuple[Server, Network, dict[str, str]]]:
    """A server and a network with ``links`` to it; yield them and each link's base URL."""
    server = Server()
    async with listening(server.handle) as port, Network() as net:
        urls = {
            name: f"http://127.0.0.1:{await net.link(name, '127.0.0.1', port)}" for name in links
        }
        yield server, net, urls


def client(url: str, timeout: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=timeout)


async def test_pass_relays_both_ways_over_one_kept_alive_connection() -> None:
    async with world("c->s") as (server, net, urls), client(urls["c->s"]) as http:
        for expected in ("ran 1", "ran 2"):
            reply = await http.get("/x")
            assert reply.text == expected
        (first, _), (second, _) = server.requests
        assert first == second  # one connection, kept alive
        assert [line for _, line in server.requests] == [b"GET /x HTTP/1.1"] * 2
        assert net.proxies["c->s"].forwarded == [b"GET /x HTTP/1.1"] * 2
        assert not net.counts


async def test_delay_adds_latency_each_way_on_open_connections_too() -> None:
    async with world("c->s") as (server, net, urls), client(urls["c->s"]) as http:
        await http.get("/warm")  # the connection is open before the fault
        net.set("c->s", Fault.delay(0.25))
        started = anyio.current_time()
        reply = await http.get("/slow")
        assert reply.text == "ran 2"
        assert anyio.current_time() - started >= 0.5  # the request's chunk, then the reply's
        assert len({connection for connection, _ in server.requests}) == 1  # the open one
        assert net.counts == {"delay": 1} and net.proxies["c->s"].hits["delay"] >= 2


async def test_drop_resets_new_connections_before_the_server_sees_them() -> None:
    async with world("c->s") as (server, net, urls), client(urls["c->s"]) as pooled:
        await pooled.get("/before")
        net.set("c->s", Fault.drop())
        async with client(urls["c->s"]) as fresh:
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError)):
                await fresh.get("/dropped")
        assert (await pooled.get("/pooled")).text == "ran 2"  # an open connection carries on
        assert [line for _, line in server.requests] == [
            b"GET /before HTTP/1.1",
            b"GET /pooled HTTP/1.1",
        ]
        assert net.proxies["c->s"].hits["drop"] == 1


async def test_reset_before_loses_the_request_and_the_server_never_saw_it() -> None:
    async with world("c->s") as (server, net, urls), client(urls["c->s"]) as http:
        net.set("c->s", Fault.reset_before())
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await http.post("/turn", json={"n": 1})
        assert server.requests == [] and net.proxies["c->s"].forwarded == []
        net.heal("c->s")
        assert (await http.post("/turn", json={"n": 2})).text == "ran 1"  # a later one is served
        assert net.counts == {"reset_before": 1}


async def test_reset_after_runs_the_request_and_loses_its_answer() -> None:
    async with world("c->s") as (server, net, urls), client(urls["c->s"]) as http:
        net.set("c->s", Fault.reset_after())
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await http.post("/turn", json={"n": 1})
        assert [line for _, line in server.requests] == [b"POST /turn HTTP/1.1"]  # ran once
        assert net.proxies["c->s"].hits["reset_after"] == 1
        net.heal("c->s")
        assert (await http.post("/turn", json={"n": 2})).text == "ran 2"


async def test_a_black_hole_stalls_the_caller_and_keeps_its_connection_stuck_after_healing() -> (
    None
):
    async with world("c->s") as (server, net, urls), client(urls["c->s"], timeout=0.5) as http:
        net.set("c->s", Fault.black_hole())
        with pytest.raises(httpx.ReadTimeout):  # accepted, never answered: half-open
            await http.get("/lost")
        port = int(urls["c->s"].rsplit(":", 1)[1])
        stuck = await anyio.connect_tcp("127.0.0.1", port)
        async with stuck:
            await stuck.send(b"GET /swallowed HTTP/1.1\r\nhost: s\r\n\r\n")
            await wait_for(  # the proxy read the bytes and threw them away
                "the black hole to swallow a connection's bytes",
                lambda: net.proxies["c->s"].hits["black_hole"] >= 2,
            )
            net.heal("c->s")
            assert (await http.get("/after")).text == "ran 1"  # a new connection is served
            await stuck.send(b"GET /still-lost HTTP/1.1\r\nhost: s\r\n\r\n")
            with anyio.move_on_after(0.5):  # the caller's own timeout ends it, nothing else
                answer = await stuck.receive()
                pytest.fail(f"a black-holed connection answered after the heal: {answer!r}")
        assert [line for _, line in server.requests] == [b"GET /after HTTP/1.1"]


async def test_a_dead_server_is_refused_through_its_link_until_it_listens_again() -> None:
    """A caller must see a dead server's refusal through the proxy too (a refused connection
    provably sent nothing: a gateway tries the next holder; a reset may have run): the link
    notices the death by itself, before any caller, and refuses from then on; once the server
    listens again on its port the link serves again, on the same port."""
    server = Server()
    async with Network() as net:
        async with listening(server.handle) as port:
            link = await net.link("c->s", "127.0.0.1", port)
            async with client(f"http://127.0.0.1:{link}") as http:
                assert (await http.get("/alive")).text == "ran 1"
        # the server is gone (its listener and every connection closed, as a killed process's)
        await wait_for(
            "the link to notice its server died", lambda: net.proxies["c->s"].hits["refused"] == 1
        )
        async with client(f"http://127.0.0.1:{link}") as http:
            with pytest.raises(httpx.ConnectError):  # refused: never a reset
                await http.get("/refused")
            async with listening(server.handle, port):  # back, on the same port
                await wait_for(
                    "the link to serve again",
                    lambda: _answers(http, "/back"),
                    timeout=10,
                    every=0.05,
                )
        assert [line for _, line in server.requests] == [
            b"GET /alive HTTP/1.1",
            b"GET /back HTTP/1.1",
        ]


async def _answers(http: httpx.AsyncClient, path: str) -> bool:
    try:
        return (await http.get(path)).status_code == 200
    except httpx.TransportError:
        return False


async def test_a_partition_cuts_every_link_of_one_process_and_heals() -> None:
    async with world("gw0->s", "gw1->s", "gw0->e1") as (server, net, urls):
        assert net.partition("gw0") == ["gw0->s", "gw0->e1"]
        async with client(urls["gw0->s"], timeout=0.5) as cut, client(urls["gw1->s"]) as other:
            with pytest.raises(httpx.ReadTimeout):
                await cut.get("/from-gw0")
            assert (await other.get("/from-gw1")).text == "ran 1"  # the rest still talk
        net.heal_all()
        async with client(urls["gw0->e1"]) as healed:
            assert (await healed.get("/healed")).text == "ran 2"
        assert net.counts == {"partition": 1}
        assert [line for _, line in server.requests] == [
            b"GET /from-gw1 HTTP/1.1",
            b"GET /healed HTTP/1.1",
        ]
        with pytest.raises(ValueError, match="no link"):
            net.partition("nobody")
        with pytest.raises(ValueError, match="CALLER->SERVER"):
            await net.link("gw0-serve", "127.0.0.1", 1)


# Promises across processes: a `loraledger gateway` process in front of two local engines'
# HTTP servers (the server `loraledger engine` runs, here in the test's process: a
# subprocess each imports its model for many seconds), every link through the proxy; serve in
# this process, its links to the engines through the proxy too (a partition of an engine
# cuts both).

TOKEN = "chaos-net-token"
UPSTREAM_TIMEOUT_S = 2.0  # the gateway's --upstream-timeout-s: how long it waits in a black hole
ABORT_TIMEOUT_S = 10.0  # then how long it waits for the engine to confirm the abort (its default)


class Cluster(NamedTuple):
    net: Network
    status: httpx.AsyncClient  # serve, as a token holder
    client: openai.AsyncOpenAI  # the gateway process's OpenAI routes, no retries of its own


@asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with AsyncExitStack() as stack:
        net = await stack.enter_async_context(Network())
        engines = {}
        for engine_id in ("e0", "e1"):
            _, url = await stack.enter_async_context(running_server(engine_id, limits=LIMITS))
            engines[engine_id] = int(url.rsplit(":", 1)[1])

        async def linked(caller: str, engine_id: str) -> str:
            port = await net.link(f"{caller}->{engine_id}", "127.0.0.1", engines[engine_id])
            return f"{engine_id}=local:http://127.0.0.1:{port}"

        specs = [parse_engine(await linked("serve", e)) for e in engines]
        ledger = await stack.enter_async_context(
            serving(tmp_path / "ledger.db", token=TOKEN, engines=tuple(specs), probe_timeout_s=1)
        )
        status = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=ledger,
                trust_env=False,
                timeout=60,
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        )
        adapter = _adapter_dir(tmp_path, 1)
        reply = await status.post("/versions", json={"version_id": 1, "adapter_dir": str(adapter)})
        assert reply.status_code == 200, reply.text
        args = [
            "gateway",
            *("--ledger", ledger, "--token-file", str(token_file), "--port", "0"),
            *("--owner", "gw0", "--refresh-s", "0.2"),
            *("--upstream-timeout-s", str(UPSTREAM_TIMEOUT_S)),
            *[arg for e in engines for arg in ("--engine", await linked("gw0", e))],
            "--json",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("LORALEDGER_TOKEN", None)
        _, row = await stack.enter_async_context(listening_process(args, env=env))
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=f"{row['url']}/v1", api_key=TOKEN, max_retries=0)
        )
        yield Cluster(net, status, client)


async def turn(client: openai.AsyncOpenAI, session: str) -> tuple[str, str]:
    """One turn of ``session``: the (version, engine) that served it."""
    raw = await client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_headers={"x-session-id": session},
    )
    return raw.headers["x-loraledger-version"], raw.headers["x-loraledger-engine"]


def generations(net: Network, link: str) -> int:
    """Generation requests the proxy forwarded on ``link``: what reached that engine."""
    return sum(line.startswith(b"POST /v1/") for line in net.proxies[link].forwarded)


def other(engine: str) -> str:
    return "e1" if engine == "e0" else "e0"


async def test_a_lost_answer_is_ambiguous_once_and_a_lost_request_leaves_later_turns_served(
    tmp_path: Path,
) -> None:
    """``reset_after`` on gateway->engine: the engine ran the turn, its answer is lost; the
    client hears ``502 AMBIGUOUS_DISPATCH`` and the turn reached an engine once, never resent
    to the other holder. ``reset_before``: the turn never reached the engine (the gateway
    cannot tell, so it is ambiguous too); after the heal the session's next turn is served on
    its version and engine. Then the engine's port refuses (its process gone): the turn is
    served by the other holder on its version, not answered ambiguous."""
    async with cluster(tmp_path) as c:
        version, engine = await turn(c.client, "s")
        link, spare = f"gw0->{engine}", f"gw0->{other(engine)}"
        sent = (generations(c.net, link), generations(c.net, spare))

        c.net.set(link, Fault.reset_after())
        with pytest.raises(openai.APIStatusError) as lost_answer:
            await turn(c.client, "s")
        assert (lost_answer.value.status_code, lost_answer.value.code) == (
            502,
            "AMBIGUOUS_DISPATCH",
        )
        # the gateway's incarnation probe after the lost answer may be reset too: a network
        # fault hits every request on the link
        assert c.net.proxies[link].hits["reset_after"] >= 1
        assert (generations(c.net, link), generations(c.net, spare)) == (sent[0] + 1, sent[1])

        c.net.set(link, Fault.reset_before())
        with pytest.raises(openai.APIStatusError) as lost_request:
            await turn(c.client, "s")
        assert lost_request.value.status_code == 502
        assert c.net.proxies[link].hits["reset_before"] >= 1
        assert (generations(c.net, link), generations(c.net, spare)) == (sent[0] + 1, sent[1])

        c.net.heal(link)
        await wait_for(  # the gateway's next turn after the heal is served, as before
            "the session's next turn served after the heal",
            lambda: _served(c.client, "s", (version, engine)),
            timeout=20,
            every=0.2,
        )
        assert c.net.counts == {"reset_after": 1, "reset_before": 1}

        # The engine's process gone (its link now leads nowhere): the link refuses, as the
        # engine's port would, so the turn provably did not run there and the other holder
        # serves it, on the session's version: no ambiguity from the test's own network.
        c.net.retarget(link, "127.0.0.1", _closed_port())
        await wait_for("the link to refuse", lambda: c.net.proxies[link].hits["refused"] == 1)
        assert await turn(c.client, "s") == (version, other(engine))


def _closed_port() -> int:
    """A loopback port nothing listens on (the OS gave it, then it was closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _served(client: openai.AsyncOpenAI, session: str, where: tuple[str, str]) -> bool:
    try:
        return await turn(client, session) == where
    except openai.APIStatusError:
        return False


async def test_a_partitioned_engine_costs_one_turn_its_timeout_and_is_routed_around(
    tmp_path: Path,
) -> None:
    """A partition of the session's engine (gateway->engine and serve->engine black-holed,
    half-open): the turn in the hole gives up after the gateway's upstream timeout and its
    wait for the abort's confirmation with ``502 AMBIGUOUS_DISPATCH``, resent nowhere;
    serve's probes time out and take the engine out of routing, the outage is recorded in
    the log once, and the session's next turns are served by the other holder on the same
    version. After the heal the engine is routable again, its outage's end recorded. The
    figures (the turn's wait, partition to the outage record) are printed."""
    async with cluster(tmp_path) as c:
        version, engine = await turn(c.client, "s")
        spare = f"gw0->{other(engine)}"
        before = generations(c.net, spare)
        assert c.net.partition(engine) == [f"serve->{engine}", f"gw0->{engine}"]
        cut_wall = time.time()

        started = anyio.current_time()
        with pytest.raises(openai.APIStatusError) as stalled:
            await turn(c.client, "s")
        waited = anyio.current_time() - started
        print(f"the turn in the hole gave up after {waited:.3f} s")
        assert (stalled.value.status_code, stalled.value.code) == (502, "AMBIGUOUS_DISPATCH")
        # The stated bound: the upstream timeout, then the wait for the abort's confirmation,
        # which a partitioned engine never sends (docs/openai.md, "Engine silence").
        assert UPSTREAM_TIMEOUT_S <= waited < UPSTREAM_TIMEOUT_S + ABORT_TIMEOUT_S + 10, waited
        assert generations(c.net, spare) == before  # never resent to the other holder

        await wait_for(
            f"{engine} out of serve's routing",
            lambda: _routable(c.status, engine, False),
            timeout=20,
            every=0.1,
        )
        await wait_for(
            "the session served by the other holder, on its version",
            lambda: _served(c.client, "s", (version, other(engine))),
            timeout=20,
            every=0.2,
        )
        c.net.heal_all()
        await wait_for(
            f"{engine} back in routing after the heal",
            lambda: _routable(c.status, engine, True),
            timeout=20,
            every=0.1,
        )
        assert c.net.counts == {"partition": 1}

    # The outage is in the log, once, and so is its end after the heal.
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        records = await store.read()
    outages = [(r, r.event) for r in records if isinstance(r.event, EngineUnreachable)]
    assert [event.engine for _, event in outages] == [engine], outages
    (outage, _), *_ = outages
    print(f"partition -> outage record: {outage.recorded_at - cut_wall:.3f} s")
    ended = [
        r.seq
        for r in records
        if isinstance(r.event, EngineReachable | EngineRestarted) and r.event.engine == engine
    ]
    assert any(seq > outage.seq for seq in ended), ended


async def _routable(status: httpx.AsyncClient, engine: str, wanted: bool) -> bool:
    engines = (await status.get("/status")).json()["engines"]
    row = next(e for e in engines if e["engine"] == engine)
    return bool(row["routable"]) == wanted
