"""``loraledger check-engine``: does *this* live engine behave the way the ledger relies on?

A team adopting loraledger runs it against its own SGLang or vLLM server (on the GPU host,
before the first publication) and the project runs it whenever a GPU machine is at hand. It
publishes a few throwaway adapters of the right shapes for the engine's base model, through
the same adapters the ledger uses (:class:`~engines.sglang.SGLangEngine`,
:class:`~engines.vllm.VLLMEngine`, :class:`~engines.local.client.LocalHTTPEngine`), and checks
each property of docs/engines.md that publication, pinning and reclaim rest on:

====================  ========  ==================================================================
check                 needed    what holds when it passes
====================  ========  ==================================================================
incarnation           yes       a non-empty id, stable across probes, carried by the inventory
load_and_list         yes       a published adapter is listed under its name
digest_confirmed      yes       the listing (or the receipt) names the published digest
adapter_applied       yes       greedy tokens with the adapter differ from the base, repeatably
same_name_reload      yes       other weights under a live name are refused; the name keeps its
                                weights (nothing swaps a version under running sessions)
unload_in_flight      yes       a request running during the unload finishes on its adapter
unload_drains         no        whether the unload waits for that request (SGLang) or answers at
                                once (vLLM); the ledger's in-flight count covers both
refused_after_unload  yes       the name is gone from the inventory; a repeated unload is a no-op
no_implicit_reload    no        a request naming an unloaded adapter is refused (stock SGLang
                                reloads it from its path: the gateway must never send such names)
prefix_cache          yes       a version never reads another version's prefix cache
tensor_vs_path        yes*      tensor (or staged) and path loads of one adapter give the same
                                tokens (*only where the engine offers both)
left_as_found         yes       the engine holds exactly what it held before the check
====================  ========  ==================================================================

The engine is left as it was found: every throwaway adapter is unloaded (and its directory
deleted) in a ``finally``, whatever failed. The engine is restarted only when asked
(``--restart-command``, :attr:`Target.restart`): then ``restart_detected`` (needed) checks that
the incarnation changes across the restart and ``restart_forgets`` (reported) whether the
restarted engine still lists what was loaded before it. A restart drops every adapter the
engine held, so give it an engine that holds nothing, or ``left_as_found`` says what was lost.

The checks take an :class:`Target` (the engine adapters plus optional hooks), so tests can run
them against a deliberately misbehaving engine (the fault wrapper); :func:`check_engine` builds
the target for a live URL.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np

from engines import http
from engines.artifacts import ArtifactStore
from engines.contract import (
    Candidate,
    CleanRefusal,
    Engine,
    EngineError,
    Generation,
    SamplingParams,
)
from engines.manifest import Manifest, TensorData, build_manifest, tensor_from_array
from publisher.adapter_copy import aiter_buckets, plan_buckets
from tools.exitcodes import Exit, ToolError

KINDS = ("sglang", "vllm", "local")
PROMPT = "the quick brown fox jumps over the lazy dog"
# Long enough that a prefix cache with large blocks (vLLM's CPU backend: 128 tokens) caches it.
LONG_PROMPT = " ".join(["hello world, this is a tiny model for integration tests"] * 16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HOLD_PROBE_S = 1.5  # how long an unload may stay unanswered before we call it draining


# --- results ---------------------------------------------------------------------------------


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One checked property. ``holds`` None: not applicable to this engine (``detail`` says
    why). ``required``: the ledger relies on it (a failure makes the command exit non-zero)."""

    check: str
    holds: bool | None
    required: bool
    detail: str


class Report(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    url: str
    engine_version: str
    incarnation: str
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.required and f.holds is False)


# --- throwaway adapters of the right shapes -----------------------------------------------------


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ModelShapes:
    """What a LoRA on the attention projections of a decoder needs from the base model's
    ``config.json`` (the Llama/Qwen/Mistral family layout PEFT and both engines use)."""

    layers: int
    hidden: int
    q_out: int
    kv_out: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShapes:
        text = config.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in config:
            config = text  # multimodal wrappers keep the language model's config inside
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            layers = int(config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolError(
                Exit.USAGE, f"base model config lacks a decoder's shape fields: {exc!r}"
            ) from None
        return cls(layers=layers, hidden=hidden, q_out=heads * head_dim, kv_out=kv_heads * head_dim)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in, out) of one attention projection."""
        return {
            "q_proj": (self.hidden, self.q_out),
            "k_proj": (self.hidden, self.kv_out),
            "v_proj": (self.hidden, self.kv_out),
            "o_proj": (self.q_out, self.hidden),
        }[module]


def throwaway_adapter(
    shapes: ModelShapes,
    seed: int,
    *,
    r: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    b_scale: float = 2.0,
) -> tuple[dict[str, Any], dict[str, TensorData]]:
    """A random PEFT LoRA (float32, peft key layout) that visibly changes greedy output: the
    same construction as :func:`engines.local.tinymodel.make_adapter`, for any base model."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, TensorData] = {}
    for layer in range(shapes.layers):
        for module in sorted(targets):
            n_in, n_out = shapes.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = (rng.standard_normal((r, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, r)) * b_scale).astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = tensor_from_array(a)
            tensors[f"{prefix}.lora_B.weight"] = tensor_from_array(b)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": "loraledger-check",
    }
    return config, tensors


# --- the target -------------------------------------------------------------------------


@dataclass
class Target:
    """What the checks drive. ``engine`` publishes through its own transport; ``alternate``
    (optional) is a second adapter of the *same* server using its other transport (tensor or
    staged vs path), for ``tensor_vs_path``. Hooks, all optional:

    * ``hold`` / ``release``: freeze and resume running requests between tokens (SGLang's
      ``/pause_generation`` in place), so "in flight" during an unload is certain;
    * ``admitted``: True once the engine runs at least one request (a gauge), so the unload is
      sent under a running request rather than after a guess.
    """

    engine: Engine
    store: ArtifactStore
    shapes: ModelShapes
    kind: str
    url: str = ""
    version: str = "unknown"
    alternate: Engine | None = None
    hold: Callable[[], Awaitable[None]] | None = None
    release: Callable[[], Awaitable[None]] | None = None
    admitted: Callable[[], Awaitable[bool]] | None = None
    long_tokens: int = 256
    restart: Callable[[], Awaitable[None]] | None = None  # restarts the engine (and returns)
    restart_timeout: float = 600.0
    rank: int = 8
    targets: tuple[str, ...] = ("q_proj", "v_proj")


@dataclass
class _Published:
    name: str
    manifest: Manifest
    tensors: dict[str, TensorData]
    attempt: int
    path: str | None


@dataclass
class _Run:
    """One check run: what it published (to clean up), and the findings so far."""

    target: Target
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    findings: list[Finding] = field(default_factory=list)
    published: dict[tuple[int, str], _Published] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    loaded: set[tuple[int, str]] = field(default_factory=set)  # (engine index, name)
    written: set[str] = field(default_factory=set)  # digests whose directory this run created
    seeds: int = 0

    def note(self, check: str, holds: bool | None, detail: str, *, required: bool = True) -> None:
        self.findings.append(Finding(check=check, holds=holds, required=required, detail=detail))

    def engine(self, index: int) -> Engine:
        if index == 0:
            return self.target.engine
        assert self.target.alternate is not None
        return self.target.alternate

    def adapter(self, seed: int) -> tuple[dict[str, Any], dict[str, TensorData], Manifest]:
        config, tensors = throwaway_adapter(
            self.target.shapes, seed, r=self.target.rank, targets=self.target.targets
        )
        return config, tensors, build_manifest(config, tensors)

    def name_for(self, manifest: Manifest, tag: str) -> str:
        return f"llcheck@{self.run_id}-{tag}-{manifest.digest[:16]}"

    async def publish(
        self, seed: int, tag: str, *, index: int = 0, name: str | None = None
    ) -> _Published:
        """prepare -> transfer -> load through the engine's own transport."""
        engine = self.engine(index)
        _, tensors, manifest = self.adapter(seed)
        lora_name = name or self.name_for(manifest, tag)
        attempt = self.attempts.get(lora_name, 0) + 1
        self.attempts[lora_name] = attempt
        if not self.target.store.contains(manifest.digest):
            self.written.add(manifest.digest)
        path = str(self.target.store.put(manifest, tensors))
        candidate = Candidate(
            lora_name=lora_name,
            digest=manifest.digest,
            attempt=attempt,
            manifest=manifest,
            artifact_path=path,
        )
        published = _Published(lora_name, manifest, tensors, attempt, path)
        self.loaded.add((index, lora_name))  # from here on, clean it up whatever happens
        prepared = await engine.prepare(candidate)
        buckets = plan_buckets(tensors) if engine.transport == "staged" else ()
        await engine.transfer(candidate, aiter_buckets(buckets))
        ready = await engine.load(candidate)
        for receipt in (prepared, ready):
            if (receipt.lora_name, receipt.digest, receipt.attempt) != (
                lora_name,
                manifest.digest,
                attempt,
            ):
                raise _Broken(f"receipt {receipt} does not echo the candidate")
        self.published[(index, lora_name)] = published
        return published

    async def unload(self, name: str, *, index: int = 0) -> bool:
        receipt = await self.engine(index).unload(name, attempt=self.attempts.get(name))
        return receipt.was_loaded

    async def generate(
        self,
        name: str | None,
        *,
        prompt: str = PROMPT,
        params: SamplingParams = GREEDY,
        salt: str | None = None,
        index: int = 0,
    ) -> Generation:
        return await self.engine(index).generate(prompt, name, params, cache_salt=salt)


class _Broken(Exception):
    """A check found the property broken in a way the engine adapter did not classify."""


# --- the checks -------------------------------------------------------------------------


async def _incarnation(run: _Run) -> str:
    engine = run.target.engine
    first = await engine.incarnation()
    second = await engine.incarnation()
    inventory = await engine.inventory()
    holds = bool(first) and first == second == inventory.incarnation
    run.note(
        "incarnation",
        holds,
        f"{first!r}, stable across probes and carried by the inventory"
        if holds
        else f"probes {first!r}, {second!r}; inventory {inventory.incarnation!r}",
    )
    return first


async def _load_list_apply(run: _Run) -> _Published | None:
    engine = run.target.engine
    try:
        a = await run.publish(1, "a")
    except (EngineError, _Broken) as exc:
        run.note("load_and_list", False, f"publishing a throwaway adapter failed: {exc}")
        return None
    entries = {e.lora_name: e for e in (await engine.inventory()).adapters}
    entry = entries.get(a.name)
    run.note(
        "load_and_list",
        entry is not None,
        f"{a.name} listed (path {entry.path or '-'})"
        if entry is not None
        else f"load answered ready, but the inventory does not list {a.name}",
    )
    if entry is None:
        return None
    confirmed = entry.digest == a.manifest.digest
    run.note(
        "digest_confirmed",
        confirmed,
        f"the listing names digest {a.manifest.digest[:16]}"
        if confirmed
        else f"the listing names digest {entry.digest!r}, published {a.manifest.digest[:16]}",
    )
    base = await run.generate(None)
    first = await run.generate(a.name)
    again = await run.generate(a.name)
    applied = first.token_ids != base.token_ids and first.token_ids == again.token_ids
    run.note(
        "adapter_applied",
        applied,
        "greedy tokens differ from the base model and repeat"
        if applied
        else f"base {list(base.token_ids)}, adapter {list(first.token_ids)} then "
        f"{list(again.token_ids)}",
    )
    return a


async def _same_name_reload(run: _Run, a: _Published) -> None:
    """Other weights under a live name: the ledger never does it, but a retried or confused
    publication must not swap a version under its sessions."""
    before = await run.generate(a.name)
    try:
        await run.publish(2, "a", name=a.name)
    except CleanRefusal as exc:
        after = await run.generate(a.name)
        kept = after.token_ids == before.token_ids
        run.note(
            "same_name_reload",
            kept,
            f"refused cleanly ({exc.code}); the name kept its weights"
            if kept
            else f"refused ({exc.code}), yet the name now generates other tokens",
        )
        return
    except EngineError as exc:
        run.note("same_name_reload", False, f"ambiguous answer to a same-name load: {exc}")
        return
    after = await run.generate(a.name)
    run.note(
        "same_name_reload",
        False,
        "a second load under a live name was accepted"
        + (" and swapped its weights" if after.token_ids != before.token_ids else ""),
    )


async def _unload_in_flight(run: _Run) -> None:
    """Unload while a long request runs on the adapter: the request must finish on it."""
    t = run.target
    b = await run.publish(3, "b")
    long = SamplingParams(max_tokens=t.long_tokens, temperature=0.0, ignore_eos=True)
    reference = await run.generate(b.name, params=long)
    result: dict[str, Any] = {}

    async def request() -> None:
        try:
            result["gen"] = await run.generate(b.name, params=long)
        except EngineError as exc:
            result["error"] = exc
        result["request_done"] = time.monotonic()

    async def unload() -> None:
        try:
            result["was_loaded"] = await run.unload(b.name)
        except EngineError as exc:
            result["unload_error"] = exc
        result["unload_done"] = time.monotonic()

    held = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await _wait_admitted(t, result)
        if t.hold is not None and "request_done" not in result:
            await t.hold()
            held = True
        try:
            tg.start_soon(unload)
            if held:
                with anyio.move_on_after(HOLD_PROBE_S):
                    while "unload_done" not in result:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
        finally:
            if held and t.release is not None:
                await t.release()
    if "unload_error" in result or "error" in result:
        run.loaded.add((0, b.name))
        run.note(
            "unload_in_flight",
            False,
            f"unload: {result.get('unload_error', 'ok')}; request: {result.get('error', 'ok')}",
        )
        return
    if result["request_done"] <= result.get("unload_sent_after", math.inf):
        run.note(
            "unload_in_flight",
            None,
            "inconclusive: the request finished before the unload was sent (raise --long-tokens)",
            required=False,
        )
        await _after_unload(run, b)
        return
    gen: Generation = result["gen"]
    same = gen.token_ids == reference.token_ids and gen.finish_reason == "length"
    run.note(
        "unload_in_flight",
        same,
        f"the running request finished on its adapter ({len(gen.token_ids)} tokens)"
        if same
        else f"the running request ended with {gen.finish_reason} and other tokens",
    )
    drains = result["unload_done"] >= result["request_done"]
    how = "with requests held in place" if held else "while the request ran"
    if drains and not held:
        # Without a hold the request may simply have ended while the unload was on its way
        # (a loaded CPU, a slow unload): a draining unload and a slow one look alike. Only an
        # unload answered first tells (it cannot have waited).
        run.note(
            "unload_drains",
            None,
            "inconclusive: the request ended while the unload was on its way (this engine "
            "cannot hold requests, so a slow unload and a draining one look alike)",
            required=False,
        )
    else:
        run.note(
            "unload_drains",
            drains,
            f"the unload answered only after the request finished ({how})"
            if drains
            else f"the unload answered while the request still ran ({how}): only the ledger's "
            "in-flight count keeps a version loaded under its requests",
            required=False,
        )
    await _after_unload(run, b)


async def _wait_admitted(t: Target, result: dict[str, Any]) -> None:
    """Until the engine runs the request (its gauge), or a fixed grace without one."""
    deadline = time.monotonic() + 30.0
    if t.admitted is not None:
        while time.monotonic() < deadline and "request_done" not in result:
            if await t.admitted():
                break
            await anyio.sleep(0.02)
    else:
        await anyio.sleep(1.0)
    result["unload_sent_after"] = time.monotonic()


async def _after_unload(run: _Run, b: _Published) -> None:
    engine = run.target.engine
    listed = b.name in (await engine.inventory()).names()
    repeat = await run.unload(b.name)
    holds = not listed and repeat is False
    run.note(
        "refused_after_unload",
        holds,
        "gone from the inventory; a repeated unload answers 'was not loaded'"
        if holds
        else f"still listed: {listed}; repeated unload says was_loaded={repeat}",
    )
    try:
        await run.generate(b.name)
    except CleanRefusal as exc:
        run.note(
            "no_implicit_reload",
            True,
            f"a request naming it is refused ({exc.code})",
            required=False,
        )
        return
    run.loaded.add((0, b.name))
    run.note(
        "no_implicit_reload",
        False,
        "HAZARD: a request naming the unloaded adapter reloaded it from its path; the "
        "gateway must never send a name it does not know to be held (docs/engines.md)",
        required=False,
    )


async def _prefix_cache(run: _Run) -> None:
    """A version never reads another version's cache: C's tokens after B warmed the same
    long prompt equal C's tokens computed in a namespace of their own."""
    b = await run.publish(4, "pb")
    c = await run.publish(5, "pc")
    isolated = await run.generate(c.name, prompt=LONG_PROMPT, salt=uuid.uuid4().hex)
    await run.generate(b.name, prompt=LONG_PROMPT)
    warm = await run.generate(b.name, prompt=LONG_PROMPT)
    after = await run.generate(c.name, prompt=LONG_PROMPT)
    holds = after.token_ids == isolated.token_ids and after.cached_tokens == 0
    reuse = (
        f"same-version reuse: {warm.cached_tokens} cached tokens"
        if warm.cached_tokens
        else "the engine reports no cached tokens"
    )
    run.note(
        "prefix_cache",
        holds,
        f"the other version's warm prefix was not reused ({reuse})"
        if holds
        else f"tokens after another version warmed the prefix differ ({after.cached_tokens} "
        "cached tokens): stale KV across versions",
    )


async def _tensor_vs_path(run: _Run) -> None:
    t = run.target
    if t.alternate is None:
        run.note(
            "tensor_vs_path",
            None,
            f"{t.kind} offers one transport here ({t.engine.transport}); nothing to compare",
        )
        return
    one = await run.publish(6, "tp0", index=0)
    two = await run.publish(6, "tp1", index=1)
    first = await run.generate(one.name, index=0)
    second = await run.generate(two.name, index=1)
    same = first.token_ids == second.token_ids
    kinds = f"{t.engine.transport} vs {t.alternate.transport}"
    run.note(
        "tensor_vs_path",
        same,
        f"{kinds} loads of one adapter give the same greedy tokens"
        if same
        else f"{kinds}: {list(first.token_ids)} vs {list(second.token_ids)}",
    )


async def _restart(run: _Run, restart: Callable[[], Awaitable[None]]) -> None:
    """Restart the engine: the ledger needs the incarnation to change (its repair trigger)."""
    engine = run.target.engine
    r = await run.publish(7, "rs")
    before = await engine.incarnation()
    try:
        await restart()
    except Exception as exc:
        raise _Broken(f"the restart command failed: {exc}") from exc
    after = before
    with anyio.move_on_after(run.target.restart_timeout):
        while after == before:
            try:
                after = await engine.incarnation()
            except EngineError:  # down while it restarts
                after = before
            if after == before:
                await anyio.sleep(0.5)
    changed = after != before
    run.note(
        "restart_detected",
        changed,
        f"the incarnation changed across the restart ({before!r} -> {after!r})"
        if changed
        else f"the incarnation stayed {before!r} across the restart: a restarted engine would "
        "be routed to as if it still held its versions",
    )
    if not changed:
        return
    kept = r.name in (await engine.inventory()).names()
    if not kept:
        run.loaded.discard((0, r.name))
    run.note(
        "restart_forgets",
        not kept,
        "the restarted engine holds nothing loaded before (the reconciler restores it)"
        if not kept
        else "the restarted engine still lists an adapter loaded before the restart",
        required=False,
    )


async def _clean_up(run: _Run) -> None:
    """Unload everything this run may have left (shielded: it runs even when cancelled)."""
    for index, name in sorted(run.loaded):
        with contextlib.suppress(EngineError):  # what stays is reported by left_as_found
            await run.unload(name, index=index)


async def run_checks(target: Target) -> Report:
    """Run every check against ``target``; the engine is left as found (``finally``)."""
    run = _Run(target)
    before = await target.engine.inventory()
    incarnation = ""
    try:
        incarnation = await _incarnation(run)
        a = await _load_list_apply(run)
        if a is not None:
            await _same_name_reload(run, a)
            await _unload_in_flight(run)
            await _prefix_cache(run)
            await _tensor_vs_path(run)
            if target.restart is not None:
                await _restart(run, target.restart)
    except (EngineError, _Broken) as exc:
        run.note("run", False, f"the check run stopped: {exc}")
    finally:
        with anyio.CancelScope(shield=True):
            await _clean_up(run)
    after = await target.engine.inventory()
    same = after.names() == before.names()
    still_read = {e.path for e in after.adapters}
    for digest in run.written:  # never a directory some held adapter was loaded from
        if str(target.store.path_for(digest)) not in still_read:
            target.store.delete(digest)
    run.note(
        "left_as_found",
        same,
        f"holds the {len(before.adapters)} adapter(s) it held before"
        if same
        else f"before {sorted(before.names())}, after {sorted(after.names())}",
    )
    return Report(
        kind=target.kind,
        url=target.url,
        engine_version=target.version,
        incarnation=incarnation,
        findings=tuple(run.findings),
    )


# --- building the target for a live URL -------------------------------------------------


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
            served_targets = list(_ATTENTION)
        targets = tuple(m for m in ("q_proj", "v_proj") if m in served_targets) or tuple(
            m for m in _ATTENTION if m in served_targets
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
        shapes=ModelShapes.from_config(config),
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


# --- rendering ----------------------------------------------------------------------------


def render(report: Report) -> Any:
    """A rich table: one row per check, what holds and what does not."""
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"{report.kind} engine at {report.url}: {report.engine_version}",
        caption=(
            "every property the ledger needs holds"
            if report.ok
            else f"{len(report.failures)} property(ies) the ledger needs do not hold"
        ),
    )
    table.add_column("check")
    table.add_column("holds")
    table.add_column("needed")
    table.add_column("detail", overflow="fold")
    for f in report.findings:
        if f.holds is None:
            mark = Text("n/a", style="dim")
        elif f.holds:
            mark = Text("yes", style="green")
        else:
            mark = Text("NO", style="bold red" if f.required else "yellow")
        table.add_row(f.check, mark, "yes" if f.required else "no", f.detail)
    return table


def as_json(report: Report) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(report)
    data["ok"] = report.ok
    return data
