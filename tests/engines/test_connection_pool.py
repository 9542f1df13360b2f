"""The engine connection pool against a real uvicorn (the server vLLM and SGLang run).

With a keep-alive shorter than the pool's idle expiry, the server's timer closes connections
the pool still holds, and requests are sent at about the moment it fires, so some cross its
close on the wire (the race the pool cannot win, made likely). What must hold whatever the
timing: no generation runs twice (nothing is resent), and none is lost silently (every
generation the server did not run came back to the caller as an ambiguous reply).

Under concurrency, requests spread over the pool's shards (``engines.http_pool``), and every
request leaves its shard's count when its reply is closed, whatever became of it."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines import http
from engines.contract import AmbiguousReply
from engines.http_pool import ShardedTransport
from engines.openai_http import CHAT_PATH, open_upstream
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio

KEEP_ALIVE_S = 0.1  # far under the pool's expiry: every reuse after it races the server's timer
GENERATIONS = 60


class GenerationServer:
    """A chat route that counts the generations it runs (by request id) and the connections
    they came on (by client port), served by uvicorn on its own thread and event loop, as an
    engine's process would be."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.client_ports: set[int] = set()
        self.holding = 0  # requests /hold has received and not yet answered
        self.release = threading.Event()

        async def chat(request: Request) -> JSONResponse:
            self.runs[request.headers["x-request-id"]] += 1
            if request.client is not None:
                self.client_ports.add(request.client.port)
            return JSONResponse({"choices": [{"message": {"content": "ok"}}]})

        async def hold(request: Request) -> JSONResponse:
            self.holding += 1
            while not self.release.is_set():  # noqa: ASYNC110 -- a thread's event
                await anyio.sleep(0.005)
            self.holding -= 1
            return JSONResponse({"held": True})

        app = Starlette(
            routes=[
                Route(CHAT_PATH, chat, methods=["POST"]),
                Route("/hold", hold, methods=["GET"]),
            ]
        )
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = _Quiet(
            uvicorn.Config(app, lifespan="off", log_config=None, timeout_keep_alive=KEEP_ALIVE_S)  # type: ignore[arg-type]  # uvicorn takes seconds as a float at run time
        )
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],))
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        assert not self._thread.is_alive()


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@pytest.fixture
def engine() -> Iterator[GenerationServer]:
    server = GenerationServer()
    try:
        yield server
    finally:
        server.stop()


async def test_no_generation_runs_twice_and_none_is_lost_silently(
    engine: GenerationServer,
) -> None:
    await wait_for("uvicorn started", lambda: engine._server.started)
    answered: list[str] = []
    ambiguous: list[str] = []
    pace = random.Random(7)
    async with http.engine_client() as client:
        for n in range(GENERATIONS):
            request_id = f"g{n}"
            try:
                async with open_upstream(
                    client,
                    engine.url + CHAT_PATH,
                    b"{}",
                    engine_id="e0",
                    request_id=request_id,
                    timeout=10.0,
                ) as response:
                    reply: Any = (await response.aread()).decode()
                    assert response.status_code == 200, reply
                answered.append(request_id)
            except AmbiguousReply:
                ambiguous.append(request_id)
            # Idle for about the server's keep-alive: the next request meets its timer.
            await anyio.sleep(KEEP_ALIVE_S + pace.uniform(-0.01, 0.01))
    ran = set(engine.runs)
    assert max(engine.runs.values()) == 1, "a generation ran twice"
    assert set(answered) <= ran, "an answer without a generation"
    assert {f"g{n}" for n in range(GENERATIONS)} - ran <= set(ambiguous), "a silent loss"
    assert len(answered) + len(ambiguous) == GENERATIONS
    assert len(engine.client_ports) < GENERATIONS, "the pool never reused a connection"


def _shards(client: httpx.AsyncClient) -> ShardedTransport:
    transport = client._transport
    assert isinstance(transport, ShardedTransport)
    return transport


async def test_concurrent_requests_spread_over_the_shards_and_leave_them_when_answered(
    engine: GenerationServer,
) -> None:
    await wait_for("uvicorn started", lambda: engine._server.started)
    callers = 4 * http.POOL_SHARDS
    async with http.engine_client(engine.url) as client:
        pool = _shards(client)

        async def held() -> None:
            reply = await http.request(client, "GET", "/hold", engine_id="e0", timeout=30.0)
            assert reply.json() == {"held": True}

        async with anyio.create_task_group() as tg:
            for _ in range(callers):
                tg.start_soon(held)
            await wait_for("every request held by the server", lambda: engine.holding == callers)
            assert pool.in_flight == (4,) * http.POOL_SHARDS
            engine.release.set()
        assert pool.in_flight == (0,) * http.POOL_SHARDS


async def test_a_reply_given_up_or_a_failed_request_leaves_no_count_behind(
    engine: GenerationServer,
) -> None:
    await wait_for("uvicorn started", lambda: engine._server.started)
    async with http.engine_client() as client:
        pool = _shards(client)
        async with open_upstream(
            client, engine.url + CHAT_PATH, b"{}", engine_id="e0", request_id="given-up"
        ) as response:
            assert response.status_code == 200
            assert pool.in_flight[0] == 1  # closed below without reading the body
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            closed_port = unused.getsockname()[1]
        with pytest.raises(AmbiguousReply) as refused:
            await http.request(
                client, "GET", f"http://127.0.0.1:{closed_port}/", engine_id="e1", timeout=5.0
            )
        assert refused.value.dispatched is False
        assert pool.in_flight == (0,) * http.POOL_SHARDS
