"""The one HTTP client engine adapters use: no proxy from the environment, and idle
connections expire before the server closes them (a reused connection that the server is
closing turns a request into a spurious ambiguous CONNECTION_LOST)."""

from __future__ import annotations

import pytest
import uvicorn

from engines import http
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine


def test_keepalive_expires_before_the_servers_close_idle_connections() -> None:
    server_idle_timeout = uvicorn.Config(app=None).timeout_keep_alive  # what vLLM/SGLang run
    assert server_idle_timeout > http.KEEPALIVE_EXPIRY_S


@pytest.mark.anyio
@pytest.mark.parametrize("make", [lambda: SGLangEngine("http://127.0.0.1:9", "e0"),
                                  lambda: VLLMEngine("http://127.0.0.1:9", "e0")])  # fmt: skip
async def test_adapters_use_the_engine_client(make) -> None:  # type: ignore[no-untyped-def]
    engine = make()
    try:
        pool = engine._client._transport._pool  # httpx's connection pool
        assert pool._keepalive_expiry == http.KEEPALIVE_EXPIRY_S
        assert engine._client._trust_env is False
    finally:
        await engine.aclose()
