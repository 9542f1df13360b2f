"""Benchmark of the ledger service: durable bind+release sessions/s, and recovery time.

1. Sessions/s: ``concurrency`` tasks each run sessions one after another (bind, then release)
   against a ledger on a fresh SQLite file (invariants checked after every batch, as in
   production). Reference, measured in the same run on the same disk: raw ``sqlite3``
   ``executemany`` of the very rows the ledger wrote (read back from its file), in batches of
   the size its group commit reached. The ratio is the figure to compare (BENCHMARKS.md: >= 40%
   at 256 concurrent sessions with FULL, and >= 20,000 sessions/s).
2. Recovery: a log of ``replay_events`` session events (bind, release, and a forget per
   1,000 sessions as a worker's cleanup does), replayed in full and from a snapshot at its
   tail; the store is opened without ``quick_check`` for the snapshot case (that full-file
   scan costs ~0.4 s per million events; the tail record is still verified).

Run ``python -m tools.bench_ledger`` or ``loraledger bench ledger``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio

from evlog.events import Event, SessionBound, SessionReleased, SessionsForgotten
from evlog.record import pending
from evlog.sqlite import SQLiteStore, Synchronous
from projections.recovery import recover, save_snapshot
from publisher.ledger import Ledger
from publisher.outcomes import Allocated
from tools.bench_store import reference_append

DEFAULT_SESSIONS = {1: 400, 16: 4_000, 256: 40_000}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


async def _bootstrap(ledger: Ledger) -> None:
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


async def _sessions(
    path: str, concurrency: int, sessions: int, sync: Synchronous
) -> dict[str, Any]:
    async with (
        SQLiteStore.open(path, synchronous=sync) as store,
        Ledger.open(store, snapshot_on_close=False) as ledger,
    ):
        await _bootstrap(ledger)
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
        done = per_task * concurrency
        written = ledger.events_written - events
        mean_batch = written / max(ledger.batches - batches, 1)
    rows = _rows_after(path, first_seq)
    assert len(rows) == written, (len(rows), written)
    ref_path = path + ".ref"
    ref_seconds = reference_append(ref_path, rows, max(1, round(mean_batch)), sync)
    ledger_rate = done / seconds
    reference_rate = (len(rows) / ref_seconds) / 2  # two events per session
    return {
        "synchronous": sync,
        "concurrency": concurrency,
        "sessions": done,
        "sessions_per_s": round(ledger_rate),
        "mean_events_per_commit": round(mean_batch, 1),
        "reference_sessions_per_s": round(reference_rate),
        "ratio": round(ledger_rate / reference_rate, 3),
    }


def _rows_after(path: str, seq: int) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(
            "SELECT seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash "
            "FROM events WHERE seq > ? ORDER BY seq",
            (seq,),
        ).fetchall()
    finally:
        conn.close()


async def _recovery(path: str, events: int) -> dict[str, Any]:
    """Build a log of session traffic, then time a full replay and a snapshot recovery."""
    async with SQLiteStore.open(path, synchronous="NORMAL") as store:
        async with Ledger.open(store, snapshot_on_close=False) as ledger:
            await _bootstrap(ledger)
        batch: list[Event] = []
        session = 0
        while store.last_seq + len(batch) < events:
            names = [f"r{session + i}" for i in range(1000)]
            session += 1000
            batch += [SessionBound(session=n, owner="worker", version_id=1, revision=1)
                      for n in names]  # fmt: skip
            batch += [SessionReleased(session=n, owner="worker", version_id=1) for n in names]
            batch.append(SessionsForgotten(sessions=tuple(names)))
            if len(batch) >= 20_000:
                await store.append([pending(e) for e in batch])
                batch = []
        if batch:
            await store.append([pending(e) for e in batch])
        total = store.last_seq
    async with SQLiteStore.open(path, quick_check=False) as store:
        start = time.perf_counter()
        state = await recover(store, use_snapshot=False)
        full = time.perf_counter() - start
        await save_snapshot(store, state)
    start = time.perf_counter()
    async with SQLiteStore.open(path, quick_check=False) as store:
        snap_state = await recover(store, use_snapshot=True)
    from_snapshot = time.perf_counter() - start
    assert snap_state.last_seq == state.last_seq == total
    return {
        "events": total,
        "full_replay_s": round(full, 3),
        "events_per_s": round(total / full),
        "snapshot_recovery_s": round(from_snapshot, 4),
    }


async def bench_ledger(
    *,
    concurrencies: Sequence[int] = (1, 16, 256),
    modes: Sequence[Synchronous] = ("FULL", "NORMAL"),
    sessions: dict[int, int] | None = None,
    replay_events: int = 1_000_000,
    directory: str | None = None,
) -> dict[str, Any]:
    counts = {**DEFAULT_SESSIONS, **(sessions or {})}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        runs = []
        for sync in modes:
            for n in concurrencies:
                path = os.path.join(tmp, f"ledger-{sync}-{n}.db")
                runs.append(await _sessions(path, n, counts.get(n, 1000 * n), sync))
        replay = (
            await _recovery(os.path.join(tmp, "replay.db"), replay_events)
            if replay_events
            else None
        )
    return {"machine": machine(), "sessions": runs, "recovery": replay}


def _print(result: dict[str, Any]) -> None:
    print(f"machine: {result['machine']}")
    print("durable bind+release (sessions/s), ledger vs raw sqlite3 executemany of the same rows")
    for r in result["sessions"]:
        print(
            f"  {r['synchronous']:6} x{r['concurrency']:<4} {r['sessions_per_s']:>8} /s  "
            f"reference {r['reference_sessions_per_s']:>8} /s  ratio {r['ratio']:.2f}  "
            f"({r['mean_events_per_commit']} events/commit, {r['sessions']} sessions)"
        )
    rec = result["recovery"]
    if rec:
        print(
            f"recovery of {rec['events']} events: full replay {rec['full_replay_s']} s "
            f"({rec['events_per_s']}/s), from a snapshot {rec['snapshot_recovery_s']} s"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 256])
    parser.add_argument("--modes", nargs="*", default=["FULL", "NORMAL"])
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = anyio.run(
        lambda: bench_ledger(
            concurrencies=args.concurrency, modes=args.modes, replay_events=args.replay_events
        )
    )
    print(json.dumps(result, indent=2)) if args.json else _print(result)


if __name__ == "__main__":
    main()
