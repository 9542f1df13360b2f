"""Building the check's target for a live engine URL: probe the server, pick adapters and hooks.

:func:`check_engine` is what ``loraledger check-engine`` runs: it reads what the server says about
itself (its base model card, version, LoRA limits and target modules), shapes the throwaway
adapters for that model (:class:`~engines.local.tinymodel.ModelShapes`, from the model's
``config.json``), opens the same engine adapters the ledger would use for that kind, with the
second transport where the server has one (``tensor_vs_path``), and the hooks that make "in
flight" certain (SGLang's in-place pause, vLLM's running-requests gauge). Everything it opened is
closed, and a scratch artifact directory deleted, whatever happens.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec

from engines import http
from engines.artifacts import ArtifactStore
from engines.contract import Engine, EngineError
from engines.local.tinymodel import ATTENTION, ModelShapes
from tools.check_engine.checks import Target, run_checks
from tools.check_engine.report import Report
from tools.exitcodes import Exit, ToolError

KINDS = ("sglang", "vllm", "local")


class CheckOptions(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    url: str
    model: str | None = None  # base model dir or its config.json; default: what the server says
    artifacts: str | None = None  # where throwaway PEFT dirs go (readable by the engine)
    api_key: str | None = None
    served_model: str | None = None  # vLLM's --served-model-name (default: read /v1/models)
    long_tokens: int | None = None
    restart_command: str | None = None  # a shell command that restarts the engine
    timeout: float = 60.0


def check_options(opts: CheckOptions) -> None:
    if opts.kind not in KINDS:
        raise ToolError(Exit.USAGE, f"--kind {opts.kind!r} is not one of {', '.join(KINDS)}")
    if not opts.url.startswith(("http://", "https://")):
        raise ToolError(Exit.USAGE, f"{opts.url!r} is not an http(s) URL")
    if opts.artifacts is not None and not Path(opts.artifacts).is_dir():
        raise ToolError(Exit.USAGE, f"--artifacts {opts.artifacts} is not a directory")
    if opts.long_tokens is not None and opts.long_tokens < 8:
        raise ToolError(Exit.USAGE, "--long-tokens must be at least 8")


def _model_config(where: str) -> dict[str, Any]:
    path = Path(where)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(Exit.USAGE, f"cannot read the base model config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ToolError(Exit.USAGE, f"{path} is not a JSON object")
    return data


async def _get_json(client: httpx.AsyncClient, path: str, timeout: float) -> Any:
    try:
        response = await client.get(path, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ToolError(Exit.ENGINE_UNAVAILABLE, f"GET {path}: {exc!r}") from None
    if response.status_code != 200:
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE, f"GET {path}: HTTP {response.status_code} {response.text!r}"
        )
    try:
        return response.json()
    except ValueError:
        raise ToolError(Exit.ENGINE_UNAVAILABLE, f"GET {path}: not JSON") from None


def _base_card(models: Any) -> dict[str, Any]:
    try:
        return next(c for c in models["data"] if c.get("parent") is None)
    except (KeyError, TypeError, StopIteration):
        raise ToolError(Exit.ENGINE_UNAVAILABLE, "GET /v1/models lists no base model") from None


@dataclass
class _Live:
    """What :func:`check_engine` opened, to close."""

    engines: list[Any] = field(default_factory=list)
    scratch: str | None = None


async def _sglang_hooks(
    client: httpx.AsyncClient, timeout: float
) -> tuple[
    Callable[[], Awaitable[None]], Callable[[], Awaitable[None]], Callable[[], Awaitable[bool]]
]:
    async def post(path: str, body: dict[str, Any]) -> None:
        response = await client.post(path, json=body, timeout=timeout)
        if response.status_code != 200:
            raise ToolError(Exit.FAILED, f"POST {path}: HTTP {response.status_code}")

    async def hold() -> None:
        await post("/pause_generation", {"mode": "in_place"})

    async def release() -> None:
        await post("/continue_generation", {})

    async def admitted() -> bool:
        info = (await client.get("/server_info", timeout=timeout)).json()
        states = info.get("internal_states") or [{}]
        running = states[0].get("in_flight") if isinstance(states[0], dict) else None
        if running is None:  # a stock server exposes no request gauge here: a grace period
            await anyio.sleep(1.0)
            return True
        return bool(running)

    return hold, release, admitted


def _vllm_admitted(client: httpx.AsyncClient, timeout: float) -> Callable[[], Awaitable[bool]]:
    import re

    gauge = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", re.M)

    async def admitted() -> bool:
        text = (await client.get("/metrics", timeout=timeout)).text
        return sum(float(v) for v in gauge.findall(text)) >= 1

    return admitted


def _has_tensor_route(info: Mapping[str, Any]) -> bool:
    """SGLang >= 0.5.17 with one data-parallel replica and no registry eviction: the tensor
    transport's conditions (:mod:`engines.sglang_tensors`)."""
    from engines.tensor_wire import FIRST_VERSION

    parts = str(info.get("version", "")).split(".")[:3]
    try:
        version = tuple(int(p) for p in parts)
    except ValueError:
        return False
    return (
        version >= FIRST_VERSION
        and int(info.get("dp_size") or 1) == 1
        and info.get("max_loaded_loras") is None
    )


async def build_target(opts: CheckOptions, live: _Live) -> Target:
    """Probe the server, pick the adapters and hooks for its kind."""
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    client = http.engine_client(opts.url, headers=headers)
    live.engines.append(client)
    models = await _get_json(client, "/v1/models", opts.timeout)
    card = _base_card(models)
    context = int(card.get("max_model_len") or 2048)
    if opts.artifacts is None:
        live.scratch = tempfile.mkdtemp(prefix="loraledger-check-")
    store = ArtifactStore(opts.artifacts or live.scratch or "")
    hold = release = admitted = None
    alternate: Engine | None = None
    if opts.kind == "vllm":
        from engines.vllm import VLLMEngine

        served = opts.served_model or str(card["id"])
        version = str((await _get_json(client, "/version", opts.timeout)).get("version", "?"))
        engine: Engine = VLLMEngine(opts.url, "check", served_model=served, api_key=opts.api_key)
        admitted = _vllm_admitted(client, opts.timeout)
        model_path = str(card.get("root") or "")
        rank = 8
        targets: tuple[str, ...] = ("q_proj", "v_proj")
    else:
        from engines.sglang import SGLangEngine

        info = await _get_json(client, "/server_info", opts.timeout)
        version = f"SGLang {info.get('version', '?')}"
        if info.get("loraledger_staged"):
            version = f"loraledger local engine ({version} face)"
        model_path = str(info.get("model_path") or card.get("root") or "")
        rank = min(8, int(info.get("max_lora_rank") or 8))
        served_targets = info.get("lora_target_modules") or ["all"]
        if "all" in served_targets:
            served_targets = list(ATTENTION)
        targets = tuple(m for m in ("q_proj", "v_proj") if m in served_targets) or tuple(
            m for m in ATTENTION if m in served_targets
        )
        if not targets:
            raise ToolError(
                Exit.USAGE, f"the server's --lora-target-modules {served_targets} has no attention"
            )
        hold, release, admitted = await _sglang_hooks(client, opts.timeout)
        path_engine = SGLangEngine(opts.url, "check", api_key=opts.api_key)
        if opts.kind == "local":
            from engines.local.client import LocalHTTPEngine

            engine = LocalHTTPEngine(opts.url, "check", api_key=opts.api_key)
            alternate = path_engine
        else:
            engine = path_engine
            if _has_tensor_route(info):
                from engines.sglang_tensors import SGLangTensorEngine

                alternate = SGLangTensorEngine(opts.url, "check-tensors", api_key=opts.api_key)
                live.engines.append(alternate)
        live.engines.append(path_engine)
    live.engines.append(engine)
    config = _model_config(opts.model or model_path)
    try:
        shapes = ModelShapes.from_config(config)
    except ValueError as exc:
        raise ToolError(Exit.USAGE, str(exc)) from None
    long_tokens = opts.long_tokens or max(8, min(1024, context - 64))
    restart = None
    if opts.restart_command:
        command = opts.restart_command

        async def restart() -> None:
            import subprocess

            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(command, shell=True, capture_output=True, text=True)
            )
            if done.returncode != 0:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")

    return Target(
        engine=engine,
        store=store,
        shapes=shapes,
        kind=opts.kind,
        url=opts.url,
        version=version,
        alternate=alternate,
        hold=hold,
        release=release,
        admitted=admitted,
        long_tokens=long_tokens,
        restart=restart,
        rank=rank,
        targets=targets,
    )


async def check_engine(opts: CheckOptions) -> Report:
    """Run every check against the live engine at ``opts.url``."""
    check_options(opts)
    live = _Live()
    try:
        target = await build_target(opts, live)
        try:
            return await run_checks(target)
        except EngineError as exc:
            raise ToolError(Exit.ENGINE_UNAVAILABLE, f"{opts.url}: {exc}") from None
    finally:
        with anyio.CancelScope(shield=True):
            for thing in reversed(live.engines):
                await thing.aclose()
        if live.scratch is not None:
            shutil.rmtree(live.scratch, ignore_errors=True)
