"""``loraledger bench NAME``: one subcommand per benchmark of ``tools/bench/``, all with the
same options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tools.cli.common import JsonOpt, guarded
from tools.exitcodes import EXIT_HELP

bench_app = typer.Typer(
    help="Benchmarks (BENCHMARKS.md): each figure with its reference ratio, measured in one run.",
    no_args_is_help=True,
    epilog=EXIT_HELP,
)


def _bench_command(name: str, summary: str) -> None:
    """Register ``loraledger bench NAME``: every bench takes the same options (``--store``
    only where the bench function has a ``store`` parameter)."""

    def command(
        quick: Annotated[
            bool, typer.Option("--quick", help="A small, fast run (CI smoke).")
        ] = False,
        directory: Annotated[
            Path | None, typer.Option("--dir", help="Scratch directory (default: a temp dir).")
        ] = None,
        json: JsonOpt = False,
        store: Annotated[
            str | None,
            typer.Option(
                "--store",
                help="Event store, for the benches that take one (ledger): sqlite (default) "
                "or postgres (a throwaway local server this run starts).",
            ),
        ] = None,
        engines: Annotated[
            str | None,
            typer.Option(
                "--engines",
                help="Engine doubles, for the benches that take them (fleet): stub (default: "
                "the protocol only) or local (in-process LocalEngines, the tiny model).",
            ),
        ] = None,
    ) -> None:
        from tools.bench.runner import run_bench

        run_bench(name, quick=quick, directory=directory, json=json, store=store, engines=engines)

    command.__doc__ = summary
    command.__name__ = f"bench_{name}"
    bench_app.command(name)(guarded(command))


for _name, _summary in {
    "store": "Event store: group-committed appends and a verified replay vs raw sqlite3.",
    "ledger": "Ledger service: durable bind+release sessions/s vs raw sqlite3 (or asyncpg with "
    "--store postgres); recovery time.",
    "publish": "Publication to two local engines vs copying the bytes; longest generation gap.",
    "memory": "Projection memory after a million sessions bound, released and forgotten.",
    "ray": "Binds/s through the Ray ledger actor vs a dict in a Ray actor; batched calls.",
    "ray-publish": "Publication through Ray (object store, engine actors) vs in process.",
    "gateway": "OpenAI gateway vs a bare proxy vs direct to a stub engine: req/s, added TTFB.",
    "routing": "Session placement: round robin, rendezvous, bounded-load rendezvous on simulated "
    "prefix-cache engines: wall time and cache hit rate.",
    "fleet": "Publication to 8, 64, 256 engine doubles: commit time, events and decide time "
    "per engine, projection memory; serve's CPU per remote bind, renewal, provenance row.",
}.items():
    _bench_command(_name, _summary)
