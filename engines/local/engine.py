"""The local reference engine: a tiny causal LM with peft adapters, behind the engine contract.

It is the engine the demo and most tests run, and the stand-in for a GPU SGLang server (through
:mod:`engines.local.server`), so it implements SGLang's LoRA semantics where they are safe and
loraledger's stricter ones where SGLang is not (docs/engines.md, SGLang):

* **Per-request references** (:mod:`engines.local.refs`): a request takes its lease before
  dispatch and gives it back exactly once, in a ``finally`` -- normal finish, failure before
  dispatch, abort, caller cancellation or disconnect, ``n>1`` children sharing one lease.
* **Unload** unregisters the name at once (new requests refused), then an engine-owned task
  waits for the references to reach zero and frees the adapter; the unload answer comes when the
  adapter is physically gone. State-changing work (install, unregister + drain) always runs in
  the engine's task group and callers only *wait* for it, so a caller that is cancelled or
  disconnects can neither cancel a drain nor leave a half-installed adapter behind -- without
  any shielding.
* **Managed names** (the ledger's ``prepare``/``transfer``/``load`` path) are protected from
  ordinary SGLang-style load/unload, never implicitly reloaded once reclaimed, and fenced by
  attempt (:mod:`engines.local.name_table`). Ordinary names behave like stock SGLang, including the
  hazardous implicit reload of an unloaded name from its old path (``implicit_reload``) and the
  ``lora_update_lock`` that an ordinary unload holds through its drain.
* **Prefix cache** keyed by the engine-local adapter id (:mod:`engines.local.prefix_cache`).
* **Model work** goes through :mod:`engines.local.scheduler` (worker threads behind a limiter of
  one, one prefill or one token per call): the event loop never blocks, requests interleave
  token by token, abort and cancellation take effect between tokens, and a step already running
  always completes before its lease can be released (no computation uses a freed adapter).

Use it as ``async with LocalEngine(...) as engine:`` (the task group lives in that block).

Why one module of ~750 lines: lifecycle, load/unload and generation share the engine's task
group and lock order (the compat lock, the name table, the drain); what stands alone already
lives beside it (refs, name_table, scheduler, prefix_cache, admission, model).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

from engines.artifacts import HEADER_ALLOWANCE, ArtifactError, read_adapter_dir
from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    Choice,
    CleanRefusal,
    EngineCapabilities,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    InventoryEntry,
    Receipt,
    SamplingParams,
    Transport,
    UnloadReceipt,
    check_name,
)
from engines.local.admission import AdapterPlan, ServingLimits, TensorShape, plan_adapter, shapes_of
from engines.local.model import ModelRunner
from engines.local.name_table import NameTable, Resident, new_adapter_id
from engines.local.refs import Lease, RefCounter
from engines.local.scheduler import OnToken, Scheduler, check_params
from engines.local.tinymodel import SERVED_NAME, ensure_tiny_model
from engines.manifest import (
    ManifestError,
    TensorData,
    TensorInfo,
    build_manifest,
    compute_digest,
    tensor_checksum,
)
from engines.tensor_wire import TENSOR_ROOT

T = TypeVar("T")


class _Outcome:
    """Result slot of an engine-owned job; waiters never own the work."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.value: Any = None


def resolve_under(root: Path | None, path: str) -> Path:
    """An adapter directory, refused with PATH_OUTSIDE_STORE when an allowed root is configured
    and the resolved path (symlinks and ``..`` followed) is not inside it."""
    candidate = Path(path)
    if root is not None and not candidate.is_absolute():
        candidate = root / candidate
    try:
        resolved = candidate.resolve()
    except (ValueError, OSError) as exc:  # a NUL byte, a symlink loop: no such directory
        raise CleanRefusal(
            ErrorCode.PATH_OUTSIDE_STORE, f"{path!r} is not a usable path: {exc}"
        ) from exc
    if root is None:
        return resolved
    if resolved == root or not resolved.is_relative_to(root):
        raise CleanRefusal(
            ErrorCode.PATH_OUTSIDE_STORE, f"{path} is not inside the artifact root {root}"
        )
    return resolved


class LocalEngine:
    """In-process reference engine implementing :class:`engines.contract.Engine`.

    ``transport`` is what the ledger should use with it: ``"staged"`` (buckets through
    ``transfer``) or ``"artifact"`` (``load`` reads ``candidate.artifact_path``); both work
    either way. ``artifact_root``, when set, confines every path load to that directory.
    """

    kind = "local"
    capabilities = EngineCapabilities()  # in process: no address, no extra body fields

    def __init__(
        self,
        engine_id: str = "local",
        *,
        model_dir: str | os.PathLike[str] | None = None,
        limits: ServingLimits | None = None,
        artifact_root: str | os.PathLike[str] | None = None,
        transport: Transport = "staged",
        threads: int = 1,
        prefix_cache_entries: int = 64,
        implicit_reload: bool = True,
        served_model_name: str = SERVED_NAME,
    ) -> None:
        self.engine_id = engine_id
        self.transport: Transport = transport
        self.limits = limits or ServingLimits()
        self.artifact_root = Path(artifact_root).resolve() if artifact_root else None
        self.implicit_reload = implicit_reload
        self.served_model_name = served_model_name
        self._model_dir = Path(model_dir) if model_dir else None
        self._threads = threads
        self._prefix_cache_entries = prefix_cache_entries
        self._incarnation = uuid.uuid4().hex
        self.startup_time = time.time()
        self._names = NameTable()
        self._runner: ModelRunner | None = None
        self._module_shapes: dict[str, tuple[int, int]] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._freed: dict[str, anyio.Event] = {}  # adapter id -> set once physically freed
        self._job_scopes: set[anyio.CancelScope] = set()
        self._scheduler: Scheduler | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> LocalEngine:
        model_dir = self._model_dir
        if model_dir is None:
            model_dir = await anyio.to_thread.run_sync(ensure_tiny_model)
        torch.set_num_threads(self._threads)
        runner = await anyio.to_thread.run_sync(
            functools.partial(
                ModelRunner, Path(model_dir), prefix_cache_entries=self._prefix_cache_entries
            )
        )
        self._runner = runner
        self._module_shapes = runner.module_shapes()
        self._scheduler = Scheduler(runner, self.engine_id)
        self._control_lock = anyio.Lock()  # one control-plane mutation at a time
        self._compat_lock = anyio.Lock()  # SGLang's lora_update_lock (ordinary path only)
        self._stack = contextlib.AsyncExitStack()
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self.startup_time = time.time()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Stop: pending drains and jobs are cancelled (their waiters get ENGINE_STOPPED) and
        in-flight generations end with ENGINE_STOPPED at their next token."""
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        # Cancel the jobs one by one, never the task group's own scope: that scope also covers
        # the task that entered the engine (the caller's code inside ``async with``).
        for scope in list(self._job_scopes):
            scope.cancel()

    @property
    def model_dir(self) -> Path:
        return self._require_runner().model_dir

    def _require_runner(self) -> ModelRunner:
        if self._runner is None or self._tg is None or self._closed:
            raise AmbiguousReply(
                ErrorCode.ENGINE_STOPPED,
                f"engine {self.engine_id} is not running",
                engine_id=self.engine_id,
            )
        return self._runner

    def _require_scheduler(self) -> Scheduler:
        self._require_runner()
        assert self._scheduler is not None
        return self._scheduler

    async def _submit(self, job: Callable[[], Awaitable[T]]) -> T:
        """Run ``job`` in the engine's task group and wait for it. Cancelling the waiter does
        not cancel the job: state changes are never left half-done by a vanished caller."""
        self._require_runner()
        assert self._tg is not None
        outcome = _Outcome()

        async def run() -> None:
            finished = False
            try:
                with anyio.CancelScope() as scope:
                    self._job_scopes.add(scope)
                    try:
                        outcome.value = await job()
                    except Exception as exc:
                        outcome.error = exc
                    finished = True
            finally:
                self._job_scopes.discard(scope)
                if not finished:  # cancelled by aclose() or by whoever stops the engine
                    outcome.error = AmbiguousReply(
                        ErrorCode.ENGINE_STOPPED,
                        f"engine {self.engine_id} stopped before the operation finished",
                        engine_id=self.engine_id,
                    )
                outcome.done.set()

        self._tg.start_soon(run)
        await outcome.done.wait()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[no-any-return]

    def _tag(self, exc: EngineError) -> EngineError:
        exc.engine_id = self.engine_id
        return exc

    # --- identity and state --------------------------------------------------------------------

    async def incarnation(self) -> str:
        self._require_runner()
        return self._incarnation

    @property
    def incarnation_id(self) -> str:
        return self._incarnation

    async def inventory(self) -> Inventory:
        self._require_runner()
        return Inventory(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            adapters=tuple(
                InventoryEntry(lora_name=r.lora_name, digest=r.digest, path=r.path)
                for r in sorted(self._names.residents.values(), key=lambda r: r.lora_name)
            ),
            staged=tuple(sorted(self._names.staging)),
        )

    def loaded_adapters(self) -> dict[str, str]:
        """``{name: path}`` as SGLang's ``loaded_adapters`` (staged loads show ``__tensor__``)."""
        return self._names.loaded_paths()

    def residents(self) -> list[Resident]:
        return list(self._names.residents.values())

    def refcount(self, lora_name: str) -> int:
        """Live references on the adapter registered or draining under ``lora_name``."""
        resident = self._names.residents.get(lora_name) or self._names.draining_name(lora_name)
        return 0 if resident is None else resident.refs.count

    def draining(self) -> list[str]:
        return sorted(r.lora_name for r in self._names.draining.values())

    def staged(self) -> list[str]:
        return sorted(self._names.staging)

    def model_adapters(self) -> list[str]:
        """Engine-local ids resident in the model (peft), for leak checks in tests."""
        return self._require_runner().adapters()

    @property
    def in_flight(self) -> int:
        return 0 if self._scheduler is None else self._scheduler.in_flight

    @property
    def eos_token_id(self) -> int | None:
        return self._require_runner().eos_token_id

    @property
    def max_length(self) -> int:
        return self._require_runner().max_length

    async def flush_cache(self) -> None:
        """Drop every prefix-cache entry (through the model worker, which owns the cache)."""
        runner = self._require_runner()
        await self._require_scheduler().run_model(runner.prefix_cache.clear)

    # --- managed (ledger) path -------------------------------------------------------------------

    def _check_candidate(self, c: Candidate) -> AdapterPlan:
        check_name(c.lora_name)
        if isinstance(c.attempt, bool) or not isinstance(c.attempt, int) or c.attempt < 1:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, f"attempt {c.attempt!r} must be >= 1")
        try:
            recomputed = compute_digest(c.manifest.config, c.manifest.tensors)
        except ManifestError as exc:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, str(exc)) from exc
        if c.manifest.digest != c.digest or recomputed != c.digest:
            raise CleanRefusal(
                ErrorCode.DIGEST_MISMATCH,
                f"candidate digest {c.digest[:16]} does not match its manifest "
                f"({c.manifest.digest[:16]}, recomputed {recomputed[:16]})",
            )
        if c.artifact_path is not None and self.transport == "artifact":
            resolve_under(self.artifact_root, c.artifact_path)
        return plan_adapter(
            c.manifest.config,
            (TensorShape(t.name, t.dtype, tuple(t.shape)) for t in c.manifest.tensors),
            self._module_shapes,
            self.limits,
        )

    async def prepare(self, candidate: Candidate) -> Receipt:
        """Validate what we can before any byte moves, and fence the attempt."""
        self._require_runner()
        try:
            self._check_candidate(candidate)
            async with self._control_lock:
                self._names.begin_prepare(candidate)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "prepared")

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        async for bucket in buckets:
            await self.receive_bucket(
                candidate.lora_name, candidate.attempt, candidate.digest, bucket
            )

    async def receive_bucket(
        self, lora_name: str, attempt: int, digest: str, bucket: Bucket
    ) -> int:
        """Verify each tensor of one bucket against the manifest on arrival. Any mismatch
        drops the whole staging area (nothing half-received survives a refusal). Returns the
        number of tensors received so far."""
        self._require_runner()
        try:
            replayed = self._names.resident_replay(lora_name, attempt, digest)
            if replayed is not None:  # a retried transfer of a loaded attempt: nothing to do
                return len(bucket.tensors)
            staging = self._names.staging_for(lora_name, attempt, digest)
            sums = await anyio.to_thread.run_sync(
                lambda: [
                    tensor_checksum(b.tensor.dtype, b.tensor.shape, b.tensor.data)
                    for b in bucket.tensors
                ]
            )
            async with self._control_lock:
                if self._names.staging_for(lora_name, attempt, digest) is not staging:
                    raise CleanRefusal(ErrorCode.NOT_PREPARED, f"{lora_name} was prepared again")
                expected = {t.name: t for t in staging.candidate.manifest.tensors}
                for item, checksum in zip(bucket.tensors, sums, strict=True):
                    refusal = _bucket_refusal(
                        expected.get(item.name), item.name, item.tensor, checksum
                    )
                    if refusal is not None:
                        self._names.drop_staging(lora_name)
                        raise refusal
                    staging.tensors[item.name] = item.tensor
                    staging.checksums[item.name] = checksum
                return len(staging.tensors)
        except EngineError as exc:
            raise self._tag(exc) from None

    async def load(self, candidate: Candidate) -> Receipt:
        """Recompute the digest from what was received (or read from the artifact path), build
        the adapter and register it under its immutable name. A refusal leaves nothing."""
        self._require_runner()
        try:
            check_name(candidate.lora_name)
            await self._submit(lambda: self._load_job(candidate))
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "ready")

    async def _load_job(self, c: Candidate) -> None:
        async with self._control_lock:
            if self._names.resident_replay(c.lora_name, c.attempt, c.digest) is not None:
                return
            staging = self._names.staging_for(c.lora_name, c.attempt, c.digest)
            try:
                if staging.tensors or c.artifact_path is None:
                    missing = sorted({t.name for t in c.manifest.tensors} - set(staging.tensors))
                    if missing:
                        raise CleanRefusal(
                            ErrorCode.INVALID_ADAPTER,
                            f"{len(missing)} manifest tensors never arrived, e.g. {missing[:3]}",
                        )
                    # the config fenced at prepare; the digest below proves it is the candidate's
                    config = staging.candidate.manifest.config
                    tensors, path = dict(staging.tensors), None
                    digest = compute_digest(
                        config,
                        [
                            TensorInfo(n, t.dtype, tuple(t.shape), t.nbytes, staging.checksums[n])
                            for n, t in tensors.items()
                        ],
                    )
                else:
                    resolved = resolve_under(self.artifact_root, c.artifact_path)
                    config, tensors, digest = await self._read_dir(resolved, c.manifest.total_bytes)
                    path = str(resolved)
                if digest != c.digest:
                    raise CleanRefusal(
                        ErrorCode.DIGEST_MISMATCH,
                        f"received content hashes to {digest[:16]}, candidate says {c.digest[:16]}",
                    )
                plan = plan_adapter(config, shapes_of(tensors), self._module_shapes, self.limits)
                await self._install(
                    c.lora_name,
                    plan,
                    tensors,
                    digest=digest,
                    path=path,
                    managed=True,
                    attempt=c.attempt,
                )
            finally:
                self._names.drop_staging(c.lora_name)

    async def unload(
        self, lora_name: str, *, attempt: int | None = None, fenced_only: bool = False
    ) -> UnloadReceipt:
        """Managed unload (reclaim, or cleanup of ``attempt``). An absent name answers
        ``was_loaded=False`` (idempotent retry); a stale attempt is refused (STALE_ATTEMPT).
        ``fenced_only`` (the HTTP face, where any caller may knock): a managed name without an
        attempt is refused (ATTEMPT_REQUIRED), checked under the control lock so that a name
        managed meanwhile cannot slip through."""
        self._require_runner()
        try:
            check_name(lora_name)
            was_loaded = await self._submit(
                lambda: self._unload_job(lora_name, attempt, fenced_only)
            )
        except EngineError as exc:
            raise self._tag(exc) from None
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=lora_name,
            was_loaded=was_loaded,
        )

    async def _unload_job(self, name: str, attempt: int | None, fenced_only: bool) -> bool:
        resident: Resident | None = None
        earlier: Resident | None = None
        async with self._control_lock:
            if attempt is None and fenced_only and name in self._names.managed:
                raise CleanRefusal(
                    ErrorCode.ATTEMPT_REQUIRED,
                    f"{name} is managed by loraledger: an unload must name the attempt it cleans "
                    "up (the ledger always does)",
                )
            if attempt is not None:
                self._names.fence_cleanup(name, attempt)
            else:
                self._names.drop_staging(name)
            if name in self._names.residents:
                resident = self._names.unregister(name)
            else:
                earlier = self._names.draining_name(name)  # an earlier unload's drain
        if resident is not None:
            await self._free_when_drained(resident)
            return True
        if earlier is not None:
            await self._wait_freed(earlier)
        return False

    def _receipt(self, c: Candidate, phase: Any) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=c.lora_name,
            digest=c.digest,
            attempt=c.attempt,
            phase=phase,
        )

    # --- ordinary (SGLang-style) path ---------------------------------------------------------

    async def load_ordinary(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """SGLang ``/load_lora_adapter``: load a PEFT directory under a name. Returns the
        loaded adapters ``{name: path}``."""
        self._require_runner()

        async def job() -> None:
            async with self._compat_lock:
                await self._load_ordinary_locked(lora_name, lora_path)

        try:
            await self._submit(job)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self.loaded_adapters()

    async def _load_ordinary_locked(self, name: str, path: str) -> None:
        check_name(name)
        self._names.check_ordinary_load(name)
        resolved = resolve_under(self.artifact_root, path)
        config, tensors, digest = await self._read_dir(resolved)
        plan = plan_adapter(config, shapes_of(tensors), self._module_shapes, self.limits)
        async with self._control_lock:
            self._names.check_ordinary_load(name)  # again: we awaited since
            await self._install(
                name, plan, tensors, digest=digest, path=str(resolved), managed=False, attempt=None
            )

    async def unload_ordinary(self, lora_name: str) -> dict[str, str]:
        """SGLang ``/unload_lora_adapter``: returns only after the adapter's requests drained,
        holding the update lock meanwhile (so ordinary loads and implicit reloads wait, as in
        SGLang 0.5.23). Managed names are refused with NAME_PROTECTED."""
        self._require_runner()

        async def job() -> None:
            async with self._compat_lock:
                async with self._control_lock:
                    self._names.check_ordinary_unload(lora_name)
                    resident = self._names.unregister(lora_name)
                await self._free_when_drained(resident)

        try:
            await self._submit(job)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self.loaded_adapters()

    async def load_tensors_ordinary(
        self, lora_name: str, config: dict[str, Any], tensors: dict[str, TensorData]
    ) -> dict[str, str]:
        """SGLang ``/load_lora_adapter_from_tensors`` (decoded and checksummed by the face):
        register an ordinary name whose weights came in the request. It lists with root
        ``__tensor__`` and, having no path, is never implicitly reloaded."""
        self._require_runner()

        async def job() -> None:
            async with self._compat_lock:
                check_name(lora_name)
                self._names.check_ordinary_load(lora_name)
                plan = plan_adapter(config, shapes_of(tensors), self._module_shapes, self.limits)
                digest = build_manifest(config, tensors).digest
                async with self._control_lock:
                    self._names.check_ordinary_load(lora_name)
                    await self._install(
                        lora_name,
                        plan,
                        tensors,
                        digest=digest,
                        path=None,
                        managed=False,
                        attempt=None,
                    )

        try:
            await self._submit(job)
        except ManifestError as exc:
            raise self._tag(CleanRefusal(ErrorCode.INVALID_ADAPTER, str(exc))) from None
        except EngineError as exc:
            raise self._tag(exc) from None
        return self.loaded_adapters()

    async def _implicit_reload(self, name: str) -> None:
        """Stock SGLang (0.5.23) reloads an unloaded ordinary name from its old path when a
        request names it; reproduced for ordinary names only, never managed ones. An adapter
        loaded from tensors has no path and fails, as in SGLang."""
        path = self._names.history[name]
        if path == TENSOR_ROOT:
            raise CleanRefusal(
                ErrorCode.NOT_LOADED,
                f"Failed to implicitly load LoRA adapter {name}: it was loaded from tensors "
                f"({TENSOR_ROOT}) and cannot be reloaded",
            )

        async def job() -> None:
            async with self._compat_lock:
                if name not in self._names.residents:
                    await self._load_ordinary_locked(name, path)

        try:
            await self._submit(job)
        except CleanRefusal as exc:
            raise CleanRefusal(
                ErrorCode.NOT_LOADED, f"Failed to implicitly load LoRA adapter {name}: {exc}"
            ) from exc

    # --- shared mechanics ---------------------------------------------------------------------

    def _largest_adapter_bytes(self) -> int:
        """The largest weights file an admissible adapter can have: every module at the rank
        limit, in the widest dtype accepted (F32), plus the safetensors header."""
        r = self.limits.max_lora_rank
        tensors = sum(r * (n_in + n_out) * 4 for n_in, n_out in self._module_shapes.values())
        return tensors + HEADER_ALLOWANCE

    async def _read_dir(
        self, path: Path, declared: int | None = None
    ) -> tuple[dict[str, Any], dict[str, TensorData], str]:
        """Read an adapter directory, at most ``declared`` weight bytes (the manifest's total,
        for a candidate) or what any admissible adapter could need."""
        limit = self._largest_adapter_bytes()
        if declared is not None:
            limit = min(limit, declared + HEADER_ALLOWANCE)

        def read() -> tuple[dict[str, Any], dict[str, TensorData], str]:
            config, tensors = read_adapter_dir(path, max_weights_bytes=limit)
            return config, tensors, build_manifest(config, tensors).digest

        try:
            return await anyio.to_thread.run_sync(read)
        except ArtifactError as exc:
            raise CleanRefusal(exc.code, exc.message) from exc
        except (ManifestError, OSError) as exc:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"{path}: {exc}") from exc

    async def _install(
        self,
        name: str,
        plan: AdapterPlan,
        tensors: dict[str, TensorData],
        *,
        digest: str,
        path: str | None,
        managed: bool,
        attempt: int | None,
    ) -> None:
        """Build the peft adapter under a fresh engine-local id and register the name. Runs
        inside a job holding the control lock, so the name table cannot change meanwhile."""
        runner = self._require_runner()
        adapter_id = new_adapter_id()
        try:
            await self._require_scheduler().run_model(runner.add_adapter, adapter_id, plan, tensors)
        except (ValueError, RuntimeError, KeyError) as exc:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"peft refused {name}: {exc}") from exc
        self._names.register(
            Resident(
                lora_name=name,
                adapter_id=adapter_id,
                digest=digest,
                path=path,
                managed=managed,
                attempt=attempt,
                refs=RefCounter(adapter_id),
            )
        )
        self._freed[adapter_id] = anyio.Event()

    async def _free_when_drained(self, resident: Resident) -> None:
        """Wait for the last holder, then free the weights. Called once per resident, by the
        job that unregistered it."""
        await resident.refs.wait_zero()
        await self._require_scheduler().run_model(
            self._require_runner().remove_adapter, resident.adapter_id
        )
        self._names.freed(resident)
        self._freed.pop(resident.adapter_id).set()

    async def _wait_freed(self, resident: Resident) -> None:
        """For a retried unload that found the name already draining: answer when it is gone."""
        freed = self._freed.get(resident.adapter_id)
        if freed is not None:
            await freed.wait()

    # --- generation control ------------------------------------------------------------------

    def pause_generation(self) -> None:
        """Freeze every in-flight request in place between tokens (SGLang ``in_place``)."""
        self._require_scheduler().pause()

    def continue_generation(self) -> None:
        self._require_scheduler().resume()

    @property
    def paused(self) -> bool:
        return self._scheduler is not None and self._scheduler.paused

    def abort(self, request_id: str) -> bool:
        """Stop one request at its next token; it answers with finish_reason ``abort``."""
        return self._require_scheduler().abort(request_id)

    def abort_all(self) -> int:
        return self._require_scheduler().abort_all()

    # --- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        extra_key: str | None = None,
        on_token: OnToken | None = None,
    ) -> Generation:
        """Generate once. ``cache_salt``/``extra_key`` namespace the prefix cache (SGLang's
        fields); they never select or reveal another adapter's cache entries. ``on_token``
        (local only: the HTTP server's streaming) hears each token as it is decoded."""
        runner = self._require_runner()
        scheduler = self._require_scheduler()
        try:
            check_params(params, max_n=self.limits.max_n)
            resident, lease = await self._acquire(lora_name)
        except EngineError as exc:
            raise self._tag(exc) from None
        try:  # from here on, every exit releases the lease exactly once
            tokens = await self._tokens(runner, scheduler, prompt, params)
            decoded = await scheduler.decode(
                tokens,
                resident.adapter_id if resident is not None else None,
                params,
                request_id,
                f"{cache_salt or ''}\x00{extra_key or ''}",
                on_token,
            )
        except EngineError as exc:
            raise self._tag(exc) from None
        finally:
            if lease is not None:
                lease.release()
        choices = tuple(
            Choice(
                index=i,
                token_ids=tuple(s.tokens),
                text=s.text or "",
                logprobs=tuple(s.logprobs) if params.logprobs else None,
                finish_reason=s.finish or "abort",
            )
            for i, s in enumerate(decoded.samples)
        )
        first = choices[0]
        return Generation(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=resident.lora_name if resident is not None else None,
            token_ids=first.token_ids,
            text=first.text,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            prompt_tokens=len(tokens),
            cached_tokens=decoded.cached_tokens,
            request_id=decoded.request_id,
            choices=choices if params.n > 1 else (),
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, decoded on the model worker (the tokenizer is not safe
        to use from two threads at once)."""
        runner = self._require_runner()
        return await self._require_scheduler().run_model(runner.decode, list(token_ids))

    async def _acquire(self, name: str | None) -> tuple[Resident | None, Lease | None]:
        if name is None:
            return None, None
        got = self._names.acquire(name)
        if got is None:
            refusal = self._names.refusal_for_absent(name)
            if refusal is not None:
                raise refusal
            if not self.implicit_reload:
                raise CleanRefusal(ErrorCode.NOT_LOADED, f"LoRA adapter {name} is not loaded")
            await self._implicit_reload(name)
            got = self._names.acquire(name)  # no await since the reload registered it
            if got is None:
                raise CleanRefusal(ErrorCode.NOT_LOADED, f"LoRA adapter {name} is not loaded")
        return got

    async def _tokens(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        prompt: str | Sequence[int],
        params: SamplingParams,
    ) -> tuple[int, ...]:
        if isinstance(prompt, str):
            # on the model worker: a fast tokenizer must not be used by two threads at once
            tokens = tuple(await scheduler.run_model(runner.encode, prompt))
        else:
            tokens = tuple(prompt)
            bad = [
                t
                for t in tokens
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < runner.vocab_size
            ]
            if bad:
                raise CleanRefusal(
                    ErrorCode.BAD_REQUEST,
                    f"token ids {bad[:5]} are outside the vocabulary [0, {runner.vocab_size})",
                )
        if not tokens:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, "empty prompt")
        cost = params.n * (len(tokens) + params.max_tokens)
        if cost > self.limits.max_request_tokens:
            raise CleanRefusal(
                ErrorCode.BAD_REQUEST,
                f"n ({params.n}) x (prompt ({len(tokens)}) + max_tokens ({params.max_tokens})) "
                f"= {cost} tokens exceeds the per-request limit {self.limits.max_request_tokens}",
            )
        if len(tokens) + params.max_tokens > runner.max_length:
            raise CleanRefusal(
                ErrorCode.BAD_REQUEST,
                f"prompt ({len(tokens)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {runner.max_length}",
            )
        return tokens


def _bucket_refusal(
    info: TensorInfo | None, name: str, tensor: TensorData, checksum: str
) -> CleanRefusal | None:
    if info is None:
        return CleanRefusal(ErrorCode.INVALID_ADAPTER, f"tensor {name!r} is not in the manifest")
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return CleanRefusal(
            ErrorCode.INVALID_ADAPTER,
            f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, manifest says "
            f"{info.dtype}{list(info.shape)}",
        )
    if info.sha256 != checksum:
        return CleanRefusal(
            ErrorCode.DIGEST_MISMATCH, f"tensor {name!r} bytes do not match the manifest checksum"
        )
    return None
