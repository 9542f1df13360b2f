"""Benchmark: the engine connection pool next to a fresh connection per engine request.

Every engine caller sends through :func:`engines.http.engine_client`'s pool, which closes idle
connections before the engine's keep-alive timer could (see that module). Before the pool,
every request went out on a connection of its own (``Connection: close``). This measures both,
in the same run and on the same server:

* ``pooled`` -- ``engines.http.request`` through ``engines.http.engine_client`` (today's rule);
* ``fresh`` -- the same, with ``Connection: close`` on every request: a TCP handshake and a
  close per request (the rule before the pool).

The server is uvicorn (what vLLM and SGLang run) in a subprocess of its own on loopback,
answering ``GET /ping`` at once: the figures are pure per-request overhead, the worst case for
the fresh connection (a real engine call spends milliseconds to seconds generating). Each arm
runs ``requests`` requests from ``concurrency`` tasks; arms alternate over ``rounds`` and the
median is kept, so a shared machine's load hits both alike. Every reply is checked.

Run ``python -m tools.bench.http`` (``--json`` for every sample).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx

from engines import http


def _serve(port_file: str) -> None:
    """The server side (run in the subprocess): one route, uvicorn defaults."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def ping(_request: Any) -> PlainTextResponse:
        return PlainTextResponse("pong")

    # proto=IPPROTO_TCP, as asyncio's own listeners have: only then does asyncio set
    # TCP_NODELAY on the accepted connections (without it, Nagle's algorithm meets the client's
    # delayed ACK and every kept-alive reply waits ~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(tmp, port_file)  # the port is listening before the parent reads it
    config = uvicorn.Config(
        Starlette(routes=[Route("/ping", ping)]), log_level="warning", access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextmanager
def _server(workdir: str) -> Iterator[str]:
    """A uvicorn subprocess on a free loopback port; stopped (by its PID) on exit."""
    port_file = os.path.join(workdir, "port")
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.http", "--serve", port_file])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark server did not start (exit {proc.poll()})")
            time.sleep(0.05)
        with open(port_file) as f:
            yield f"http://127.0.0.1:{f.read().strip()}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The rule before the pool: the server closes the connection after each reply.
_ONE_REQUEST_PER_CONNECTION = {"Connection": "close"}


async def _arm(client: httpx.AsyncClient, fresh: bool, requests: int, concurrency: int) -> float:
    """Requests per second for one arm; every reply must be ``pong``."""
    per_task = requests // concurrency
    headers = _ONE_REQUEST_PER_CONNECTION if fresh else None

    async def one_task() -> None:
        for _ in range(per_task):
            response = await http.request(
                client, "GET", "/ping", engine_id="b", timeout=30, headers=headers
            )
            if response.text != "pong":
                raise RuntimeError(f"unexpected reply {response.status_code} {response.text!r}")

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(one_task)
    return per_task * concurrency / (time.perf_counter() - t0)


async def bench_http(
    base_url: str,
    *,
    requests: int = 2000,
    concurrencies: tuple[int, ...] = (1, 32, 256),
    rounds: int = 5,
) -> dict[str, Any]:
    rows = []
    async with http.engine_client(base_url) as client:
        await _arm(client, False, 50, 1)  # warm-up: imports, first connection
        for concurrency in concurrencies:
            samples: dict[str, list[float]] = {"pooled": [], "fresh": []}
            for _ in range(rounds):
                samples["pooled"].append(await _arm(client, False, requests, concurrency))
                samples["fresh"].append(await _arm(client, True, requests, concurrency))
            pooled, fresh = (statistics.median(samples[k]) for k in ("pooled", "fresh"))
            rows.append(
                {
                    "concurrency": concurrency,
                    "pooled_rps": round(pooled),
                    "fresh_rps": round(fresh),
                    "ratio": round(pooled / fresh, 2),
                    # Per request, as one sequential caller waits it (concurrency 1 only).
                    "saved_us_per_request": (
                        round((1 / fresh - 1 / pooled) * 1e6) if concurrency == 1 else None
                    ),
                    "samples": samples,
                }
            )
    return {
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        ),
        "load_average": os.getloadavg(),
        "requests": requests,
        "rounds": rounds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.http", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print every figure as JSON")
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as workdir, _server(workdir) as base_url:
        result = anyio.run(lambda: bench_http(base_url, requests=args.requests, rounds=args.rounds))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"machine: {result['machine']}; {result['requests']} requests x {result['rounds']} rounds;"
        f" load average at the end {result['load_average'][0]:.2f}"
    )
    for row in result["rows"]:
        saved = row["saved_us_per_request"]
        print(
            f"concurrency {row['concurrency']:>3}: pooled {row['pooled_rps']:>6} req/s, "
            f"fresh connection {row['fresh_rps']:>6} req/s, ratio {row['ratio']:.2f}"
            + (f" ({saved:+} us per request saved)" if saved is not None else "")
        )


if __name__ == "__main__":
    main()
