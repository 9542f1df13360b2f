"""``loraledger demo``: the whole system end to end, told from the log it wrote."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from tools import logconfig
from tools.cli.common import JsonOpt, guarded, run_async, verbosity
from tools.exitcodes import Exit, ToolError
from tools.output import emit, stderr_console, stdout_console, to_json


@guarded
def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the run goes (default: a new folder in ./demo-runs/)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="The same story, smaller (a few seconds; CI).")
    ] = False,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="local: two in-process local engines (default); vllm: the real vLLM CPU "
            "engine (its venv must be installed).",
        ),
    ] = "local",
    json: JsonOpt = False,
) -> None:
    """Run the whole system end to end and tell what happened, from the log it wrote.

    A SQLite ledger, two local engines, a trainer publishing versions while multi-turn
    sessions generate on several rollout workers, an engine restart repaired by the
    reconciler, old versions reclaimed as their last session closes. About a minute on 2
    cores; --quick for a small run.
    """
    from tools import demo as demo_run
    from tools.progress import progress_bar
    from tools.render import story_view, try_view

    if engine not in ("local", "vllm"):
        raise ToolError(Exit.USAGE, f"--engine must be local or vllm, got {engine!r}")
    vllm_python = None
    if engine == "vllm":
        vllm_python = demo_run.check_vllm()
    if verbosity() == 0:
        # The story explains the expected warnings and errors (requests refused or lost by
        # the restarting engine); -v shows every decision as it happens.
        logconfig.configure(-2)
        demo_run.quiet_libraries()
    folder = demo_run.prepare_dir(directory)
    cfg = demo_run.QUICK if quick else demo_run.FULL
    if not json:
        stderr_console().print(
            f"loraledger demo: {cfg.workers} rollout workers x {cfg.sessions} sessions x "
            f"{cfg.waves} waves, {cfg.turns} turns each on "
            f"{demo_run.fleet_description(engine)}; log in {folder}",
            highlight=False,
        )
    with progress_bar("sessions", json=json) as update:
        run = run_async(
            functools.partial(
                demo_run.run_demo,
                folder,
                cfg,
                engine=engine,
                vllm_python=vllm_python,
                on_progress=update,
            )
        )
    story = run_async(demo_run.read_story, run)
    commands = demo_run.suggestions(run, story)
    if json:
        emit(
            {
                "row": "demo",
                "engine": engine,
                "quick": quick,
                "directory": run.directory,
                "log": run.log,
                "provenance": run.provenance,
                "plot": run.plot,
                "story": to_json(story),
                "rollout": to_json(run.stats),
                "try": commands,
            }
        )
        return
    out = stdout_console()
    out.print(story_view(story, run, fleet=demo_run.fleet_description(engine)))
    out.print(try_view(commands))
