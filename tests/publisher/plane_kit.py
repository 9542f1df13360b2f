"""Shared wiring for the publication/reclaim/reconcile tests: real local engines (optionally
restartable and wrapped in :class:`~tests.engines.faulty_engine.FaultyEngine`), a control plane
over a ``MemoryStore`` and small adapters (the log is read with :mod:`tests.support.log`).

Nothing here stands in for an engine: every engine is a real :class:`LocalEngine`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engines.contract import Inventory, SamplingParams, Transport
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.testing import RestartableEngine
from evlog.memory import MemoryStore
from evlog.store import EventStore
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from tests.engines.faulty_engine import FaultyEngine

LIMITS = ServingLimits(max_lora_rank=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "the quick brown fox"
FAST = EngineTimeouts(probe=2, inventory=5, prepare=10, transfer=20, load=20, unload=20)

# peft warns on every adapter deletion in the engine (its message, not ours)
PEFT_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Adapter .* was active which is now deleted:UserWarning",
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",
)


def adapter_copy(seed: int, *, r: int = 8, bucket_bytes: int = 16 * 1024) -> AdapterCopy:
    """A small adapter for the tiny model (several buckets at the default ``bucket_bytes``)."""
    config, tensors = make_adapter(seed, r=r)
    return AdapterCopy.from_state_dict(tensors, config, bucket_bytes=bucket_bytes)


@contextlib.asynccontextmanager
async def local_engines(
    n: int, *, artifact_root: Path | None = None, transport: Transport = "staged"
) -> AsyncIterator[list[LocalEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                LocalEngine(
                    f"e{i}", limits=LIMITS, artifact_root=artifact_root, transport=transport
                )
            )
            for i in range(n)
        ]
        yield engines


@contextlib.asynccontextmanager
async def faulty_engines(
    n: int, *, artifact_root: Path | None = None, seed: int | None = None
) -> AsyncIterator[list[FaultyEngine]]:
    """``n`` restartable local engines, each behind a FaultyEngine with the restart hook."""
    async with contextlib.AsyncExitStack() as stack:
        out: list[FaultyEngine] = []
        for i in range(n):

            def factory(i: int = i) -> LocalEngine:
                return LocalEngine(f"e{i}", limits=LIMITS, artifact_root=artifact_root)

            host = await stack.enter_async_context(RestartableEngine(factory))
            faulty = FaultyEngine(host, restart=host.restart, seed=seed)
            out.append(await stack.enter_async_context(faulty))
        yield out


@contextlib.asynccontextmanager
async def open_plane(
    engines: Sequence[Any],
    tmp_path: Path,
    *,
    store: EventStore | None = None,
    capacity: int = 2,
    **options: Any,
) -> AsyncIterator[ControlPlane]:
    options.setdefault("probe_interval_s", 0.05)
    options.setdefault("reclaim_tick_s", 0.05)
    options.setdefault("timeouts", FAST)
    options.setdefault("cleanup_timeout", 5.0)
    async with ControlPlane.open(
        store if store is not None else MemoryStore(),
        Fleet(engines),
        deployment="dep",
        prefix="agent",
        capacity=capacity,
        artifact_root=tmp_path / "artifacts",
        **options,
    ) as plane:
        yield plane


async def names(engine: Any) -> frozenset[str]:
    inventory: Inventory = await engine.inventory()
    return inventory.names()
