"""The local engine in process: reference rules, unload drain, managed names, prefix cache,
clean refusals, and generation equal to a transformers+peft reference."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from engines.artifacts import CONFIG_FILE, WEIGHTS_FILE, ArtifactStore
from engines.contract import (
    AmbiguousReply,
    Bucket,
    BucketTensor,
    Candidate,
    ErrorCode,
    Generation,
    SamplingParams,
)
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.tinymodel import ensure_tiny_model, make_adapter
from engines.manifest import TensorData, build_manifest, tensor_from_array
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    Published,
    aiter_list,
    buckets_of,
    candidate_for,
    expect_refusal,
    lora_name_for,
    publish,
    write_adapter_dir,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio
# The bound on what happens at once (a drain with nothing to wait for, a refusal): the
# alternative is never (a paused holder), so it only has to outlast a loaded machine.
AT_ONCE_S = 30.0

LIMITS = ServingLimits(max_lora_rank=32)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def engine(store: ArtifactStore, anyio_backend: str) -> AsyncIterator[LocalEngine]:
    async with LocalEngine("e0", limits=LIMITS, artifact_root=store.root) as e:
        yield e


async def loaded(engine: LocalEngine, store: ArtifactStore, seed: int) -> Published:
    p = candidate_for(store, seed)
    await publish(engine, p)
    return p


def assert_no_state(engine: LocalEngine) -> None:
    """Nothing registered, staged, draining or resident in the model."""
    assert engine.loaded_adapters() == {}
    assert engine.staged() == []
    assert engine.draining() == []
    assert engine.model_adapters() == []


# --- per-request references ----------------------------------------------------------------


async def test_failure_before_dispatch_releases_the_reference(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 1)
    await expect_refusal(ErrorCode.BAD_REQUEST, engine.generate([1, 99999], p.name, GREEDY))
    too_long = SamplingParams(max_tokens=600)
    await expect_refusal(ErrorCode.BAD_REQUEST, engine.generate(PROMPT, p.name, too_long))
    assert engine.refcount(p.name) == 0
    with anyio.fail_after(AT_ONCE_S):  # nothing holds it: the drain is immediate
        assert (await engine.unload(p.name)).was_loaded


async def test_duplicate_request_id_is_refused_without_leaking(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 2)
    engine.pause_generation()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: engine.generate(PROMPT, p.name, GREEDY, request_id="r"))
        await wait_for(  # its id is registered
            "the request to be in flight", lambda: engine.in_flight == 1
        )
        await expect_refusal(
            ErrorCode.BAD_REQUEST, engine.generate(PROMPT, p.name, GREEDY, request_id="r")
        )
        assert engine.refcount(p.name) == 1
        engine.continue_generation()
    assert engine.refcount(p.name) == 0


async def test_a_request_queued_for_the_model_when_a_paused_engine_stops_ends(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    """Regression (a whole-suite run hung ~15 min under load): a request that had taken its
    lease but was still waiting for the model worker to tokenize its prompt when the engine
    stopped was registered with the scheduler only *after* the stop had aborted every
    registered request, so nothing ended it and it waited on the pause gate forever. Held at
    exactly that point: the model worker is kept busy while the engine stops."""
    p = await loaded(engine, store, 45)
    engine.pause_generation()
    busy, release = threading.Event(), threading.Event()

    def hold_the_worker() -> None:
        busy.set()
        release.wait()

    codes: list[str] = []

    async def request() -> None:
        try:
            await engine.generate(PROMPT, p.name, GREEDY)
        except AmbiguousReply as exc:
            codes.append(exc.code)

    try:
        # a hang guard, not a timing: before the fix the request never ended
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                scheduler = engine._scheduler
                assert scheduler is not None
                tg.start_soon(scheduler.run_model, hold_the_worker)
                await anyio.to_thread.run_sync(busy.wait)
                tg.start_soon(request)
                await wait_for(
                    "the queued request to take its reference", lambda: engine.refcount(p.name) == 1
                )
                assert engine.in_flight == 0  # leased, queued behind the worker, not decoding
                await engine.aclose()
                release.set()
    finally:
        release.set()
    assert codes == [ErrorCode.ENGINE_STOPPED]
    assert engine.refcount(p.name) == 0 and engine.in_flight == 0


async def test_abort_interrupts_decoding_and_releases_once(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 3)
    result: list[Generation] = []
    engine.pause_generation()  # frozen between tokens: only an abort can end it
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.append(await engine.generate(PROMPT, p.name, LONG, request_id="r1"))

        tg.start_soon(run)
        # in the scheduler, not just leased: a lease is taken before the prompt is tokenized
        # (on the model worker), and an abort before the request registers finds nothing
        await wait_for("the request to be in flight", lambda: engine.in_flight == 1)
        assert engine.abort("r1") is True
        engine.abort("r1")  # a duplicated abort is harmless
    assert result[0].finish_reason == "abort"
    assert len(result[0].token_ids) < LONG.max_tokens
    assert engine.refcount(p.name) == 0
    assert engine.abort("r1") is False  # no longer in flight
    with anyio.fail_after(AT_ONCE_S):
        assert (await engine.unload(p.name)).was_loaded  # still paused: nothing holds it


async def test_cancelled_caller_releases_the_reference(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 4)
    engine.pause_generation()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, PROMPT, p.name, LONG)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)
        tg.cancel_scope.cancel()  # the caller goes away (disconnect, timeout, shutdown)
    assert engine.refcount(p.name) == 0
    assert engine.in_flight == 0
    with anyio.fail_after(AT_ONCE_S):
        assert (await engine.unload(p.name)).was_loaded


async def test_parallel_children_share_one_reference(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 5)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=4, ignore_eos=True)
    results: list[Generation] = []
    engine.pause_generation()
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await engine.generate(PROMPT, p.name, params))

        tg.start_soon(run)
        await wait_for(
            "the parallel request to take one reference and start",
            lambda: engine.refcount(p.name) == 1 and engine.in_flight == 1,
        )
        await anyio.sleep(0.05)  # children forked: still one reference, not four
        assert engine.refcount(p.name) == 1
        engine.continue_generation()
    assert len(results[0].choices) == 4
    assert engine.refcount(p.name) == 0


async def test_unload_waits_for_every_parallel_child(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    """SGLang #36894: unload hung forever after n>1 traffic. Here it completes right after."""
    p = await loaded(engine, store, 6)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=1, n=3, ignore_eos=True)
    done = anyio.Event()
    engine.pause_generation()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, PROMPT, p.name, params)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)

        async def unload() -> None:
            await engine.unload(p.name)
            done.set()

        tg.start_soon(unload)
        await anyio.sleep(0.1)
        assert not done.is_set()
        engine.continue_generation()
        with anyio.fail_after(5):
            await done.wait()
    assert_no_state(engine)


async def test_aborted_parallel_request_releases_once(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 7)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=1, n=3, ignore_eos=True)
    out: list[Generation] = []
    engine.pause_generation()
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            out.append(await engine.generate(PROMPT, p.name, params, request_id="par"))

        tg.start_soon(run)
        await wait_for(  # registered: the abort finds it
            "the parallel request to be in flight", lambda: engine.in_flight == 1
        )
        assert engine.abort("par") is True
    assert [c.finish_reason for c in out[0].choices] == ["abort"] * 3
    assert engine.refcount(p.name) == 0


# --- unload ----------------------------------------------------------------------------------


async def test_unload_unregisters_at_once_and_frees_after_the_last_request(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 8)
    reference = await engine.generate(PROMPT, p.name, LONG)
    adapter_ids = engine.model_adapters()
    results: dict[str, Any] = {}
    engine.pause_generation()
    async with anyio.create_task_group() as tg:

        async def request() -> None:
            results["gen"] = await engine.generate(PROMPT, p.name, LONG)

        async def unload() -> None:
            results["unload"] = await engine.unload(p.name)

        tg.start_soon(request)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)
        tg.start_soon(unload)
        await wait_for("the unload to start draining", lambda: engine.draining() == [p.name])
        # unregistered at once: gone from inventory, new requests refused immediately ...
        assert p.name not in (await engine.inventory()).names()
        with anyio.fail_after(AT_ONCE_S):
            await expect_refusal(ErrorCode.NAME_RECLAIMED, engine.generate(PROMPT, p.name, GREEDY))
        # ... but the weights stay until the holder is done
        assert engine.model_adapters() == adapter_ids
        assert "unload" not in results
        engine.continue_generation()
    assert results["gen"].token_ids == reference.token_ids  # finished on the old adapter
    assert results["unload"].was_loaded is True
    assert_no_state(engine)


async def test_cancelled_unload_caller_does_not_cancel_the_drain(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 9)
    engine.pause_generation()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, PROMPT, p.name, LONG)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)
        with anyio.move_on_after(0.1) as scope:
            await engine.unload(p.name)  # the caller gives up (timeout, disconnect)
        assert scope.cancelled_caught
        assert engine.draining() == [p.name] and engine.model_adapters() != []
        engine.continue_generation()
    await wait_for("the drained adapter to be freed", lambda: engine.model_adapters() == [])
    assert_no_state(engine)
    again = await engine.unload(p.name)
    assert again.was_loaded is False


async def test_retried_unload_during_a_drain_answers_when_the_drain_is_done(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 10)
    answers: list[bool] = []
    engine.pause_generation()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, PROMPT, p.name, LONG)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)

        async def unload() -> None:
            answers.append((await engine.unload(p.name)).was_loaded)

        tg.start_soon(unload)
        await wait_for("the first unload to start draining", lambda: engine.draining() == [p.name])
        tg.start_soon(unload)  # a retry while the first still waits
        await anyio.sleep(0.05)
        assert answers == []
        engine.continue_generation()
    assert sorted(answers) == [False, True]
    assert_no_state(engine)


# --- managed names -------------------------------------------------------------------------


async def test_managed_names_are_protected_from_ordinary_calls(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 11)
    path = p.candidate.artifact_path or ""
    await expect_refusal(ErrorCode.NAME_PROTECTED, engine.load_ordinary(p.name, path))
    await expect_refusal(ErrorCode.NAME_PROTECTED, engine.unload_ordinary(p.name))
    assert p.name in engine.loaded_adapters()
    await engine.unload(p.name)  # the managed path may
    # once reclaimed, neither an ordinary load nor a request brings it back
    await expect_refusal(ErrorCode.NAME_PROTECTED, engine.load_ordinary(p.name, path))
    await expect_refusal(ErrorCode.NAME_RECLAIMED, engine.generate(PROMPT, p.name, GREEDY))
    await expect_refusal(ErrorCode.NAME_RECLAIMED, engine.prepare(p.candidate))
    assert_no_state(engine)


async def test_ordinary_name_blocks_a_managed_prepare(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 12)
    await engine.load_ordinary(p.name, p.candidate.artifact_path or "")
    await expect_refusal(ErrorCode.ALREADY_LOADED, engine.prepare(p.candidate))


async def test_ordinary_names_are_implicitly_reloaded_like_stock_sglang(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 13)
    await engine.load_ordinary("plain@v1", p.candidate.artifact_path or "")
    before = await engine.generate(PROMPT, "plain@v1", GREEDY)
    first_id = engine.residents()[0].adapter_id
    await engine.unload_ordinary("plain@v1")
    again = await engine.generate(PROMPT, "plain@v1", GREEDY)  # silently reloaded
    assert again.token_ids == before.token_ids
    assert engine.residents()[0].adapter_id != first_id  # a fresh incarnation of the adapter


async def test_implicit_reload_can_be_switched_off(store: ArtifactStore) -> None:
    p = candidate_for(store, 14)
    async with LocalEngine("e1", artifact_root=store.root, implicit_reload=False) as engine:
        await engine.load_ordinary("plain@v1", p.candidate.artifact_path or "")
        await engine.unload_ordinary("plain@v1")
        await expect_refusal(ErrorCode.NOT_LOADED, engine.generate(PROMPT, "plain@v1", GREEDY))


async def test_stale_cleanup_never_touches_a_staged_newer_attempt(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p2 = candidate_for(store, 15, attempt=2)
    await engine.prepare(p2.candidate)
    await engine.transfer(p2.candidate, aiter_list(buckets_of(p2.tensors)[:1]))
    await expect_refusal(ErrorCode.STALE_ATTEMPT, engine.unload(p2.name, attempt=1))
    assert engine.staged() == [p2.name]
    await engine.transfer(p2.candidate, aiter_list(buckets_of(p2.tensors)[1:]))
    await engine.load(p2.candidate)
    assert p2.name in engine.loaded_adapters()


async def test_cleanup_of_the_current_attempt_unloads_it(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 16)
    receipt = await engine.unload(p.name, attempt=1)
    assert receipt.was_loaded is True
    assert_no_state(engine)
    retry = candidate_for(store, 16, attempt=2)
    await publish(engine, retry)  # a new attempt of a cleaned-up name is a fresh load
    assert (await engine.generate(PROMPT, retry.name, GREEDY)).lora_name == retry.name


# --- prefix cache ----------------------------------------------------------------------------


async def test_a_warm_cache_of_one_version_never_serves_another(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    a, b = await loaded(engine, store, 17), await loaded(engine, store, 18)
    long_prompt = PROMPT + " jumps over the lazy dog"
    warm_a = await engine.generate(long_prompt, a.name, GREEDY)
    assert (await engine.generate(long_prompt, a.name, GREEDY)).cached_tokens > 0
    b_after_a = await engine.generate(long_prompt, b.name, GREEDY)
    assert b_after_a.cached_tokens == 0
    await engine.flush_cache()
    b_cold = await engine.generate(long_prompt, b.name, GREEDY)
    assert b_cold.cached_tokens == 0
    assert b_after_a.token_ids == b_cold.token_ids
    assert b_after_a.logprobs == b_cold.logprobs
    assert b_cold.token_ids != warm_a.token_ids
    b_warm = await engine.generate(long_prompt, b.name, GREEDY)
    assert b_warm.cached_tokens > 0
    assert b_warm.token_ids == b_cold.token_ids
    assert b_warm.logprobs == pytest.approx(b_cold.logprobs, abs=1e-4)


async def test_same_name_reloaded_with_other_weights_starts_cold(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    """vLLM #42125: a same-name reload served stale prefix KV. Ids are fresh per load here."""
    a, b = candidate_for(store, 19), candidate_for(store, 20)
    await engine.load_ordinary("reused", a.candidate.artifact_path or "")
    await engine.generate(PROMPT, "reused", GREEDY)
    await engine.unload_ordinary("reused")
    await engine.load_ordinary("reused", b.candidate.artifact_path or "")
    served = await engine.generate(PROMPT, "reused", GREEDY)
    assert served.cached_tokens == 0
    await engine.load_ordinary("b-ref", b.candidate.artifact_path or "")
    reference = await engine.generate(PROMPT, "b-ref", GREEDY, cache_salt="fresh")
    assert served.token_ids == reference.token_ids
    assert served.logprobs == reference.logprobs


# --- refusals that leave nothing behind --------------------------------------------------------


async def test_digest_and_transfer_refusals_leave_no_state(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p, other = candidate_for(store, 21), candidate_for(store, 22)
    buckets = buckets_of(p.tensors, max_bytes=4096)  # one tensor per bucket
    assert len(buckets) == len(p.tensors)
    # bytes that do not match the manifest checksum
    first = buckets[0].tensors[0]
    flipped = bytearray(first.tensor.data)
    flipped[3] ^= 0x01
    corrupt = Bucket(
        0,
        (
            BucketTensor(
                first.name, TensorData(first.tensor.dtype, first.tensor.shape, bytes(flipped))
            ),
        ),
    )
    # a tensor that is not in the manifest
    extra = Bucket(0, (BucketTensor("base_model.model.extra.lora_A.weight", first.tensor),))
    for bad, code in ((corrupt, ErrorCode.DIGEST_MISMATCH), (extra, ErrorCode.INVALID_ADAPTER)):
        await engine.prepare(p.candidate)
        await expect_refusal(code, engine.transfer(p.candidate, aiter_list([bad])))
        assert_no_state(engine)
        await expect_refusal(ErrorCode.NOT_PREPARED, engine.load(p.candidate))
    # a missing tensor, noticed at load
    await engine.prepare(p.candidate)
    await engine.transfer(p.candidate, aiter_list(buckets[:-1]))
    await expect_refusal(ErrorCode.INVALID_ADAPTER, engine.load(p.candidate))
    assert_no_state(engine)
    # an artifact path holding another adapter's bytes
    swapped = Candidate(
        lora_name=p.name,
        digest=p.candidate.digest,
        attempt=1,
        manifest=p.candidate.manifest,
        artifact_path=other.candidate.artifact_path,
    )
    await engine.prepare(swapped)
    await expect_refusal(ErrorCode.DIGEST_MISMATCH, engine.load(swapped))
    assert_no_state(engine)
    # and the honest candidate still loads
    await publish(engine, p)
    assert list(engine.loaded_adapters()) == [p.name]


async def test_path_loads_use_the_artifact_store(store: ArtifactStore) -> None:
    p = candidate_for(store, 23)
    async with LocalEngine("art", artifact_root=store.root, transport="artifact") as engine:
        await publish(engine, p)  # transport "artifact": no buckets, load reads the path
        inventory = await engine.inventory()
        assert inventory.adapters[0].path == p.candidate.artifact_path
        assert inventory.adapters[0].digest == p.candidate.digest


def _bad_dirs(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, expected refusal code)."""
    out: dict[str, tuple[Path, str]] = {}
    config, tensors = make_adapter(30)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / CONFIG_FILE).write_text(json.dumps(config))
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    out["corrupt-safetensors"] = (corrupt, ErrorCode.INVALID_ADAPTER)
    rank_mismatch = {**config, "r": 4}
    out["config-rank-mismatch"] = (
        write_adapter_dir(root, "rank-mismatch", rank_mismatch, tensors),
        ErrorCode.INVALID_ADAPTER,
    )
    wrong_shape = dict(tensors)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong_shape[key] = tensor_from_array(torch.zeros(8, 64))  # in_features is 128
    out["wrong-shape"] = (
        write_adapter_dir(root, "wrong-shape", config, wrong_shape),
        ErrorCode.INVALID_ADAPTER,
    )
    ghost = dict(tensors)
    ghost["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = tensors[key]
    out["module-not-in-model"] = (
        write_adapter_dir(root, "ghost", config, ghost),
        ErrorCode.INVALID_ADAPTER,
    )
    o_config, o_tensors = make_adapter(31, targets=("o_proj",))
    out["target-not-served"] = (
        write_adapter_dir(root, "o-proj", o_config, o_tensors),
        ErrorCode.INVALID_ADAPTER,
    )
    out["dora"] = (
        write_adapter_dir(root, "dora", {**config, "use_dora": True}, tensors),
        ErrorCode.INVALID_ADAPTER,
    )
    big_config, big_tensors = make_adapter(32, r=64)
    out["rank-too-big"] = (
        write_adapter_dir(root, "big", big_config, big_tensors),
        ErrorCode.RANK_UNSUPPORTED,
    )
    return out


@pytest.mark.parametrize(
    "case",
    [
        "corrupt-safetensors",
        "config-rank-mismatch",
        "wrong-shape",
        "module-not-in-model",
        "target-not-served",
        "dora",
        "rank-too-big",
    ],
)
async def test_bad_adapters_are_named_refusals(store: ArtifactStore, case: str) -> None:
    path, code = _bad_dirs(store.root)[case]
    limits = ServingLimits(max_lora_rank=32, target_modules=("q_proj", "k_proj", "v_proj"))
    async with LocalEngine("bad", limits=limits, artifact_root=store.root) as engine:
        await expect_refusal(code, engine.load_ordinary("bad@v1", str(path)))
        assert_no_state(engine)
        if case == "corrupt-safetensors":
            return  # no manifest can describe it; the ordinary path proved the refusal
        config = json.loads((path / CONFIG_FILE).read_text())
        from engines.artifacts import deserialize_safetensors

        tensors = deserialize_safetensors((path / WEIGHTS_FILE).read_bytes())
        manifest = build_manifest(config, tensors)
        c = Candidate(
            lora_name=lora_name_for(manifest, 1),
            digest=manifest.digest,
            attempt=1,
            manifest=manifest,
        )
        await expect_refusal(code, engine.prepare(c))  # refused before any byte moves
        assert_no_state(engine)


@pytest.mark.parametrize("name", ["a/b", "a:b", "../x", " lead", "x" * 201])
async def test_bad_names_are_refused_everywhere(
    engine: LocalEngine, store: ArtifactStore, name: str
) -> None:
    p = candidate_for(store, 33)
    await expect_refusal(
        ErrorCode.INVALID_NAME, engine.load_ordinary(name, p.candidate.artifact_path or "")
    )
    await expect_refusal(ErrorCode.INVALID_NAME, engine.unload(name))
    assert_no_state(engine)


async def test_paths_outside_the_artifact_root_are_refused(
    engine: LocalEngine, store: ArtifactStore, tmp_path: Path
) -> None:
    config, tensors = make_adapter(34)
    outside = write_adapter_dir(tmp_path, "outside", config, tensors)
    link = store.root / "link"
    os.symlink(outside, link)
    for path in (str(outside), str(link), str(store.root / ".." / "outside"), str(store.root)):
        await expect_refusal(ErrorCode.PATH_OUTSIDE_STORE, engine.load_ordinary("x@v1", path))
    manifest = build_manifest(config, tensors)
    c = Candidate(
        lora_name=lora_name_for(manifest, 2),
        digest=manifest.digest,
        attempt=1,
        manifest=manifest,
        artifact_path=str(outside),
    )
    await engine.prepare(c)
    await expect_refusal(ErrorCode.PATH_OUTSIDE_STORE, engine.load(c))
    assert_no_state(engine)


# --- generation correctness ------------------------------------------------------------------


def _reference(
    adapter_dir: str | None, prompt: list[int], steps: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from plain transformers (+ peft), no engine code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0], dim=-1)[tok])
        for score, tok in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


async def test_generation_equals_a_transformers_peft_reference(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    prompt = [12, 200, 7, 45, 301, 99]
    steps = 12
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    a, b = candidate_for(store, 40), candidate_for(store, 41, r=16)
    await publish(engine, a)  # staged transfer
    await engine.load_ordinary("b-by-path", b.candidate.artifact_path or "")
    # concurrently, so the adapters and the base interleave token by token
    outputs: dict[str | None, Generation] = {}

    async def run(name: str | None) -> None:
        outputs[name] = await engine.generate(prompt, name, params)

    async with anyio.create_task_group() as tg:
        for name in (a.name, "b-by-path", None):
            tg.start_soon(run, name)
    for name, adapter_dir in (
        (a.name, a.candidate.artifact_path),
        ("b-by-path", b.candidate.artifact_path),
        (None, None),
    ):
        tokens, logprobs = await anyio.to_thread.run_sync(_reference, adapter_dir, prompt, steps)
        assert list(outputs[name].token_ids) == tokens, name
        assert outputs[name].logprobs == pytest.approx(logprobs, abs=1e-4)
    assert outputs[a.name].token_ids != outputs[None].token_ids


async def test_rslora_and_alpha_are_applied(engine: LocalEngine, store: ArtifactStore) -> None:
    config, tensors = make_adapter(42, alpha=32)
    config = {**config, "use_rslora": True}
    path = write_adapter_dir(store.root, "rslora", config, tensors)
    await engine.load_ordinary("rs@v1", str(path))
    prompt = [3, 4, 5, 6]
    out = await engine.generate(prompt, "rs@v1", SamplingParams(max_tokens=8, ignore_eos=True))
    tokens, _ = await anyio.to_thread.run_sync(_reference, str(path), prompt, 8)
    assert list(out.token_ids) == tokens


async def test_generation_never_blocks_the_event_loop(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    """Three concurrent requests (two on an adapter, one on the base model): every forward pass
    runs in a worker thread, never on the event loop, and the loop serves another task *while*
    each pass is under way -- each pass stops at its start until a step of a task on the loop
    has run (``anyio.from_thread.run``, which only completes if the loop is free). Had a pass
    run on the loop, the hook would see the loop's own thread. No clock: the latency a busy
    loop would add is a benchmark's business, not a test's."""
    p = await loaded(engine, store, 43)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    loop_thread = threading.get_ident()
    on_loop: list[int] = []  # forward passes that ran on the event loop's thread
    served: list[int] = []  # loop steps run while a forward pass was under way

    async def a_step_on_the_loop() -> None:
        await anyio.lowlevel.checkpoint()  # the loop switched to other tasks and came back
        served.append(threading.get_ident())

    def during_forward(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == loop_thread:
            on_loop.append(1)
            return
        anyio.from_thread.run(a_step_on_the_loop)  # the pass waits until the loop ran it

    runner = engine._runner
    assert runner is not None
    embeddings = runner._base.get_input_embeddings()  # every forward pass starts here
    hook = embeddings.register_forward_pre_hook(during_forward)
    try:
        async with anyio.create_task_group() as work:
            for name in (p.name, None, p.name):
                work.start_soon(engine.generate, PROMPT, name, params)
    finally:
        hook.remove()
    assert on_loop == []
    assert len(served) >= 3 * (params.max_tokens - 1)  # a prefill or a token each
    assert set(served) == {loop_thread}


async def test_stop_strings_and_max_tokens(engine: LocalEngine) -> None:
    prompt = "adapters change the output"  # the untrained model's text here is printable
    free = await engine.generate(prompt, None, SamplingParams(max_tokens=12, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.text[3:5]
    assert stop
    params = SamplingParams(max_tokens=12, stop=(stop, "never-there"), ignore_eos=True)
    cut = await engine.generate(prompt, None, params)
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert len(cut.token_ids) < len(free.token_ids)
    zero = await engine.generate(prompt, None, SamplingParams(max_tokens=0))
    assert zero.token_ids == () and zero.finish_reason == "length"


async def test_bad_sampling_params_are_refused(engine: LocalEngine) -> None:
    for params in (
        SamplingParams(n=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
    ):
        await expect_refusal(ErrorCode.BAD_REQUEST, engine.generate(PROMPT, None, params))
    await expect_refusal(ErrorCode.BAD_REQUEST, engine.generate([], None, GREEDY))


# --- identity ----------------------------------------------------------------------------------


async def test_every_engine_start_has_a_fresh_incarnation(store: ArtifactStore) -> None:
    async with LocalEngine("same") as one:
        first = await one.incarnation()
    async with LocalEngine("same") as two:
        second = await two.incarnation()
    assert first != second


async def test_a_stopped_engine_refuses_nothing_cleanly(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    p = await loaded(engine, store, 44)
    engine.pause_generation()
    results: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def request() -> None:
            try:
                await engine.generate(PROMPT, p.name, LONG)
            except AmbiguousReply as exc:
                results.append(exc)

        tg.start_soon(request)
        await wait_for("the request to take its reference", lambda: engine.refcount(p.name) == 1)
        await engine.aclose()
    assert [type(r) for r in results] == [AmbiguousReply]
    assert engine.refcount(p.name) == 0
    with pytest.raises(AmbiguousReply):
        await engine.inventory()
