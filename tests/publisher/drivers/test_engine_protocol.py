"""The engine protocol (:mod:`publisher.drivers.engine_protocol`) against a real local engine.

Every engine here is a real :class:`~engines.local.engine.LocalEngine` (restartable, behind a
:class:`~tests.engines.faulty_engine.FaultyEngine` that injects what networks do on the calls we
choose); the engine's own inventory and fences are the witnesses. What the drivers rely on:

* a load counts only when a fresh inventory confirms it, in the incarnation the caller expects;
* ``NOT_LOADED`` is an answer of absence, and an inventory is the proof of absence;
* an ambiguous reply stays ambiguous (the inventory decides), a clean refusal stays clean;
* the attempt a caller passes is the fence the engine applies, never another.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from engines.contract import AmbiguousReply, Candidate, CleanRefusal, ErrorCode, Receipt
from publisher.drivers.adapter_copy import AdapterCopy, aiter_buckets
from publisher.drivers.engine_protocol import (
    READY_UNCONFIRMED,
    LoadNotConfirmed,
    inventory_confirms,
    stage_and_load,
    unload_and_prove_absent,
    unload_fenced,
)
from tests.engines.faulty_engine import (
    Delay,
    Drop,
    FaultyEngine,
    Refuse,
    Restart,
    ServerError,
    Swallow,
)
from tests.publisher.plane_kit import FAST, PEFT_WARNINGS, adapter_copy, faulty_engines, names

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


def candidate(snap: AdapterCopy, *, attempt: int = 1) -> Candidate:
    return Candidate(
        lora_name=f"agent@proto-1-{snap.digest[:16]}",
        digest=snap.digest,
        attempt=attempt,
        manifest=snap.manifest,
    )


def methods(engine: FaultyEngine) -> list[str]:
    return [c.method for c in engine.calls]


async def stage(engine: FaultyEngine, snap: AdapterCopy, c: Candidate) -> None:
    """Prepare and transfer only: the candidate is staged, not loaded."""
    await engine.prepare(c)
    await engine.transfer(c, aiter_buckets(snap.buckets))


async def load(engine: FaultyEngine, snap: AdapterCopy, c: Candidate) -> None:
    await stage_and_load(engine, c, snap.buckets, timeouts=FAST)


@dataclasses.dataclass
class Watch:
    busy: bool = False


# --- stage_and_load ------------------------------------------------------------------------


async def test_a_load_is_confirmed_by_a_fresh_inventory() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(1)
        c = candidate(snap)
        recorded: list[tuple[Receipt, list[str]]] = []

        async def on_prepared(receipt: Receipt) -> None:
            recorded.append((receipt, methods(engine)))

        loaded = await stage_and_load(
            engine, c, snap.buckets, timeouts=FAST, on_prepared=on_prepared
        )
        assert methods(engine) == ["prepare", "transfer", "load", "inventory"]
        # the caller records the prepared receipt before any byte moves
        assert recorded == [(loaded.prepared, ["prepare"])]
        assert (loaded.prepared.phase, loaded.ready.phase) == ("prepared", "ready")
        assert loaded.ready.attempt == c.attempt
        incarnation = await engine.incarnation()
        assert loaded.ready.incarnation == loaded.inventory.incarnation == incarnation
        entry = next(a for a in loaded.inventory.adapters if a.lora_name == c.lora_name)
        assert entry.digest == c.digest
        assert loaded.started <= loaded.prepared_at <= loaded.transferred_at <= loaded.loaded_at


async def test_ready_without_the_adapter_is_not_confirmed_and_is_clean() -> None:
    """The engine answers READY but never applied the load: the inventory catches it."""
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(2)
        c = candidate(snap)
        engine.inject("load", Swallow())
        with pytest.raises(LoadNotConfirmed) as info:
            await load(engine, snap, c)
        assert info.value.clean and info.value.code == READY_UNCONFIRMED
        assert "does not list" in info.value.message
        assert methods(engine)[-1] == "inventory"
        assert c.lora_name not in await names(engine)


async def test_a_load_in_another_incarnation_than_expected_is_not_confirmed() -> None:
    """A restore is for the process life the caller inspected: an engine that restarted before
    the load holds the adapter in a life nobody has checked yet."""
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(3)
        c = candidate(snap)
        inspected = await engine.incarnation()
        engine.inject("prepare", Restart())
        with pytest.raises(LoadNotConfirmed) as info:
            await stage_and_load(engine, c, snap.buckets, timeouts=FAST, incarnation=inspected)
        assert info.value.clean and "restarted" in info.value.message
        assert await engine.incarnation() != inspected


async def test_a_lost_load_reply_is_ambiguous_and_the_inventory_decides() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(4)
        c = candidate(snap)
        watch = Watch()
        engine.inject("load", Drop())
        with pytest.raises(AmbiguousReply) as info:
            await stage_and_load(engine, c, snap.buckets, timeouts=FAST, watch=watch)
        assert not info.value.clean and not watch.busy  # answered (badly), not cut off
        assert "inventory" not in methods(engine)  # no confirmation of an unknown outcome
        incarnation = await engine.incarnation()
        assert await inventory_confirms(engine, c.lora_name, c.digest, incarnation, timeout=5)


async def test_a_clean_refusal_stays_clean_and_stops_the_load() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(5)
        c = candidate(snap)
        engine.inject("prepare", Refuse(code=ErrorCode.INVALID_ADAPTER))
        with pytest.raises(CleanRefusal) as info:
            await load(engine, snap, c)
        assert info.value.code == ErrorCode.INVALID_ADAPTER
        assert methods(engine) == ["prepare"]
        incarnation = await engine.incarnation()
        assert not await inventory_confirms(engine, c.lora_name, c.digest, incarnation, timeout=5)


async def test_a_cancelled_load_leaves_the_watch_busy() -> None:
    """Cut off inside an engine call, the caller cannot know what the engine did."""
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(6)
        watch = Watch()
        engine.inject("transfer", Delay(seconds=30))
        with anyio.move_on_after(0.5):
            await stage_and_load(engine, candidate(snap), snap.buckets, timeouts=FAST, watch=watch)
        assert watch.busy


# --- unload --------------------------------------------------------------------------------


async def test_the_attempt_passed_is_the_fence_the_engine_applies() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(7)
        first, second = candidate(snap, attempt=1), candidate(snap, attempt=2)
        await stage(engine, snap, first)
        answer = await unload_fenced(engine, first.lora_name, attempt=1, timeout=5)
        assert answer.absent and answer.receipt is not None and answer.error is None
        # attempt 1 is over on this engine: a late duplicate of its prepare is refused
        with pytest.raises(CleanRefusal) as late:
            await engine.prepare(first)
        assert late.value.code == ErrorCode.STALE_ATTEMPT

        await load(engine, snap, second)
        stale = await unload_fenced(engine, first.lora_name, attempt=1, timeout=5)
        # a cleanup of attempt 1 never touches attempt 2: refused cleanly, nothing proven
        assert not stale.absent and stale.receipt is None
        assert stale.error is not None and stale.error.clean
        assert stale.error.code == ErrorCode.STALE_ATTEMPT
        assert second.lora_name in await names(engine)


async def test_an_unfenced_unload_fences_nothing() -> None:
    """``attempt=None`` is for names the ledger never allocated: the engine then keeps no
    fence, so the same attempt can be staged again."""
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(8)
        c = candidate(snap)
        await stage(engine, snap, c)
        answer = await unload_fenced(engine, c.lora_name, attempt=None, timeout=5)
        assert answer.absent
        await load(engine, snap, c)
        assert c.lora_name in await names(engine)


async def test_not_loaded_is_absent_and_the_inventory_proves_it() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(9)
        c = candidate(snap)
        engine.inject("unload", Refuse(code=ErrorCode.NOT_LOADED))
        absence = await unload_and_prove_absent(
            engine, c.lora_name, attempt=1, unload_timeout=5, inventory_timeout=5
        )
        assert absence.unload.absent and absence.unload.receipt is None
        assert absence.unload.error is None
        assert absence.proven and absence.inventory is not None
        assert c.lora_name not in absence.inventory.names()
        assert methods(engine) == ["unload", "inventory"]


async def test_without_an_inventory_not_loaded_stands_in_for_the_proof() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(10)
        engine.inject("unload", Refuse(code=ErrorCode.NOT_LOADED))
        engine.inject("inventory", ServerError())
        absence = await unload_and_prove_absent(
            engine, candidate(snap).lora_name, attempt=1, unload_timeout=5, inventory_timeout=5
        )
        assert absence.proven and absence.inventory is None


@pytest.mark.parametrize(("fault", "executed"), [(Drop(), True), (ServerError(), False)])
async def test_an_ambiguous_unload_stays_ambiguous_and_the_inventory_decides(
    fault: Drop | ServerError, executed: bool
) -> None:
    """A lost reply (the engine did unload) or a 5xx before sending (it never saw the call):
    the answer is ambiguous either way, and only the inventory tells the two apart."""
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(11)
        c = candidate(snap)
        await load(engine, snap, c)
        engine.inject("unload", fault)
        absence = await unload_and_prove_absent(
            engine, c.lora_name, attempt=1, unload_timeout=5, inventory_timeout=5
        )
        assert not absence.unload.absent and isinstance(absence.unload.error, AmbiguousReply)
        assert absence.inventory is not None
        assert absence.proven is executed
        assert (c.lora_name in absence.inventory.names()) is not executed


async def test_an_ambiguous_unload_without_an_inventory_proves_nothing() -> None:
    async with faulty_engines(1) as [engine]:
        snap = adapter_copy(12)
        c = candidate(snap)
        await load(engine, snap, c)
        engine.inject("unload", Drop())
        engine.inject("inventory", ServerError())
        unknown = await unload_and_prove_absent(
            engine, c.lora_name, attempt=1, unload_timeout=5, inventory_timeout=5
        )
        assert not unknown.proven and unknown.inventory is None
