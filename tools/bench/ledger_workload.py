"""The workload of the ledger benches: a deployment with one published version and one owner,
then sessions bound and released from concurrent tasks.

Its own module so that ``bench ledger`` (:mod:`tools.bench.ledger`) and its per-command profile
(:mod:`tools.bench.ledger_profile`) drive the very same commands without importing each other.
"""

from __future__ import annotations

import hashlib
import time

import anyio

from evlog.store import EventStore
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Allocated


async def bootstrap(ledger: Ledger) -> None:
    await ledger.create_deployment("bench", prefix="agent", capacity=2)
    for engine in ("e0", "e1"):
        await ledger.join_engine(engine, f"{engine}-1")
        await ledger.repair_engine(engine, f"{engine}-1")
    digest = hashlib.sha256(b"bench").hexdigest()
    allocated = await ledger.allocate(1, digest)
    assert isinstance(allocated, Allocated), allocated  # a fresh version is never skipped
    await ledger.claim_transport(1, allocated.attempt, "bench")
    for engine in allocated.fleet:
        await ledger.record_prepared(1, 1, engine, f"{engine}-1", digest, allocated.lora_name)
        await ledger.record_ready(1, 1, engine, f"{engine}-1", digest, allocated.lora_name)
    await ledger.commit(1, 1)
    await ledger.register_owner("worker", ttl_s=3600)


async def drive(
    store: EventStore, concurrency: int, sessions: int
) -> tuple[int, int, float, int, float]:
    """Bind and release ``sessions`` sessions from ``concurrency`` tasks through a ledger on
    ``store``: (sessions done, first seq written, seconds, events written, mean events per
    commit)."""
    async with Ledger.open(store, snapshot_on_close=False) as ledger:
        await bootstrap(ledger)
        first_seq = store.last_seq
        batches, events = ledger.batches, ledger.events_written
        per_task = sessions // concurrency

        async def worker(k: int) -> None:
            for i in range(per_task):
                name = f"s{k}-{i}"
                await ledger.bind(name, "worker")
                await ledger.release(name, "worker")

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(concurrency):
                tg.start_soon(worker, k)
        seconds = time.perf_counter() - start
        written = ledger.events_written - events
        mean_batch = written / max(ledger.batches - batches, 1)
    return per_task * concurrency, first_seq, seconds, written, mean_batch
