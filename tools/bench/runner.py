"""``loraledger bench {store,ledger,publish,memory,ray,ray-publish,gateway,routing,fleet}``: thin
wrappers over the benchmark modules of this package.

The measurements live in ``tools/bench/<name>.py`` (each also runnable with ``python -m
tools.bench.<name>``); this only chooses the sizes (``--quick``: a smoke run small enough for
CI, whose figures are *not* the BENCHMARKS.md ones), names the machine the figures were
measured on (they are meaningless without it: fsync latency alone varies several-fold between
machines), and prints every figure next to its reference and ratio, as a table or as one JSON
object.
"""

from __future__ import annotations

import importlib
import inspect
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tools.cli.common import server_loop_options
from tools.exitcodes import Exit, ToolError
from tools.output import emit, stdout_console
from tools.progress import working

# name -> (module, function, full-size kwargs, --quick kwargs, name of its scratch-dir kwarg)
BENCHES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], str]] = {
    "store": (
        "tools.bench.store",
        "bench_store",
        {},
        {
            "appenders": (1, 16),
            "modes": ("FULL",),
            "events": {1: 200, 16: 1_600},
            "replay_events": 20_000,
        },
        "directory",
    ),
    "ledger": (
        "tools.bench.ledger",
        "bench_ledger",
        {},
        {
            "concurrencies": (1, 16),
            "modes": ("FULL",),
            "sessions": {1: 100, 16: 800},
            "replay_events": 20_000,
            "profile_rounds": 4,
        },
        "directory",
    ),
    "publish": (
        "tools.bench.publish",
        "bench_publish",
        {},
        {"size_mib": 4, "repeats": 1},
        "workdir",
    ),
    "memory": (
        "tools.bench.memory",
        "bench_memory",
        {},
        {"sessions": 20_000},
        "",
    ),
    "ray": (
        "tools.bench.ray",
        "bench_ray",
        {},
        {"concurrencies": (1, 8), "binds": 400, "batched_binds": 4096, "rounds": 1},
        "directory",
    ),
    "ray-publish": (
        "tools.bench.ray_publish",
        "bench_ray_publish",
        {},
        {"size_mib": 4, "repeats": 1},
        "workdir",
    ),
    "gateway": (
        "tools.bench.gateway",
        "bench_gateway",
        {},
        {
            "concurrencies": (1, 4),
            "requests": {1: 40, 4: 80},
            "rounds": 1,
            "paced_seconds": 0.5,
            "sse_concurrencies": (1, 4),
            "sse_requests": 16,
            "sse_chunks": 4,
            "chunk_interval_ms": 1.0,
        },
        "workdir",
    ),
    "routing": (
        "tools.bench.routing",
        "bench_routing",
        {},
        {"sessions": 48, "seeds": (1,), "arrival_s": 10.0},
        "",
    ),
    "fleet": (
        "tools.bench.fleet",
        "bench_fleet",
        {},
        {
            "sizes": (2, 8),
            "repeats": 1,
            "gateways": 4,
            "binds": 512,
            "renewals": 4,
            "rows": 512,
        },
        "workdir",
    ),
}


STORES = ("sqlite", "postgres")
# The full PostgreSQL replay log: a fifth of SQLite's million (filling it costs minutes here).
POSTGRES_REPLAY_EVENTS = 200_000


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        model = ""
    cpu = f"{model}, " if model else ""
    return (
        f"{platform.system()} {platform.machine()}, {cpu}{os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )


def _function(name: str) -> Callable[..., Any]:  # a sync or an async bench, found by name
    module_name, function, *_ = BENCHES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ToolError(
            Exit.FAILED, f"bench {name} is not available in this installation ({exc})"
        ) from None
    return getattr(module, function)  # type: ignore[no-any-return]


def run_bench(
    name: str,
    *,
    quick: bool,
    directory: Path | None,
    json: bool,
    store: str | None = None,
    engines: str | None = None,
) -> dict[str, Any]:
    fn = _function(name)
    _, _, full, small, scratch = BENCHES[name]
    kwargs = dict(small if quick else full)
    if directory is not None and scratch:
        kwargs[scratch] = str(directory)
    if store is not None:
        if "store" not in inspect.signature(fn).parameters:
            raise ToolError(Exit.USAGE, f"bench {name} has no --store choice")
        if store not in STORES:
            raise ToolError(Exit.USAGE, f"--store must be one of {', '.join(STORES)}")
        kwargs["store"] = store
        if store == "postgres":
            kwargs.pop("modes", None)  # SQLite's synchronous modes
            if not quick:
                kwargs["replay_events"] = POSTGRES_REPLAY_EVENTS
    if engines is not None:
        if "engines" not in inspect.signature(fn).parameters:
            raise ToolError(Exit.USAGE, f"bench {name} has no --engines choice")
        kwargs["engines"] = engines
    run = inspect.iscoroutinefunction(fn)
    with working(f"bench {name}", json=json):
        result: dict[str, Any] = (
            # the loop serve and gateway run on (uvloop where the fast extra installed it)
            anyio.run(lambda: fn(**kwargs), backend_options=server_loop_options())
            if run
            else fn(**kwargs)
        )
    out = {"bench": name, "quick": quick, **result, "machine": machine()}
    if json:
        emit({"row": "bench", **out})
    else:
        stdout_console().print(view(out))
    return out


def view(result: dict[str, Any]) -> RenderableType:
    """Every list of rows as a table, every mapping as key/value lines: the bench modules own
    their fields (and their ratios), so this never needs to know them."""
    parts: list[RenderableType] = [
        Text(
            f"bench {result['bench']}{' (quick: smoke sizes)' if result['quick'] else ''}",
            style="bold",
        ),
        Text(f"machine: {result['machine']}"),
    ]
    for key, value in result.items():
        if key in ("bench", "quick", "machine"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            table = Table(title=key, title_justify="left")
            columns = list(dict.fromkeys(k for row in value for k in row))
            for column in columns:
                table.add_column(column, justify="right")
            for row in value:
                table.add_row(*(str(row.get(c, "")) for c in columns))
            parts.append(table)
        elif isinstance(value, dict):
            table = Table(title=key, title_justify="left", show_header=False)
            table.add_column("figure")
            table.add_column("value", justify="right")
            for k, v in value.items():
                table.add_row(k, str(v))
            parts.append(table)
        elif value is not None:
            parts.append(Text(f"{key}: {value}"))
    return Group(*parts)
