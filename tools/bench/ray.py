"""Benchmark of the Ray deployment: binds/s through the ledger actor, next to the simplest design.

The simplest registry keeps ``session_id -> version`` in a dict inside a named Ray actor, one
remote call per bind, with nothing durable and no lease: the floor a durable ledger is judged
against. Everything below runs in ONE local Ray instance,
in the same run, driven the same way: ``concurrency`` asyncio tasks in one client process,
each binding fresh sessions one call after another; for each concurrency the measures are
interleaved over ``rounds`` (median kept) so the load of a shared machine hits them alike.

Measured (sessions bound per second), at each client concurrency of ``concurrencies``:

* ``dict_actor`` -- that registry: a sync actor, ``bind(session) -> version`` on a dict, one Ray
  call per bind. The baseline of every ratio.
* ``ledger_client`` -- the durable ledger actor (SQLite, ``synchronous=FULL``, group commit)
  through :class:`~publisher.ray.client.RayLedger`, one ``bind`` call per session. The client
  coalesces calls made while round trips are in flight into one ``execute_many``.
* ``ledger_batched`` -- the same client, each task binding a GROUP of ``group`` sessions per
  call (``execute_many``: how a rollout worker binds a GRPO group).
* reference rows, to explain the ratios: ``ledger_per_call`` (one Ray call per bind, no client
  coalescing), ``async_dict_actor`` (the same dict in an async actor: what Ray's async
  dispatch costs by itself), ``ledger_batched_per_call`` (one Ray call per group).

The headline ratios (BENCHMARKS.md: single >= 1, batched >= 10) are taken at the highest
concurrency: a rollout worker runs many sessions at once. With ONE sequential caller the
durable single call cannot match a dict: each answer waits for its own fsync.

Every bind is checked (a ``Bound`` answer; the ledger's session count at the end equals the
binds made). Run ``python -m tools.bench.ray`` (``--json`` for the raw numbers), or
``await bench_ray(...)`` on asyncio (smoke sizes: ``concurrencies=(1, 8), binds=400,
batched_binds=4096, rounds=1``; their figures are not the BENCHMARKS.md ones).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from publisher.core import commands as c
from publisher.core.outcomes import Bound
from publisher.ray.client import RayLedger
from publisher.ray.ledger_actor import LedgerConfig, start_ledger
from publisher.ray.local import local_ray
from tools.logconfig import configure as configure_logs

OWNER = "bench-worker"
TARGET_SINGLE = 1.0  # BENCHMARKS.md: at least as fast as the dict actor
TARGET_BATCHED = 10.0  # and a batched call at least 10x that


class DictRegistry:
    """The simplest design: a dict behind a (sync) Ray actor, one call per bind."""

    def __init__(self) -> None:
        self._bindings: dict[str, int] = {}
        self.default = 1

    def bind(self, session: str) -> int:
        return self._bindings.setdefault(session, self.default)

    def count(self) -> int:
        return len(self._bindings)


class AsyncDictRegistry(DictRegistry):
    """The same dict in an async actor (reference: Ray's async-actor dispatch cost)."""

    async def bind(self, session: str) -> int:  # type: ignore[override]
        return self._bindings.setdefault(session, self.default)

    async def count(self) -> int:  # type: ignore[override]
        return len(self._bindings)


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"Ray {ray.__version__}, load average at start {load}"
    )


async def _bootstrap(ledger: RayLedger) -> None:
    """One published version on two (recorded) engines and one registered owner."""
    await ledger.execute(c.CreateDeployment(deployment="bench", prefix="agent", capacity=2))
    for engine in ("e0", "e1"):
        await ledger.execute(c.JoinEngine(engine=engine, incarnation=f"{engine}-1"))
        await ledger.execute(c.RepairEngine(engine=engine, incarnation=f"{engine}-1"))
    digest = hashlib.sha256(b"bench").hexdigest()
    allocated: Any = await ledger.execute(c.Allocate(version_id=1, digest=digest))
    await ledger.execute(c.ClaimTransport(version_id=1, attempt=allocated.attempt, owner="b"))
    for engine in allocated.fleet:
        receipt = dict(
            version_id=1,
            attempt=allocated.attempt,
            engine=engine,
            incarnation=f"{engine}-1",
            digest=digest,
            lora_name=allocated.lora_name,
        )
        await ledger.execute(c.RecordPrepared(**receipt))
        await ledger.execute(c.RecordReady(**receipt))
    await ledger.execute(c.Commit(version_id=1, attempt=allocated.attempt))
    await ledger.register_owner(OWNER, ttl_s=24 * 3600)


async def _drive(
    concurrency: int, total: int, group: int, call: Callable[[list[str]], Awaitable[int]]
) -> tuple[float, int]:
    """``concurrency`` tasks bind about ``total`` fresh sessions, ``group`` per call.
    Returns (sessions bound per second, sessions bound)."""
    calls = max(1, total // (concurrency * group))

    async def task() -> None:
        for _ in range(calls):
            sessions = [f"s{next(_ids)}" for _ in range(group)]
            bound = await call(sessions)
            if bound != len(sessions):
                raise AssertionError(f"{bound} of {len(sessions)} sessions bound")

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(task())
    made = calls * concurrency * group
    return made / (time.perf_counter() - start), made


_ids = itertools.count()


def _all_bound(results: Sequence[Any]) -> int:
    return sum(isinstance(r, Bound) for r in results)


def scaled(total: int, concurrency: int, per_caller: int, floor: int) -> int:
    """Sessions per measure: fewer for few callers (each call waits a round trip, and for
    the ledger an fsync), so that every measure lasts about as long."""
    return max(floor, min(total, per_caller * concurrency))


async def _measure(
    ledger_handle: Any,
    *,
    concurrencies: Sequence[int],
    binds: int,
    group: int,
    batched_binds: int,
    rounds: int,
) -> dict[str, Any]:
    dict_actor = ray.remote(DictRegistry).options(num_cpus=0).remote()
    async_dict = ray.remote(AsyncDictRegistry).options(num_cpus=0).remote()
    await dict_actor.count.remote()
    await async_dict.count.remote()
    runs: list[dict[str, Any]] = []
    every: dict[str, list[int]] = {}  # every sample, for the record
    made = 0
    async with RayLedger.connect() as ledger:
        await _bootstrap(ledger)

        async def dict_one(sessions: list[str]) -> int:
            await dict_actor.bind.remote(sessions[0])
            return 1

        async def async_dict_one(sessions: list[str]) -> int:
            await async_dict.bind.remote(sessions[0])
            return 1

        async def client_one(sessions: list[str]) -> int:
            return int(isinstance(await ledger.bind(sessions[0], OWNER), Bound))

        async def per_call(sessions: list[str]) -> int:
            commands = [c.Bind(session=s, owner=OWNER) for s in sessions]
            reply = await ledger_handle.execute_many.remote(commands, None)
            return _all_bound(reply.results)

        async def client_group(sessions: list[str]) -> int:
            commands = [c.Bind(session=s, owner=OWNER) for s in sessions]
            return _all_bound(await ledger.execute_many(commands))

        on_ledger = {client_one, per_call, client_group}
        for concurrency in concurrencies:
            single = scaled(binds, concurrency, 125, 400)
            batched = scaled(batched_binds, concurrency, 2048, 4 * group)
            plan: list[tuple[str, int, int, Callable[[list[str]], Awaitable[int]]]] = [
                ("dict_actor", single, 1, dict_one),
                ("ledger_client", single, 1, client_one),
                ("ledger_batched", batched, group, client_group),
                ("ledger_per_call", single, 1, per_call),
                ("async_dict_actor", single, 1, async_dict_one),
                ("ledger_batched_per_call", batched, group, per_call),
            ]
            samples: dict[str, list[float]] = {}
            # an untimed warm-up pass of every path (connections, code paths, file pages)
            for _, _, size, call in plan:
                _, bound = await _drive(concurrency, concurrency * size, size, call)
                made += bound if call in on_ledger else 0
            for _ in range(rounds):
                for name, total, size, call in plan:
                    rate, bound = await _drive(concurrency, total, size, call)
                    samples.setdefault(name, []).append(rate)
                    made += bound if call in on_ledger else 0
            rates = {name: round(statistics.median(v)) for name, v in samples.items()}
            base = rates["dict_actor"]
            runs.append(
                {
                    "concurrency": concurrency,
                    **rates,
                    "single_ratio": round(rates["ledger_client"] / base, 2),
                    "batched_ratio": round(rates["ledger_batched"] / base, 2),
                    "per_call_ratio": round(rates["ledger_per_call"] / base, 2),
                }
            )
            for name, values in samples.items():
                every[f"x{concurrency} {name}"] = [round(x) for x in values]
        status = await ledger.status()
        round_trips = ledger.round_trips
    if status.sessions_bound != made:
        raise AssertionError(f"ledger holds {status.sessions_bound} bindings, {made} were made")
    return {
        "runs": runs,
        "samples": every,
        "sessions_bound": status.sessions_bound,
        "client_round_trips": round_trips,
    }


async def bench_ray(
    *,
    concurrencies: Sequence[int] = (1, 4, 8, 32),
    binds: int = 4000,
    group: int = 128,
    batched_binds: int = 65_536,
    rounds: int = 3,
    num_cpus: int = 2,
    directory: str | None = None,
) -> dict[str, Any]:
    """Start a local loopback Ray instance, measure, stop it. Run it on asyncio (Ray's
    awaitables need it); starting and stopping Ray blocks the loop, nothing else runs then."""
    where = machine()
    with (
        tempfile.TemporaryDirectory(dir=directory) as tmp,
        local_ray(num_cpus=num_cpus, log_to_driver=False),  # actors' logs stay in Ray's files
    ):
        path = os.path.join(tmp, "ledger.db")
        handle = start_ledger(LedgerConfig(path=path, synchronous="FULL"), name="ledger")
        try:
            result = await _measure(
                handle,
                concurrencies=concurrencies,
                binds=binds,
                group=group,
                batched_binds=batched_binds,
                rounds=rounds,
            )
        finally:
            ray.kill(handle, no_restart=True)
    headline = result["runs"][-1]  # the most concurrent run: how rollout workers call
    return {
        "machine": where,
        "group": group,
        "rounds": rounds,
        "synchronous": "FULL",
        "single_ratio": headline["single_ratio"],
        "batched_ratio": headline["batched_ratio"],
        "meets_single": headline["single_ratio"] >= TARGET_SINGLE,
        "meets_batched": headline["batched_ratio"] >= TARGET_BATCHED,
        **result,
    }


ROWS = (
    ("dict_actor", "dict in a sync actor, 1 call per bind"),
    ("ledger_client", "ledger actor via RayLedger, 1 call per bind"),
    ("ledger_batched", "ledger actor via RayLedger, 1 call per group"),
    ("ledger_per_call", "  ref: ledger actor, 1 Ray round trip per bind"),
    ("async_dict_actor", "  ref: dict in an async actor, 1 call per bind"),
    ("ledger_batched_per_call", "  ref: ledger actor, 1 Ray round trip per group"),
)


def _print(result: dict[str, Any]) -> None:
    print(f"machine: {result['machine']}")
    print(
        f"binds/s through Ray, median of {result['rounds']} interleaved rounds; ledger: SQLite "
        f"synchronous=FULL; groups of {result['group']}"
    )
    for run in result["runs"]:
        print(f" {run['concurrency']} concurrent client task(s):")
        base = run["dict_actor"]
        for key, label in ROWS:
            print(f"  {label:52} {run[key]:>9} /s   {run[key] / base:>6.2f}x dict")
    print(
        f"at the highest concurrency: single-call ratio {result['single_ratio']:.2f} "
        f"(target >= {TARGET_SINGLE:g}: {'met' if result['meets_single'] else 'NOT met'}), "
        f"batched ratio {result['batched_ratio']:.2f} (target >= {TARGET_BATCHED:g}: "
        f"{'met' if result['meets_batched'] else 'NOT met'})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--binds", type=int, default=4000)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--batched-binds", type=int, default=65_536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    configure_logs()  # logs on stderr: stdout carries the figures (or the JSON) only
    result = asyncio.run(
        bench_ray(
            concurrencies=args.concurrency,
            binds=args.binds,
            group=args.group,
            batched_binds=args.batched_binds,
            rounds=args.rounds,
        )
    )
    print(json.dumps(result, indent=2)) if args.json else _print(result)


if __name__ == "__main__":
    main()
