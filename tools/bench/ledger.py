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
3. Profile (``profile_rounds`` > 0, SQLite only): where a command's time goes at 256 sessions
   in flight, stage by stage, in microseconds (:mod:`tools.bench.ledger_profile`).

With ``store="postgres"`` (``loraledger bench ledger --store postgres``) the same two parts run
against a PostgreSQL log on a throwaway server this run starts on 127.0.0.1
(``tools/pg_server.py``: PostgreSQL's defaults, ``fsync=on``, ``synchronous_commit=on``), a
fresh database per run. The reference is then raw asyncpg: ``executemany`` of the very rows the
ledger wrote into an identical table of another fresh database on the same server, one call
(one transaction, atomic) per batch of the size the ledger's group commit reached, reported
as events/s and sessions/s with the ratio.

Run ``python -m tools.bench.ledger`` or ``loraledger bench ledger [--store postgres]``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from evlog.store import EventStore
from projections.recovery import recover, save_snapshot
from publisher.core.ledger import Ledger
from tools.bench.ledger_profile import profile_ledger
from tools.bench.ledger_workload import bootstrap, drive
from tools.bench.store import reference_append
from tools.cli.common import server_loop_options

DEFAULT_SESSIONS = {1: 400, 16: 4_000, 256: 40_000}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def running_loop() -> str:
    """Which event loop ran the figures: ``serve`` runs on uvloop where the ``fast`` extra
    installed it, and the ledger's per-command cost is half asyncio wake-ups, so it shows."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )


async def _sessions(
    path: str, concurrency: int, sessions: int, sync: Synchronous
) -> dict[str, Any]:
    async with SQLiteStore.open(path, synchronous=sync) as store:
        done, first_seq, seconds, written, mean_batch = await drive(store, concurrency, sessions)
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


async def _fill(store: EventStore, events: int) -> None:
    """A log of about ``events`` session events: bind, release, a forget per 1,000."""
    async with Ledger.open(store, snapshot_on_close=False) as ledger:
        await bootstrap(ledger)
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


async def _recovery(path: str, events: int) -> dict[str, Any]:
    """Build a log of session traffic, then time a full replay and a snapshot recovery."""
    async with SQLiteStore.open(path, synchronous="NORMAL") as store:
        await _fill(store, events)
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


_PG_REFERENCE_TABLE = (
    "CREATE TABLE loraledger_events (seq bigint PRIMARY KEY, event_id bytea NOT NULL UNIQUE, "
    "stream text NOT NULL, type text NOT NULL, schema integer NOT NULL, "
    "recorded_at double precision NOT NULL, payload bytea NOT NULL, prev_hash bytea NOT NULL, "
    "hash bytea NOT NULL)"
)
_PG_COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"


async def _pg_reference(url: str, rows: list[tuple[Any, ...]], batch: int) -> float:
    """Raw asyncpg into an identical table: one ``executemany`` (one transaction) per batch."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(_PG_REFERENCE_TABLE)
        insert = (
            f"INSERT INTO loraledger_events ({_PG_COLUMNS}) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
        )
        start = time.perf_counter()
        for i in range(0, len(rows), batch):
            await conn.executemany(insert, rows[i : i + batch])
        return time.perf_counter() - start
    finally:
        await conn.close()


async def _pg_rows_after(url: str, seq: int) -> list[tuple[Any, ...]]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        found = await conn.fetch(
            f"SELECT {_PG_COLUMNS} FROM loraledger_events WHERE seq > $1 ORDER BY seq", seq
        )
        return [tuple(r) for r in found]
    finally:
        await conn.close()


async def _pg_sessions(server: Any, run: str, concurrency: int, sessions: int) -> dict[str, Any]:
    from evlog.postgres import PostgresStore
    from tools.pg_server import create_database

    url = await create_database(server, f"ledger_{run}")
    async with PostgresStore.open(url) as store:
        done, first_seq, seconds, written, mean_batch = await drive(store, concurrency, sessions)
    rows = await _pg_rows_after(url, first_seq)
    assert len(rows) == written, (len(rows), written)
    reference = await create_database(server, f"reference_{run}")
    ref_seconds = await _pg_reference(reference, rows, max(1, round(mean_batch)))
    ledger_rate = done / seconds
    reference_rate = (len(rows) / ref_seconds) / 2  # two events per session
    return {
        "store": "postgres",
        "concurrency": concurrency,
        "sessions": done,
        "sessions_per_s": round(ledger_rate),
        "events_per_s": round(written / seconds),
        "mean_events_per_commit": round(mean_batch, 1),
        "reference_sessions_per_s": round(reference_rate),
        "reference_events_per_s": round(len(rows) / ref_seconds),
        "ratio": round(ledger_rate / reference_rate, 3),
    }


async def _pg_recovery(server: Any, events: int) -> dict[str, Any]:
    from evlog.postgres import PostgresStore
    from tools.pg_server import create_database

    url = await create_database(server, "replay")
    async with PostgresStore.open(url) as store:
        await _fill(store, events)
        total = store.last_seq
    async with PostgresStore.open(url) as store:
        start = time.perf_counter()
        state = await recover(store, use_snapshot=False)
        full = time.perf_counter() - start
        await save_snapshot(store, state)
    start = time.perf_counter()
    async with PostgresStore.open(url) as store:
        snap_state = await recover(store, use_snapshot=True)
    from_snapshot = time.perf_counter() - start
    assert snap_state.last_seq == state.last_seq == total
    return {
        "events": total,
        "full_replay_s": round(full, 3),
        "events_per_s": round(total / full),
        "snapshot_recovery_s": round(from_snapshot, 4),
    }


async def _bench_postgres(
    concurrencies: Sequence[int],
    counts: dict[int, int],
    replay_events: int,
    directory: str | None,
) -> dict[str, Any]:
    from tools.exitcodes import Exit, ToolError
    from tools.pg_server import PostgresUnavailable, temporary_server

    try:
        with temporary_server(directory=directory) as server:
            runs = [
                await _pg_sessions(server, f"c{n}", n, counts.get(n, 1000 * n))
                for n in concurrencies
            ]
            replay = await _pg_recovery(server, replay_events) if replay_events else None
            version = await _server_version(server)
    except PostgresUnavailable as exc:
        raise ToolError(Exit.FAILED, str(exc)) from None
    return {
        "machine": machine(),
        "server": f"{version} on 127.0.0.1 (same machine), fsync=on, synchronous_commit=on",
        "sessions": runs,
        "recovery": replay,
    }


async def _server_version(server: Any) -> str:
    import asyncpg

    conn = await asyncpg.connect(server.url())
    try:
        return str(await conn.fetchval("SELECT split_part(version(), ' on ', 1)"))
    finally:
        await conn.close()


async def bench_ledger(
    *,
    concurrencies: Sequence[int] = (1, 16, 256),
    modes: Sequence[Synchronous] = ("FULL", "NORMAL"),
    sessions: dict[int, int] | None = None,
    replay_events: int = 1_000_000,
    directory: str | None = None,
    store: str = "sqlite",
    profile_rounds: int = 100,
) -> dict[str, Any]:
    """``store`` is ``sqlite`` (``modes`` apply) or ``postgres`` (a throwaway server);
    ``profile_rounds`` batches of binds and of releases for the profile (0: none)."""
    counts = {**DEFAULT_SESSIONS, **(sessions or {})}
    if store == "postgres":
        return await _bench_postgres(concurrencies, counts, replay_events, directory)
    if store != "sqlite":
        raise ValueError(f"store must be sqlite or postgres, got {store!r}")
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
        profile = (
            await profile_ledger(rounds=profile_rounds, directory=tmp) if profile_rounds else None
        )
    return {
        "machine": machine(),
        "event_loop": running_loop(),
        "sessions": runs,
        "recovery": replay,
        "profile": profile,
    }


def _print(result: dict[str, Any]) -> None:
    print(f"machine: {result['machine']}, event loop: {result.get('event_loop', 'asyncio')}")
    raw = "asyncpg" if result.get("server") else "sqlite3"
    print(f"durable bind+release (sessions/s), ledger vs raw {raw} executemany of the same rows")
    if result.get("server"):
        print(f"server: {result['server']}")
    for r in result["sessions"]:
        print(
            f"  {r.get('synchronous', r.get('store')):8} x{r['concurrency']:<4} "
            f"{r['sessions_per_s']:>8} /s  "
            f"reference {r['reference_sessions_per_s']:>8} /s  ratio {r['ratio']:.2f}  "
            f"({r['mean_events_per_commit']} events/commit, {r['sessions']} sessions)"
        )
    rec = result["recovery"]
    if rec:
        print(
            f"recovery of {rec['events']} events: full replay {rec['full_replay_s']} s "
            f"({rec['events_per_s']}/s), from a snapshot {rec['snapshot_recovery_s']} s"
        )
    prof = result.get("profile")
    if prof:
        print(f"where a command's time goes at {prof['concurrency']} sessions in flight (us):")
        for key, value in prof.items():
            if key.endswith("_us"):
                print(f"  {key[:-3]:24} {value:>7.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 256])
    parser.add_argument("--modes", nargs="*", default=["FULL", "NORMAL"])
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--profile-rounds", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = anyio.run(
        lambda: bench_ledger(
            concurrencies=args.concurrency,
            modes=args.modes,
            replay_events=args.replay_events,
            store=args.store,
            profile_rounds=args.profile_rounds,
        ),
        backend_options=server_loop_options(),  # the loop serve runs the ledger on
    )
    print(json.dumps(result, indent=2)) if args.json else _print(result)


if __name__ == "__main__":
    main()
