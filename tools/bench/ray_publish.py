"""Publication through Ray vs in process (BENCHMARKS.md): the same adapter, the same engines,
the same sizes, in the same run.

Method (one local Ray instance, one driver process):

* **Adapter**: a LoRA for the tiny model with rank ``size_mib * 128`` on q/k/v/o of both layers
  (8 KiB per rank), float32: ``size_mib`` MiB exactly (as ``bench publish``). Version ``10+i``
  is built from seed ``100+i`` on both sides, so both publish the same bytes under one digest.
  The adapter copy (owned copy + digest) is made before the clock starts, on both sides.
* **In process** (the reference): ``TrainerClient(plane).publish(copy, step)`` on a
  :class:`~publisher.drivers.plane.ControlPlane` over ``engines`` in-process
  :class:`~engines.local.engine.LocalEngine` s, SQLite (``synchronous=FULL``), artifact store on
  local disk, ``bucket_mib`` buckets.
* **Through Ray**: a trainer actor calls ``RayTrainerClient.publish(copy, step)``: the tensors
  go into the object store once, the ledger actor (hosting the same control plane over
  ``engines`` engine actors, each hosting a ``LocalEngine``) gets a descriptor, every engine
  actor pulls and verifies the bytes, the ledger pulls them once for its durable copy. The
  clock runs in the trainer actor around the call.
* After one untimed warm-up publication on each side, rounds interleave the two (in process,
  then Ray, for each version), after every retired version was reclaimed on both sides; the
  median of ``repeats`` rounds is reported, and the ratio Ray / in process.
* **Bytes**: what crossed the ledger actor and the engine actors, from their own counters
  (``pull_stats``, ``transfer_stats``), summed over every publication of the run (warm-up
  included); ``None`` where the code under test has no such counter
  (run against an older checkout for the before/after comparison: the file only uses the
  public API).

Run: ``python -m tools.bench.ray_publish [--size-mib 64] [--engines 2] [--repeats 3] [--json]``
or ``loraledger bench ray-publish``. Smoke sizes (``--quick``) are not the BENCHMARKS.md ones.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from publisher.ray.engine import RayEngine, TransferStats

DEFAULT_SIZE_MIB = 64
RANK_PER_MIB = 128  # q/k/v/o of 2 layers at hidden 128, float32: 8 KiB per rank
TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")
NAMESPACE = "loraledger-bench-publish"


def _copy(seed: int, rank: int, bucket_bytes: int) -> Any:
    from engines.local.tinymodel import make_adapter
    from publisher.drivers.adapter_copy import AdapterCopy

    config, tensors = make_adapter(seed, r=rank, targets=TARGETS)
    return AdapterCopy.from_state_dict(tensors, config, bucket_bytes=bucket_bytes)


class TrainerActor:
    """The trainer process of the Ray half: builds the copy, then times the publish call."""

    def __init__(self, ledger_name: str, namespace: str) -> None:
        from publisher.ray.trainer import RayTrainerClient

        self.client = RayTrainerClient(ledger_name, namespace=namespace)

    async def publish(self, seed: int, step: int, rank: int) -> tuple[float, Any]:
        copy = await anyio.to_thread.run_sync(_copy, seed, rank, 2**62)
        t = time.perf_counter()
        outcome = await self.client.publish(copy, step=step)
        return time.perf_counter() - t, outcome


async def _settled(status: Callable[[], Awaitable[Any]]) -> None:
    """Every retired version reclaimed, nothing RECLAIMING: the engines are idle."""
    with anyio.fail_after(120):
        while any(v.state in ("RETIRED", "RECLAIMING") for v in (await status()).versions):  # noqa: ASYNC110 -- polls another process's state
            await anyio.sleep(0.05)
    await anyio.sleep(0.2)


async def _stats(call: Callable[[], Awaitable[Any]]) -> dict[str, Any] | None:
    """A component's byte counters as a dict, or None where this code has none."""
    try:
        value = await call()
    except Exception:  # an older checkout: the method does not exist
        return None
    import msgspec

    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    return msgspec.to_builtins(value)  # type: ignore[no-any-return]


def _phases(path: str, outcomes: list[Any]) -> dict[str, Any]:
    """Where a publication's time went (medians over the rounds, milliseconds): each engine's
    prepare / transfer (for an engine actor: its pull, digest check and staging) / load /
    confirm, and the concurrent artifact write (on Ray: the ledger's pull and write)."""

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 1)

    timings = [t for o in outcomes for t in o.engines]
    return {
        "path": path,
        "prepare": ms([t.prepare_s for t in timings]),
        "transfer": ms([t.transfer_s for t in timings]),
        "load": ms([t.load_s for t in timings]),
        "confirm": ms([t.confirm_s for t in timings]),
        "artifact": ms([o.artifact_s for o in outcomes]),
    }


async def _transfer_stats(engine: RayEngine) -> TransferStats:
    return await engine.transfer_stats()


def machine() -> str:
    import ray

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, Ray "
        f"{ray.__version__}, load average at start {load}"
    )


async def bench_ray_publish(
    *,
    size_mib: int = DEFAULT_SIZE_MIB,
    engines: int = 2,
    repeats: int = 3,
    bucket_mib: int = 64,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its results (see the module docstring)."""
    import ray

    from engines.local.admission import ServingLimits
    from engines.local.engine import LocalEngine
    from evlog.sqlite import SQLiteStore
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane
    from publisher.drivers.trainer import TrainerClient
    from publisher.ray.engine import start_engine, stop_engine
    from publisher.ray.ledger_actor import LedgerConfig, PlaneConfig, start_ledger, stop_ledger
    from publisher.ray.link import ActorLink
    from publisher.ray.local import local_ray

    rank = size_mib * RANK_PER_MIB
    limits = ServingLimits(max_lora_rank=max(64, rank))
    bucket_bytes = bucket_mib * 1024 * 1024
    options: dict[str, Any] = {"bucket_bytes": bucket_bytes, "reclaim_tick_s": 0.1}
    capacity = repeats + 2
    tag = uuid.uuid4().hex[:8]
    ledger_name = f"bench-ledger-{tag}"
    store_mib = max(512, 4 * size_mib * (engines + 2))
    in_process_s: list[float] = []
    ray_s: list[float] = []
    phases: dict[str, list[Any]] = {"in process (reference)": [], "through Ray": []}
    size_bytes = 0

    with (
        tempfile.TemporaryDirectory(prefix="bench-ray-publish-", dir=workdir) as tmp,
        local_ray(num_cpus=2, log_to_driver=False, object_store_memory=store_mib * 2**20),
    ):
        root = Path(tmp)
        fleet = []
        trainer: Any = None
        try:
            for i in range(engines):
                start = functools.partial(
                    start_engine,
                    functools.partial(LocalEngine, f"e{i}", limits=limits),
                    name=f"{tag}-e{i}",
                    namespace=NAMESPACE,
                )
                fleet.append(await anyio.to_thread.run_sync(start))
            config = LedgerConfig(
                path=str(root / "ray-ledger.db"),
                plane=PlaneConfig(
                    deployment="bench",
                    prefix="bench",
                    capacity=capacity,
                    artifact_root=str(root / "ray-artifacts"),
                    engines=tuple(fleet),
                    options=options,
                ),
            )
            await anyio.to_thread.run_sync(
                lambda: start_ledger(config, name=ledger_name, namespace=NAMESPACE)
            )
            link = ActorLink(ledger_name, namespace=NAMESPACE)
            trainer = ray.remote(TrainerActor).options(num_cpus=0).remote(ledger_name, NAMESPACE)
            async with contextlib.AsyncExitStack() as stack:
                store = await stack.enter_async_context(
                    SQLiteStore.open(root / "ledger.db", synchronous="FULL")
                )
                local = [
                    await stack.enter_async_context(LocalEngine(f"e{i}", limits=limits))
                    for i in range(engines)
                ]
                plane = await stack.enter_async_context(
                    ControlPlane.open(
                        store,
                        Fleet(local),
                        deployment="bench",
                        prefix="bench",
                        capacity=capacity,
                        artifact_root=root / "artifacts",
                        **options,
                    )
                )
                in_process = TrainerClient(plane)

                async def local_status() -> Any:
                    return plane.ledger.status()

                async def ray_status() -> Any:
                    return await link.call("status")

                # warm-up, untimed: first calls, imports and the object store's first pages
                warm = await anyio.to_thread.run_sync(_copy, 1, rank, bucket_bytes)
                await in_process.publish(warm, step=1)
                await trainer.publish.remote(1, 1, rank)
                del warm
                for i in range(repeats):
                    seed, step = 100 + i, 10 + i
                    copy = await anyio.to_thread.run_sync(_copy, seed, rank, bucket_bytes)
                    size_bytes = copy.size_bytes
                    await _settled(local_status)
                    await _settled(ray_status)
                    t = time.perf_counter()
                    local_outcome = await in_process.publish(copy, step=step)
                    in_process_s.append(time.perf_counter() - t)
                    del copy
                    await _settled(local_status)
                    await _settled(ray_status)
                    seconds, ray_outcome = await trainer.publish.remote(seed, step, rank)
                    ray_s.append(seconds)
                    for outcome in (local_outcome, ray_outcome):
                        if outcome.status != "PUBLISHED":
                            raise RuntimeError(f"version {step} was not published: {outcome}")
                    if local_outcome.digest != ray_outcome.digest:
                        raise RuntimeError("the two halves published different adapters")
                    phases["in process (reference)"].append(local_outcome)
                    phases["through Ray"].append(ray_outcome)
            ledger_bytes = await _stats(lambda: link.call("pull_stats"))
            engine_bytes = {
                e.engine_id: await _stats(functools.partial(_transfer_stats, e)) for e in fleet
            }
        finally:
            if trainer is not None:
                ray.kill(trainer, no_restart=True)
            with contextlib.suppress(Exception):
                stop_ledger(ledger_name, namespace=NAMESPACE)
            for engine in fleet:
                with contextlib.suppress(Exception):
                    stop_engine(engine)

    med_local, med_ray = statistics.median(in_process_s), statistics.median(ray_s)
    return {
        "size_mib": size_mib,
        "size_bytes": size_bytes,
        "engines": engines,
        "repeats": repeats,
        "bucket_mib": bucket_mib,
        "figures": [
            {
                "path": "in process (reference)",
                "publish_ms": round(med_local * 1e3, 1),
                "all_ms": ", ".join(f"{x * 1e3:.0f}" for x in in_process_s),
                "ratio": 1.0,
            },
            {
                "path": "through Ray",
                "publish_ms": round(med_ray * 1e3, 1),
                "all_ms": ", ".join(f"{x * 1e3:.0f}" for x in ray_s),
                "ratio": round(med_ray / med_local, 2),
            },
        ],
        "ratio_ray_vs_in_process": med_ray / med_local,
        "phases_ms": [_phases(path, outcomes) for path, outcomes in phases.items()],
        "ledger_actor_bytes": ledger_bytes,
        "engine_actor_bytes": engine_bytes,
        "ray_machine": machine(),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"machine: {result['ray_machine']}",
        f"adapter: {result['size_bytes'] / 2**20:.1f} MiB to {result['engines']} engines "
        f"(buckets {result['bucket_mib']} MiB), median of {result['repeats']}",
    ]
    for row in result["figures"]:
        lines.append(
            f"{row['path']}: {row['publish_ms']:.0f} ms (all: {row['all_ms']} ms), "
            f"ratio {row['ratio']:.2f}x"
        )
    for p in result["phases_ms"]:
        lines.append(
            f"  {p['path']}: prepare {p['prepare']:.0f} ms, transfer {p['transfer']:.0f} ms, "
            f"load {p['load']:.0f} ms, confirm {p['confirm']:.0f} ms, artifact write "
            f"{p['artifact']:.0f} ms (medians)"
        )
    lines.append(f"ledger actor: {result['ledger_actor_bytes']}")
    for engine, stats in result["engine_actor_bytes"].items():
        lines.append(f"engine actor {engine}: {stats}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.ray_publish", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = p.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    result = anyio.run(
        functools.partial(
            bench_ray_publish,
            size_mib=args.size_mib,
            engines=args.engines,
            repeats=args.repeats,
            bucket_mib=args.bucket_mib,
        )
    )
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
