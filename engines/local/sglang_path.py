"""The local engine's ordinary names: load, unload and implicit reload as stock SGLang does.

The local engine stands in for a GPU SGLang server (through :mod:`engines.local.server`), so
names the ledger does not manage behave like stock SGLang's (0.5.23), hazards included:

* ``load_ordinary`` / ``load_tensors_ordinary`` are ``/load_lora_adapter`` and
  ``/load_lora_adapter_from_tensors``; ``unload_ordinary`` is ``/unload_lora_adapter`` and
  returns only after the adapter's requests drained, holding the update lock
  (``_compat_lock``) meanwhile, so ordinary loads and implicit reloads wait, as in SGLang.
* A request naming an unloaded ordinary name reloads it from its old path (``implicit_reload``);
  an adapter loaded from tensors has no path and fails, as in SGLang.

Managed names never take this path: an ordinary load or unload of one is ``NAME_PROTECTED``,
and nothing reloads a managed name implicitly (:mod:`engines.local.name_table`).
"""

from __future__ import annotations

from typing import Any

from engines.contract import CleanRefusal, EngineError, ErrorCode, check_name
from engines.local.admission import plan_adapter, shapes_of
from engines.local.residency import Residency, resolve_under
from engines.manifest import ManifestError, TensorData, build_manifest
from engines.tensor_wire import TENSOR_ROOT


class SGLangPath(Residency):
    """Ordinary (unmanaged) names, with stock SGLang's semantics (module docstring)."""

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
