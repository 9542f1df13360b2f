"""The local engine's HTTP face does not trust its caller: control routes need the token when
one is configured, a managed name is unloaded only under its attempt's fence, the engine will
not listen beyond loopback without a token, and every route caps its body and refuses numbers
it cannot use with a 400.

Each test is named after the defect it pins. Servers listen on 127.0.0.1 and are stopped by the
test that started them (subprocesses by PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import ErrorCode
from engines.local.admission import ServingLimits
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import (
    CONTROL_PATHS,
    ENGINE_TOKEN_ENV,
    MAX_BODY_BYTES,
    UnsafeListen,
    running_server,
    serve,
)
from tests.engines.contract import candidate_for, publish
from tests.support.paths import REPO

pytestmark = pytest.mark.anyio

TOKEN = "engine-secret-0123456789"
POST_ROUTES = sorted(
    {p for p in CONTROL_PATHS if p != "/loraledger/inventory"} | {"/generate"},
)


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def guarded(
    store: ArtifactStore, anyio_backend: str
) -> AsyncIterator[tuple[LocalEngine, str]]:
    async with running_server("tr-0", artifact_root=store.root, token=TOKEN) as served:
        yield served


@pytest.fixture
async def open_server(
    store: ArtifactStore, anyio_backend: str
) -> AsyncIterator[tuple[LocalEngine, httpx.AsyncClient]]:
    limits = ServingLimits(max_lora_rank=32)
    async with (
        running_server("tr-1", limits=limits, artifact_root=store.root) as (engine, url),
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as client,
    ):
        yield engine, client


async def test_control_routes_answered_any_caller_without_the_token(
    guarded: tuple[LocalEngine, str], store: ArtifactStore
) -> None:
    """Before: ``POST /loraledger/unload {"lora_name": ...}`` from any process answered 200
    ``was_loaded: true``. Now every control route is 401 without the configured token, and the
    fleet adapter, given the token, publishes and cleans up as before."""
    engine, url = guarded
    p = candidate_for(store, 1)
    adapter = LocalHTTPEngine(url, "tr-0", api_key=TOKEN)
    try:
        await publish(adapter, p)
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as anyone:
            for path in sorted(CONTROL_PATHS):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                    method = "GET" if path.endswith("/inventory") else "POST"
                    r = await anyone.request(
                        method, path, json={"lora_name": p.name, "attempt": 1}, headers=headers
                    )
                    assert r.status_code == 401, (path, headers, r.text)
                    assert r.json()["error"]["code"] == "UNAUTHORIZED"
            # reads and generation stay open
            assert (await anyone.get("/health")).status_code == 200
            assert (await anyone.get("/v1/models")).status_code == 200
        assert p.name in engine.loaded_adapters()
        receipt = await adapter.unload(p.name, attempt=p.candidate.attempt)
        assert receipt.was_loaded is True
    finally:
        await adapter.aclose()


async def test_an_unload_without_its_attempt_unloaded_a_managed_name(
    open_server: tuple[LocalEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    """Before: an unfenced unload of a managed name answered 200 ``was_loaded: true``. Now it
    is a clean ATTEMPT_REQUIRED and the adapter stays; the fenced unload still works."""
    engine, client = open_server
    p = candidate_for(store, 2)
    adapter = LocalHTTPEngine(str(client.base_url), "tr-1")
    try:
        await publish(adapter, p)
        r = await client.post("/loraledger/unload", json={"lora_name": p.name})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == ErrorCode.ATTEMPT_REQUIRED
        assert p.name in engine.loaded_adapters()
        r = await client.post(
            "/loraledger/unload", json={"lora_name": p.name, "attempt": p.candidate.attempt}
        )
        assert r.status_code == 200 and r.json()["was_loaded"] is True
        # a name never managed here may still be unloaded unfenced (an idempotent no-op)
        r = await client.post("/loraledger/unload", json={"lora_name": "never@seen-1"})
        assert r.status_code == 200 and r.json()["was_loaded"] is False
    finally:
        await adapter.aclose()


async def test_the_engine_listened_beyond_loopback_without_a_token(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Before: ``python -m engines.local.server --host 0.0.0.0`` listened with every control
    route open. Now it refuses (exit 11) before the model loads; in process, :func:`serve`
    raises :class:`UnsafeListen`."""
    env = {k: v for k, v in os.environ.items() if k != ENGINE_TOKEN_ENV}
    proc = subprocess.Popen(  # noqa: ASYNC220 -- starting is instant; waits go to threads
        [sys.executable, "-m", "engines.local.server", "--host", "0.0.0.0", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    try:
        with anyio.fail_after(60):
            code = await anyio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
        assert proc.stderr is not None
        assert code == 11 and "without a token" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    # with a token from a file it is allowed (checked without starting a model)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    from engines.guard import read_token
    from engines.local.server import check_listen

    check_listen("0.0.0.0", read_token(ENGINE_TOKEN_ENV, token_file))
    with pytest.raises(UnsafeListen):
        async with serve(LocalEngine("tr-2"), host="0.0.0.0"):
            pass


# --- limits ------------------------------------------------------------------------------------


async def raw_post(url: str, path: str, head: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One request on a raw loopback socket: ``(status, body)``. Raw, because a client that
    keeps writing a body the server refused gets the connection reset, reply and all."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in head.items()]
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        reply = b""
        with anyio.fail_after(30):
            while True:
                try:
                    reply += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    status = int(reply.split(b" ", 2)[1])
    return status, reply.partition(b"\r\n\r\n")[2]


async def test_a_body_of_any_size_was_read_into_memory(
    open_server: tuple[LocalEngine, httpx.AsyncClient],
) -> None:
    """Before: a 300 MB body was buffered whole (946 MB -> 1.8 GB RSS). Now a declared length
    over the cap is refused before any of it is read, and a chunked body is cut off at the
    cap: 413 BODY_TOO_LARGE on every route."""
    _, client = open_server
    url = str(client.base_url)
    declared = {"Content-Type": "application/json", "Content-Length": str(300 * 1024 * 1024)}
    for path in POST_ROUTES:
        status, body = await raw_post(url, path, declared, b"")
        assert status == 413 and b"BODY_TOO_LARGE" in body, (path, status, body)
    chunk = 65536
    chunks = b"".join(
        b"%x\r\n" % chunk + b" " * chunk + b"\r\n" for _ in range(MAX_BODY_BYTES // chunk + 1)
    )
    status, body = await raw_post(url, "/generate", {"Transfer-Encoding": "chunked"}, chunks)
    assert status == 413 and b"BODY_TOO_LARGE" in body
    assert (await client.get("/health")).status_code == 200


async def test_n_and_total_tokens_had_no_cap(
    open_server: tuple[LocalEngine, httpx.AsyncClient],
) -> None:
    """Before: ``n=30000`` was accepted and held the model worker (a concurrent small request
    waited 28 s). Now ``n`` over ``max_n`` and a request over ``max_request_tokens`` (one
    prompt or a batch) are 400 BAD_REQUEST with the limit named."""
    engine, client = open_server
    limits = engine.limits
    sp = {"max_new_tokens": 1, "temperature": 0}
    for n, why in ((30000, "per-request limit"), (limits.max_n + 1, f"[1, {limits.max_n}]")):
        r = await client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {**sp, "n": n}}
        )
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    batch = [[1]] * (limits.max_request_tokens // 2 + 1)
    r = await client.post("/generate", json={"input_ids": batch, "sampling_params": sp})
    assert r.status_code == 400 and "per-request limit" in r.json()["error"]["message"]
    r = await client.post(
        "/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 8, "n": limits.max_n}},
    )
    assert r.status_code == 200 and len(r.json()) == limits.max_n


BODILESS = {"/flush_cache", "/continue_generation"}  # they read no body
NON_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", str(2**80).encode()]


async def test_nan_infinity_and_huge_numbers_were_internal_errors(
    open_server: tuple[LocalEngine, httpx.AsyncClient],
) -> None:
    """Before: a NaN temperature reached the sampler (500) and ``1e400``/``2^80`` passed the
    parse. Now every POST route answers 400 for each, in every field, and for malformed bodies."""
    _, client = open_server
    for path in sorted(set(POST_ROUTES) - BODILESS):
        bodies = [b"{", b"[]", b'"x"', b"\xff\xfe", b"{" * 100_000]
        for value in NON_NUMBERS:
            bodies += [
                b'{"text": "hi", "sampling_params": {"temperature": %s}}' % value,
                b'{"lora_name": "a@v-1", "attempt": %s, "mode": %s, "rid": %s}'
                % (value, value, value),
            ]
        for body in bodies:
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, body[:80], r.status_code, r.text[:200])
    assert (await client.get("/health")).status_code == 200
