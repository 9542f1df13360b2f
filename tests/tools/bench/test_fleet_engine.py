"""The fleet bench's stub engine answers the staged protocol as the local engine does: a
publication through the real control plane commits on it, and its refusals, unloads and
inventories are the engine's own (its name table is the local engine's)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from engines.contract import Bucket, BucketTensor, Candidate, CleanRefusal, ErrorCode
from engines.local.tinymodel import make_adapter
from publisher.drivers.adapter_copy import AdapterCopy, aiter_buckets
from tools.bench.fleet import _plane_with_one_version, publication_at
from tools.bench.fleet_engine import FleetStubEngine

pytestmark = pytest.mark.anyio


def _candidate(adapter: AdapterCopy, name: str, attempt: int) -> Candidate:
    return Candidate(
        lora_name=name, digest=adapter.digest, attempt=attempt, manifest=adapter.manifest
    )


async def test_a_publication_to_stub_engines_commits_and_each_holds_it(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        plane = await _plane_with_one_version(stack, tmp_path, 3, capacity=4, double="stub")
        config, tensors = make_adapter(7)
        outcome = await plane.publisher.publish(
            AdapterCopy.from_state_dict(tensors, config), version_id=2
        )
        assert outcome.status == "PUBLISHED"
        state = plane.ledger.state
        assert state.default == 2
        assert sorted(state.versions[2].ready) == ["e000", "e001", "e002"]
        for engine_id in ("e000", "e001", "e002"):
            engine = plane.fleet[engine_id]
            assert isinstance(engine, FleetStubEngine)
            inventory = await engine.inventory()
            held = {a.lora_name: a.digest for a in inventory.adapters}
            assert held[outcome.lora_name] == outcome.digest
            assert inventory.incarnation == state.engines[engine_id].incarnation


async def test_stub_engine_refuses_and_unloads_as_the_local_engine_does() -> None:
    config, tensors = make_adapter(3)
    adapter = AdapterCopy.from_state_dict(tensors, config)
    other_config, other_tensors = make_adapter(4)
    other = AdapterCopy.from_state_dict(other_tensors, other_config)
    async with FleetStubEngine("e0") as engine:
        name = "bench@fleet-1-abc"
        first = _candidate(adapter, name, 1)
        prepared = await engine.prepare(first)
        assert (prepared.phase, prepared.digest, prepared.attempt) == (
            "prepared",
            adapter.digest,
            1,
        )
        assert (await engine.inventory()).staged == (name,)

        # a load before every tensor arrived is refused, and leaves nothing staged
        with pytest.raises(CleanRefusal) as missing:
            await engine.load(first)
        assert missing.value.code == ErrorCode.INVALID_ADAPTER
        assert (await engine.inventory()).staged == ()

        await engine.prepare(_candidate(adapter, name, 2))
        second = _candidate(adapter, name, 2)
        await engine.transfer(second, aiter_buckets(adapter.buckets))
        ready = await engine.load(second)
        assert (ready.phase, ready.digest, ready.incarnation) == (
            "ready",
            adapter.digest,
            await engine.incarnation(),
        )
        inventory = await engine.inventory()
        assert [(a.lora_name, a.digest) for a in inventory.adapters] == [(name, adapter.digest)]

        # the name is loaded: other content under it, or an older attempt, is refused
        with pytest.raises(CleanRefusal) as taken:
            await engine.prepare(_candidate(other, name, 3))
        assert taken.value.code == ErrorCode.ALREADY_LOADED
        with pytest.raises(CleanRefusal) as stale:
            await engine.unload(name, attempt=1)
        assert stale.value.code == ErrorCode.STALE_ATTEMPT

        # a tensor the manifest does not name is refused on arrival
        foreign_candidate = _candidate(other, "bench@fleet-2-def", 1)
        await engine.prepare(foreign_candidate)
        stray = Bucket(0, (BucketTensor("not.in.manifest", adapter.buckets[0].tensors[0].tensor),))
        with pytest.raises(CleanRefusal) as foreign:
            await engine.transfer(foreign_candidate, aiter_buckets([stray]))
        assert foreign.value.code == ErrorCode.INVALID_ADAPTER

        unloaded = await engine.unload(name, attempt=2)
        assert unloaded.was_loaded
        assert (await engine.inventory()).adapters == ()
        again = await engine.unload(name, attempt=2)
        assert not again.was_loaded
        # a reclaimed name is never loaded again by the attempt that held it
        with pytest.raises(CleanRefusal) as reclaimed:
            await engine.prepare(second)
        assert reclaimed.value.code == ErrorCode.NAME_RECLAIMED


async def test_bench_publication_row_runs_on_stub_engines(tmp_path: Path) -> None:
    row = await publication_at(4, repeats=1, workdir=str(tmp_path), double="stub", load_ms=1.0)
    assert row["engines"] == 4 and row["commit_ms"] > 0
    # a prepared and a ready record per engine, plus the publication's own
    assert row["events"] >= 2 * 4
