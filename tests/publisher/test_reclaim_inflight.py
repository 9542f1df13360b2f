"""Reclaim never unloads a version with a request in flight on that engine.

The real reclaim driver (``publisher.reclaim.ReclaimDriver``, swept by the test) with the
gateway as its in-flight source. A long generation on v1 runs (frozen between tokens on the
real local engine) while v1 is retired (v2 committed) and released (its worker's lease
expires: a dead worker). The binding no longer pins v1, so only the gateway's in-flight
evidence stands between v1 and its unload: no claim while the request runs, and the
engine-side unload returns only after the generation finished -- with all its tokens, from v1.
"""

from __future__ import annotations

import time

import anyio
import pytest

from engines.contract import SamplingParams
from evlog.errors import Code, LedgerError
from evlog.events import ReclaimClaimed
from projections.registry import VersionState
from publisher.gateway import Served
from publisher.sessions import RolloutWorker
from tests.publisher.rollout_kit import ENGINE_WARNINGS, PROMPT, Recording, Rig, rig

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 -- polling counters that have no event
            await anyio.sleep(0.002)


async def test_the_unload_waits_for_the_generation_in_flight() -> None:
    async with rig(timeout=30, wrap=Recording) as r:
        driver = r.reclaimer()
        await r.publish(1)
        v1 = r.names[1]
        served: list[tuple[Served, float]] = []
        for engine in r.local.values():
            engine.pause_generation()
        async with (
            anyio.create_task_group() as tg,
            RolloutWorker.open(r.ledger, r.gateway, owner="w1", ttl_s=10.0) as w,
        ):
            s = w.session("long")

            async def run() -> None:
                result = await s.generate(PROMPT, LONG)
                served.append((result, time.monotonic()))

            tg.start_soon(run)
            await wait_for(lambda: sum(r.gateway.inflight_counts().values()) == 1)
            ((busy, _),) = r.gateway.inflight_counts()
            # v2 commits: v1 is RETIRED. The worker dies (its lease expires): released.
            await r.publish(2)
            r.clock.advance(60.0)
            assert [x.owner for x in await r.ledger.expire_leases()] == ["w1"]
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert r.ledger.state.versions[1].bound == 0  # nothing pins v1 any more

            # Only the in-flight evidence blocks the reclaim, as long as the request runs.
            # (bounded: a wrongly granted claim would wait forever on the engine's drain)
            for _ in range(3):
                with anyio.fail_after(5):
                    assert await driver.sweep() == []
                await anyio.sleep(0.02)
            assert r.ledger.state.versions[1].state is VersionState.RETIRED
            assert await claims(r) == []
            busy_reports = [x for x in driver.evidence(1) if x.count]
            assert [(x.reporter, x.engine, x.count) for x in busy_reports] == [("gw", busy, 1)]
            with pytest.raises(LedgerError) as info:  # and the decider would refuse it too
                await r.ledger.claim_reclaim(1, driver.evidence(1))
            assert info.value.code == Code.REQUESTS_IN_FLIGHT
            assert r.local[busy].refcount(v1) == 1
            assert all(v1 in e.loaded_adapters() for e in r.local.values())

            for engine in r.local.values():
                engine.continue_generation()
            await wait_for(lambda: bool(served))

        (result, finished_at) = served[0]
        assert result.version_id == 1 and result.lora_name == v1
        assert result.generation.lora_name == v1
        assert len(result.generation.token_ids) == 40  # it ran to the end, not aborted
        assert r.gateway.inflight_counts() == {}

        assert await driver.sweep() == [1]
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED
        for member in r.fleet:  # Recording wrappers, typed as the fleet's Engine
            # the engine-side unload returned after the generation had finished
            assert finished_at < member.unloaded_at[v1]  # type: ignore[attr-defined]
            assert v1 not in member.loaded_adapters()  # type: ignore[attr-defined]
        (claim,) = await claims(r)
        assert {x.engine: x.count for x in claim.evidence if x.reporter == "gw"} == {
            "e0": 0,
            "e1": 0,
        }


async def claims(r: Rig) -> list[ReclaimClaimed]:
    return [rec.event async for rec in r.store.iterate() if isinstance(rec.event, ReclaimClaimed)]
