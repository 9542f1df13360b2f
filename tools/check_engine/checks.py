"""The checks of ``loraledger check-engine``: each property of docs/engines.md, probed on a target.

A run publishes throwaway adapters and takes them off again *through the engine protocol the ledger
uses* (:mod:`publisher.drivers.engine_protocol`):
:func:`~publisher.drivers.engine_protocol.stage_and_load` (prepare, transfer, load, then a fresh
inventory must list the name with its digest) and
:func:`~publisher.drivers.engine_protocol.unload_fenced` (an attempt-fenced unload, ``NOT_LOADED``
counting as gone), under the ledger's default deadlines. So what passes here is what a publication
and a reclaim will see, not a look-alike of them. The adapters are the tiny-model
construction (:func:`engines.local.tinymodel.make_adapter`) shaped for the engine's base model.

The checks take a :class:`Target` (the engine adapters plus optional hooks), so tests can run
them against a deliberately misbehaving engine (the fault wrapper); :mod:`.live` builds the
target for a live URL. The engine is left as it was found: every throwaway adapter is unloaded
(and its directory deleted) in a ``finally``, whatever failed.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from engines.artifacts import ArtifactStore
from engines.contract import (
    Candidate,
    CleanRefusal,
    Engine,
    EngineError,
    Generation,
    SamplingParams,
)
from engines.local.tinymodel import ModelShapes, make_adapter
from engines.manifest import Manifest, TensorData, build_manifest
from publisher.drivers.adapter_copy import plan_buckets
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.engine_protocol import (
    LoadNotConfirmed,
    UnloadAnswer,
    stage_and_load,
    unload_fenced,
)
from tools.check_engine.report import Finding, Report

PROMPT = "the quick brown fox jumps over the lazy dog"
# Long enough that a prefix cache with large blocks (vLLM's CPU backend: 128 tokens) caches it.
LONG_PROMPT = " ".join(["hello world, this is a tiny model for integration tests"] * 16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HOLD_PROBE_S = 1.5  # how long an unload may stay unanswered before we call it draining
# The base model the throwaway adapters' configs name (any: the engine serves its own).
CHECK_BASE = "loraledger-check"


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
    # The ledger's default deadlines for each engine call of the protocol.
    timeouts: EngineTimeouts = field(default_factory=EngineTimeouts)


@dataclass
class _Throwaway:
    """One throwaway adapter, written to the artifact store, for engine ``index`` (0: the
    target's engine, 1: its alternate)."""

    name: str
    manifest: Manifest
    tensors: dict[str, TensorData]
    attempt: int
    path: str
    index: int


@dataclass
class _Run:
    """One check run: what it published (to clean up), and the findings so far."""

    target: Target
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    findings: list[Finding] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    loaded: set[tuple[int, str]] = field(default_factory=set)  # (engine index, name)
    written: set[str] = field(default_factory=set)  # digests whose directory this run created

    def note(self, check: str, holds: bool | None, detail: str, *, required: bool = True) -> None:
        self.findings.append(Finding(check=check, holds=holds, required=required, detail=detail))

    def engine(self, index: int) -> Engine:
        if index == 0:
            return self.target.engine
        assert self.target.alternate is not None
        return self.target.alternate

    def throwaway(
        self, seed: int, tag: str, *, index: int = 0, name: str | None = None
    ) -> _Throwaway:
        """A throwaway adapter of the target's shapes, rank and modules, in the artifact store,
        under its next attempt (``name``: another name than its own, e.g. a live one)."""
        t = self.target
        config, tensors = make_adapter(
            seed,
            r=t.rank,
            alpha=2 * t.rank,
            targets=t.targets,
            shapes=t.shapes,
            base_model=CHECK_BASE,
        )
        manifest = build_manifest(config, tensors)
        lora_name = name or f"llcheck@{self.run_id}-{tag}-{manifest.digest[:16]}"
        attempt = self.attempts.get(lora_name, 0) + 1
        self.attempts[lora_name] = attempt
        if not t.store.contains(manifest.digest):
            self.written.add(manifest.digest)
        path = str(t.store.put(manifest, tensors))
        return _Throwaway(lora_name, manifest, tensors, attempt, path, index)

    async def load(self, adapter: _Throwaway) -> None:
        """Put ``adapter`` on its engine as a publication does, through the engine's own transport:
        :func:`~publisher.drivers.engine_protocol.stage_and_load` (a load its inventory does not
        confirm raises :class:`~publisher.drivers.engine_protocol.LoadNotConfirmed`), and both
        receipts must echo the candidate."""
        engine = self.engine(adapter.index)
        candidate = Candidate(
            lora_name=adapter.name,
            digest=adapter.manifest.digest,
            attempt=adapter.attempt,
            manifest=adapter.manifest,
            artifact_path=adapter.path,
        )
        self.loaded.add((adapter.index, adapter.name))  # from here on, clean it up whatever happens
        buckets = plan_buckets(adapter.tensors) if engine.transport == "staged" else ()
        loaded = await stage_and_load(engine, candidate, buckets, timeouts=self.target.timeouts)
        for receipt in (loaded.prepared, loaded.ready):
            if (receipt.lora_name, receipt.digest, receipt.attempt) != (
                adapter.name,
                adapter.manifest.digest,
                adapter.attempt,
            ):
                raise _Broken(f"receipt {receipt} does not echo the candidate")

    async def publish(
        self, seed: int, tag: str, *, index: int = 0, name: str | None = None
    ) -> _Throwaway:
        """A throwaway adapter (:meth:`throwaway`), loaded (:meth:`load`)."""
        adapter = self.throwaway(seed, tag, index=index, name=name)
        await self.load(adapter)
        return adapter

    async def unload(self, name: str, *, index: int = 0) -> UnloadAnswer:
        """Take ``name`` off as the ledger does: one unload fenced by the attempt this run last
        published it under (:func:`~publisher.drivers.engine_protocol.unload_fenced`: never
        raises; a receipt or ``NOT_LOADED`` says it is gone)."""
        return await unload_fenced(
            self.engine(index),
            name,
            attempt=self.attempts.get(name),
            timeout=self.target.timeouts.unload,
        )

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


async def _load_list_apply(run: _Run) -> _Throwaway | None:
    engine = run.target.engine
    a = run.throwaway(1, "a")
    try:
        await run.load(a)
    except LoadNotConfirmed:
        pass  # the engine answered ready: the inventory read below says what it failed to hold
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


async def _same_name_reload(run: _Run, a: _Throwaway) -> None:
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
        answer = await run.unload(b.name)
        if answer.error is not None:
            result["unload_error"] = answer.error
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


async def _after_unload(run: _Run, b: _Throwaway) -> None:
    engine = run.target.engine
    listed = b.name in (await engine.inventory()).names()
    answer = await run.unload(b.name)
    if answer.error is not None:  # neither a receipt nor NOT_LOADED: the run cannot go on
        raise answer.error
    repeat = answer.receipt is not None and answer.receipt.was_loaded
    holds = not listed and not repeat
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
        await run.unload(name, index=index)  # whatever it answers: left_as_found reports what stays


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
