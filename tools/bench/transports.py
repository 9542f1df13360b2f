"""Transport benchmark (BENCHMARKS.md, Transports): publication of one adapter to 2 engines
over HTTP by path (a shared filesystem), through an engine-host agent, and through SGLang's
tensor route, each next to the same run's cost of writing the bytes twice durably.

Method (one process, one run, so the numbers are comparable):

* **Engines**: 2 local engines, each served over loopback HTTP (their SGLang face), each with
  its own artifact root, and a ``ControlPlane`` over an SQLite ledger (``synchronous=FULL``)
  whose artifact store is a third directory. All on the same disk.
* **Adapter**: the tiny model's LoRA of :mod:`tools.bench.publish` (``size_mib`` MiB of
  float32 exactly); one fresh version per publication.
* **Transports**:

  - ``path``: :class:`~engines.sglang.SGLangEngine`; each engine reads the version's directory
    from the control plane's store (what a shared filesystem gives);
  - ``agent``: :class:`~engines.agent.AgentEngine`; buckets (64 MiB) stream to each host's
    agent (in this process, over loopback), which verifies them, writes and fsyncs the
    directory into its host's root, then asks its engine to load that path;
  - ``tensor``: :class:`~engines.sglang_tensors.SGLangTensorEngine`; buckets verified in the
    client, then one ``/load_lora_adapter_from_tensors`` request per engine (base64 of a
    by-value pickle, sha256 per tensor checked by the engine).

  Every transport also writes the version's directory into the control plane's store (the
  source for restores and repairs), as the publication driver always does.
* **Reference**: the bytes written twice to files with fsync (``tools.bench.publish``), median
  of ``repeats`` interleaved with the publications.
* **CPU**: this process's CPU time per publication (every thread: control plane, engines and
  agents alike), median: the work itself, which a loaded machine stretches in wall time but
  does not change.
* **Memory**: this process's peak resident set during each publication (Linux ``VmHWM``,
  reset through ``/proc/self/clear_refs`` just before it), absolute and above the resident
  set at its start (the adapter itself is already held then), the largest of the repeats; the
  engines, agents and control plane all live in this process, so it is the sum of every
  side's buffers.

Run: ``python -m tools.bench.transports [--size-mib 64] [--repeats 3] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from tools.bench.publish import RANK_PER_MIB, machine, write_twice

TRANSPORTS = ("path", "agent", "tensor")


async def bench_transports(
    *, size_mib: int = 64, repeats: int = 3, workdir: str | None = None
) -> dict[str, Any]:
    from engines.agent import Agent, AgentEngine, serve_agent
    from engines.artifacts import ArtifactStore
    from engines.local.admission import ServingLimits
    from engines.local.engine import LocalEngine
    from engines.local.server import serve
    from engines.local.tinymodel import make_adapter
    from engines.sglang import SGLangEngine, SGLangTimeouts
    from engines.sglang_tensors import SGLangTensorEngine
    from evlog.sqlite import SQLiteStore
    from publisher.drivers.adapter_copy import AdapterCopy
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane

    rank = size_mib * RANK_PER_MIB
    limits = ServingLimits(max_lora_rank=max(64, rank))
    targets = ("k_proj", "o_proj", "q_proj", "v_proj")
    body_cap = 2 * (size_mib * 1024 * 1024 * 4 // 3) + 64 * 1024 * 1024
    seeds = iter(range(1000, 10_000))
    # A load moves the whole adapter in one request: at 512 MiB on a loaded 2-core machine the
    # default 60 s control timeout is shorter than the work itself.
    timeouts = SGLangTimeouts(control=max(60.0, 2.0 * size_mib))

    def adapter() -> AdapterCopy:
        config, tensors = make_adapter(next(seeds), r=rank, targets=targets)
        return AdapterCopy.from_state_dict(tensors, config)

    results: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    cpu: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    peaks: dict[str, dict[str, float]] = {}
    write_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-transports-", dir=workdir) as tmp:
        root = Path(tmp)
        for transport in TRANSPORTS:
            async with contextlib.AsyncExitStack() as stack:
                members: list[Any] = []
                for i in range(2):
                    host = root / transport / f"host{i}"
                    host.mkdir(parents=True)
                    # the path transport's engines read the control plane's store
                    allowed = root / transport / "trainer" if transport == "path" else host
                    engine = await stack.enter_async_context(
                        LocalEngine(f"e{i}", limits=limits, artifact_root=allowed)
                    )
                    url = await stack.enter_async_context(
                        serve(engine, max_tensor_body_bytes=body_cap)
                    )
                    if transport == "path":
                        member: Any = SGLangEngine(url, f"e{i}", timeouts=timeouts)
                    elif transport == "tensor":
                        member = SGLangTensorEngine(url, f"e{i}", timeouts=timeouts)
                    else:
                        agent = Agent(
                            SGLangEngine(url, f"e{i}", timeouts=timeouts), ArtifactStore(host)
                        )
                        agent_url = await stack.enter_async_context(serve_agent(agent))
                        member = AgentEngine(
                            agent_url, SGLangEngine(url, f"e{i}", timeouts=timeouts)
                        )
                        stack.push_async_callback(agent.engine.aclose)
                    stack.push_async_callback(member.aclose)
                    members.append(member)
                (root / transport / "trainer").mkdir(exist_ok=True)
                store = await stack.enter_async_context(
                    SQLiteStore.open(root / transport / "ledger.db", synchronous="FULL")
                )
                plane = await stack.enter_async_context(
                    ControlPlane.open(
                        store,
                        Fleet(members),
                        deployment="bench",
                        prefix="bench",
                        capacity=repeats + 2,
                        artifact_root=root / transport / "trainer",
                        reclaim_tick_s=0.1,
                    )
                )
                peak_rss_mib = peak_above_mib = 0.0
                for i in range(repeats):
                    copy = await anyio.to_thread.run_sync(adapter)
                    write_s.append(
                        await anyio.to_thread.run_sync(write_twice, dict(copy.tensors), root)
                    )
                    start_rss = reset_peak_rss()
                    t, c = time.perf_counter(), time.process_time()
                    await plane.publisher.publish(copy, version_id=1 + i)
                    results[transport].append(time.perf_counter() - t)
                    cpu[transport].append(time.process_time() - c)
                    peak = peak_rss()
                    peak_rss_mib = max(peak_rss_mib, peak / 2**20)
                    peak_above_mib = max(peak_above_mib, (peak - start_rss) / 2**20)
                    del copy
                peaks[transport] = {
                    "peak_rss_mib": peak_rss_mib,
                    "peak_above_start_mib": peak_above_mib,
                }
    reference = statistics.median(write_s)
    return {
        "machine": machine(),
        "size_mib": size_mib,
        "repeats": repeats,
        "write_twice_fsync_s": reference,
        "publish_s": {t: statistics.median(v) for t, v in results.items()},
        "publish_all_s": results,
        "ratio_to_write_twice": {t: statistics.median(v) / reference for t, v in results.items()},
        "cpu_s": {t: statistics.median(v) for t, v in cpu.items()},
        "memory": peaks,
    }


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> int:
    """Reset this process's peak resident set (Linux) and return the resident set now."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set since the last :func:`reset_peak_rss` (Linux)."""
    return _status_bytes("VmHWM")


def render(result: dict[str, Any]) -> str:
    lines = [
        f"publication of {result['size_mib']} MiB to 2 engines over HTTP "
        f"(median of {result['repeats']}), vs writing the bytes twice with fsync "
        f"({result['write_twice_fsync_s'] * 1e3:.0f} ms):"
    ]
    for t in TRANSPORTS:
        lines.append(
            f"  {t:7s} {result['publish_s'][t] * 1e3:8.0f} ms  "
            f"{result['ratio_to_write_twice'][t]:.2f}x the durable double write, "
            f"CPU {result['cpu_s'][t] * 1e3:.0f} ms, "
            f"peak RSS {result['memory'][t]['peak_rss_mib']:.0f} MiB "
            f"(+{result['memory'][t]['peak_above_start_mib']:.0f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.transports")
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = anyio.run(
        lambda: bench_transports(size_mib=args.size_mib, repeats=args.repeats, workdir=args.dir)
    )
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
