"""The connection pool under :func:`engines.http.engine_client`: httpx's pool, split into
shards so that its bookkeeping stays cheap under concurrency.

Why shards: httpcore's pool re-examines every connection it holds on every request and every
reply (expiry, a readability probe of each idle socket, a count of idle ones per connection),
so its cost per request grows with the connections held: at 32 concurrent callers one pool
answered half as many requests per second as eight small ones (BENCHMARKS.md, Engine HTTP
connections), and fell behind a fresh connection per request. Here each request goes to the
shard with the fewest requests in flight (the first such, so a lone caller always reuses the
same shard's connection); each shard is an ordinary httpx transport with the limits and idle
expiry :mod:`engines.http` sets, so everything that module says about reuse holds per shard.

A request counts as in flight from the moment it is handed to a shard until its reply is
closed (read to the end, or given up: the connection is then closed, never reused).
"""

from __future__ import annotations

import functools
import math
import ssl
from collections.abc import AsyncIterator

import httpx


class ShardedTransport(httpx.AsyncBaseTransport):
    """``shards`` httpx transports sharing ``limits.max_connections`` between them (each
    holds at most its share, rounded up), ``limits.keepalive_expiry`` in each."""

    def __init__(self, limits: httpx.Limits, *, shards: int) -> None:
        total = limits.max_connections or 100
        share = math.ceil(total / shards)
        each = httpx.Limits(
            max_connections=share,
            max_keepalive_connections=share,
            keepalive_expiry=limits.keepalive_expiry,
        )
        tls = _tls_context()
        self._shards = [httpx.AsyncHTTPTransport(limits=each, verify=tls) for _ in range(shards)]
        self._in_flight = [0] * shards

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per shard (sent, reply not yet closed)."""
        return tuple(self._in_flight)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        shard = min(range(len(self._shards)), key=self._in_flight.__getitem__)
        self._in_flight[shard] += 1
        try:
            response = await self._shards[shard].handle_async_request(request)
        except BaseException:
            self._in_flight[shard] -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_CountedStream(response.stream, self._in_flight, shard),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's roots), built once per process and shared by
    every shard of every engine client: building one costs tens of milliseconds of CPU (the
    root store), which once per shard made a fleet's adapters slow to construct."""
    return httpx.create_ssl_context()


class _CountedStream(httpx.AsyncByteStream):
    """A reply's body that takes its request off its shard's in-flight count when closed
    (once, however often it is closed)."""

    def __init__(self, inner: httpx.AsyncByteStream, in_flight: list[int], shard: int) -> None:
        self._inner = inner
        self._in_flight = in_flight
        self._shard: int | None = shard

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            if self._shard is not None:
                self._in_flight[self._shard] -= 1
                self._shard = None
