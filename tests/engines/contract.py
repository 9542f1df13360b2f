"""The engine contract, written once and run against every engine implementation.

Usage (one module per engine family)::

    from tests.engines.contract import EngineContract, contract_fixture

    eut = contract_fixture({"vllm": my_vllm_factory})   # name -> factory

    class TestVLLMContract(EngineContract):
        pass

A *factory* is ``factory(tmp_path) -> async context manager yielding EngineUnderTest``; it owns
everything it starts (servers, processes) and stops it on exit. :class:`Capabilities` says what
an engine can do; a test that needs a missing capability is skipped *with that reason*, and
where engines legitimately differ (stock SGLang implicitly reloads an unloaded name, the local
engine refuses it) the test asserts the behaviour the flag declares -- both branches can fail.

Every factory must give adapters to its engine through ``eut.store`` (an ``ArtifactStore``) for
the artifact transport, and be able to serve adapters of rank 8 but not rank
:data:`UNSERVABLE_RANK` (start the engine with ``max_lora_rank`` 16 or 32).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from engines.artifacts import CONFIG_FILE, WEIGHTS_FILE, ArtifactStore, serialize_safetensors
from engines.contract import (
    AmbiguousReply,
    Bucket,
    BucketTensor,
    Candidate,
    CleanRefusal,
    Engine,
    EngineCapabilities,
    ErrorCode,
    Generation,
    SamplingParams,
)
from engines.local.tinymodel import make_adapter
from engines.manifest import Manifest, TensorData, build_manifest
from publisher.drivers.adapter_copy import aiter_buckets, plan_buckets
from tests.support.waiting import wait_for

UNSERVABLE_RANK = 64
PROMPT = "the quick brown fox"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Capabilities:
    """What the engine under test can do. Defaults describe the most capable engine."""

    # unload returns only after the adapter's in-flight requests finished (SGLang, local);
    # vLLM's unload only forgets the name.
    unload_drains: bool = True
    # the harness can freeze generation between tokens (``eut.hold``), so "in flight" is
    # deterministic rather than a race against a fast tiny model
    can_hold: bool = True
    # an unloaded name comes back on a later request naming it (stock SGLang 0.5.23)
    implicit_reload: bool = False
    # managed names: a reclaimed name answers NAME_RECLAIMED (local engine managed path)
    reclaimed_refusal: bool = False
    # SamplingParams.n > 1
    parallel_sampling: bool = True
    # the engine reports prefix-cache hits in ``cached_tokens``
    reports_cached_tokens: bool = True
    # the adapter refuses cleanup/prepare of an attempt older than the newest one
    attempt_fencing: bool = True
    # bytes staged engine-side for a prepared attempt show in ``Inventory.staged`` (the local
    # engine's staged faces); an engine that stages nothing engine-side reports none
    reports_staging: bool = False


@dataclass
class EngineUnderTest:
    engine: Engine
    caps: Capabilities
    store: ArtifactStore
    # freeze / unfreeze generation on the serving engine (``can_hold``)
    hold: Callable[[], None] | None = None
    release: Callable[[], None] | None = None
    # live references on an adapter, read from the serving engine (None: not observable)
    refcount: Callable[[str], int] | None = None
    # stop the serving side (engine process or server) for good
    stop: Callable[[], Awaitable[None]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


Factory = Callable[[Path], contextlib.AbstractAsyncContextManager[EngineUnderTest]]


def contract_fixture(factories: Mapping[str, Factory]) -> Any:
    """A pytest fixture ``eut`` parametrised over ``factories`` (assign it to ``eut``)."""

    @pytest.fixture(params=list(factories))
    async def eut(
        request: pytest.FixtureRequest, tmp_path: Path, anyio_backend: str
    ) -> AsyncIterator[EngineUnderTest]:
        async with factories[request.param](tmp_path) as under_test:
            yield under_test

    return eut


# --- adapters and publication, as the publisher would do them --------------------------------


@dataclass(frozen=True)
class Published:
    candidate: Candidate
    tensors: dict[str, TensorData]

    @property
    def name(self) -> str:
        return self.candidate.lora_name


def lora_name_for(manifest: Manifest, version: int, prefix: str = "agent") -> str:
    """docs/identities.md: ``{prefix}@{deployment}-{version_id}-{digest[:16]}``."""
    return f"{prefix}@ct-{version}-{manifest.digest[:16]}"


def candidate_for(
    store: ArtifactStore,
    seed: int,
    *,
    version: int | None = None,
    attempt: int = 1,
    r: int = 8,
) -> Published:
    config, tensors = make_adapter(seed, r=r)
    manifest = build_manifest(config, tensors)
    path = str(store.put(manifest, tensors))
    candidate = Candidate(
        lora_name=lora_name_for(manifest, version if version is not None else seed),
        digest=manifest.digest,
        attempt=attempt,
        manifest=manifest,
        artifact_path=path,
    )
    return Published(candidate, tensors)


def buckets_of(tensors: Mapping[str, TensorData], max_bytes: int = 64 * 1024) -> list[Bucket]:
    """The publisher's own bucket plan (never splits a tensor), at a size small enough that
    the tiny test adapters take several buckets."""
    return list(plan_buckets(tensors, max_bytes))


aiter_list = aiter_buckets  # the async iterable ``Engine.transfer`` takes


async def publish(
    engine: Engine, published: Published, *, buckets: list[Bucket] | None = None
) -> None:
    """prepare -> transfer -> load, checking both receipts like the publisher does."""
    c = published.candidate
    incarnation = await engine.incarnation()
    prepared = await engine.prepare(c)
    sent = (
        buckets
        if buckets is not None
        else (buckets_of(published.tensors) if engine.transport == "staged" else [])
    )
    await engine.transfer(c, aiter_list(sent))
    ready = await engine.load(c)
    for receipt, phase in ((prepared, "prepared"), (ready, "ready")):
        assert receipt.phase == phase
        assert (receipt.lora_name, receipt.digest, receipt.attempt) == (
            c.lora_name,
            c.digest,
            c.attempt,
        )
        assert receipt.engine_id == engine.engine_id
        assert receipt.incarnation == incarnation


def write_adapter_dir(
    root: Path, name: str, config: Mapping[str, Any], tensors: Mapping[str, TensorData]
) -> Path:
    """A PEFT directory written *without* the store's validation (for bad-input tests)."""
    target = root / name
    target.mkdir(parents=True)
    (target / CONFIG_FILE).write_text(json.dumps(config))
    (target / WEIGHTS_FILE).write_bytes(serialize_safetensors(tensors))
    return target


async def expect_refusal(code: str | set[str], awaitable: Any) -> CleanRefusal:
    codes = {code} if isinstance(code, str) else code
    with pytest.raises(CleanRefusal) as info:
        await awaitable
    assert info.value.code in codes, info.value
    return info.value


# --- the suite ---------------------------------------------------------------------------------


@pytest.mark.anyio
class EngineContract:
    """Behaviour every engine adapter must show. Subclass it and provide an ``eut`` fixture."""

    async def test_incarnation_is_stable_and_shared_by_inventory(
        self, eut: EngineUnderTest
    ) -> None:
        assert isinstance(eut.engine, Engine)
        assert eut.engine.transport in ("artifact", "staged") and eut.engine.kind
        first = await eut.engine.incarnation()
        assert first and first == await eut.engine.incarnation()
        inventory = await eut.engine.inventory()
        assert inventory.incarnation == first
        assert inventory.engine_id == eut.engine.engine_id
        assert inventory.adapters == ()

    async def test_declared_capabilities_are_honoured(self, eut: EngineUnderTest) -> None:
        """Optional features are declared, never discovered: an engine that declares
        ``extra_body`` takes the keyword on ``generate``; a declared endpoint is a URL."""
        capabilities = eut.engine.capabilities
        assert isinstance(capabilities, EngineCapabilities)
        if capabilities.endpoint:
            assert capabilities.endpoint.startswith(("http://", "https://"))
        if capabilities.extra_body:
            generation = await eut.engine.generate(
                PROMPT,
                None,
                GREEDY,
                extra_body={},  # type: ignore[call-arg]
            )
            assert generation.token_ids

    async def test_publish_then_inventory_lists_name_and_digest(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 1)
        await publish(eut.engine, p)
        inventory = await eut.engine.inventory()
        entries = {e.lora_name: e for e in inventory.adapters}
        assert set(entries) == {p.name}
        assert entries[p.name].digest == p.candidate.digest

    async def test_adapter_changes_greedy_output_and_is_deterministic(
        self, eut: EngineUnderTest
    ) -> None:
        a, b = candidate_for(eut.store, 1), candidate_for(eut.store, 2)
        await publish(eut.engine, a)
        await publish(eut.engine, b)
        base = await eut.engine.generate(PROMPT, None, GREEDY)
        out_a = await eut.engine.generate(PROMPT, a.name, GREEDY)
        out_b = await eut.engine.generate(PROMPT, b.name, GREEDY)
        again_a = await eut.engine.generate(PROMPT, a.name, GREEDY)
        assert len(base.token_ids) == len(out_a.token_ids) == GREEDY.max_tokens
        assert base.token_ids != out_a.token_ids != out_b.token_ids
        assert again_a.token_ids == out_a.token_ids
        assert out_a.lora_name == a.name and base.lora_name is None
        assert out_a.finish_reason == "length"
        assert out_a.logprobs is not None and len(out_a.logprobs) == len(out_a.token_ids)
        assert all(lp <= 0.0 for lp in out_a.logprobs)
        assert out_a.engine_id == eut.engine.engine_id
        assert out_a.incarnation == await eut.engine.incarnation()

    async def test_token_id_prompts(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 18)
        await publish(eut.engine, p)
        prompt = [5, 17, 42, 99, 7]
        base = await eut.engine.generate(prompt, None, GREEDY)
        tuned = await eut.engine.generate(prompt, p.name, GREEDY)
        assert base.prompt_tokens == len(prompt) == tuned.prompt_tokens
        assert base.token_ids != tuned.token_ids
        assert (await eut.engine.generate(prompt, p.name, GREEDY)).token_ids == tuned.token_ids

    async def test_unload_then_repeat_is_idempotent(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 3)
        await publish(eut.engine, p)
        receipt = await eut.engine.unload(p.name, attempt=p.candidate.attempt)
        assert receipt.was_loaded is True and receipt.lora_name == p.name
        assert receipt.incarnation == await eut.engine.incarnation()
        assert p.name not in (await eut.engine.inventory()).names()
        again = await eut.engine.unload(p.name, attempt=p.candidate.attempt)
        assert again.was_loaded is False

    async def test_generation_after_unload(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 4)
        await publish(eut.engine, p)
        before = await eut.engine.generate(PROMPT, p.name, GREEDY)
        await eut.engine.unload(p.name, attempt=p.candidate.attempt)
        if eut.caps.implicit_reload:
            # the hazard the gateway must avoid: the name silently comes back from its path
            again = await eut.engine.generate(PROMPT, p.name, GREEDY)
            assert again.token_ids == before.token_ids
            assert p.name in (await eut.engine.inventory()).names()
        else:
            code = ErrorCode.NAME_RECLAIMED if eut.caps.reclaimed_refusal else ErrorCode.NOT_LOADED
            await expect_refusal(code, eut.engine.generate(PROMPT, p.name, GREEDY))
            assert p.name not in (await eut.engine.inventory()).names()

    async def test_unknown_adapter_is_a_clean_not_loaded(self, eut: EngineUnderTest) -> None:
        await expect_refusal(
            ErrorCode.NOT_LOADED, eut.engine.generate(PROMPT, "never@loaded-1-00", GREEDY)
        )

    @pytest.mark.parametrize("bad", ["agent/v1", "agent:v1", "", "x" * 300])
    async def test_invalid_names_are_refused(self, eut: EngineUnderTest, bad: str) -> None:
        p = candidate_for(eut.store, 5)
        c = Candidate(
            lora_name=bad,
            digest=p.candidate.digest,
            attempt=1,
            manifest=p.candidate.manifest,
            artifact_path=p.candidate.artifact_path,
        )
        await expect_refusal(ErrorCode.INVALID_NAME, eut.engine.prepare(c))
        assert (await eut.engine.inventory()).adapters == ()

    async def test_digest_mismatch_is_refused_and_leaves_nothing(
        self, eut: EngineUnderTest
    ) -> None:
        p, other = candidate_for(eut.store, 6), candidate_for(eut.store, 7)
        lying = Candidate(
            lora_name=p.name,
            digest=other.candidate.digest,  # says it is another adapter
            attempt=1,
            manifest=p.candidate.manifest,
            artifact_path=p.candidate.artifact_path,
        )
        await expect_refusal(ErrorCode.DIGEST_MISMATCH, eut.engine.prepare(lying))
        assert (await eut.engine.inventory()).adapters == ()
        await publish(eut.engine, p)  # the honest candidate still goes through

    async def test_corrupt_bytes_are_refused_and_a_retry_succeeds(
        self, eut: EngineUnderTest
    ) -> None:
        p = candidate_for(eut.store, 8)
        if eut.engine.transport == "staged":
            buckets = buckets_of(p.tensors)
            first = buckets[0].tensors[0]
            flipped = bytearray(first.tensor.data)
            flipped[0] ^= 0xFF
            bad = TensorData(first.tensor.dtype, first.tensor.shape, bytes(flipped))
            buckets[0] = Bucket(0, (BucketTensor(first.name, bad), *buckets[0].tensors[1:]))
            with pytest.raises(CleanRefusal) as info:
                await publish(eut.engine, p, buckets=buckets)
        else:
            # an artifact directory whose weights file is damaged on disk
            damaged = Path(p.candidate.artifact_path or "")
            weights = damaged / WEIGHTS_FILE
            blob = bytearray(weights.read_bytes())
            blob[-1] ^= 0xFF
            weights.write_bytes(bytes(blob))
            with pytest.raises(CleanRefusal) as info:
                await publish(eut.engine, p)
            weights.write_bytes(serialize_safetensors(p.tensors))  # repaired
        assert info.value.code in {ErrorCode.DIGEST_MISMATCH, ErrorCode.INVALID_ADAPTER}
        assert p.name not in (await eut.engine.inventory()).names()
        cleanup = await eut.engine.unload(p.name, attempt=1)
        assert cleanup.was_loaded is False
        retry = candidate_for(eut.store, 8, attempt=2)
        await publish(eut.engine, retry)
        assert retry.name in (await eut.engine.inventory()).names()

    async def test_rank_beyond_the_engine_limit_is_refused(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 9, r=UNSERVABLE_RANK)
        await expect_refusal(ErrorCode.RANK_UNSUPPORTED, publish(eut.engine, p))
        assert (await eut.engine.inventory()).adapters == ()

    async def test_config_tensor_mismatch_is_refused(self, eut: EngineUnderTest) -> None:
        config, tensors = make_adapter(10, r=4)
        config = {**config, "r": 8}  # tensors have rank 4
        path = write_adapter_dir(eut.store.root, "mismatch", config, tensors)
        manifest = build_manifest(config, tensors)
        c = Candidate(
            lora_name=lora_name_for(manifest, 10),
            digest=manifest.digest,
            attempt=1,
            manifest=manifest,
            artifact_path=str(path),
        )
        await expect_refusal(ErrorCode.INVALID_ADAPTER, publish(eut.engine, Published(c, tensors)))
        assert (await eut.engine.inventory()).adapters == ()

    async def test_load_without_prepare_is_refused(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 11)
        await expect_refusal(ErrorCode.NOT_PREPARED, eut.engine.load(p.candidate))
        assert (await eut.engine.inventory()).adapters == ()

    async def test_stale_attempt_cleanup_never_touches_the_newer_attempt(
        self, eut: EngineUnderTest
    ) -> None:
        if not eut.caps.attempt_fencing:
            pytest.skip("engine adapter does not fence attempts")
        p2 = candidate_for(eut.store, 12, attempt=2)
        await publish(eut.engine, p2)
        await expect_refusal(ErrorCode.STALE_ATTEMPT, eut.engine.unload(p2.name, attempt=1))
        stale = candidate_for(eut.store, 12, attempt=1)
        await expect_refusal(ErrorCode.STALE_ATTEMPT, eut.engine.prepare(stale.candidate))
        assert p2.name in (await eut.engine.inventory()).names()
        out = await eut.engine.generate(PROMPT, p2.name, GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens

    async def test_cleaned_up_attempt_cannot_come_back(self, eut: EngineUnderTest) -> None:
        if not eut.caps.attempt_fencing:
            pytest.skip("engine adapter does not fence attempts")
        p = candidate_for(eut.store, 13)
        await eut.engine.prepare(p.candidate)
        assert (await eut.engine.unload(p.name, attempt=1)).was_loaded is False
        await expect_refusal(ErrorCode.STALE_ATTEMPT, eut.engine.prepare(p.candidate))
        await expect_refusal(
            {ErrorCode.STALE_ATTEMPT, ErrorCode.NOT_PREPARED}, eut.engine.load(p.candidate)
        )
        assert (await eut.engine.inventory()).adapters == ()

    async def test_staged_bytes_show_in_the_inventory_until_loaded_or_cleaned(
        self, eut: EngineUnderTest
    ) -> None:
        """Bytes staged for a prepared attempt are engine memory that only that attempt's load
        or an attempt-fenced unload frees. The inventory lists them (``staged``, never among
        the servable ``adapters``), so a cleanup that was lost or ignored can be found."""
        p = candidate_for(eut.store, 16)
        q = candidate_for(eut.store, 17)
        for staged in (p, q):
            await eut.engine.prepare(staged.candidate)
            sent = buckets_of(staged.tensors) if eut.engine.transport == "staged" else []
            await eut.engine.transfer(staged.candidate, aiter_list(sent))
        inventory = await eut.engine.inventory()
        assert inventory.adapters == ()
        if not eut.caps.reports_staging:
            assert inventory.staged == ()
            return
        assert inventory.staged == tuple(sorted((p.name, q.name)))
        await eut.engine.load(p.candidate)
        assert (await eut.engine.unload(q.name, attempt=1)).was_loaded is False
        inventory = await eut.engine.inventory()
        assert inventory.names() == {p.name}
        assert inventory.staged == ()

    async def test_republish_same_attempt_is_idempotent(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 14)
        await publish(eut.engine, p)
        out = await eut.engine.generate(PROMPT, p.name, GREEDY)
        await publish(eut.engine, p)  # a retry after a lost reply: same receipts, no reload
        assert (await eut.engine.generate(PROMPT, p.name, GREEDY)).token_ids == out.token_ids
        assert [e.lora_name for e in (await eut.engine.inventory()).adapters] == [p.name]

    async def test_seeded_sampling_is_reproducible(self, eut: EngineUnderTest) -> None:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
        one = await eut.engine.generate(PROMPT, None, params)
        two = await eut.engine.generate(PROMPT, None, params)
        assert one.token_ids == two.token_ids

    async def test_parallel_sampling(self, eut: EngineUnderTest) -> None:
        if not eut.caps.parallel_sampling:
            pytest.skip("engine adapter sends one completion per call")
        p = candidate_for(eut.store, 15)
        await publish(eut.engine, p)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
        out = await eut.engine.generate(PROMPT, p.name, params)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert len({c.token_ids for c in out.choices}) > 1  # different seeds per child
        assert out.token_ids == out.choices[0].token_ids
        again = await eut.engine.generate(PROMPT, p.name, params)
        assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]
        if eut.refcount is not None:
            assert eut.refcount(p.name) == 0

    async def test_cache_salt_and_prefix_reuse(self, eut: EngineUnderTest) -> None:
        p = candidate_for(eut.store, 16)
        await publish(eut.engine, p)
        cold = await eut.engine.generate(PROMPT, p.name, GREEDY, cache_salt="s1")
        warm = await eut.engine.generate(PROMPT, p.name, GREEDY, cache_salt="s1")
        assert warm.token_ids == cold.token_ids
        if eut.caps.reports_cached_tokens:
            assert cold.cached_tokens == 0
            assert warm.cached_tokens > 0
            other_salt = await eut.engine.generate(PROMPT, p.name, GREEDY, cache_salt="s2")
            assert other_salt.cached_tokens == 0

    async def test_unload_waits_for_in_flight_requests(self, eut: EngineUnderTest) -> None:
        if not (eut.caps.unload_drains and eut.caps.can_hold):
            pytest.skip("engine's unload does not drain, or requests cannot be held")
        assert eut.hold is not None and eut.release is not None
        p = candidate_for(eut.store, 17)
        await publish(eut.engine, p)
        reference = await eut.engine.generate(PROMPT, p.name, GREEDY)
        results: dict[str, Any] = {}
        unloaded = anyio.Event()
        async with anyio.create_task_group() as tg:
            eut.hold()

            async def request() -> None:
                results["gen"] = await eut.engine.generate(PROMPT, p.name, GREEDY)

            async def unload() -> None:
                results["unload"] = await eut.engine.unload(p.name, attempt=p.candidate.attempt)
                unloaded.set()

            tg.start_soon(request)
            refcount = eut.refcount
            if refcount is not None:
                await wait_for(
                    "the held request to take its reference", lambda: refcount(p.name) == 1
                )
            else:
                await anyio.sleep(0.3)
            tg.start_soon(unload)
            await anyio.sleep(0.3)
            assert not unloaded.is_set(), "unload returned while a request held the adapter"
            if not eut.caps.implicit_reload:
                # new requests are refused at once, while the old one is still running
                with anyio.fail_after(2):
                    with pytest.raises(CleanRefusal):
                        await eut.engine.generate(PROMPT, p.name, GREEDY)
            eut.release()
        gen: Generation = results["gen"]
        assert gen.token_ids == reference.token_ids  # finished on the OLD adapter
        assert results["unload"].was_loaded is True
        assert p.name not in (await eut.engine.inventory()).names()

    async def test_an_unload_that_does_not_drain_answers_under_a_running_request(
        self, eut: EngineUnderTest
    ) -> None:
        """``unload_drains=False`` (vLLM): the unload answers while a request still runs on the
        adapter, the name is gone at once, and the request finishes on its adapter. Nothing on
        such an engine waits for running requests, so only the ledger's in-flight rule keeps a
        version loaded under them (``tests/publisher/drivers/test_reclaim_inflight.py`` runs the
        reclaim driver and the reconciler against an engine declared this way)."""
        if eut.caps.unload_drains or not eut.caps.can_hold:
            pytest.skip("engine's unload drains (the draining test covers it), or cannot hold")
        assert eut.hold is not None and eut.release is not None
        p = candidate_for(eut.store, 20)
        await publish(eut.engine, p)
        reference = await eut.engine.generate(PROMPT, p.name, GREEDY)
        results: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            eut.hold()

            async def request() -> None:
                results["gen"] = await eut.engine.generate(PROMPT, p.name, GREEDY)

            tg.start_soon(request)
            refcount = eut.refcount
            if refcount is not None:
                await wait_for(
                    "the held request to take its reference", lambda: refcount(p.name) == 1
                )
            else:
                await anyio.sleep(0.3)
            with anyio.fail_after(5):  # a draining unload would wait for the held request
                receipt = await eut.engine.unload(p.name, attempt=p.candidate.attempt)
            assert receipt.was_loaded is True
            assert "gen" not in results, "the request finished before the unload answered"
            assert p.name not in (await eut.engine.inventory()).names()
            eut.release()
        gen: Generation = results["gen"]
        assert gen.token_ids == reference.token_ids  # finished on its adapter

    async def test_a_stopped_engine_never_answers_cleanly(self, eut: EngineUnderTest) -> None:
        """Once the serving side is gone, no call may pretend to know the engine's state."""
        if eut.stop is None:
            pytest.skip("the harness cannot stop this engine")
        p = candidate_for(eut.store, 19)
        await publish(eut.engine, p)
        await eut.stop()
        calls = [
            eut.engine.incarnation(),
            eut.engine.inventory(),
            eut.engine.generate(PROMPT, p.name, GREEDY),
            eut.engine.unload(p.name, attempt=p.candidate.attempt),
        ]
        for call in calls:
            with pytest.raises(AmbiguousReply):
                await call
