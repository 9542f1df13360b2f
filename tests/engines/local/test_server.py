"""The local engine's HTTP face: SGLang 0.5.x shapes, status codes and texts, SGLang's blocking
unload and implicit reload (docs/engines.md), disconnects, and the process mode.

Every server listens on 127.0.0.1 and is stopped by the test that started it (subprocesses by
PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, CleanRefusal, ErrorCode, SamplingParams
from engines.local.admission import ServingLimits
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import running_server, serve
from engines.sglang import SGLangEngine, SGLangTimeouts
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    candidate_for,
    expect_refusal,
    publish,
    write_adapter_dir,
)
from tests.support.paths import REPO
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio

LORA_UPDATE_KEYS = {"rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"}
LONG = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def served(
    store: ArtifactStore, anyio_backend: str
) -> AsyncIterator[tuple[LocalEngine, httpx.AsyncClient]]:
    limits = ServingLimits(max_lora_rank=32)
    async with (
        running_server("srv", limits=limits, artifact_root=store.root) as (engine, url),
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client,
    ):
        yield engine, client


async def load(client: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path})


# --- shapes, codes, texts ----------------------------------------------------------------------


async def test_load_unload_answer_lora_update_output(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, client = served
    path = candidate_for(store, 1).candidate.artifact_path or ""
    ok = await load(client, "agent@v1", path)
    assert ok.status_code == 200
    assert ok.json() == {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "error_message": None,
        "loaded_adapters": {"agent@v1": path},
    }
    dup = await load(client, "agent@v1", path)
    assert dup.status_code == 400 and set(dup.json()) == LORA_UPDATE_KEYS
    assert dup.json()["success"] is False
    assert dup.json()["error_message"] == (
        "Failed to load LoRA adapter agent@v1 because it is already loaded"
    )
    gone = await client.post("/unload_lora_adapter", json={"lora_name": "agent@v1"})
    assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {}
    again = await client.post("/unload_lora_adapter", json={"lora_name": "agent@v1"})
    assert again.status_code == 400
    assert again.json()["error_message"].startswith(
        "LoRA with name agent@v1 does not exist. Loaded LoRAs:"
    )


async def test_models_server_info_and_health(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    engine, client = served
    path = candidate_for(store, 2).candidate.artifact_path or ""
    await load(client, "agent@v2", path)
    cards = (await client.get("/v1/models")).json()["data"]
    base, adapter = cards
    assert base["id"] == "tiny" and base["parent"] is None
    assert (adapter["id"], adapter["root"], adapter["parent"]) == ("agent@v2", path, "tiny")
    info = (await client.get("/server_info")).json()
    assert info["startup_time"] == engine.startup_time
    assert info["incarnation"] == await engine.incarnation()
    assert info["max_lora_rank"] == 32 and info["enable_lora"] is True
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b""


async def test_generate_shapes_batch_and_errors(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, client = served
    await load(client, "agent@v3", candidate_for(store, 3).candidate.artifact_path or "")
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    single = await client.post(
        "/generate",
        json={
            "text": PROMPT,
            "lora_path": "agent@v3",
            "sampling_params": sp,
            "return_logprob": True,
        },
    )
    assert single.status_code == 200
    body = single.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 0
    assert [p[1] for p in meta["output_token_logprobs"]] == body["output_ids"]
    base = (await client.post("/generate", json={"text": PROMPT, "sampling_params": sp})).json()
    assert "output_token_logprobs" not in base["meta_info"]
    batch = await client.post(
        "/generate",
        json={"text": [PROMPT, PROMPT], "lora_path": ["agent@v3", None], "sampling_params": sp},
    )
    assert [item["output_ids"] for item in batch.json()] == [body["output_ids"], base["output_ids"]]
    by_ids = await client.post(
        "/generate", json={"input_ids": [5, 6, 7], "lora_path": "agent@v3", "sampling_params": sp}
    )
    assert by_ids.status_code == 200 and by_ids.json()["meta_info"]["prompt_tokens"] == 3
    parallel = await client.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {**sp, "n": 2, "temperature": 1.0}},
    )
    assert len(parallel.json()) == 2
    unknown = await client.post(
        "/generate", json={"text": PROMPT, "lora_path": "nobody", "sampling_params": sp}
    )
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"] == (
        "Got LoRA adapter that has never been loaded: nobody"
    )
    unsupported = await client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {**sp, "top_k": 5}}
    )
    assert unsupported.status_code == 400


async def test_paths_outside_the_root_and_bad_names(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore, tmp_path: Path
) -> None:
    _, client = served
    p = candidate_for(store, 4)
    outside = write_adapter_dir(tmp_path, "elsewhere", p.candidate.manifest.config, p.tensors)
    refused = await load(client, "x@v1", str(outside))
    assert refused.status_code == 400
    assert refused.json()["error_message"].startswith("PATH_OUTSIDE_STORE: ")
    named = await load(client, "x:v1", p.candidate.artifact_path or "")
    assert named.status_code == 400
    assert named.json()["error_message"].startswith("INVALID_NAME: ")
    big = candidate_for(store, 5, r=64)
    rank = await load(client, "big@v1", big.candidate.artifact_path or "")
    assert rank.status_code == 400
    assert "incompatible with the current LoRA memory pool" in rank.json()["error_message"]
    assert (await client.get("/v1/models")).json()["data"][1:] == []


# --- SGLang's unload and reload semantics ------------------------------------------------------


async def test_unload_returns_only_after_in_flight_requests_drained(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    engine, client = served
    await load(client, "agent@v6", candidate_for(store, 6).candidate.artifact_path or "")
    order: list[str] = []
    engine.pause_generation()
    async with anyio.create_task_group() as tg:

        async def generate() -> None:
            r = await client.post(
                "/generate", json={"text": PROMPT, "lora_path": "agent@v6", "sampling_params": LONG}
            )
            assert r.status_code == 200
            order.append("generate")

        async def unload() -> None:
            r = await client.post("/unload_lora_adapter", json={"lora_name": "agent@v6"})
            assert r.status_code == 200
            # the answer came after the request finished on the engine (its HTTP reply may
            # still be on its way, so the client-side order of the two replies is not fixed)
            assert engine.in_flight == 0 and engine.model_adapters() == []
            order.append("unload")

        tg.start_soon(generate)
        await wait_for(
            "the request to take its reference on agent@v6",
            lambda: engine.refcount("agent@v6") == 1,
        )
        tg.start_soon(unload)
        await wait_for(
            "the unload of agent@v6 to start draining", lambda: engine.draining() == ["agent@v6"]
        )
        await anyio.sleep(0.1)
        assert order == []
        engine.continue_generation()
    assert sorted(order) == ["generate", "unload"]


async def test_request_during_a_drain_waits_then_implicitly_reloads(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    """SGLang 0.5.23's unload under a running request, reproduced: a request for the name is
    blocked during the drain, and the name is implicitly reloaded after it."""
    engine, client = served
    path = candidate_for(store, 7).candidate.artifact_path or ""
    await load(client, "agent@v7", path)
    first_id = engine.residents()[0].adapter_id
    order: list[str] = []
    outputs: list[Any] = []
    engine.pause_generation()
    async with anyio.create_task_group() as tg:

        async def generate(tag: str) -> None:
            r = await client.post(
                "/generate", json={"text": PROMPT, "lora_path": "agent@v7", "sampling_params": LONG}
            )
            outputs.append(r.json()["output_ids"])
            order.append(tag)

        async def unload() -> None:
            await client.post("/unload_lora_adapter", json={"lora_name": "agent@v7"})
            # the old request is done; the new one is still waiting for the update lock
            assert engine.in_flight == 0 and engine.loaded_adapters() == {}
            order.append("unload")

        tg.start_soon(generate, "old")
        await wait_for(
            "the request to take its reference on agent@v7",
            lambda: engine.refcount("agent@v7") == 1,
        )
        tg.start_soon(unload)
        await wait_for(
            "the unload of agent@v7 to start draining", lambda: engine.draining() == ["agent@v7"]
        )
        tg.start_soon(generate, "new")
        await anyio.sleep(0.1)
        assert engine.loaded_adapters() == {}  # the new request did not get in
        engine.continue_generation()
    assert order.index("unload") < order.index("new")
    assert outputs[0] == outputs[1]
    assert engine.loaded_adapters() == {"agent@v7": path}
    assert engine.residents()[0].adapter_id != first_id


async def test_managed_names_refuse_ordinary_calls_over_http(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    engine, client = served
    staged = LocalHTTPEngine(str(client.base_url), "srv")
    ordinary = SGLangEngine(str(client.base_url), "srv")
    try:
        p = candidate_for(store, 8)
        await publish(staged, p)
        cards = (await client.get("/v1/models")).json()["data"]
        assert cards[1]["id"] == p.name and cards[1]["root"] == "__tensor__"
        r = await client.post("/unload_lora_adapter", json={"lora_name": p.name})
        assert r.status_code == 400 and r.json()["error_message"].startswith("NAME_PROTECTED: ")
        await expect_refusal(ErrorCode.NAME_PROTECTED, ordinary.unload(p.name))
        r = await load(client, p.name, p.candidate.artifact_path or "")
        assert r.status_code == 400 and r.json()["error_message"].startswith("NAME_PROTECTED: ")
        assert p.name in engine.loaded_adapters()
        await staged.unload(p.name, attempt=p.candidate.attempt)
        await expect_refusal(ErrorCode.NAME_RECLAIMED, ordinary.generate(PROMPT, p.name, GREEDY))
    finally:
        await staged.aclose()
        await ordinary.aclose()


# --- disconnects and timeouts ------------------------------------------------------------------


async def test_a_disconnected_generation_releases_its_adapter(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    engine, client = served
    await load(client, "agent@v9", candidate_for(store, 9).candidate.artifact_path or "")
    impatient = SGLangEngine(str(client.base_url), "srv", timeouts=SGLangTimeouts(generate=0.3))
    try:
        engine.pause_generation()
        with pytest.raises(AmbiguousReply) as info:
            await impatient.generate(PROMPT, "agent@v9", GREEDY)
        assert info.value.code == ErrorCode.TIMEOUT and info.value.dispatched
        await wait_for(
            "the aborted request to let go of agent@v9",
            lambda: engine.refcount("agent@v9") == 0 and engine.in_flight == 0,
        )
        with anyio.fail_after(2):  # still paused, yet nothing holds the adapter
            r = await client.post("/unload_lora_adapter", json={"lora_name": "agent@v9"})
        assert r.status_code == 200
    finally:
        engine.continue_generation()
        await impatient.aclose()


@pytest.mark.parametrize("staged", [False, True], ids=["ordinary", "staged"])
async def test_a_timed_out_unload_caller_does_not_stop_the_drain(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore, staged: bool
) -> None:
    engine, client = served
    url = str(client.base_url)
    kind = LocalHTTPEngine if staged else SGLangEngine
    impatient = kind(url, "srv", timeouts=SGLangTimeouts(unload=0.2))
    try:
        p = candidate_for(store, 10)
        if staged:
            await publish(impatient, p)
            name = p.name
        else:
            name = "agent@v10"
            await load(client, name, p.candidate.artifact_path or "")
        engine.pause_generation()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: client.post(
                    "/generate", json={"text": PROMPT, "lora_path": name, "sampling_params": LONG}
                )
            )
            await wait_for("the request to take its reference", lambda: engine.refcount(name) == 1)
            with pytest.raises(AmbiguousReply) as info:
                await impatient.unload(name, attempt=p.candidate.attempt if staged else None)
            assert info.value.code == ErrorCode.TIMEOUT
            assert engine.draining() == [name] and engine.model_adapters() != []
            engine.continue_generation()
        await wait_for("the drained adapter to be freed", lambda: engine.model_adapters() == [])
        assert name not in (await impatient.inventory()).names()
    finally:
        await impatient.aclose()


# --- generation control ----------------------------------------------------------------------


async def test_abort_pause_continue_and_flush(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    engine, client = served
    r = await client.post("/pause_generation", json={"mode": "in_place"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    results: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:

        async def generate() -> None:
            r = await client.post(
                "/generate", json={"text": PROMPT, "rid": "abc", "sampling_params": LONG}
            )
            results.append(r.json())

        tg.start_soon(generate)
        await wait_for("the request to be in flight", lambda: engine.in_flight == 1)
        busy = await client.post("/flush_cache")
        assert busy.status_code == 400
        assert (await client.post("/abort_request", json={"rid": "abc"})).status_code == 200
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results[0]["meta_info"]["id"] == "abc"
    r = await client.post("/continue_generation", json={})
    assert r.json()["status"] == "ok" and not engine.paused
    assert (await client.post("/flush_cache")).status_code == 200


# --- as a process ------------------------------------------------------------------------------


async def test_server_runs_as_a_subprocess_and_stops_by_pid(
    store: ArtifactStore, tmp_path: Path, anyio_backend: str
) -> None:
    port_file = tmp_path / "port"
    cmd = [
        sys.executable,
        "-m",
        "engines.local.server",
        "--port",
        "0",
        "--engine-id",
        "proc-0",
        "--artifact-root",
        str(store.root),
        "--max-lora-rank",
        "16",
        "--port-file",
        str(port_file),
    ]
    proc = subprocess.Popen(  # noqa: ASYNC220 -- starting is instant; waits go to threads
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            line = await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        port = int(line)
        assert port_file.read_text().strip() == str(port)
        engine = LocalHTTPEngine(f"http://127.0.0.1:{port}", "proc-0")
        try:
            p = candidate_for(store, 11)
            await publish(engine, p)
            out = await engine.generate(PROMPT, p.name, GREEDY)
            assert out.lora_name == p.name and out.incarnation == await engine.incarnation()
            big = candidate_for(store, 12, r=32)
            await expect_refusal(ErrorCode.RANK_UNSUPPORTED, engine.prepare(big.candidate))
        finally:
            await engine.aclose()
        os.kill(proc.pid, signal.SIGTERM)
        with anyio.fail_after(20):
            code = await anyio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
        assert code == 0
        unreachable = SGLangEngine(f"http://127.0.0.1:{port}", "proc-0")
        try:
            with pytest.raises(AmbiguousReply) as info:
                await unreachable.generate(PROMPT, None, SamplingParams(max_tokens=1))
            assert info.value.code == ErrorCode.ENGINE_UNREACHABLE
            assert info.value.dispatched is False
        finally:
            await unreachable.aclose()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


async def test_clean_refusals_keep_their_codes_over_http(
    served: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, client = served
    staged = LocalHTTPEngine(str(client.base_url), "srv")
    try:
        p = candidate_for(store, 13)
        await expect_refusal(ErrorCode.NOT_PREPARED, staged.load(p.candidate))
        await staged.prepare(p.candidate)
        with pytest.raises(CleanRefusal) as info:
            await staged.unload("bad/name")
        assert info.value.code == ErrorCode.INVALID_NAME and info.value.engine_id == "srv"
        r = await client.post("/loraledger/bucket", content=b"\x93not a bucket")
        assert r.status_code == 400 and r.json()["error"]["code"] == ErrorCode.BAD_REQUEST
    finally:
        await staged.aclose()


async def test_a_server_ended_by_cancellation_stops_listening() -> None:
    """``serve()`` ended by cancelling its scope (how a structured-concurrency block ends) shuts
    uvicorn down like a clean exit: the next server of the same event loop answers. Before the
    fix the listener stayed registered with the loop while its socket was closed, so the next
    server whose socket reused the file descriptor accepted TCP connections and never answered
    them (found by the crash-point harness: fresh engines per crash point hung on their first
    request)."""
    async with LocalEngine("e0") as engine:
        for _ in range(4):
            with anyio.CancelScope() as scope:
                async with serve(engine) as url:
                    async with httpx.AsyncClient(trust_env=False) as client:
                        response = await client.get(f"{url}/health", timeout=5)
                    assert response.status_code == 200
                    scope.cancel()
            assert scope.cancelled_caught
