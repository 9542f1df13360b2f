"""Memory of the registry projection under session churn (BENCHMARKS.md: 1,000,000 sessions bound,
released and forgotten leave the projection within 10 MB of where it started).

The sessions go through the real decider and evolve (no store: this measures the projection,
not SQLite's page cache). Two shapes, both hard on CPython dicts, which never shrink on
deletion: ``waves`` binds ``wave`` sessions, releases them, forgets them, over and over (a
steady rollout fleet); ``flood`` binds every session first, then releases and forgets them all
(a million sessions alive at once). Memory is traced with ``tracemalloc`` (Python allocations
only, exact and repeatable), after a ``gc.collect()``.

Run ``python -m tools.bench.memory`` or ``loraledger bench memory``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

from projections.registry import RegistryState, evolve
from publisher.core import commands as c
from publisher.core.decider import decide
from tools.bench.ledger import machine


def _run(state: RegistryState, command: c.Command) -> None:
    decision = decide(state, command)
    if decision.error is not None:
        raise decision.error
    for event in decision.events:
        evolve(state, event)


def _bootstrapped() -> RegistryState:
    state = RegistryState()
    _run(state, c.CreateDeployment(deployment="mem", prefix="agent", capacity=2))
    for engine in ("e0", "e1"):
        _run(state, c.JoinEngine(engine=engine, incarnation=f"{engine}-1"))
        _run(state, c.RepairEngine(engine=engine, incarnation=f"{engine}-1"))
    digest = hashlib.sha256(b"mem").hexdigest()
    _run(state, c.Allocate(version_id=1, digest=digest))
    _run(state, c.ClaimTransport(version_id=1, attempt=1, owner="bench"))
    for engine in ("e0", "e1"):
        receipt = dict(
            version_id=1,
            attempt=1,
            engine=engine,
            incarnation=f"{engine}-1",
            digest=digest,
            lora_name=state.versions[1].lora_name,
        )
        _run(state, c.RecordPrepared(**receipt))  # type: ignore[arg-type]
        _run(state, c.RecordReady(**receipt))  # type: ignore[arg-type]
    _run(state, c.Commit(version_id=1, attempt=1))
    _run(state, c.RegisterOwner(owner="worker", ttl_s=60.0, now=0.0))
    return state


def _names(start: int, stop: int) -> list[str]:
    return [f"session-{i:07d}" for i in range(start, stop)]


def _churn(state: RegistryState, names: list[str], *, forget_every: int) -> None:
    for name in names:
        _run(state, c.Bind(session=name, owner="worker"))
    for name in names:
        _run(state, c.Release(session=name, owner="worker"))
    for i in range(0, len(names), forget_every):
        _run(state, c.Forget(sessions=tuple(names[i : i + forget_every])))


def measure(sessions: int, *, shape: str = "flood", wave: int = 10_000) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        state = _bootstrapped()
        gc.collect()
        start_bytes, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        began = time.perf_counter()
        for base in range(0, sessions, sessions if shape == "flood" else wave):
            # A function call per wave: the names list must not outlive its wave, or it
            # would be counted as growth of the projection.
            _churn(
                state,
                _names(base, min(base + wave, sessions) if shape != "flood" else sessions),
                forget_every=1000,
            )
        seconds = time.perf_counter() - began
        gc.collect()
        end_bytes, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not state.sessions and not state.tombstones
    return {
        "shape": shape,
        "sessions": sessions,
        "start_mib": round(start_bytes / 2**20, 3),
        "end_mib": round(end_bytes / 2**20, 3),
        "growth_mib": round((end_bytes - start_bytes) / 2**20, 3),
        "peak_mib": round(peak / 2**20, 1),
        "seconds": round(seconds, 1),
    }


def bench_memory(
    sessions: int = 1_000_000, shapes: Sequence[str] = ("flood", "waves")
) -> dict[str, Any]:
    return {"machine": machine(), "runs": [measure(sessions, shape=s) for s in shapes]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = bench_memory(args.sessions)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"machine: {result['machine']}")
    for r in result["runs"]:
        print(
            f"  {r['shape']:6} {r['sessions']} sessions bound, released, forgotten: "
            f"projection {r['start_mib']} MiB -> {r['end_mib']} MiB "
            f"(growth {r['growth_mib']} MiB, peak {r['peak_mib']} MiB, {r['seconds']} s)"
        )


if __name__ == "__main__":
    main()
