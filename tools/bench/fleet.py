"""Fleet scale (BENCHMARKS.md): publication to 8, 64 and 256 engines, and what one ``serve``
spends on each remote gateway's binds, renewals and provenance rows.

Method (one process, one run; every figure is read against one measured in the same run):

* **Publication**: for each fleet size, a fresh SQLite ledger (``synchronous=FULL``) and that
  many in-process engine doubles (``engines``): by default
  :class:`~tools.bench.fleet_engine.FleetStubEngine` s, the staged protocol answered as a real
  engine answers it with none of the engine's own work on the bytes (a real engine checksums
  and builds weights on a machine of its own; in this one process that CPU would hide the
  control plane's), optionally after a simulated load latency (``engine_load_ms``); or
  (``engines="local"``) :class:`~engines.local.engine.LocalEngine` s, the tiny-model engine the
  other publication benches use, whose checksums and peft loads run in this process. The
  output names the double (``engine_double``). 256 engine processes would not fit this
  machine. The health loop probes every engine once a minute (``probe_interval_s``): no probe
  round falls inside a timed publication.
  After an untimed warm-up publication, a 1 MiB adapter (rank 128, so the protocol shows, not
  the bytes) is published ``repeats`` times through ``ControlPlane.publish``; the median time
  to commit is reported with its ratio to the smallest fleet's (target: 256 engines within 4x
  of 8), under the driver's default bound on engines driven at once. Per
  publication: the events it appended and the time the decider spent deciding its commands
  (the ledger's ``decide`` wrapped by a timer for the run), each also per engine -- a figure
  per engine that rises with the fleet is a cost growing faster than the engine count.
  **Projection memory**: the whole log of the run folded into a fresh registry projection
  under ``tracemalloc`` (the memory bench's method), per engine.
* **Service CPU**: :class:`~publisher.remote.service.LedgerService` called directly (no HTTP:
  what the ledger's process spends beyond decoding the wire), on a SQLite ledger and
  provenance store (``FULL``), by ``gateways`` registered owners: new-session binds in
  batches as a gateway's client sends them, lease renewals of every life, provenance rows in
  batches. Process CPU time (all threads, SQLite's included) per bind, per renewal and per
  row. From those: binds per second per ``serve`` core (target >= 10,000), and how many
  gateway processes one core carries at a stated load per gateway.

Run ``loraledger bench fleet`` (``--quick``: smoke sizes; ``--engines local``: LocalEngines) or
``python -m tools.bench.fleet`` (``--engines``, ``--engine-load-ms``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from tools.bench.ledger import machine
from tools.exitcodes import Exit, ToolError

ADAPTER_RANK = 128  # q/k/v/o of the tiny model's 2 layers at hidden 128, float32: 1 MiB
# The load one remote gateway puts on ``serve`` when the number it carries is computed:
# new sessions per second, generations (provenance rows) per second, renewals per second.
GATEWAY_LOAD = {"new_sessions_per_s": 100.0, "rows_per_s": 1000.0, "renewals_per_s": 1.0}


# The engine doubles a publication can run against, and how the output names each.
DOUBLES = {
    "stub": "in-process FleetStubEngine (the staged protocol, none of an engine's own work)",
    "local": "in-process LocalEngine (tiny model), not GPU servers",
}

_DECIDE = "decide"  # the name the ledger's writer calls the decider by


class _DecideTimer:
    """Wraps the ledger's ``decide`` for the benchmark's life: seconds spent and calls made.
    A wrapper, not a change: the ledger calls the same function with the same arguments."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[_DecideTimer]:
        import publisher.core.ledger as ledger_module

        original: Callable[..., Any] = getattr(ledger_module, _DECIDE)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(ledger_module, _DECIDE, timed)
        try:
            yield self
        finally:
            setattr(ledger_module, _DECIDE, original)


async def _projection_bytes(store: Any) -> int:
    """The registry projection of the whole log, as the memory bench measures it: events
    decoded first, then folded under ``tracemalloc``."""
    from projections.registry import RegistryState, evolve

    events = [record.event async for record in store.iterate()]
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        state = RegistryState()
        for event in events:
            evolve(state, event)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del state
    return end - start


async def _engine_doubles(
    stack: contextlib.AsyncExitStack, engines: int, double: str, load_ms: float
) -> list[Any]:
    """``engines`` in-process engine doubles of the kind ``double`` names (:data:`DOUBLES`)."""
    if double == "local":
        from engines.local.admission import ServingLimits
        from engines.local.engine import LocalEngine

        limits = ServingLimits(max_lora_rank=ADAPTER_RANK)
        return [
            await stack.enter_async_context(LocalEngine(f"e{i:03d}", limits=limits))
            for i in range(engines)
        ]
    if double == "stub":
        from tools.bench.fleet_engine import FleetStubEngine

        return [
            await stack.enter_async_context(
                FleetStubEngine(f"e{i:03d}", load_latency_s=load_ms / 1e3)
            )
            for i in range(engines)
        ]
    raise ValueError(f"engine double {double!r} is not one of {', '.join(DOUBLES)}")


async def _plane_with_one_version(
    stack: contextlib.AsyncExitStack,
    root: Path,
    engines: int,
    *,
    capacity: int,
    double: str = "local",
    load_ms: float = 0.0,
) -> Any:
    """A control plane on a SQLite ledger (``FULL``) over ``engines`` in-process engine
    doubles, with version 1 published untimed: the first publication of the process pays
    imports and warm-up, and a bind needs a version to bind to."""
    from engines.local.tinymodel import make_adapter
    from evlog.sqlite import SQLiteStore
    from publisher.drivers.adapter_copy import AdapterCopy
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane

    store = await stack.enter_async_context(
        SQLiteStore.open(root / "ledger.db", synchronous="FULL")
    )
    fleet = await _engine_doubles(stack, engines, double, load_ms)
    plane = await stack.enter_async_context(
        ControlPlane.open(
            store,
            Fleet(fleet),
            deployment="fleet",
            prefix="bench",
            capacity=capacity,
            artifact_root=root / "artifacts",
            reclaim_tick_s=0.1,
            probe_interval_s=60.0,  # no probe rounds inside the timed parts
            full_reconcile_s=600.0,
        )
    )
    config, tensors = make_adapter(1)
    await plane.publisher.publish(AdapterCopy.from_state_dict(tensors, config), version_id=1)
    return plane


async def publication_at(
    engines: int,
    *,
    repeats: int,
    workdir: str | None,
    double: str = "stub",
    load_ms: float = 0.0,
) -> dict[str, Any]:
    """Publish a 1 MiB adapter ``repeats`` times to ``engines`` in-process engine doubles."""
    from engines.local.tinymodel import make_adapter
    from publisher.drivers.adapter_copy import AdapterCopy

    targets = ("k_proj", "o_proj", "q_proj", "v_proj")
    adapters = []
    for i in range(repeats):
        config, tensors = make_adapter(200 + i, r=ADAPTER_RANK, targets=targets)
        adapters.append(AdapterCopy.from_state_dict(tensors, config))
    timer = _DecideTimer()
    commit_s, commit_cpu_s, events, decide_s = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=workdir) as tmp:
        async with contextlib.AsyncExitStack() as stack:
            plane = await _plane_with_one_version(
                stack, Path(tmp), engines, capacity=repeats + 3, double=double, load_ms=load_ms
            )
            stack.enter_context(timer.installed())
            ledger = plane.ledger

            async def settled() -> None:
                """Nothing RECLAIMING and nothing retired left to reclaim."""
                while ledger.state.reclaimable() or any(  # noqa: ASYNC110 -- polls state
                    v.state == "RECLAIMING" for v in ledger.state.versions.values()
                ):
                    await anyio.sleep(0.02)

            for i, adapter in enumerate(adapters):
                await settled()
                seq, decided = ledger.state.last_seq, timer.seconds
                t, cpu = time.perf_counter(), time.process_time()
                outcome = await plane.publisher.publish(adapter, version_id=10 + i)
                commit_s.append(time.perf_counter() - t)
                commit_cpu_s.append(time.process_time() - cpu)
                if outcome.status != "PUBLISHED":
                    raise RuntimeError(f"publication to {engines} engines: {outcome.status}")
                events.append(ledger.state.last_seq - seq)
                decide_s.append(timer.seconds - decided)
            projection = await _projection_bytes(plane.ledger.store)
            log_events = ledger.state.last_seq
    commit = statistics.median(commit_s)
    return {
        "engines": engines,
        "commit_ms": round(commit * 1e3, 1),
        "commit_ms_per_engine": round(commit * 1e3 / engines, 3),
        # this process's CPU (all threads, the engine doubles' included) during the commit:
        # on a loaded machine, what the wall time cannot separate from waiting for a core
        "commit_cpu_ms": round(statistics.median(commit_cpu_s) * 1e3, 1),
        "events": statistics.median(events),
        "events_per_engine": round(statistics.median(events) / engines, 2),
        "decide_ms": round(statistics.median(decide_s) * 1e3, 2),
        "decide_us_per_engine": round(statistics.median(decide_s) * 1e6 / engines, 1),
        "log_events": log_events,
        "projection_kib": round(projection / 1024, 1),
        "projection_kib_per_engine": round(projection / 1024 / engines, 2),
    }


async def service_cpu(
    *, gateways: int, binds: int, batch: int, renewals: int, rows: int, workdir: str | None
) -> dict[str, Any]:
    """CPU the ledger's process spends per remote bind, renewal and provenance row."""
    from evlog.provenance_store import SQLiteProvenance
    from publisher.core import commands as c
    from publisher.gateway.provenance import ProvenanceRow
    from publisher.remote.service import LedgerService

    with tempfile.TemporaryDirectory(prefix="bench-fleet-serve-", dir=workdir) as tmp:
        root = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            plane = await _plane_with_one_version(stack, root, 2, capacity=3)
            provenance = await stack.enter_async_context(
                SQLiteProvenance.open(root / "provenance.db")
            )
            service = LedgerService(plane.ledger, provenance=provenance)
            lives = [(f"gw-{g}", f"life-{g}") for g in range(gateways)]
            secrets = {life: f"{g:064x}" for g, life in enumerate(lives)}
            for life in lives:
                await service.register(life[0], 3600.0, life[1], secret=secrets[life])

            # new-session binds, in batches as a gateway's client sends them
            cpu, wall = time.process_time(), time.perf_counter()
            for start in range(0, binds, batch):
                owner, incarnation = lives[(start // batch) % gateways]
                commands = [
                    c.Bind(
                        session=f"s-{n}",
                        owner=owner,
                        incarnation=incarnation,
                        secret=secrets[(owner, incarnation)],
                    )
                    for n in range(start, min(start + batch, binds))
                ]
                results, _ = await service.execute(commands)
                if bad := [r for r in results if isinstance(r, Exception)]:
                    raise RuntimeError(f"bind refused: {bad[0]}")
            bind_cpu, bind_wall = time.process_time() - cpu, time.perf_counter() - wall

            # renewals of every life, with an in-flight count each
            version = next(iter(plane.ledger.state.versions))
            counts = {life: {("e0", version): 1} for life in lives}
            cpu = time.process_time()
            for _ in range(renewals):
                lost, _ = service.renew(counts, secrets=secrets)
                if lost:
                    raise RuntimeError(f"renewal refused: {next(iter(lost.values()))}")
            renew_cpu = time.process_time() - cpu
            renewed = renewals * gateways

            # provenance rows in batches of ``batch``
            lora = plane.ledger.state.versions[1].lora_name
            sample = [
                ProvenanceRow(
                    session=f"s-{n}",
                    turn=0,
                    engine="e0",
                    incarnation="i",
                    version_id=1,
                    lora_name=lora,
                    digest="ab" * 32,
                    bound_revision=1,
                    head_revision=1,
                    head_revision_done=1,
                    request_id=f"r-{n}",
                    prompt_tokens=16,
                    completion_tokens=16,
                    cached_tokens=0,
                    finish_reason="length",
                    started_at=0.0,
                    finished_at=0.0,
                    gateway="gw-0",
                    row_id=f"row-{n}",
                )
                for n in range(rows)
            ]
            cpu = time.process_time()
            for start in range(0, rows, batch):
                await service.store_provenance(sample[start : start + batch])
            row_cpu = time.process_time() - cpu

    per_bind, per_renewal, per_row = bind_cpu / binds, renew_cpu / renewed, row_cpu / rows
    load = GATEWAY_LOAD
    per_gateway_s = (
        load["new_sessions_per_s"] * per_bind
        + load["rows_per_s"] * per_row
        + load["renewals_per_s"] * per_renewal
    )
    return {
        "gateways": gateways,
        "bind_batch": batch,
        "binds": binds,
        "bind_cpu_us": round(per_bind * 1e6, 1),
        "binds_per_s_per_core": round(1 / per_bind),
        "binds_per_s_wall": round(binds / bind_wall),
        "target_binds_per_s_per_core": 10_000,
        "renewals": renewed,
        "renewal_cpu_us": round(per_renewal * 1e6, 1),
        "rows": rows,
        "row_cpu_us": round(per_row * 1e6, 1),
        "gateway_load": dict(load),
        "gateway_cpu_ms_per_s": round(per_gateway_s * 1e3, 2),
        "gateways_per_serve_core": int(1 / per_gateway_s),
    }


async def bench_fleet(
    sizes: Sequence[int] = (8, 64, 256),
    repeats: int = 3,
    gateways: int = 64,
    binds: int = 20_000,
    batch: int = 64,
    renewals: int = 200,
    rows: int = 20_000,
    workdir: str | None = None,
    engines: str = "stub",
    engine_load_ms: float = 0.0,
) -> dict[str, Any]:
    """Run the benchmark and return its results (see the module docstring)."""
    if engines not in DOUBLES:
        raise ToolError(Exit.USAGE, f"--engines must be one of {', '.join(DOUBLES)}")
    publication = [
        await publication_at(
            n, repeats=repeats, workdir=workdir, double=engines, load_ms=engine_load_ms
        )
        for n in sizes
    ]
    base = publication[0]
    for row in publication:
        row["commit_vs_smallest"] = round(row["commit_ms"] / base["commit_ms"], 2)
    largest = publication[-1]
    return {
        "machine_detail": machine(),
        "engine_double": DOUBLES[engines],
        "engine_load_ms": engine_load_ms if engines == "stub" else None,
        "adapter_mib": 1,
        "publication": publication,
        "scale": {
            "engines": f"{base['engines']} -> {largest['engines']} "
            f"({largest['engines'] / base['engines']:.0f}x)",
            "commit_ratio": largest["commit_vs_smallest"],
            "commit_cpu_ratio": round(largest["commit_cpu_ms"] / base["commit_cpu_ms"], 2),
            "target_commit_ratio": 4.0,
            "events_per_engine_ratio": round(
                largest["events_per_engine"] / base["events_per_engine"], 2
            ),
            "decide_us_per_engine_ratio": round(
                largest["decide_us_per_engine"] / base["decide_us_per_engine"], 2
            ),
        },
        "service": await service_cpu(
            gateways=gateways,
            binds=binds,
            batch=batch,
            renewals=renewals,
            rows=rows,
            workdir=workdir,
        ),
        "service_called": "LedgerService directly, in process (no HTTP)",
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", choices=sorted(DOUBLES), default="stub")
    parser.add_argument("--engine-load-ms", type=float, default=0.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    result = anyio.run(
        lambda: bench_fleet(
            sizes=args.sizes,
            repeats=args.repeats,
            engines=args.engines,
            engine_load_ms=args.engine_load_ms,
        )
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
