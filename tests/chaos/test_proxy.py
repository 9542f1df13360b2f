"""The chaos proxy's faults, each against a real HTTP/1.1 server on loopback (keep-alive, one
request line per request counted where it arrives), showing what the caller sees and what the
server saw: a drop and a reset before the request never reach the server, a reset after it
ran loses only the answer, a black hole stalls the caller until its own timeout (and keeps the
connection stuck after the link heals), a partition cuts every link of one process at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import httpx
import pytest

from tests.chaos.proxy import Fault, Network
from tests.support.relay import listening, read_request
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio


class Server:
    """A keep-alive HTTP/1.1 server that answers every request ``200 ran <n>`` and records the
    request lines it received, with the connection each came on."""

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
        assert server.requests == [(1, b"GET /x HTTP/1.1")] * 2  # one connection, kept alive
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
        assert server.connections == 1
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
        assert server.requests == [(1, b"POST /turn HTTP/1.1")]  # it ran, exactly once
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
