"""A bare pass-through proxy: the floor the gateway's own overhead is measured against.

Case (b) of ``loraledger bench gateway``: the same stack as the gateway (Starlette on uvicorn,
httpx to the engine, responses streamed through as they arrive) doing nothing but forwarding,
so that (c) minus (b) is what loraledger's pinning costs and (b) minus (a) what any Python proxy
on this stack costs. Every request goes to the one upstream, body and headers untouched (hop
headers dropped), the reply's status, headers and bytes streamed back without buffering; a
client that goes away closes the upstream response (the upstream request is abandoned).

Upstream connections are pooled and kept alive (the cheapest a pass-through can be).

Run ``python -m tools.bench.proxy --upstream URL --port-file FILE``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tools.bench.stub_engine import listen_and_run

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx/uvicorn recompute.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
    }
)


def build_proxy(upstream: str, *, pool: int = 1024) -> Starlette:
    client = httpx.AsyncClient(
        base_url=upstream,
        trust_env=False,
        timeout=httpx.Timeout(600.0),
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
    )

    async def forward(request: Request) -> StreamingResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        upstream_request = client.build_request(
            request.method, request.url.path, headers=headers, content=await request.body()
        )
        response = await client.send(upstream_request, stream=True)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:  # also when the client went away mid-stream
                await response.aclose()

        reply_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(
            body(),
            status_code=response.status_code,
            headers=reply_headers,
        )

    routes: list[Any] = [Route("/{path:path}", forward, methods=["GET", "POST"])]
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.proxy", description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)
    listen_and_run(build_proxy(args.upstream), args.port_file)


if __name__ == "__main__":
    main()
