"""The engine connection pool against a real uvicorn (the server vLLM and SGLang run) whose
keep-alive is shorter than the pool's idle expiry: the server's timer closes connections the
pool still holds, and requests are sent at about the moment it fires, so some cross its close
on the wire (the race the pool cannot win, made likely). What must hold whatever the timing:
no generation runs twice (nothing is resent), and none is lost silently (every generation the
server did not run came back to the caller as an ambiguous reply)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines import http
from engines.contract import AmbiguousReply
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

        async def chat(request: Request) -> JSONResponse:
            self.runs[request.headers["x-request-id"]] += 1
            if request.client is not None:
                self.client_ports.add(request.client.port)
            return JSONResponse({"choices": [{"message": {"content": "ok"}}]})

        app = Starlette(routes=[Route(CHAT_PATH, chat, methods=["POST"])])
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = _Quiet(
            uvicorn.Config(app, lifespan="off", log_config=None, timeout_keep_alive=KEEP_ALIVE_S)  # type: ignore[arg-type]  # uvicorn takes seconds as a float at run time
        )
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],))
        self._thread.start()

    def stop(self) -> None:
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
