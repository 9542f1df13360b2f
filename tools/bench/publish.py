"""Publication benchmark (BENCHMARKS.md): a 64 MiB adapter to 2 local engines, timed against copying
the same bytes twice in the same run, and the longest gap between generation completions of
steady background traffic during a publication, next to the same traffic without one.

Method (everything in one process, one run, so the numbers are comparable):

* **Adapter**: a LoRA for the tiny model with rank ``size_mib * 128`` on q/k/v/o of both layers
  (8 KiB per rank), float32: ``size_mib`` MiB exactly. The adapter copy (owned copy + digest)
  is made first and timed separately (reported as ``snapshot_s``, the figure's name since the
  first run): ``publish`` starts from the copy.
* **Publication**: ``ControlPlane.publish`` of that copy to ``engines`` in-process
  :class:`~engines.local.engine.LocalEngine` s (staged transport, ``bucket_mib`` buckets),
  with an SQLite ledger (``synchronous=FULL``) and the artifact store on local disk -- the full
  path: allocate, claim, prepare, transfer (per-tensor checksums on the engine), load (peft
  injection), inventory confirmation, artifact directory written and fsynced, commit. The
  median of ``repeats`` publications of fresh versions is reported (the previous version is
  reclaimed and the engines idle before each one).
* **Baseline**: the same bytes copied twice in memory (``bytearray`` of every tensor, two
  passes: the least any transport to two engines must do), median of ``repeats``. Also shown:
  writing the bytes to two files with fsync (what a naive per-engine file copy costs).
* **Gaps**: ``streams`` concurrent generation loops per engine (greedy, ``tokens`` tokens each)
  on a small, bound version. Completion times of all loops are merged; the longest interval
  between consecutive completions that overlaps the publication window is reported, and the
  same for a window of equal length without publication. Per-engine maxima are reported too.

Run: ``python -m tools.bench.publish [--size-mib 64] [--engines 2] [--repeats 3] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from engines.contract import Engine

DEFAULT_SIZE_MIB = 64
RANK_PER_MIB = 128  # q/k/v/o of 2 layers at hidden 128, float32: 8 KiB per rank
PROMPT = "the quick brown fox"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu": cpu,
        "loadavg_1m": round(load[0], 2),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def copy_twice(tensors: dict[str, Any]) -> float:
    t = time.perf_counter()
    for _ in range(2):
        for tensor in tensors.values():
            bytearray(tensor.data)
    return time.perf_counter() - t


def write_twice(tensors: dict[str, Any], directory: Path) -> float:
    t = time.perf_counter()
    for i in range(2):
        with open(directory / f"copy-{i}.bin", "wb") as f:
            for tensor in tensors.values():
                f.write(tensor.data)
            f.flush()
            os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    for i in range(2):
        (directory / f"copy-{i}.bin").unlink()
    return elapsed


def max_gap(times: Sequence[float], start: float, end: float) -> float:
    """Longest interval between consecutive completions that overlaps [start, end]."""
    ordered = sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b >= start and a <= end]
    return max(gaps, default=float("nan"))


class _Traffic:
    def __init__(
        self, engines: Sequence[Engine], lora_name: str, streams: int, tokens: int
    ) -> None:
        from engines.contract import SamplingParams

        self.engines = engines
        self.lora_name = lora_name
        self.streams = streams
        self.params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        self.done: list[tuple[str, float]] = []
        self.stop = False

    async def _loop(self, engine: Engine) -> None:
        while not self.stop:
            await engine.generate(PROMPT, self.lora_name, self.params)
            self.done.append((engine.engine_id, time.perf_counter()))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_Traffic]:
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                for _ in range(self.streams):
                    tg.start_soon(self._loop, engine)
            # warm and steady before anything is measured
            while len(self.done) < 4 * len(self.engines) * self.streams:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            try:
                yield self
            finally:
                self.stop = True

    def gaps(self, start: float, end: float) -> dict[str, float]:
        out = {"all": max_gap([t for _, t in self.done], start, end)}
        for engine in self.engines:
            times = [t for e, t in self.done if e == engine.engine_id]
            out[engine.engine_id] = max_gap(times, start, end)
        return out


async def bench_publish(
    *,
    size_mib: int = DEFAULT_SIZE_MIB,
    engines: int = 2,
    repeats: int = 3,
    bucket_mib: int = 64,
    streams: int = 2,
    tokens: int = 8,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its results (see the module docstring)."""
    from engines.local.admission import ServingLimits
    from engines.local.engine import LocalEngine
    from engines.local.tinymodel import make_adapter
    from evlog.sqlite import SQLiteStore
    from publisher.drivers.adapter_copy import AdapterCopy
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane

    rank = size_mib * RANK_PER_MIB
    limits = ServingLimits(max_lora_rank=max(64, rank))
    bucket_bytes = bucket_mib * 1024 * 1024
    targets = ("k_proj", "o_proj", "q_proj", "v_proj")

    def big(seed: int) -> tuple[AdapterCopy, float]:
        config, tensors = make_adapter(seed, r=rank, targets=targets)
        t = time.perf_counter()
        adapter = AdapterCopy.from_state_dict(tensors, config, bucket_bytes=bucket_bytes)
        return adapter, time.perf_counter() - t

    with tempfile.TemporaryDirectory(prefix="bench-publish-", dir=workdir) as tmp:
        root = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            store = await stack.enter_async_context(
                SQLiteStore.open(root / "ledger.db", synchronous="FULL")
            )
            fleet = [
                await stack.enter_async_context(LocalEngine(f"e{i}", limits=limits))
                for i in range(engines)
            ]
            plane = await stack.enter_async_context(
                ControlPlane.open(
                    store,
                    Fleet(fleet),
                    deployment="bench",
                    prefix="bench",
                    capacity=repeats + 3,
                    artifact_root=root / "artifacts",
                    bucket_bytes=bucket_bytes,
                    reclaim_tick_s=0.1,
                )
            )
            ledger = plane.ledger

            async def settled() -> None:
                """No version RECLAIMING, nothing retired and unbound left to reclaim."""
                while ledger.state.reclaimable() or any(  # noqa: ASYNC110 -- polls state
                    v.state == "RECLAIMING" for v in ledger.state.versions.values()
                ):
                    await anyio.sleep(0.02)
                await anyio.sleep(0.2)

            config, tensors = make_adapter(1)
            small = AdapterCopy.from_state_dict(tensors, config)
            await plane.publisher.publish(small, version_id=1)
            await ledger.register_owner("bench-traffic", ttl_s=3600)
            bound = await ledger.bind("traffic", "bench-traffic")

            # 1. publication time vs copying the bytes twice (no traffic)
            copies = [await anyio.to_thread.run_sync(big, 100 + i) for i in range(repeats + 1)]
            publish_s, copy_s, write_s, outcomes = [], [], [], []
            for i in range(repeats):
                await settled()
                adapter = copies[i][0]
                tensors_i = dict(adapter.tensors)
                copy_s.append(await anyio.to_thread.run_sync(copy_twice, tensors_i))
                write_s.append(await anyio.to_thread.run_sync(write_twice, tensors_i, root))
                await settled()
                t = time.perf_counter()
                outcome = await plane.publisher.publish(adapter, version_id=10 + i)
                publish_s.append(time.perf_counter() - t)
                outcomes.append(outcome)

            # 2. gaps between completions of steady traffic, without and with a publication
            await settled()
            window = max(1.0, statistics.median(publish_s))
            traffic = _Traffic(fleet, bound.lora_name, streams, tokens)
            async with traffic.running():
                quiet_start = time.perf_counter()
                await anyio.sleep(window)
                quiet_end = time.perf_counter()
                await anyio.sleep(0.3)
                pub_start = time.perf_counter()
                during = await plane.publisher.publish(copies[repeats][0], version_id=10 + repeats)
                pub_end = time.perf_counter()
                await anyio.sleep(0.3)
            quiet = traffic.gaps(quiet_start, quiet_end)
            busy = traffic.gaps(pub_start, pub_end)
            completions = len(traffic.done)

    med_publish = statistics.median(publish_s)
    med_copy = statistics.median(copy_s)
    last = outcomes[-1]
    return {
        "machine": machine(),
        "size_mib": size_mib,
        "size_bytes": copies[0][0].size_bytes,
        "engines": engines,
        "repeats": repeats,
        "bucket_mib": bucket_mib,
        "snapshot_s": statistics.median(s for _, s in copies),
        "publish_s": med_publish,
        "publish_all_s": publish_s,
        "copy_twice_s": med_copy,
        "write_twice_fsync_s": statistics.median(write_s),
        "ratio_vs_copy_twice": med_publish / med_copy,
        "ratio_vs_write_twice": med_publish / statistics.median(write_s),
        "artifact_s": last.artifact_s,
        "engine_phases_s": {
            t.engine: {
                "prepare": t.prepare_s,
                "transfer": t.transfer_s,
                "load": t.load_s,
                "confirm": t.confirm_s,
                "ready_after": t.ready_after_s,
            }
            for t in last.engines
        },
        "traffic": {"streams_per_engine": streams, "tokens": tokens, "completions": completions},
        "max_gap_without_publication_s": quiet,
        "max_gap_during_publication_s": busy,
        "publication_during_traffic_s": pub_end - pub_start,
        "publication_during_traffic_status": str(during.status),
    }


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}, "
        f"torch {m['torch']} ({m['torch_threads']} threads), load average {m['loadavg_1m']} "
        "at the start",
        f"adapter: {result['size_bytes'] / 2**20:.1f} MiB to {result['engines']} local engines "
        f"(buckets {result['bucket_mib']} MiB), median of {result['repeats']}",
        f"snapshot (copy + digest): {result['snapshot_s'] * 1e3:.0f} ms",
        f"publish: {result['publish_s'] * 1e3:.0f} ms  (all: "
        + ", ".join(f"{x * 1e3:.0f}" for x in result["publish_all_s"])
        + " ms)",
        f"copy the bytes twice (memory): {result['copy_twice_s'] * 1e3:.0f} ms  "
        f"-> ratio {result['ratio_vs_copy_twice']:.2f}x (target <= 3x)",
        f"write the bytes twice (files, fsync): {result['write_twice_fsync_s'] * 1e3:.0f} ms  "
        f"-> ratio {result['ratio_vs_write_twice']:.2f}x",
        f"artifact write (concurrent with transfer): {result['artifact_s'] * 1e3:.0f} ms",
    ]
    for engine, p in result["engine_phases_s"].items():
        lines.append(
            f"  {engine}: prepare {p['prepare'] * 1e3:.0f} ms, transfer {p['transfer'] * 1e3:.0f} "
            f"ms, load {p['load'] * 1e3:.0f} ms, confirm {p['confirm'] * 1e3:.0f} ms, ready after "
            f"{p['ready_after'] * 1e3:.0f} ms"
        )
    q, b = result["max_gap_without_publication_s"], result["max_gap_during_publication_s"]
    lines += [
        f"traffic: {result['traffic']['streams_per_engine']} streams/engine x "
        f"{result['traffic']['tokens']} tokens, {result['traffic']['completions']} completions",
        f"longest gap between completions without publication: {q['all'] * 1e3:.0f} ms "
        f"(per engine: "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in q.items() if k != "all")
        + ")",
        f"longest gap between completions during publication:  {b['all'] * 1e3:.0f} ms "
        f"(per engine: "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in b.items() if k != "all")
        + f"; target < 500 ms; publication took {result['publication_during_traffic_s'] * 1e3:.0f}"
        " ms)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.publish", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--streams", type=int, default=2, help="generation loops per engine")
    p.add_argument("--tokens", type=int, default=8, help="tokens per background request")
    p.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = p.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    result = anyio.run(
        lambda: bench_publish(
            size_mib=args.size_mib,
            engines=args.engines,
            repeats=args.repeats,
            bucket_mib=args.bucket_mib,
            streams=args.streams,
            tokens=args.tokens,
        )
    )
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
