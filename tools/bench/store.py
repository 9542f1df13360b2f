"""Benchmark of the SQLite event store: group-committed appends and a full verified replay.

Every figure is printed next to a reference measured in the same run on the same disk: raw
``sqlite3`` ``executemany`` of the very same rows (already sealed, so the reference does no
hashing), one transaction per batch of ``appenders x per_append`` rows, i.e. the group size a
perfect group commit would reach. fsync latency on a shared VM varies several-fold between
runs, so only the ratio is comparable across machines and runs.

Run ``python -m tools.bench.store`` (``--help`` for options); ``loraledger bench`` may call
:func:`bench_store`.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio

from evlog.events import Event, SessionBound, SessionReleased
from evlog.record import GENESIS_HASH, Pending, Row, pending, seal_row
from evlog.sqlite import SQLiteStore, Synchronous

DEFAULT_EVENTS = {1: 3_000, 16: 30_000, 256: 150_000}


def _pendings(n: int, tag: str) -> list[Pending]:
    """Realistic session traffic: bind then release, ~75-byte payloads."""
    out: list[Pending] = []
    for i in range(n):
        session = f"{tag}-{i // 2:08d}"
        if i % 2 == 0:
            event: Event = SessionBound(
                session=session, owner="worker-3", version_id=17, revision=4
            )
        else:
            event = SessionReleased(session=session, owner="worker-3", version_id=17)
        out.append(pending(event))
    return out


def _sealed(items: Sequence[Pending]) -> list[Row]:
    rows: list[Row] = []
    prev = GENESIS_HASH
    for seq, p in enumerate(items, start=1):
        row = seal_row(p, seq, prev)
        prev = row[8]
        rows.append(row)
    return rows


def reference_append(path: str, rows: list[Row], batch: int, synchronous: str) -> float:
    """Raw sqlite3: same table, same rows, one ``executemany`` + COMMIT per ``batch``."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY, event_id BLOB NOT NULL UNIQUE, "
            "stream TEXT NOT NULL, type TEXT NOT NULL, schema INTEGER NOT NULL, "
            "recorded_at REAL NOT NULL, payload BLOB NOT NULL, prev_hash BLOB NOT NULL, "
            "hash BLOB NOT NULL) STRICT"
        )
        insert = "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        start = time.perf_counter()
        for i in range(0, len(rows), batch):
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(insert, rows[i : i + batch])
            conn.execute("COMMIT")
        return time.perf_counter() - start
    finally:
        conn.close()


async def _store_append(
    path: str, items: list[Pending], appenders: int, per_append: int, synchronous: Synchronous
) -> tuple[float, float]:
    """``appenders`` tasks, each appending its share in calls of ``per_append`` events.
    Returns (seconds, mean events per transaction)."""
    calls = [items[i : i + per_append] for i in range(0, len(items), per_append)]
    shares = [calls[k::appenders] for k in range(appenders)]

    async def appender(share: list[list[Pending]]) -> None:
        for call in share:
            await store.append(call)

    async with SQLiteStore.open(path, synchronous=synchronous) as store:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for share in shares:
                tg.start_soon(appender, share)
        seconds = time.perf_counter() - start
        stats = store.stats
        if store.last_seq != len(items):
            raise RuntimeError(f"appended {len(items)}, the log holds {store.last_seq}")
    return seconds, stats.events / max(stats.transactions, 1)


def _raw_read(path: str) -> tuple[int, float, float]:
    """Reference replay: plain sqlite3 fetching every row in chunks, no verification."""
    conn = sqlite3.connect(path)
    try:
        start = time.perf_counter()
        count = 0
        cursor = conn.execute("SELECT * FROM events ORDER BY seq")
        while rows := cursor.fetchmany(4096):
            count += len(rows)
        return count, time.perf_counter() - start, os.path.getsize(path) / 2**20
    finally:
        conn.close()


async def _replay(directory: str, n: int) -> dict[str, Any]:
    path = os.path.join(directory, "replay.db")
    items = _pendings(n, "replay")
    start = time.perf_counter()
    async with SQLiteStore.open(path, synchronous="NORMAL") as store:
        for i in range(0, n, 5_000):
            await store.append(items[i : i + 5_000])
    build_s = time.perf_counter() - start
    del items

    start = time.perf_counter()
    async with SQLiteStore.open(path, quick_check=False):
        open_tail_only_s = time.perf_counter() - start
    start = time.perf_counter()
    async with SQLiteStore.open(path) as store:
        open_s = time.perf_counter() - start
        start = time.perf_counter()
        count = 0
        async for _record in store.iterate():
            count += 1
        iterate_s = time.perf_counter() - start
        start = time.perf_counter()
        report = await store.verify()
        verify_s = time.perf_counter() - start
    if count != n or not report.ok:
        raise RuntimeError(f"replay read {count} of {n} records; verify: {report}")
    raw_count, raw_s, size_mb = _raw_read(path)
    return {
        "events": n,
        "file_mb": round(size_mb, 1),
        "build_s": round(build_s, 2),
        "open_s": round(open_s, 3),
        "open_tail_only_s": round(open_tail_only_s, 3),
        "iterate_s": round(iterate_s, 2),
        "iterate_events_per_s": round(n / iterate_s),
        "verify_s": round(verify_s, 2),
        "raw_read_s": round(raw_s, 2),
        "raw_read_events_per_s": round(raw_count / raw_s),
    }


async def bench_store(
    directory: str | None = None,
    *,
    appenders: Sequence[int] = (1, 16, 256),
    modes: Sequence[Synchronous] = ("FULL", "NORMAL"),
    events: dict[int, int] | None = None,
    per_append: int = 1,
    replay_events: int = 1_000_000,
) -> dict[str, Any]:
    """Measure; return ``{"append": [...], "replay": {...}}`` (no replay if 0 events).

    Per append case: the store's events/s, its mean group (events per transaction), the raw
    reference at the ideal group (``appenders x per_append`` rows per transaction, the figure
    BENCHMARKS.md compares against) and at the group the store actually reached (what the store's
    own overhead costs, group size aside), with both ratios.
    """
    counts = {**DEFAULT_EVENTS, **(events or {})}
    with tempfile.TemporaryDirectory(dir=directory, prefix="bench-store-") as tmp:
        results: list[dict[str, Any]] = []
        for mode in modes:
            for k in appenders:
                # bigger calls need more events for a stable figure; 300k bounds the run time
                n = min(counts.get(k, 1_000 * k) * per_append, max(300_000, counts.get(k, 0)))
                items = _pendings(n, f"{mode}-{k}")
                rows = _sealed(items)
                store_s, group = await _store_append(
                    os.path.join(tmp, f"store-{mode}-{k}.db"), items, k, per_append, mode
                )
                ideal_s = reference_append(
                    os.path.join(tmp, f"ref-{mode}-{k}.db"), rows, k * per_append, mode
                )
                same_s = reference_append(
                    os.path.join(tmp, f"ref-same-{mode}-{k}.db"), rows, max(round(group), 1), mode
                )
                results.append(
                    {
                        "synchronous": mode,
                        "appenders": k,
                        "per_append": per_append,
                        "events": n,
                        "events_per_s": round(n / store_s),
                        "mean_group": round(group, 1),
                        "reference_events_per_s": round(n / ideal_s),
                        "ratio": round(ideal_s / store_s, 2),
                        "reference_same_group_events_per_s": round(n / same_s),
                        "ratio_same_group": round(same_s / store_s, 2),
                    }
                )
        out: dict[str, Any] = {"append": results}
        if replay_events:
            out["replay"] = await _replay(tmp, replay_events)
    return out


def _print(result: dict[str, Any]) -> None:
    print(
        f"{'sync':<7}{'appenders':>10}{'events':>9}{'events/s':>10}{'group':>7}"
        f"{'raw ref/s':>11}{'ratio':>7}{'same-group ref/s':>18}{'ratio':>7}"
    )
    for r in result["append"]:
        print(
            f"{r['synchronous']:<7}{r['appenders']:>10}{r['events']:>9}{r['events_per_s']:>10}"
            f"{r['mean_group']:>7}{r['reference_events_per_s']:>11}{r['ratio']:>7}"
            f"{r['reference_same_group_events_per_s']:>18}{r['ratio_same_group']:>7}"
        )
    if "replay" in result:
        print("replay:", json.dumps(result["replay"]))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the scratch files go (default: tmp)")
    parser.add_argument("--appenders", default="1,16,256")
    parser.add_argument("--modes", default="FULL,NORMAL")
    parser.add_argument("--per-append", type=int, default=1)
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = parser.parse_args(argv)
    result = anyio.run(
        lambda: bench_store(
            args.dir,
            appenders=[int(x) for x in args.appenders.split(",")],
            modes=[m.strip().upper() for m in args.modes.split(",")],
            per_append=args.per_append,
            replay_events=args.replay_events,
        )
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)


if __name__ == "__main__":
    main()
