"""``loraledger bench gateway`` runs end to end at a tiny size: every case it can run is
measured and checked, the gateway case is either measured or named as not available, and every
process the benchmark started is gone afterwards (a smoke test against rot: performance is
judged from the benchmark's output, never by a timed test). The stub engine it measures against
is checked here too, since every figure is relative to it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.tools.conftest import Cli
from tools.bench.gateway import UNAVAILABLE, Processes, _port_url


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_bench_gateway_quick(cli: Cli, tmp_path: Path) -> None:
    result = cli("bench", "gateway", "--quick", "--json", "--dir", tmp_path)
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    assert out["bench"] == "gateway" and out["quick"] is True
    assert "cores" in out["machine"]

    # Every process started was stopped and reaped, by PID.
    procs = out["processes"]
    assert [p["role"] for p in procs] == ["stub", "proxy", "serve"]
    for p in procs:
        assert p["exit"] is not None, p
        assert _gone(p["pid"]), p
    assert next(p for p in procs if p["role"] == "serve")["exit"] == 0  # serve stops cleanly

    # serve published one version to the stub through loraledger's vLLM adapter.
    assert out["publish"]["status"] == "PUBLISHED"
    assert len(out["publish"]["stub_holds"]) == 1
    available = out["gateway"] == "available"
    if not available:
        assert out["gateway"] == UNAVAILABLE
        assert out["cases"]["c"] == UNAVAILABLE
        c_verdicts = [v for v in out["verdicts"] if v["case"] == "c"]
        assert len(c_verdicts) == 4
        assert all(v["verdict"] == f"pending: {UNAVAILABLE}" for v in c_verdicts)
    cases = ["a", "b", "c"] if available else ["a", "b"]

    closed = out["closed_loop"]
    assert [(r["concurrency"], r["case"]) for r in closed] == [
        (c, k) for c in (1, 4) for k in cases
    ]
    for row in closed:
        assert row["errors"] == 0, row
        assert row["req_per_s"] > 0
        assert row["ttfb_p50_ms"] > 0 and row["ttfb_p99_ms"] >= row["ttfb_p50_ms"]
        assert row["cpu_us_per_req_client"] >= 0
    for row in (r for r in closed if r["case"] == "a"):
        assert row["x_of_a"] == 1.0 and row["added_p50_ms"] == 0.0
    for row in (r for r in closed if r["case"] == "c"):
        assert row["unpinned"] == 0
        assert row["x_of_b"] is not None

    assert [r["case"] for r in out["paced"]] == cases
    assert all(r["errors"] == 0 and r["ttfb_p50_ms"] > 0 for r in out["paced"])

    sse = out["sse"]
    assert [(r["concurrency"], r["case"]) for r in sse] == [(c, k) for c in (1, 4) for k in cases]
    for row in sse:
        # 16 streams of 4 chunks each, every chunk timed, no usage chunk nobody asked for.
        assert row["streams"] == 16 and row["chunks"] == 16 * 4, row
        assert row["unasked_usage_chunks"] == 0 and row["errors"] == 0
        assert row["chunk_p99_ms"] >= row["chunk_p50_ms"] >= 0


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[str]:
    """The stub engine in its own process; stopped by PID."""
    procs = Processes(tmp_path)
    port_file = tmp_path / "stub.port"
    started = procs.start("stub", ["-m", "tools.bench.stub_engine", "--port-file", str(port_file)])
    try:
        yield anyio.run(_port_url, started, port_file)
    finally:
        procs.stop_all()
    assert _gone(started.pid)


def _events(text: str) -> list[Any]:
    datas = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stub_streams_usage_only_when_asked(stub: str, route: str, tmp_path: Path) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "stream": True}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    )
    with httpx.Client(base_url=stub, trust_env=False, timeout=30) as http:
        plain = _events(http.post(route, json=body).text)
        asked = _events(
            http.post(route, json={**body, "stream_options": {"include_usage": True}}).text
        )
        whole = http.post(route, json={**body, "stream": False}).json()
    assert len(plain) == 3 and all(len(c["choices"]) == 1 for c in plain)
    assert len(asked) == 4 and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 3
    assert whole["usage"]["completion_tokens"] == 3 and len(whole["choices"]) == 1


def test_stub_lora_api_has_vllm_shapes(stub: str, tmp_path: Path) -> None:
    with httpx.Client(base_url=stub, trust_env=False, timeout=30) as http:
        missing = http.post("/v1/chat/completions", json={"model": "v1", "messages": []})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `v1` does not exist."
        nowhere = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "v1", "lora_path": str(tmp_path / "none")}
        )
        assert nowhere.status_code == 404 and "No adapter found" in nowhere.text
        assert (
            http.post(
                "/v1/load_lora_adapter", json={"lora_name": "v1", "lora_path": str(tmp_path)}
            ).status_code
            == 200
        )
        again = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "v1", "lora_path": str(tmp_path)}
        )
        assert again.status_code == 400 and "has already been loaded" in again.text
        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("v1", "tiny")]
        assert cards[1]["root"] == str(tmp_path)
        ok = http.post("/v1/chat/completions", json={"model": "v1", "messages": []})
        assert ok.status_code == 200 and ok.json()["model"] == "v1"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "v1"}).status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "v1"})
        assert gone.status_code == 404 and "cannot be found" in gone.text
        assert "process_start_time_seconds " in http.get("/metrics").text
