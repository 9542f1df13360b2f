"""The commands next to an engine: ``loraledger engine`` (the bundled local engine over HTTP),
``agent`` (the engine-host agent beside an SGLang or vLLM server) and ``check-engine`` (does a
live engine behave the way the ledger relies on)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated

import typer

from tools.cli.common import JsonOpt, guarded, run_async, secret
from tools.exitcodes import Exit, ToolError
from tools.output import emit, stdout_console

# --- engine --------------------------------------------------------------------------------


@guarded
def engine(
    engine_id: Annotated[
        str, typer.Option("--id", help="The engine's id (the fleet member's name).")
    ] = "e0",
    port: Annotated[
        int, typer.Option("--port", help="TCP port on 127.0.0.1 (0: any free port).")
    ] = 30000,
    artifact_root: Annotated[
        Path | None,
        typer.Option("--artifacts", help="Refuse adapter paths outside this directory."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token the control routes require "
            "(load, unload, staged transfer, pause, abort); default: $LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            help="On SIGINT/SIGTERM, how long the requests already running may take to finish "
            "(seconds); new ones are refused 503 ENGINE_DRAINING meanwhile, and served by "
            "another engine.",
        ),
    ] = 30.0,
    json: JsonOpt = False,
) -> None:
    """Run the bundled local engine over HTTP on 127.0.0.1: try loraledger without a GPU.

    A tiny model built locally (no download) behind SGLang 0.5.x's endpoints plus staged
    transfer: use it as sglang:URL (adapters loaded by path, as on SGLang) or local:URL
    (adapters streamed and verified). Stops cleanly on SIGINT/SIGTERM, after a drain: new
    requests refused retryably, the running ones finished (at most --drain-timeout).
    """
    from tools import local_engine
    from tools.demo import quiet_libraries

    opts = local_engine.EngineOptions(
        engine_id=engine_id,
        port=port,
        artifact_root=str(artifact_root) if artifact_root else None,
        token=secret(None, "", token_file, "LORALEDGER_ENGINE_TOKEN"),
        drain_timeout_s=drain_timeout,
    )
    local_engine.check_options(opts)
    quiet_libraries()

    def ready(url: str) -> None:
        if json:
            emit({"row": "listening", "engine": engine_id, "url": url, "pid": os.getpid()})
        else:
            print(
                f"loraledger engine: {engine_id} listening on {url} (pid {os.getpid()})", flush=True
            )

    run_async(functools.partial(local_engine.run_engine, opts, on_ready=ready))


# --- agent ---------------------------------------------------------------------------------


@guarded
def agent(
    engine_spec: Annotated[
        str,
        typer.Option("--engine", help="The engine beside it, KIND:URL with KIND sglang or vllm."),
    ],
    artifacts: Annotated[
        Path,
        typer.Option("--artifacts", help="This host's artifact directory (the engine reads it)."),
    ],
    engine_id: Annotated[str, typer.Option("--id", help="The fleet member's engine id.")] = "e0",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 30100,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token its routes require; default: "
            "$LORALEDGER_AGENT_TOKEN. Required to listen beyond loopback, and whenever the "
            "agent holds the engine's token ($LORALEDGER_ENGINE_TOKEN): exit 11 otherwise.",
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Listen address.")] = "127.0.0.1",
    served_model: Annotated[
        str, typer.Option("--served-model", help="vLLM's --served-model-name.")
    ] = "tiny",
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            help="On SIGINT/SIGTERM, how long the publication steps already running may take "
            "(seconds); new ones are refused 503 ENGINE_DRAINING meanwhile.",
        ),
    ] = 30.0,
    staging_bytes: Annotated[
        int | None,
        typer.Option(
            "--staging-bytes",
            help="Cap on the bytes held in memory for prepared, not yet loaded versions, all "
            "together; a bucket beyond it is refused STAGING_FULL (default 4 GiB).",
        ),
    ] = None,
    staging_idle: Annotated[
        float | None,
        typer.Option(
            "--staging-idle",
            help="Seconds after which a prepared version with no new step is dropped from "
            "staging (its load then answers NOT_PREPARED; default 600).",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Run the engine-host agent beside an SGLang or vLLM server: no shared filesystem.

    It receives a version's buckets over loraledger's staged protocol, verifies them, writes
    the PEFT directory on this host's disk and asks its engine to load that path
    (docs/engines.md, The engine-host agent). Join it to the ledger as
    ID=agent:AGENT_URL,KIND:ENGINE_URL. Stops cleanly on SIGINT/SIGTERM, after a drain of the
    steps already running (at most --drain-timeout).
    """
    from engines import agent as host_agent

    kind, _, url = engine_spec.partition(":")
    if kind not in ("sglang", "vllm") or not url.startswith(("http://", "https://")):
        raise ToolError(Exit.USAGE, f"--engine {engine_spec!r}: expected sglang:URL or vllm:URL")
    if not artifacts.is_dir():
        raise ToolError(Exit.USAGE, f"--artifacts {artifacts} is not a directory")
    if not 0 <= drain_timeout < float("inf"):
        raise ToolError(Exit.USAGE, "--drain-timeout must be a number of seconds >= 0")
    staging_bytes = host_agent.DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
    staging_idle = host_agent.DEFAULT_STAGING_IDLE_S if staging_idle is None else staging_idle
    if staging_bytes < 1 or not 0 < staging_idle < float("inf"):
        raise ToolError(Exit.USAGE, "--staging-bytes and --staging-idle must be > 0")
    token = secret(None, "", token_file, "LORALEDGER_AGENT_TOKEN")
    engine_token = secret(None, "", None, "LORALEDGER_ENGINE_TOKEN")
    try:
        host_agent.check_configuration(host, token, engine_token)
    except host_agent.UnsafeConfiguration as exc:
        raise ToolError(Exit.UNSAFE, str(exc)) from None

    def ready(base: str) -> None:
        if json:
            emit({"row": "listening", "engine": engine_id, "url": base, "pid": os.getpid()})
        else:
            print(f"loraledger agent: {engine_id} listening on {base} (pid {os.getpid()})")

    try:
        run_async(
            functools.partial(
                host_agent.run,
                engine=engine_spec,
                artifacts=str(artifacts),
                engine_id=engine_id,
                host=host,
                port=port,
                token=token,
                engine_token=engine_token,
                served_model=served_model,
                on_ready=ready,
                drain_timeout=drain_timeout,
                staging_bytes=staging_bytes,
                staging_idle_s=staging_idle,
            )
        )
    except ValueError as exc:
        raise ToolError(Exit.UNSAFE, str(exc)) from None


# --- check-engine --------------------------------------------------------------------------


@guarded
def check_engine(
    url: Annotated[str, typer.Argument(help="The engine's base URL, e.g. http://127.0.0.1:30000")],
    kind: Annotated[
        str,
        typer.Option(
            "--kind", help="sglang, vllm or local (the bundled engine, staged and path loads)."
        ),
    ] = "sglang",
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Base model directory (or its config.json), for the throwaway adapters' "
            "shapes; default: the model path the server reports, read on this host.",
        ),
    ] = None,
    artifacts: Annotated[
        Path | None,
        typer.Option(
            "--artifacts",
            help="Where the throwaway adapter directories go; the engine must read them at the "
            "same path (default: a temporary directory on this host, deleted afterwards).",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            "--api-key-file",
            help="File whose first line is the engine's API key; default: "
            "$LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    long_tokens: Annotated[
        int | None,
        typer.Option(
            "--long-tokens",
            help="Length of the request kept running during the unload (default: most of "
            "the context, at most 1024).",
        ),
    ] = None,
    restart_command: Annotated[
        str | None,
        typer.Option(
            "--restart-command",
            help="A shell command that restarts the engine (and returns): also checks that a "
            "restart changes its incarnation. Use it on an engine that holds nothing.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Check that a live engine behaves the way loraledger relies on (docs/engines.md).

    Publishes throwaway adapters, checks load/list, digest confirmation, same-name reloads,
    unload under a running request, refusal after unload, implicit reloads, prefix-cache
    isolation between versions and tensor vs path loads, then unloads everything it loaded.
    Exit 0 when everything the ledger needs holds, 1 when something does not, 12 when the
    engine cannot be reached.
    """
    from tools import check_engine as checker

    opts = checker.CheckOptions(
        kind=kind,
        url=url,
        model=str(model) if model else None,
        artifacts=str(artifacts) if artifacts else None,
        api_key=secret(None, "", api_key_file, "LORALEDGER_ENGINE_TOKEN", "--api-key-file"),
        long_tokens=long_tokens,
        restart_command=restart_command,
    )
    checker.check_options(opts)
    report = run_async(checker.check_engine, opts)
    if json:
        emit({"row": "check", **checker.as_json(report)})
    else:
        stdout_console().print(checker.render(report))
    if not report.ok:
        raise typer.Exit(int(Exit.FAILED))
