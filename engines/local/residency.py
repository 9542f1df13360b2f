"""Which adapters the local engine's model holds, under which names, and when their weights go.

The name table (:mod:`engines.local.name_table`) decides who holds which name; this room does
the physical side and reports it:

* **Reading** an adapter directory (bounded by what any admissible adapter could need, confined
  to the artifact root when one is configured: :func:`resolve_under`).
* **Installing** builds the peft adapter under a fresh engine-local id and registers the name,
  inside a job that holds the control lock, so the name table cannot change meanwhile.
* **Freeing**: an unregistered name's weights are removed only once its last reference is
  released (the drain), by the job that unregistered it; a retried unload that finds the name
  draining waits for the same moment, so its answer also means "physically gone".
* **Reporting**: the inventory (registered adapters and staged names), SGLang's
  ``loaded_adapters``, and the views the tests and the HTTP face read (references, draining,
  staged names, adapters resident in the model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from engines.artifacts import HEADER_ALLOWANCE, ArtifactError, read_adapter_dir
from engines.contract import CleanRefusal, ErrorCode, Inventory
from engines.local.admission import AdapterPlan
from engines.local.lifecycle import EngineLifecycle
from engines.local.name_table import Resident, new_adapter_id
from engines.local.refs import RefCounter
from engines.manifest import ManifestError, TensorData, build_manifest


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


class Residency(EngineLifecycle):
    """Reading, installing, freeing and reporting adapters (module docstring)."""

    async def inventory(self) -> Inventory:
        self._require_runner()
        return self._names.inventory(self.engine_id, self._incarnation)

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
