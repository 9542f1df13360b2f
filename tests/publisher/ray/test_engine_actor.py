"""Engines as Ray actors: the engine contract suite, run against a :class:`RayEngine` proxy of
an :class:`EngineActor` hosting a real local engine (one actor for the module: starting one
costs seconds), and what only Ray adds -- the proxy's bytes and answers equal the in-process
engine's, and a dead engine actor is ambiguous, never a clean answer."""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from ray.exceptions import GetTimeoutError

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, EngineCapabilities, ErrorCode, SamplingParams
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.testing import RestartableEngine
from publisher.ray.engine import EngineActor, RayEngine, start_engine, stop_engine
from publisher.ray.link import DEFAULT_NAMESPACE
from tests.engines.contract import (
    Capabilities,
    EngineContract,
    EngineUnderTest,
    buckets_of,
    candidate_for,
    publish,
)

LIMITS = ServingLimits(max_lora_rank=32)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PEFT_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Adapter .* was active which is now deleted:UserWarning",
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",
)


class InspectableEngineActor(EngineActor):
    """An engine actor hosting a :class:`RestartableEngine`, plus the contract's harness hooks
    (a fresh engine per test, freeze decoding, read refcounts) as actor methods: one actor
    process for the module, a new engine life (empty, new incarnation) for every test."""

    async def fresh(self) -> None:
        await self._host.call(self._engine.restart)  # type: ignore[attr-defined]

    async def stop_current(self) -> None:
        """End the current engine life without a new one (until the next ``fresh``)."""
        await self._host.call(self._engine.current.aclose)  # type: ignore[attr-defined]

    async def hold(self) -> None:
        async def run() -> None:
            self._engine.current.pause_generation()  # type: ignore[attr-defined]

        await self._host.call(run)

    async def release(self) -> None:
        async def run() -> None:
            self._engine.current.continue_generation()  # type: ignore[attr-defined]

        await self._host.call(run)

    async def refcount(self, lora_name: str) -> int:
        async def run() -> int:
            return self._engine.current.refcount(lora_name)  # type: ignore[attr-defined,no-any-return]

        return await self._host.call(run)


def _restartable() -> RestartableEngine:
    return RestartableEngine(functools.partial(LocalEngine, "ray-e0", limits=LIMITS))


@pytest.fixture(scope="module")
def engine_actor(ray_instance: Any) -> Iterator[RayEngine]:
    handle = (
        ray.remote(InspectableEngineActor)
        .options(name="contract-engine", max_concurrency=1000, num_cpus=0)
        .remote(_restartable)
    )
    info = ray.get(handle.describe.remote(), timeout=300)
    engine = RayEngine(handle, info.engine_id, info.kind, info.transport)
    yield engine
    stop_engine(engine)


@pytest.fixture
def eut(engine_actor: RayEngine, tmp_path: Path) -> EngineUnderTest:
    handle = engine_actor.handle
    ray.get(handle.fresh.remote(), timeout=120)

    async def stop() -> None:
        await handle.stop_current.remote()

    return EngineUnderTest(
        engine=engine_actor,
        caps=Capabilities(reclaimed_refusal=True, reports_staging=True),
        store=ArtifactStore(tmp_path / "artifacts"),
        hold=lambda: ray.get(handle.hold.remote()),
        release=lambda: ray.get(handle.release.remote()),
        refcount=lambda name: ray.get(handle.refcount.remote(name)),
        stop=stop,
    )


@PEFT_WARNINGS
class TestRayEngineContract(EngineContract):
    pass


@contextlib.contextmanager
def _dedicated_engine(name: str) -> Iterator[RayEngine]:
    engine = start_engine(functools.partial(LocalEngine, name, limits=LIMITS), name=name)
    try:
        yield engine
    finally:
        stop_engine(engine)


@pytest.mark.anyio
@PEFT_WARNINGS
async def test_the_proxy_serves_what_the_engine_in_process_serves(eut: EngineUnderTest) -> None:
    """Many small buckets streamed one per round trip, then the same greedy tokens and
    logprobs as an in-process engine holding the same adapter."""
    engine_actor, store = eut.engine, eut.store
    published = candidate_for(store, 101)
    buckets = buckets_of(published.tensors, max_bytes=4096)
    assert len(buckets) > 3
    await publish(engine_actor, published, buckets=buckets)
    remote = await engine_actor.generate("the quick brown fox", published.name, GREEDY)
    async with LocalEngine("local-ref", limits=LIMITS) as local:
        await publish(local, published)
        here = await local.generate("the quick brown fox", published.name, GREEDY)
    assert remote.token_ids == here.token_ids
    assert remote.logprobs == pytest.approx(here.logprobs)
    assert remote.lora_name == published.name
    assert remote.engine_id == engine_actor.engine_id == "ray-e0"


def test_the_proxy_declares_no_extra_body_and_confirms_a_requests_end() -> None:
    """``generate`` carries no ``extra_body`` across the actor (the gateway refuses extra
    fields for a proxied engine); its address is the hosted engine's own, if it has one (an
    HTTP adapter in the actor, which the OpenAI gateway actor reaches directly); it confirms a
    request's end (the actor asks its engine; a dead actor runs nothing)."""
    handle: Any = None
    ends = EngineCapabilities(confirms_end=True)
    assert RayEngine(handle, "e0", "local", "staged").capabilities == ends
    served = RayEngine(handle, "e0", "local", "staged", "http://127.0.0.1:9")
    assert served.capabilities == EngineCapabilities(
        endpoint="http://127.0.0.1:9", confirms_end=True
    )


@pytest.mark.anyio
async def test_a_dead_engine_actor_is_ambiguous_never_clean(ray_instance: Any) -> None:
    """The call that finds the actor dead may have run (ambiguous, ``dispatched``); every later
    call on that proxy is refused before it is sent (``ENGINE_GONE``, not dispatched), so the
    gateway may try another holder and the reconciler suspends the engine at once. A fresh
    proxy (another process's copy) learns it from its own first call, which stays ambiguous:
    nothing proves that call was not sent."""
    with _dedicated_engine("doomed") as engine:
        assert await engine.incarnation()
        copy = pickle.loads(pickle.dumps(engine))  # another process's proxy, as Ray sends it
        ray.kill(engine.handle, no_restart=True)
        # ray.kill is asynchronous: a call may still reach the actor before it dies (that
        # answer is a real one). Once a call is lost, it is ambiguous, never a clean refusal
        # (any other error propagates and fails the test).
        found: AmbiguousReply | None = None
        with anyio.fail_after(30):
            while found is None:
                try:
                    await engine.incarnation()
                except AmbiguousReply as exc:
                    found = exc
                await anyio.sleep(0.05)
        assert (found.code, found.dispatched) == (ErrorCode.ENGINE_GONE, True)
        assert engine.gone
        for call in (
            engine.incarnation(),
            engine.inventory(),
            engine.unload("agent@dep-1-0123456789abcdef"),
            engine.generate("hello", None, GREEDY),
        ):
            with pytest.raises(AmbiguousReply) as refused:
                await call
            assert (refused.value.code, refused.value.dispatched) == (ErrorCode.ENGINE_GONE, False)
        assert not copy.gone
        with pytest.raises(AmbiguousReply) as lost_generation:
            await copy.generate("hello", None, GREEDY)
        # the gateway must not resend: as far as this proxy can tell, the request may have run
        assert (lost_generation.value.code, lost_generation.value.dispatched) == (
            ErrorCode.ENGINE_GONE,
            True,
        )
        assert copy.gone


@contextlib.asynccontextmanager
async def _never_up() -> AsyncIterator[LocalEngine]:
    """An engine whose start never ends (a model that takes longer to load than the caller
    waits)."""
    await anyio.sleep(3600)
    raise AssertionError("unreachable")
    yield


def test_an_engine_that_does_not_start_in_time_leaves_no_actor_behind(ray_instance: Any) -> None:
    """``start_engine`` gives up after ``timeout``: the detached actor it created must not stay
    (holding its resources, and its name, so a retry was refused as taken)."""
    name = "slow-start"
    with pytest.raises(GetTimeoutError):
        start_engine(_never_up, name=name, detached=True, timeout=2.0)
    with pytest.raises(ValueError, match="Failed to look up actor"):  # the name is free
        ray.get_actor(name, namespace=DEFAULT_NAMESPACE)
    again = start_engine(
        functools.partial(LocalEngine, "slow-start-e0", limits=LIMITS), name=name, detached=True
    )
    try:
        assert ray.get(again.handle.describe.remote(), timeout=60).engine_id == "slow-start-e0"
    finally:
        stop_engine(again)


def test_start_engine_refuses_two_placements() -> None:
    from evlog.errors import InvalidInput

    with pytest.raises(InvalidInput):
        start_engine(lambda: None, name="x", node_id="n", scheduling_strategy="SPREAD")  # type: ignore[arg-type,return-value]
