"""SGLangEngine specifics beyond the contract: request bodies, the "already loaded" check,
reply classification, and at-most-once generation.

Most tests run against the local engine's SGLang face (the faithful stand-in, docs/engines.md).
Three classification tests need replies no faithful server produces (an unknown 4xx body, a
timeout at a chosen moment, a probe without ``startup_time``); they use
:class:`ScriptedSGLang`, an ``httpx.MockTransport`` test double named as such.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, Candidate, ErrorCode, SamplingParams
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.server import running_server
from engines.sglang import SGLangEngine, build_generate_body
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    aiter_list,
    buckets_of,
    candidate_for,
    expect_refusal,
    publish,
    write_adapter_dir,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def sglang(
    store: ArtifactStore, anyio_backend: str
) -> AsyncIterator[tuple[LocalEngine, SGLangEngine, httpx.AsyncClient]]:
    limits = ServingLimits(max_lora_rank=32)
    async with running_server("sg", limits=limits, artifact_root=store.root) as (engine, url):
        adapter = SGLangEngine(url, "sg")
        raw = httpx.AsyncClient(base_url=url, trust_env=False)
        try:
            yield engine, adapter, raw
        finally:
            await adapter.aclose()
            await raw.aclose()


def test_body_strips_caller_owned_keys() -> None:
    extra = {
        "extra_key": "lora-id-of-someone-else",
        "cache_salt": "theirs",
        "lora_path": "other@v1",
        "stream": True,
        "rid": "spoofed",
        "custom_logit_processor": None,
    }
    body = build_generate_body([1, 2], "mine@v1", GREEDY, request_id="r1", extra_body=extra)
    assert "extra_key" not in body and "cache_salt" not in body
    assert body["lora_path"] == "mine@v1" and body["rid"] == "r1" and body["stream"] is False
    assert body["input_ids"] == [1, 2] and "custom_logit_processor" in body
    assert body["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "ignore_eos": True,
        "n": 1,
    }
    salted = build_generate_body("hi", None, GREEDY, cache_salt="v7", extra_body=extra)
    assert (salted["cache_salt"], salted["extra_key"]) == ("v7", "v7")
    seeded = build_generate_body("hi", None, SamplingParams(seed=5, stop=("x",)))
    assert seeded["sampling_params"]["sampling_seed"] == 5
    assert seeded["sampling_params"]["stop"] == ["x"]


async def test_a_client_extra_key_never_reaches_the_engine(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    """A raw request warms the cache under a crafted ``extra_key``; the adapter's request
    carrying the same ``extra_key`` is stripped, so it lands in the default namespace (cold)."""
    _, adapter, raw = sglang
    sp = {"max_new_tokens": 4, "temperature": 0}
    for _ in range(2):
        r = await raw.post(
            "/generate", json={"text": PROMPT, "extra_key": "crafted", "sampling_params": sp}
        )
    assert r.json()["meta_info"]["cached_tokens"] > 0  # the crafted namespace is warm
    params = SamplingParams(max_tokens=4)
    via_adapter = await adapter.generate(PROMPT, None, params, extra_body={"extra_key": "crafted"})
    assert via_adapter.cached_tokens == 0
    assert (await adapter.generate(PROMPT, None, params)).cached_tokens > 0


async def test_already_loaded_is_success_only_for_our_path(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, adapter, raw = sglang
    mine, other = candidate_for(store, 1), candidate_for(store, 2)
    # a lost reply: the engine loaded it, then our retry arrives
    await raw.post(
        "/load_lora_adapter",
        json={"lora_name": mine.name, "lora_path": mine.candidate.artifact_path},
    )
    await publish(adapter, mine)
    assert mine.name in (await adapter.inventory()).names()
    # someone else's path under our name: a clean refusal, never success
    await raw.post(
        "/load_lora_adapter",
        json={"lora_name": other.name, "lora_path": mine.candidate.artifact_path},
    )
    await adapter.prepare(other.candidate)
    await expect_refusal(ErrorCode.ALREADY_LOADED, adapter.load(other.candidate))


async def test_inventory_digest_only_for_digest_named_dirs(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, adapter, raw = sglang
    p = candidate_for(store, 3)
    plain = write_adapter_dir(store.root, "plain-dir", p.candidate.manifest.config, p.tensors)
    await raw.post("/load_lora_adapter", json={"lora_name": "a@v1", "lora_path": str(plain)})
    await publish(adapter, p)
    entries = {e.lora_name: e for e in (await adapter.inventory()).adapters}
    assert entries["a@v1"].digest is None and entries["a@v1"].path == str(plain)
    assert entries[p.name].digest == p.candidate.digest


async def test_paths_the_engine_refuses_are_clean(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient],
    store: ArtifactStore,
    tmp_path: Path,
) -> None:
    """A directory outside the server's artifact root passes our own checks (it is a valid
    adapter) and is refused by the engine with a named code; a relative path never leaves us
    (SGLang would take it for a hub repo id)."""
    _, adapter, _ = sglang
    p = candidate_for(store, 4)
    outside = tmp_path / "outside-store"
    outside.mkdir()
    moved = write_adapter_dir(outside, p.candidate.digest, p.candidate.manifest.config, p.tensors)
    c = with_attempt(p.candidate, 1, artifact_path=str(moved))
    await adapter.prepare(c)
    await expect_refusal(ErrorCode.PATH_OUTSIDE_STORE, adapter.load(c))
    relative = with_attempt(p.candidate, 2, artifact_path="rel/x")
    await expect_refusal(ErrorCode.PATH_OUTSIDE_STORE, adapter.prepare(relative))


async def test_buckets_are_refused_by_the_artifact_transport(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient], store: ArtifactStore
) -> None:
    _, adapter, _ = sglang
    p = candidate_for(store, 5)
    await adapter.prepare(p.candidate)
    await expect_refusal(
        ErrorCode.BAD_REQUEST, adapter.transfer(p.candidate, aiter_list(buckets_of(p.tensors)))
    )


def with_attempt(c: Candidate, attempt: int, *, artifact_path: str | None) -> Candidate:
    return Candidate(
        lora_name=c.lora_name,
        digest=c.digest,
        attempt=attempt,
        manifest=c.manifest,
        artifact_path=artifact_path,
    )


async def test_incarnation_joins_startup_time_and_server_id(
    sglang: tuple[LocalEngine, SGLangEngine, httpx.AsyncClient],
) -> None:
    engine, adapter, _ = sglang
    value = await adapter.incarnation()
    assert value == f"st-{engine.startup_time!r}/{engine.incarnation_id}"


# --- replies no faithful server gives ---------------------------------------------------------


class ScriptedSGLang:
    """Test double (``httpx.MockTransport``): answers each path with a scripted reply and counts
    calls. Used only for replies the local SGLang face never produces."""

    def __init__(self, routes: dict[str, Callable[[httpx.Request], httpx.Response]]) -> None:
        self.routes = routes
        self.calls: dict[str, int] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] = self.calls.get(path, 0) + 1
        return self.routes[path](request)

    def engine(self) -> SGLangEngine:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self), base_url="http://sg")
        return SGLangEngine("http://sg", "scripted", client=client)


def _server_info(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"startup_time": 1.5, "max_lora_rank": 16})


def _raise(exc: Exception) -> Callable[[httpx.Request], httpx.Response]:
    def answer(_: httpx.Request) -> httpx.Response:
        raise exc

    return answer


async def test_unrecognised_4xx_bodies_are_ambiguous(store: ArtifactStore) -> None:
    weird = ScriptedSGLang(
        {
            "/server_info": _server_info,
            "/generate": lambda _: httpx.Response(400, json={"detail": "something new"}),
            "/unload_lora_adapter": lambda _: httpx.Response(
                400, json={"success": False, "error_message": "scheduler said no"}
            ),
            "/load_lora_adapter": lambda _: httpx.Response(422, text="Unprocessable"),
        }
    )
    engine = weird.engine()
    with pytest.raises(AmbiguousReply) as info:
        await engine.generate(PROMPT, None, GREEDY)
    assert info.value.code == ErrorCode.MALFORMED_REPLY
    with pytest.raises(AmbiguousReply):
        await engine.unload("a@v1")
    p = candidate_for(store, 7)
    await engine.prepare(p.candidate)
    with pytest.raises(AmbiguousReply):
        await engine.load(p.candidate)


@pytest.mark.parametrize(
    "answer",
    [
        _raise(httpx.ReadTimeout("slow")),
        _raise(httpx.RemoteProtocolError("peer closed")),
        lambda _: httpx.Response(503, text="busy"),
        lambda _: httpx.Response(200, text="<html>not json</html>"),
    ],
    ids=["timeout", "reset", "503", "malformed"],
)
async def test_generation_is_sent_once_and_failures_are_ambiguous(
    answer: Callable[[httpx.Request], httpx.Response],
) -> None:
    server = ScriptedSGLang({"/server_info": _server_info, "/generate": answer})
    engine = server.engine()
    with pytest.raises(AmbiguousReply) as info:
        await engine.generate(PROMPT, None, GREEDY)
    assert info.value.dispatched is True
    assert server.calls["/generate"] == 1


async def test_a_failed_incarnation_probe_means_nothing_was_sent() -> None:
    server = ScriptedSGLang(
        {
            "/server_info": lambda _: httpx.Response(200, json={"no": "startup_time"}),
            "/generate": lambda _: httpx.Response(200, json={}),
        }
    )
    engine = server.engine()
    with pytest.raises(AmbiguousReply) as info:
        await engine.generate(PROMPT, None, GREEDY)
    assert info.value.dispatched is False and "/generate" not in server.calls


async def test_rank_limit_read_from_server_info(store: ArtifactStore) -> None:
    """The local SGLang face started with ``--max-lora-rank 16``; the adapter is given no
    limit of its own, so what it refuses it learned from that server's ``/server_info``."""
    limits = ServingLimits(max_lora_rank=16)
    async with running_server("sg16", limits=limits, artifact_root=store.root) as (local, url):
        engine = SGLangEngine(url, "sg16")
        try:
            assert engine.max_lora_rank is None
            await expect_refusal(
                ErrorCode.RANK_UNSUPPORTED, engine.prepare(candidate_for(store, 6, r=32).candidate)
            )
            # refused before anything reached the server's adapters
            assert local.loaded_adapters() == {} and local.staged() == []
            within = candidate_for(store, 7, r=16)
            await publish(engine, within)  # at the limit: served
            assert set(local.loaded_adapters()) == {within.name}
        finally:
            await engine.aclose()
