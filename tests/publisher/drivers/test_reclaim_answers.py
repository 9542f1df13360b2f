"""How the reclaim driver reads each answer of an engine's unload, on real local engines and a
real ledger: a failed or refused unload marks the reclaim ambiguous (the slot stays taken,
publication is blocked, the reconciler is poked) and is not retried blindly; ``NOT_LOADED`` is a
confirmation at the incarnation the ledger knows; a receipt from an incarnation the ledger does
not know yet pokes the reconciler instead of being recorded.

Written from the reclaim mutation campaign's survivors (``python -m tests.mutation.campaign
reclaim``): no test of the campaign reached ``ReclaimDriver._ambiguous`` at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engines.contract import (
    AmbiguousReply,
    CleanRefusal,
    ErrorCode,
    UnloadReceipt,
)
from engines.local.engine import LocalEngine
from evlog.events import EngineUnloaded, InFlight, ReclaimAmbiguous
from projections.registry import VersionState
from publisher.drivers.reclaim import ReclaimDriver
from tests.publisher.rollout_kit import ENGINE_WARNINGS, Recording, Rig, rig
from tests.support.log import events_of

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class Unloads(Recording):
    """Counts the unloads it receives (and runs them for real)."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner)
        self.unloads: list[tuple[str, int | None]] = []

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> Any:
        self.unloads.append((lora_name, attempt))
        return await self.answer(lora_name, attempt)

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        return await self.inner.unload(lora_name, attempt=attempt)


class TimesOut(Unloads):
    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        raise AmbiguousReply(ErrorCode.TIMEOUT, "no reply in 5 s", engine_id=self.engine_id)


class Refuses(Unloads):
    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        raise CleanRefusal(ErrorCode.BAD_REQUEST, "adapter busy", engine_id=self.engine_id)


class SaysNotLoaded(Unloads):
    """Unloads for real, then answers as an engine that had already dropped the name."""

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        await self.inner.unload(lora_name, attempt=attempt)
        raise CleanRefusal(ErrorCode.NOT_LOADED, f"{lora_name} is not loaded")


class Restarted(Unloads):
    """Answers with a receipt from a new process life the ledger has not observed yet."""

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        await self.inner.unload(lora_name, attempt=attempt)
        return UnloadReceipt(
            engine_id=self.engine_id, incarnation="e1-reborn", lora_name=lora_name, was_loaded=True
        )


def e1_is(kind: type[Unloads]) -> Callable[[LocalEngine], Any]:
    return lambda engine: (kind if engine.engine_id == "e1" else Unloads)(engine)


class Pokes:
    def __init__(self) -> None:
        self.ambiguous = 0
        self.restart = 0

    def driver(self, r: Rig) -> ReclaimDriver:
        return ReclaimDriver(
            r.ledger,
            r.fleet,
            sources=[r.gateway],
            on_ambiguous=self.on_ambiguous,
            on_restart=self.on_restart,
        )

    def on_ambiguous(self) -> None:
        self.ambiguous += 1

    def on_restart(self) -> None:
        self.restart += 1


async def _retired(r: Rig) -> str:
    await r.publish(1)
    await r.publish(2)
    return r.names[1]


def _unloads(r: Rig, engine: str) -> list[tuple[str, int | None]]:
    wrapped = r.fleet[engine]
    assert isinstance(wrapped, Unloads)
    return wrapped.unloads


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        (TimesOut, "TIMEOUT: no reply in 5 s"),
        (Refuses, "clean refusal BAD_REQUEST: BAD_REQUEST: adapter busy"),
    ],
)
async def test_an_unload_without_proof_marks_the_reclaim_ambiguous_once(
    kind: type[Unloads], reason: str
) -> None:
    async with rig(wrap=e1_is(kind)) as r:
        name = await _retired(r)
        pokes = Pokes()
        driver = pokes.driver(r)
        await driver.sweep()
        v1 = r.ledger.state.versions[1]
        assert (v1.state, v1.ambiguous, list(v1.confirmed)) == (
            VersionState.RECLAIMING,
            True,
            ["e0"],
        )
        assert r.ledger.state.blocked_by() == [1]
        marked = [
            (e.version_id, e.engine, e.reason) for e in await events_of(r.store, ReclaimAmbiguous)
        ]
        assert marked == [(1, "e1", reason)]
        assert pokes.ambiguous == 1 and pokes.restart == 0
        assert _unloads(r, "e1") == [(name, v1.attempt)]
        await driver.sweep()  # an ambiguous reclaim waits for inventory evidence, not a retry
        assert _unloads(r, "e1") == [(name, v1.attempt)]
        assert _unloads(r, "e0") == [(name, v1.attempt)]
        assert driver.sweeps == 2


async def test_not_loaded_confirms_at_the_incarnation_the_ledger_knows() -> None:
    async with rig(wrap=e1_is(SaysNotLoaded)) as r:
        await _retired(r)
        incarnation = r.ledger.state.engines["e1"].incarnation
        assert await Pokes().driver(r).sweep() == [1]
        unloaded = {e.engine: e.incarnation for e in await events_of(r.store, EngineUnloaded)}
        assert unloaded["e1"] == incarnation
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED


async def test_a_receipt_from_an_unknown_incarnation_pokes_the_reconciler() -> None:
    async with rig(wrap=e1_is(Restarted)) as r:
        await _retired(r)
        pokes = Pokes()
        assert await pokes.driver(r).sweep() == []
        v1 = r.ledger.state.versions[1]
        assert (v1.state, v1.ambiguous, list(v1.confirmed)) == (
            VersionState.RECLAIMING,
            False,
            ["e0"],
        )
        assert (pokes.restart, pokes.ambiguous) == (1, 0)


async def test_a_wildcard_in_flight_report_holds_every_engine() -> None:
    """A reporter that knows of a request but not where it runs (``engine="*"``) holds them all."""

    class Wildcard:
        def inflight_evidence(self, version_id: int) -> list[InFlight]:
            return [InFlight(reporter="w", engine="*", count=1, at=0.0)]

    async with rig(wrap=e1_is(Unloads)) as r:
        await _retired(r)
        driver = ReclaimDriver(r.ledger, r.fleet, sources=[Wildcard()])
        assert (driver.inflight("e0", 1), driver.inflight("e1", 1)) == (1, 1)
        assert await driver.sweep() == []
        assert r.ledger.state.versions[1].state is VersionState.RETIRED


async def test_a_wake_before_the_loop_runs_is_harmless_and_sweeps_count_one_each() -> None:
    """The ledger's subscribers and the plane may wake the driver before its loop started."""
    async with rig() as r:
        await _retired(r)
        driver = ReclaimDriver(r.ledger, r.fleet, sources=[r.gateway])
        driver.wake()
        assert driver.sweeps == 0
        assert await driver.sweep() == [1]
        assert driver.sweeps == 1
