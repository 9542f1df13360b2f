"""End to end through the ControlPlane with real local engines (in process, and over loopback
HTTP through LocalHTTPEngine and SGLangEngine): publish, pin sessions, publish again while
generations run, reclaim as soon as nothing uses the old version, skip on full capacity without
touching an engine."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from engines.contract import CleanRefusal, ErrorCode, Generation, SamplingParams
from engines.local.client import LocalHTTPEngine
from engines.local.server import running_server
from engines.sglang import SGLangEngine
from evlog.events import (
    AttemptStarted,
    EnginePrepared,
    EngineReady,
    EngineUnloaded,
    PublicationSkipped,
    ReclaimClaimed,
    SessionBound,
    TransportClaimed,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
)
from evlog.memory import MemoryStore
from projections.registry import VersionState
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from tests.engines.faulty_engine import FaultyEngine
from tests.publisher.plane_kit import (
    LIMITS,
    PEFT_WARNINGS,
    PROMPT,
    adapter_copy,
    local_engines,
    names,
    open_plane,
)
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Traffic:
    """Steady generation loops on one lora_name per engine, recording every completion."""

    def __init__(self, engines: Sequence[Any], lora_name: str) -> None:
        self.engines = engines
        self.lora_name = lora_name
        self.done: list[tuple[float, Generation]] = []
        self.errors: list[BaseException] = []
        self.stop = False

    async def loop(self, engine: Any) -> None:
        while not self.stop:
            try:
                g = await engine.generate(PROMPT, self.lora_name, LONG)
            except Exception as exc:
                self.errors.append(exc)
                return
            self.done.append((time.monotonic(), g))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Traffic]:
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(self.loop, engine)
            await wait_for(
                "a first generation done on every engine",
                lambda: len(self.done) >= len(self.engines),
            )
            try:
                yield self
            finally:
                self.stop = True


async def full_cycle(plane: ControlPlane, engines: Sequence[Any]) -> None:
    """The acceptance scenario, shared by the in-process and HTTP fleets."""
    ledger = plane.ledger
    v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
    assert v1.status == PublicationStatus.PUBLISHED and v1.revision == 1
    assert set(v1.ready_latency()) == {e.engine_id for e in engines}
    for e in engines:
        assert v1.lora_name in await names(e)

    await ledger.register_owner("w1", ttl_s=60)
    old = [await ledger.bind(f"old-{i}", "w1") for i in range(3)]
    assert {b.lora_name for b in old} == {v1.lora_name}
    before = {e.engine_id: await e.generate(PROMPT, v1.lora_name, LONG) for e in engines}

    # v2 is published while generations on v1 run on every engine
    traffic = Traffic(engines, v1.lora_name)  # type: ignore[arg-type]  # published: named
    async with traffic.running():
        started = time.monotonic()
        v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
        finished = time.monotonic()
        await wait_for(
            "a generation done after v2 was published",
            lambda: any(t > finished for t, _ in traffic.done),
        )
    assert v2.status == PublicationStatus.PUBLISHED and v2.retired == 1
    assert traffic.errors == []
    assert any(t < started for t, _ in traffic.done) and any(t > finished for t, _ in traffic.done)
    # v1 generations were never disturbed: same tokens before, during and after
    for _, g in traffic.done:
        assert g.token_ids == before[g.engine_id].token_ids

    again = [await ledger.bind(f"old-{i}", "w1") for i in range(3)]
    assert [b.version_id for b in again] == [1, 1, 1]  # old sessions stay on v1
    new = await ledger.bind("new-0", "w1")
    assert new.version_id == 2 and new.lora_name == v2.lora_name
    for e in engines:
        g2 = await e.generate(PROMPT, new.lora_name, LONG)
        assert g2.token_ids != before[e.engine_id].token_ids  # v2 is really applied
        assert {v1.lora_name, v2.lora_name} <= await names(e)

    for b in old:
        await ledger.release(b.session, "w1")
    await wait_for("v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED)
    for e in engines:
        held = await names(e)
        assert v1.lora_name not in held and v2.lora_name in held
    log = await events(ledger)
    claimed = of_type(log, ReclaimClaimed)
    assert [c.version_id for c in claimed] == [1]
    unloaded = {e.engine for e in of_type(log, EngineUnloaded) if e.version_id == 1}
    assert unloaded == {e.engine_id for e in engines}
    assert isinstance(
        next(
            e for e in log if isinstance(e, VersionReclaimed | EngineUnloaded) and e.version_id == 1
        ),
        EngineUnloaded,
    )


def assert_publication_order(log: list[Any], version_id: int, fleet: set[str]) -> None:
    """Allocated -> attempt started (on ``fleet``) -> claimed -> prepared and ready on each
    engine of the fleet, prepared first, once each -> published; nothing else in between."""
    mine = [e for e in log if getattr(e, "version_id", None) == version_id]
    kinds = [type(e) for e in mine]
    assert kinds[:3] == [VersionAllocated, AttemptStarted, TransportClaimed], kinds
    assert set(mine[1].fleet) == fleet
    published = kinds.index(VersionPublished)
    loading = mine[3:published]
    receipts = sorted((type(e).__name__, e.engine) for e in loading)
    assert receipts == sorted((k, e) for k in ("EnginePrepared", "EngineReady") for e in fleet)
    for engine in fleet:
        prepared, ready = (
            next(i for i, e in enumerate(loading) if isinstance(e, kind) and e.engine == engine)
            for kind in (EnginePrepared, EngineReady)
        )
        assert prepared < ready


async def test_two_local_engines_full_cycle(tmp_path: Path) -> None:
    async with local_engines(2) as engines, open_plane(engines, tmp_path) as plane:
        await full_cycle(plane, engines)
        log = await events(plane.ledger)
        assert_publication_order(log, 1, {"e0", "e1"})
        assert_publication_order(log, 2, {"e0", "e1"})
        with pytest.raises(CleanRefusal) as info:
            await engines[0].generate(PROMPT, plane.ledger.state.versions[1].lora_name, LONG)
        assert info.value.code == ErrorCode.NAME_RECLAIMED


async def test_four_local_engines_full_cycle(tmp_path: Path) -> None:
    async with local_engines(4) as engines, open_plane(engines, tmp_path) as plane:
        await full_cycle(plane, engines)
        assert plane.ledger.state.routable_engines() == ("e0", "e1", "e2", "e3")
        assert_publication_order(await events(plane.ledger), 2, {"e0", "e1", "e2", "e3"})


async def test_over_loopback_http_staged_and_artifact_transports(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    async with (
        running_server("h0", limits=LIMITS) as (_, url0),
        running_server("h1", limits=LIMITS, artifact_root=root) as (_, url1),
    ):
        staged = LocalHTTPEngine(url0, "h0")
        artifact = SGLangEngine(url1, "h1")
        try:
            assert (staged.transport, artifact.transport) == ("staged", "artifact")
            async with open_plane([staged, artifact], tmp_path) as plane:
                await full_cycle(plane, [staged, artifact])
                # the artifact engine loaded from the store by path
                inventory = await artifact.inventory()
                v2 = plane.ledger.state.versions[2]
                entry = next(a for a in inventory.adapters if a.lora_name == v2.lora_name)
                assert entry.path == str(plane.artifacts.path_for(v2.digest))
                assert entry.digest == v2.digest
        finally:
            await staged.aclose()
            await artifact.aclose()


async def test_full_capacity_is_skipped_without_touching_an_engine(tmp_path: Path) -> None:
    async with local_engines(2) as inner:
        engines = [FaultyEngine(e) for e in inner]  # no faults: it only records every call
        async with open_plane(engines, tmp_path, capacity=2, probe_interval_s=3600) as plane:
            ledger = plane.ledger
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            await ledger.register_owner("w1", ttl_s=60)
            await ledger.bind("pinned", "w1")
            await plane.publisher.publish(adapter_copy(2), version_id=2)
            calls = [e.count() for e in engines]
            seq = ledger.state.last_seq

            v3 = adapter_copy(3)
            skipped = await plane.publisher.publish(v3, version_id=3)
            assert skipped.status == PublicationStatus.SKIPPED
            assert skipped.code == "CAPACITY_ERROR" and skipped.lora_name is None
            assert [e.count() for e in engines] == calls  # not a single engine call
            log = await events(ledger, after=seq)
            assert [type(e) for e in log] == [PublicationSkipped]
            assert 3 not in ledger.state.versions
            assert ledger.state.default == 2

            await ledger.release("pinned", "w1")
            await wait_for(
                "v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED
            )
            published = await plane.publisher.publish(v3, version_id=3)
            assert published.status == PublicationStatus.PUBLISHED
            assert ledger.state.default == 3
            for e in engines:
                assert published.lora_name in await names(e)


async def test_republishing_a_step_is_a_no_op_and_touches_no_engine(tmp_path: Path) -> None:
    async with local_engines(2) as inner:
        engines = [FaultyEngine(e) for e in inner]
        async with open_plane(engines, tmp_path, probe_interval_s=3600) as plane:
            first = await plane.publisher.publish(adapter_copy(1), version_id=1)
            await plane.ledger.register_owner("w1", ttl_s=60)
            await plane.ledger.bind("keeps-v1", "w1")  # no reclaim traffic meanwhile
            await plane.publisher.publish(adapter_copy(2), version_id=2)
            calls = [e.count() for e in engines]
            seq = plane.ledger.state.last_seq
            again = await plane.publisher.publish(adapter_copy(1), version_id=1)
            assert again.status == PublicationStatus.NO_OP
            assert (again.lora_name, again.revision) == (first.lora_name, 1)
            assert [e.count() for e in engines] == calls
            assert plane.ledger.state.last_seq == seq and plane.ledger.state.default == 2


async def test_sessions_survive_a_controller_restart(tmp_path: Path) -> None:
    """The same log reopened by a new control plane: bindings kept, engines re-observed."""
    from evlog.memory import MemoryLog

    log = MemoryLog()
    async with local_engines(2) as engines:
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            await plane.ledger.register_owner("w1", ttl_s=600)
            bound = await plane.ledger.bind("s", "w1")
        async with open_plane(engines, tmp_path, store=MemoryStore(log)) as plane:
            assert (await plane.ledger.bind("s", "w1")).version_id == bound.version_id
            assert plane.ledger.state.routable_engines() == ("e0", "e1")
            assert plane.started is not None and plane.started.joined == ()
            v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
            assert v2.revision == 2
            assert of_type(await events(plane.ledger), SessionBound)[0].session == "s"
