"""The reclaim driver's loop and its edges, on real local engines and a real ledger: a closed or
fenced ledger stops the driver; an unload that hangs becomes an ambiguous reclaim when its
timeout runs out; a refusal to record an unload pokes the reconciler only when the engine
restarted; artifact directories go a grace period after *their own* reclaim, and only with a
store and a grace period configured.

Written from the reclaim mutation campaign's open survivors (``python -m tests.mutation.campaign
reclaim``, RELIABILITY.md "Mutation testing").
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from engines.local.engine import LocalEngine
from evlog.errors import LoraLedgerError
from publisher.errors import Code
from publisher.ledger import Ledger
from publisher.reclaim import ReclaimDriver
from tests.publisher.plane_kit import wait_for
from tests.publisher.rollout_kit import ENGINE_WARNINGS, Rig, rig
from tests.publisher.test_reclaim_answers import Pokes, Unloads, e1_is

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class Gated(Unloads):
    """Unloads for real once the test opens its gate: the unload is in flight meanwhile."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner)
        self.started = anyio.Event()
        self.gate = anyio.Event()

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        self.started.set()
        await self.gate.wait()
        return await self.inner.unload(lora_name, attempt=attempt)


class Hangs(Unloads):
    """An engine whose unload never answers (a leaked reference under SGLang's draining
    unload, docs/engines.md): only the caller's timeout ends the call."""

    async def answer(self, lora_name: str, attempt: int | None) -> Any:
        await anyio.sleep_forever()


def _gated(r: Rig, engine: str) -> Gated:
    wrapped = r.fleet[engine]
    assert isinstance(wrapped, Gated)
    return wrapped


async def _events(r: Rig, kind: type[Any]) -> list[Any]:
    return [rec.event async for rec in r.store.iterate() if isinstance(rec.event, kind)]


async def _stopped_with(driver: ReclaimDriver) -> LoraLedgerError:
    """Run the driver until it stops (it must, within seconds) and return why."""
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        await driver.run()
    stops = info.value.subgroup(lambda e: isinstance(e, LoraLedgerError))
    assert stops is not None, info.value
    leaves = list(_leaves(stops))
    assert len(leaves) == 1, leaves
    assert isinstance(leaves[0], LoraLedgerError)
    return leaves[0]


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


async def _retired(r: Rig) -> str:
    """v1 published, then retired by v2: reclaimable (nothing bound, nothing in flight)."""
    await r.publish(1)
    await r.publish(2)
    return r.names[1]


# --- the loop stops with its ledger -----------------------------------------------------------


async def test_a_fenced_controller_stops_its_driver_before_unloading_anything() -> None:
    async with rig(wrap=e1_is(Unloads)) as r:
        await _retired(r)
        async with Ledger.open(r.store):  # a second controller takes the log over
            driver = ReclaimDriver(r.ledger, r.fleet, sources=[r.gateway], tick_s=0.05)
            stop = await _stopped_with(driver)
        assert stop.code == Code.FENCED
        assert [e.unloads for e in r.fleet if isinstance(e, Unloads)] == [[], []]


async def test_a_ledger_closed_under_a_running_driver_stops_it() -> None:
    """The ledger closes while an unload is in flight: recording it is refused with
    LEDGER_CLOSED, which ends the driver instead of a retry every tick."""
    async with rig(wrap=lambda engine: Gated(engine)) as r:
        await _retired(r)
        pokes = Pokes()
        async with anyio.create_task_group() as tg:
            async with Ledger.open(r.store) as ledger:  # this controller's own ledger
                driver = ReclaimDriver(ledger, r.fleet, tick_s=0.05, on_restart=pokes.on_restart)
                stopped: list[LoraLedgerError] = []

                async def run() -> None:
                    stopped.append(await _stopped_with(driver))

                tg.start_soon(run)
                _gated(r, "e0").gate.set()
                await _gated(r, "e1").started.wait()
                await wait_for(lambda: "e0" in ledger.state.versions[1].confirmed)
            _gated(r, "e1").gate.set()  # answers after the ledger closed
        assert [s.code for s in stopped] == [Code.LEDGER_CLOSED]
        assert pokes.restart == 0
        assert _gated(r, "e1").unloads == [(r.names[1], 1)]  # sent once, not again every tick
