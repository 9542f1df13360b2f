"""One request makes ``loraledger serve`` do work bounded by what the request needs, never by
what the caller packed into it:

* an OpenAI body is judged on the fields the face reads (``model``, the session, ``stream``)
  without building Python objects for the rest (the conversation is forwarded as the client's
  bytes): a 63 MiB body of tiny JSON values with a bad ``model`` is refused quickly, in
  bounded memory, and ``/health`` keeps answering meanwhile. Before: the whole body was
  parsed into Python objects on the event loop first; ``serve`` (``/health`` too) blocked
  17 s and peaked at 1.7 GB;
* ``POST /versions`` of a directory on this host copies the weights file into the artifact
  store as it reads it (hashed from the copy) and publishes from there, as an upload is: the
  peak resident memory grows by a fraction of the file. Before: the file was read whole,
  parsed into tensors and copied again (a 512 MiB file took ``serve`` to 1.6 GB).

Real processes: ``loraledger serve`` and, for the publication, a ``loraledger engine`` process
(the local engine server, its rank limit raised for a large adapter), each stopped by its PID.
Peak memory is the kernel's ``VmHWM`` of the ``serve`` process, reset (``clear_refs``) once it
is warmed up. Figures are printed (``-s``) for RELIABILITY.md; the bounds are wide."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import httpx
import pytest

from tests.engines.test_artifact_copy import sparse_adapter
from tests.publisher.remote.test_http_trainer import (
    TOKEN,
    adapter,
    high_rank_engine,
    serve_process,
)
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.memory import PeakGrowth

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MiB = 1024 * 1024


def tiny_values_body(size: int) -> bytes:
    """A chat body of about ``size`` bytes whose one message holds a flat list of empty objects
    and zeros (a Python dict each, and a number parsed by the strict parser's hook), naming a
    model that does not exist."""
    head = b'{"model": "no-such-model", "messages": [{"role": "user", "content": ['
    tail = b"]}]}"
    count = (size - len(head) - len(tail)) // 5
    return head + b",".join([b"{},0"] * count) + tail


async def test_a_huge_openai_body_with_a_bad_model_neither_stalls_serve_nor_balloons(
    tmp_path: Path,
) -> None:
    body = tiny_values_body(63 * MiB)
    # An engine the face has a route to (nothing listens there: the request never gets so far).
    with serve_process(tmp_path / "serve", ["http://127.0.0.1:9"]) as (url, served):
        pid = served.proc.pid
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=120) as http:
            assert (await http.get("/health")).status_code == 200
            warm = await http.post("/v1/chat/completions", content=b"{}", headers=AUTH)
            assert warm.status_code == 400, warm.text
            peak = await PeakGrowth.start(pid)
            answered: list[httpx.Response] = []
            health_waits: list[float] = []
            started = time.monotonic()

            async def post() -> None:
                answered.append(await http.post("/v1/chat/completions", content=body, headers=AUTH))

            async def health() -> None:
                async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=120) as probe:
                    while not answered:
                        started = time.monotonic()
                        assert (await probe.get("/health")).status_code == 200
                        health_waits.append(time.monotonic() - started)
                        await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(post)
                tg.start_soon(health)
            took = time.monotonic() - started
            growth = peak.bytes()
    refusal = answered[0]
    slowest = max(health_waits)
    print(
        f"\n{len(body) / MiB:.0f} MiB body of tiny values, bad model: refused in {took:.2f} s, "
        f"slowest /health {slowest:.2f} s, peak resident memory +{growth / MiB:.0f} MiB"
    )
    assert refusal.status_code == 404, refusal.text[:300]
    error = refusal.json()["error"]
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"], error
    assert slowest < 2.0, health_waits
    assert growth < 4 * len(body), growth


async def test_publishing_a_directory_on_this_host_streams_it_into_the_store(
    tmp_path: Path,
) -> None:
    home = tmp_path / "trainer"
    home.mkdir()
    big = sparse_adapter(home, 256 * MiB)
    size = (big / "adapter_model.safetensors").stat().st_size
    rank = json.loads((big / "adapter_config.json").read_text())["r"]
    async with high_rank_engine(tmp_path, max_rank=rank) as engine_url:
        with serve_process(tmp_path / "serve", [engine_url]) as (url, served):
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=600) as http:
                small = adapter(home, 1)
                warm = {"version_id": 1, "adapter_dir": str(small)}
                reply = await http.post("/versions", json=warm, headers=AUTH)
                assert reply.json()["status"] == "PUBLISHED", reply.text
                peak = await PeakGrowth.start(served.proc.pid)
                started = time.monotonic()
                published = {"version_id": 2, "adapter_dir": str(big)}
                reply = await http.post("/versions", json=published, headers=AUTH)
                took = time.monotonic() - started
                growth = peak.bytes()
    print(
        f"\nPOST /versions of a {size / MiB:.0f} MiB adapter directory: {took:.1f} s, "
        f"peak resident memory of serve +{growth / MiB:.0f} MiB"
    )
    assert reply.status_code == 200 and reply.json()["status"] == "PUBLISHED", reply.text
    assert growth < size // 2, growth
