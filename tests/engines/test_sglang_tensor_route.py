"""SGLang's tensor route (``/load_lora_adapter_from_tensors``) on the local engine's SGLang face,
and :class:`SGLangTensorEngine` driving it.

The face is the CPU stand-in for SGLang >= 0.5.17, so these tests pin what the wire and the
failure modes are: the exact request schema, one payload per TP rank, checksums naming every
tensor, by-value payloads only (a ``ForkingPickler`` handle payload is refused), the
``__tensor__`` listing, no implicit reload after an unload, the refused server configurations,
and the crash on a bad payload: the process form dies, and once restarted it is a new
incarnation holding nothing, which the client reports as ambiguous ``ENGINE_STOPPED``.
"""

from __future__ import annotations

import base64
import io
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, ErrorCode
from engines.local.admission import ServingLimits
from engines.local.server import running_server
from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData
from engines.sglang_tensors import SGLangTensorEngine, _Staging
from engines.tensor_wire import (
    ROUTE,
    TENSOR_ROOT,
    PayloadError,
    checksums,
    decode_tensors,
    encode_request_payloads,
    encode_tensors,
)
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    aiter_list,
    buckets_of,
    candidate_for,
    expect_refusal,
    publish,
)
from tests.support.paths import REPO
from tests.tools.conftest import script_env

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]

LIMITS = ServingLimits(max_lora_rank=32)


def _request(name: str, seed: int = 1, *, tp: int = 1, **overrides: Any) -> dict[str, Any]:
    config, tensors = make_adapter(seed)
    body: dict[str, Any] = {
        "lora_name": name,
        "config_dict": config,
        "serialized_named_tensors": encode_request_payloads(tensors, tp),
        "expected_checksums": checksums(tensors),
        "pinned": False,
    }
    body.update(overrides)
    return body


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False) as client:
        return await client.post(f"{url}{ROUTE}", json=body, timeout=60)


async def _models(url: str) -> dict[str, str]:
    async with httpx.AsyncClient(trust_env=False) as client:
        cards = (await client.get(f"{url}/v1/models", timeout=10)).json()["data"]
    return {c["id"]: c["root"] for c in cards if c.get("parent") is not None}


# --- the wire ----------------------------------------------------------------------------------


def test_by_value_payloads_round_trip_and_handles_are_refused() -> None:
    import torch
    from torch.multiprocessing import reductions  # registers torch's handle reductions

    assert reductions is not None
    from multiprocessing.reduction import ForkingPickler

    _, tensors = make_adapter(3)
    assert decode_tensors(encode_tensors(tensors)) == tensors
    named = {
        n: torch.frombuffer(bytearray(t.data), dtype=torch.float32) for n, t in tensors.items()
    }
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    with pytest.raises(PayloadError, match="handle-based"):
        decode_tensors(buf.getvalue())
    with pytest.raises(PayloadError, match="not allowed"):
        decode_tensors(pickle.dumps({"x": Path("/etc/passwd")}))


def test_checksums_are_sha256_of_the_raw_bytes() -> None:
    import hashlib

    t = TensorData("F32", (2,), b"\x00\x00\x80?\x00\x00\x00@")
    assert checksums({"w": t}) == {"w": hashlib.sha256(t.data).hexdigest()}


# --- the face ----------------------------------------------------------------------------------


async def test_a_valid_load_lists_as_tensor_and_generates(tmp_path: Path) -> None:
    async with running_server("t0", limits=LIMITS) as (engine, url):
        reply = await _post(url, _request("agent@t-1"))
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["success"] is True and body["loaded_adapters"] == {"agent@t-1": TENSOR_ROOT}
        assert await _models(url) == {"agent@t-1": TENSOR_ROOT}
        base = await engine.generate(PROMPT, None, GREEDY)
        tuned = await engine.generate(PROMPT, "agent@t-1", GREEDY)
        assert base.token_ids != tuned.token_ids


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"serialized_tensors": "x"}, "unknown field (the pre-0.5.17 name)"),
        ({"lora_name": 3}, "name not a string"),
        ({"serialized_named_tensors": "abc"}, "not a list"),
        ({"load_format": "flattened_bucket"}, "a format this face does not read"),
    ],
)
async def test_schema_errors_are_400(change: dict[str, Any], why: str) -> None:
    async with running_server("t1", limits=LIMITS) as (_, url):
        reply = await _post(url, _request("agent@t-2", **change))
        assert reply.status_code == 400, why
        assert reply.json()["success"] is False
        assert await _models(url) == {}


@pytest.mark.parametrize(
    "bad",
    ["wrong checksum", "missing checksum", "extra checksum", "short rank list", "not base64"],
)
async def test_payload_failures_are_the_crash_class(bad: str) -> None:
    """What SGLang's TP worker hits without a ``try``: a 500 after the crash hook, never a
    clean 400, and nothing loaded."""
    crashed: list[str] = []
    info = {"tp_size": 2}
    async with running_server(
        "t2", limits=LIMITS, sglang_info=info, on_bad_payload=lambda: crashed.append(bad)
    ) as (_, url):
        body = _request("agent@t-3", tp=2)
        sums = dict(body["expected_checksums"])
        first = sorted(sums)[0]
        if bad == "wrong checksum":
            sums[first] = "0" * 64
        elif bad == "missing checksum":
            del sums[first]
        elif bad == "extra checksum":
            sums["base_model.model.extra.lora_A.weight"] = "0" * 64
        elif bad == "short rank list":
            body["serialized_named_tensors"] = body["serialized_named_tensors"][:1]
        else:
            body["serialized_named_tensors"] = ["!!", "!!"]
        body["expected_checksums"] = sums
        reply = await _post(url, body)
        assert reply.status_code == 500
        assert crashed == [bad]
        assert await _models(url) == {}
        ok = await _post(url, _request("agent@t-3", tp=2))  # one payload per rank: loads
        assert ok.status_code == 200, ok.text


async def test_a_handle_payload_is_refused_by_the_face() -> None:
    import torch
    from torch.multiprocessing import reductions

    assert reductions is not None
    from multiprocessing.reduction import ForkingPickler

    _, tensors = make_adapter(4)
    named = {
        n: torch.frombuffer(bytearray(t.data), dtype=torch.float32) for n, t in tensors.items()
    }
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    async with running_server("t3", limits=LIMITS) as (_, url):
        body = _request(
            "agent@t-4", serialized_named_tensors=[base64.b64encode(buf.getvalue()).decode()]
        )
        reply = await _post(url, body)
        assert reply.status_code == 500 and "handle-based" in reply.text
        assert await _models(url) == {}


# --- the client ---------------------------------------------------------------------------------


async def test_client_publishes_lists_digest_and_never_reloads(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "a")
    async with running_server("t4", limits=LIMITS) as (engine, url):
        client = SGLangTensorEngine(url, "t4")
        try:
            p = candidate_for(store, 7)
            await publish(client, p)
            entry = {e.lora_name: e for e in (await client.inventory()).adapters}[p.name]
            assert (entry.path, entry.digest) == (TENSOR_ROOT, p.candidate.digest)
            assert await _models(url) == {p.name: TENSOR_ROOT}
            before = await client.generate(PROMPT, p.name, GREEDY)
            await client.unload(p.name, attempt=1)
            refusal = await expect_refusal(
                ErrorCode.NOT_LOADED, client.generate(PROMPT, p.name, GREEDY)
            )
            assert "implicitly" in refusal.message and before.token_ids
            assert engine.loaded_adapters() == {}
            # another client (a restarted control plane) sees the adapter without a digest
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    ("info", "text"),
    [
        ({"dp_size": 2}, "dp_size"),
        ({"max_loaded_loras": 4}, "max-loaded-loras"),
        ({"version": "0.5.16"}, "0.5.17"),
    ],
)
async def test_refused_server_configurations(
    tmp_path: Path, info: dict[str, Any], text: str
) -> None:
    store = ArtifactStore(tmp_path / "a")
    async with running_server("t5", limits=LIMITS, sglang_info=info) as (_, url):
        client = SGLangTensorEngine(url, "t5")
        try:
            refusal = await expect_refusal(
                ErrorCode.BAD_REQUEST, client.prepare(candidate_for(store, 8).candidate)
            )
            assert text in refusal.message
        finally:
            await client.aclose()


async def test_client_sends_one_payload_per_tp_rank(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "a")
    async with running_server("t6", limits=LIMITS, sglang_info={"tp_size": 3}) as (_, url):
        client = SGLangTensorEngine(url, "t6")
        try:
            p = candidate_for(store, 9)
            await publish(client, p)
            assert await _models(url) == {p.name: TENSOR_ROOT}
        finally:
            await client.aclose()


class _CountingPickle:
    """The ``pickle`` module as :mod:`engines.tensor_wire` sees it, counting every pickling
    (one per request body encoded; decoding unpickles, which is not counted)."""

    def __init__(self) -> None:
        self.encoded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    def dumps(self, *args: Any, **kwargs: Any) -> bytes:
        self.encoded += 1
        return pickle.dumps(*args, **kwargs)

    def Pickler(self, *args: Any, **kwargs: Any) -> pickle.Pickler:
        self.encoded += 1
        return pickle.Pickler(*args, **kwargs)


@pytest.mark.parametrize("tp", [1, 2])
async def test_engines_taking_the_same_bytes_share_one_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    """Two engines staging the same digest under the same name and TP size send one request
    body, encoded once (every rank's payload copied from the first); the body is dropped once
    neither staging holds it. Before, each engine pickled, base64-encoded and JSON-encoded the
    whole adapter for itself."""
    import gc

    from engines import sglang_tensors, tensor_wire

    counting = _CountingPickle()
    monkeypatch.setattr(tensor_wire, "pickle", counting)
    store = ArtifactStore(tmp_path / "a")
    p = candidate_for(store, 12)
    info = {"tp_size": tp}
    async with (
        running_server("s1", limits=LIMITS, sglang_info=info) as (_, url1),
        running_server("s2", limits=LIMITS, sglang_info=info) as (_, url2),
    ):
        clients = [SGLangTensorEngine(url1, "s1"), SGLangTensorEngine(url2, "s2")]
        try:
            for client in clients:
                await client.prepare(p.candidate)
                await client.transfer(p.candidate, aiter_list(buckets_of(p.tensors)))
            for client in clients:
                await client.load(p.candidate)
            assert counting.encoded == 1
            for url in (url1, url2):
                assert await _models(url) == {p.name: TENSOR_ROOT}
            gc.collect()
            assert len(sglang_tensors._BODIES) == 0  # nothing outlives the loads
        finally:
            for client in clients:
                await client.aclose()


# --- the crash fault: the process form dies on a bad payload --------------------------------------


class _Process:
    """``python -m engines.local.server --exit-on-bad-tensor-payload``, stopped by its PID."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> str:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engines.local.server",
                "--port",
                str(self.port),
                "--engine-id",
                "crashy",
                "--max-lora-rank",
                "32",
                "--exit-on-bad-tensor-payload",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
            env=script_env(),
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline().strip())
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def crashy() -> Iterator[_Process]:
    process = _Process()
    try:
        yield process
    finally:
        process.stop()


class _Corrupting(SGLangTensorEngine):
    """A client whose payload goes bad after its local checks (a bit flip on the way): only
    this test double can make the server see a bad payload, since the real client verifies."""

    @staticmethod
    async def _body(candidate: Any, staging: _Staging) -> bytes:
        # a decoded copy: the shared body other engines may send stays intact
        body = msgspec.json.decode(await SGLangTensorEngine._body(candidate, staging))
        first = sorted(body["expected_checksums"])[0]
        body["expected_checksums"][first] = "0" * 64
        return msgspec.json.encode(body)


async def test_a_bad_payload_kills_the_server_and_the_client_says_engine_stopped(
    tmp_path: Path, crashy: _Process
) -> None:
    store = ArtifactStore(tmp_path / "a")
    url = crashy.start()
    good = SGLangTensorEngine(url, "crashy")
    bad = _Corrupting(url, "crashy")
    try:
        kept = candidate_for(store, 10)
        await publish(good, kept)
        first = await good.incarnation()
        victim = candidate_for(store, 11)
        await bad.prepare(victim.candidate)
        from engines.contract import Bucket, BucketTensor
        from publisher.drivers.adapter_copy import aiter_buckets

        buckets = [Bucket(0, tuple(BucketTensor(n, t) for n, t in sorted(victim.tensors.items())))]
        await bad.transfer(victim.candidate, aiter_buckets(buckets))
        with pytest.raises(AmbiguousReply) as info:
            await bad.load(victim.candidate)
        assert info.value.code == ErrorCode.ENGINE_STOPPED
        assert crashy.proc is not None and crashy.proc.wait(timeout=30) == 70
        crashy.start()  # the supervisor brings it back on the same port
        second = await good.incarnation()
        assert second != first
        assert (await good.inventory()).adapters == ()  # the restart lost everything
    finally:
        await good.aclose()
        await bad.aclose()
