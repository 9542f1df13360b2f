"""FaultyEngine around a real LocalEngine: each fault does to the engine exactly what it says
(the engine's own inventory is the witness), restarts give a new incarnation that holds
nothing, duplicates are really delivered twice, and seeded plans are reproducible."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from engines.artifacts import ArtifactStore
from engines.contract import AmbiguousReply, CleanRefusal, ErrorCode
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.testing import RestartableEngine
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    Published,
    aiter_list,
    buckets_of,
    candidate_for,
    publish,
)
from tests.engines.faulty_engine import (
    Delay,
    Drop,
    Duplicate,
    FaultyEngine,
    Refuse,
    Restart,
    ServerError,
    Swallow,
)
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
]


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def host(store: ArtifactStore, anyio_backend: str) -> AsyncIterator[RestartableEngine]:
    def factory() -> LocalEngine:
        return LocalEngine("e0", limits=ServingLimits(max_lora_rank=32), artifact_root=store.root)

    async with RestartableEngine(factory) as h:
        yield h


@pytest.fixture
async def faulty(host: RestartableEngine) -> AsyncIterator[FaultyEngine]:
    async with FaultyEngine(host, restart=host.restart) as f:
        yield f


async def prepared(engine: FaultyEngine, p: Published) -> None:
    await engine.prepare(p.candidate)
    await engine.transfer(p.candidate, aiter_list(buckets_of(p.tensors)))


async def held(engine: FaultyEngine) -> frozenset[str]:
    return (await engine.inventory()).names()


async def test_drop_executes_on_the_engine_and_loses_the_reply(
    faulty: FaultyEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 1)
    await prepared(faulty, p)
    faulty.inject("load", Drop())
    with pytest.raises(AmbiguousReply) as info:
        await faulty.load(p.candidate)
    assert info.value.code == ErrorCode.CONNECTION_LOST
    assert p.name in await held(faulty)  # it did happen
    assert faulty.calls[-2].fault == "Drop" and faulty.calls[-2].deliveries == 1


async def test_server_error_and_refusal_never_reach_the_engine(
    faulty: FaultyEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 2)
    await prepared(faulty, p)
    faulty.inject("load", ServerError(status=502))
    with pytest.raises(AmbiguousReply) as info:
        await faulty.load(p.candidate)
    assert (info.value.code, info.value.status) == (ErrorCode.SERVER_ERROR, 502)
    faulty.inject("load", Refuse(code=ErrorCode.RANK_UNSUPPORTED))
    with pytest.raises(CleanRefusal) as refused:
        await faulty.load(p.candidate)
    assert refused.value.code == ErrorCode.RANK_UNSUPPORTED
    assert p.name not in await held(faulty)
    assert [c.deliveries for c in faulty.calls if c.method == "load"] == [0, 0]
    await faulty.load(p.candidate)  # the next call is clean and reaches the engine
    assert p.name in await held(faulty)


async def test_delay_before_sending_and_before_replying(
    faulty: FaultyEngine, host: RestartableEngine, store: ArtifactStore
) -> None:
    """Delays far longer than the test: the caller gives up (a cancel), never a timer race --
    a 3 s timeout around a real load under a 5 s delay failed whenever the load itself took
    over 3 s on a loaded machine."""
    p = candidate_for(store, 3)
    await prepared(faulty, p)
    faulty.inject("load", Delay(seconds=3600.0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(faulty.load, p.candidate)
        await wait_for("the load call to reach the wrapper", lambda: faulty.count("load") == 1)
        tg.cancel_scope.cancel()  # the caller gives up
    assert p.name not in await held(faulty)  # ... before it was sent
    faulty.inject("load", Delay(seconds=3600.0, after=True))
    async with anyio.create_task_group() as tg:
        tg.start_soon(faulty.load, p.candidate)
        # sent and done on the engine while the call is still out: only the reply is late
        await wait_for(
            "the delayed load to be done on the engine",
            lambda: p.name in host.current.loaded_adapters(),
            timeout=60,
        )
        assert [c for c in faulty.calls if c.method == "load" and c.n == 2] == []
        tg.cancel_scope.cancel()
    assert p.name in await held(faulty)
    faulty.inject("incarnation", Delay(seconds=0.15))
    t = time.monotonic()
    await faulty.incarnation()
    assert time.monotonic() - t >= 0.15


async def test_restart_gives_a_new_incarnation_that_holds_nothing(
    faulty: FaultyEngine, host: RestartableEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 4)
    old = await faulty.incarnation()
    await publish(faulty, p)
    before = host.current
    faulty.inject("inventory", Restart(after=True))
    inventory = await faulty.inventory()
    assert inventory.incarnation == old and p.name in inventory.names()  # the reply is old
    new = await faulty.incarnation()
    assert new != old and host.lives == 2 and host.current is not before
    assert await held(faulty) == frozenset()
    with pytest.raises(CleanRefusal) as info:
        await faulty.generate(PROMPT, p.name, GREEDY)
    assert info.value.code == ErrorCode.NOT_LOADED
    # a restart *before* a call: the call lands on the next life
    faulty.inject("incarnation", Restart())
    assert await faulty.incarnation() not in (old, new)


async def test_restart_mid_generation_ends_in_flight_requests(
    faulty: FaultyEngine, host: RestartableEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 5)
    await publish(faulty, p)
    host.current.pause_generation()
    errors: list[BaseException] = []

    async def generate() -> None:
        try:
            await faulty.generate(PROMPT, p.name, GREEDY)
        except AmbiguousReply as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await wait_for(  # decoding, frozen between tokens
            "the generation to be decoding", lambda: host.current.in_flight == 1
        )
        await host.restart()
    assert [e.code for e in errors] == [ErrorCode.ENGINE_STOPPED]  # type: ignore[attr-defined]


async def test_duplicate_delivers_twice(faulty: FaultyEngine, store: ArtifactStore) -> None:
    p = candidate_for(store, 6)
    faulty.inject("transfer", Duplicate())
    faulty.inject("load", Duplicate())
    await publish(faulty, p)
    faulty.inject("unload", Duplicate())
    receipt = await faulty.unload(p.name)
    assert receipt.was_loaded  # the caller sees the first delivery
    assert [(d.method, d.outcome) for d in faulty.duplicates] == [
        ("transfer", "ok"),
        ("load", "ok"),  # an idempotent replay of the same attempt
        ("unload", "ok"),  # the second found it gone (was_loaded=False)
    ]
    assert [c.deliveries for c in faulty.calls if c.fault == "Duplicate"] == [2, 2, 2]
    assert p.name not in await held(faulty)


async def test_a_late_duplicate_load_after_cleanup_is_fenced(
    faulty: FaultyEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 7)
    await prepared(faulty, p)
    faulty.inject("load", Duplicate(delay=0.2))
    await faulty.load(p.candidate)
    await faulty.unload(p.name, attempt=1)  # cleanup of attempt 1
    with anyio.fail_after(5):
        while not faulty.duplicates:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert [(d.method, d.outcome) for d in faulty.duplicates] == [("load", "STALE_ATTEMPT")]
    assert p.name not in await held(faulty)


async def test_swallow_answers_success_without_acting(
    faulty: FaultyEngine, store: ArtifactStore
) -> None:
    p = candidate_for(store, 8)
    await prepared(faulty, p)
    faulty.inject("load", Swallow())
    receipt = await faulty.load(p.candidate)
    assert receipt.phase == "ready" and receipt.lora_name == p.name
    assert p.name not in await held(faulty)  # the adapter silently never applied
    assert faulty.calls[-2].deliveries == 0


async def test_scheduling_by_call_number_and_times(faulty: FaultyEngine) -> None:
    faulty.inject("incarnation", ServerError(), call=2, times=2)
    await faulty.incarnation()
    for _ in range(2):
        with pytest.raises(AmbiguousReply):
            await faulty.incarnation()
    await faulty.incarnation()
    assert [c.fault for c in faulty.calls] == [None, "ServerError", "ServerError", None]
    assert faulty.count("incarnation") == 4 and faulty.count() == 4


async def test_seeded_rates_are_reproducible(host: RestartableEngine) -> None:
    rates = {"incarnation": [(0.3, ServerError()), (0.2, Refuse())]}

    async def run(seed: int) -> list[str | None]:
        f = FaultyEngine(host, seed=seed, rates=rates)
        for _ in range(40):
            with contextlib.suppress(AmbiguousReply, CleanRefusal):
                await f.incarnation()
        return [c.fault for c in f.calls]

    first, again, other = await run(11), await run(11), await run(12)
    assert first == again
    assert first != other
    assert {"ServerError", "Refuse", None} <= set(first)


def test_invalid_schedules_are_refused(host: RestartableEngine) -> None:
    plain = FaultyEngine(host)
    with pytest.raises(ValueError, match="restart hook"):
        plain.inject("load", Restart())
    with pytest.raises(ValueError, match="Swallow"):
        plain.inject("generate", Swallow())
    with pytest.raises(ValueError, match="unknown"):
        plain.inject("reload", Drop())
    with pytest.raises(ValueError, match="sum"):
        FaultyEngine(host, rates={"load": [(0.7, Drop()), (0.7, Drop())]})
