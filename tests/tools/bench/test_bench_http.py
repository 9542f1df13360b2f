"""The HTTP connection benchmark runs end to end at a small size and reports what it claims to
(a smoke test against rot: performance itself is judged from the benchmark's output, never by a
timed test)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from tools.bench.http import _server, bench_http


def test_bench_http_small(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with _server(str(tmp_path)) as base_url:
        result = anyio.run(
            lambda: bench_http(base_url, requests=64, concurrencies=(1, 8), rounds=2)
        )
    # The benchmark's server is gone with its context.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/ping", timeout=5)
    assert [row["concurrency"] for row in result["rows"]] == [1, 8]
    for row in result["rows"]:
        assert len(row["samples"]["pooled"]) == len(row["samples"]["fresh"]) == 2
        assert row["pooled_rps"] > 0 and row["fresh_rps"] > 0
        assert row["ratio"] == pytest.approx(row["pooled_rps"] / row["fresh_rps"], abs=0.01)
    assert isinstance(result["rows"][0]["saved_us_per_request"], int)
    assert result["rows"][1]["saved_us_per_request"] is None
