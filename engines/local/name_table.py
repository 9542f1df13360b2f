"""The local engine's name table: who holds which name, for which attempt, and what it may do.

Pure, synchronous state (no I/O, no awaits), mutated only on the event loop thread, so each
decision below is atomic. The rules, and why:

* **Residents** are registered adapters, keyed by name, each with a fresh engine-local id and
  its own :class:`~engines.local.refs.RefCounter`. Unregistering closes the counter and moves
  the resident to *draining* at once, so new requests are refused immediately while holders
  finish on the old weights.
* **Managed names** (anything that went through ``prepare``) belong to the ledger: an ordinary
  SGLang-style load or unload of such a name is ``NAME_PROTECTED``, and once a managed name is
  unloaded it is *reclaimed*: a later generation gets ``NAME_RECLAIMED`` and nothing ever
  reloads it implicitly (stock SGLang does, from the name's old path).
* **Fences**: per managed name, the highest attempt seen and whether it was cleaned up. A
  ``prepare``/``transfer``/``load`` of an older attempt, or of a cleaned-up one, is
  ``STALE_ATTEMPT``; so is a cleanup of an attempt older than the fence. A late cleanup of
  attempt k therefore never touches attempt k+1, and a late prepare of a cleaned-up attempt
  cannot resurrect it.
* **Unmanaged history** (name -> path of ordinary loads) is what SGLang's implicit reload reads;
  the engine consults it only for names that were never managed.

Memory: fences, reclaimed names and history grow by one small entry per name for the life of
the process (names are per version; a restart -- a new incarnation -- starts empty).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engines.contract import Candidate, CleanRefusal, ErrorCode, Inventory, InventoryEntry
from engines.local.refs import Lease, RefCounter
from engines.manifest import TensorData
from engines.tensor_wire import TENSOR_ROOT


@dataclass(eq=False)
class Resident:
    lora_name: str
    adapter_id: str  # engine-local, fresh per load: peft adapter name and prefix-cache key
    digest: str
    path: str | None  # artifact directory, or None for staged (tensor) loads
    managed: bool
    attempt: int | None
    refs: RefCounter
    loaded_at: float = field(default_factory=time.time)


@dataclass(eq=False)
class Fence:
    attempt: int
    closed: bool = False  # the attempt was cleaned up: nothing of it may come back


@dataclass(eq=False)
class Staging:
    """Bytes received for one (name, attempt), each verified against the manifest on arrival."""

    candidate: Candidate
    tensors: dict[str, TensorData] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)


def new_adapter_id() -> str:
    return f"l{uuid.uuid4().hex}"


class NameTable:
    """One process life's names, fences and staging (the rules are in the module docstring)."""

    def __init__(self) -> None:
        self.residents: dict[str, Resident] = {}
        self.draining: dict[str, Resident] = {}  # by adapter id
        self.fences: dict[str, Fence] = {}
        self.staging: dict[str, Staging] = {}
        self.managed: set[str] = set()  # every name ever prepared
        self.reclaimed: set[str] = set()
        self.history: dict[str, str] = {}  # unmanaged name -> path (SGLang's lora_ref_cache)

    # --- generation ------------------------------------------------------------------------

    def acquire(self, name: str) -> tuple[Resident, Lease] | None:
        """A lease on the resident holding ``name``; None when it is not resident (the caller
        decides between NOT_LOADED, NAME_RECLAIMED and an implicit reload)."""
        resident = self.residents.get(name)
        if resident is None:
            return None
        return resident, resident.refs.acquire()

    def refusal_for_absent(self, name: str) -> CleanRefusal | None:
        """The refusal for a generation naming an absent adapter, or None when the name is an
        unmanaged one that stock SGLang would implicitly reload."""
        if name in self.reclaimed:
            return CleanRefusal(
                ErrorCode.NAME_RECLAIMED,
                f"LoRA adapter {name} was unloaded (reclaimed) and is never reloaded implicitly",
            )
        if name in self.managed:
            return CleanRefusal(ErrorCode.NOT_LOADED, f"LoRA adapter {name} is not loaded")
        if name in self.history:
            return None
        return CleanRefusal(
            ErrorCode.NOT_LOADED, f"Got LoRA adapter that has never been loaded: {name}"
        )

    # --- managed (ledger) path -------------------------------------------------------------

    def begin_prepare(self, c: Candidate) -> bool:
        """Fence the attempt and open a fresh staging area. Returns True when the candidate is
        already resident for this very attempt and digest (an idempotent replay)."""
        name = c.lora_name
        fence = self.fences.get(name)
        if name in self.reclaimed and (fence is None or c.attempt <= fence.attempt):
            raise CleanRefusal(
                ErrorCode.NAME_RECLAIMED, f"{name} was reclaimed; attempt {c.attempt} is over"
            )
        self._check_attempt(name, c.attempt, fence)
        resident = self.residents.get(name)
        if resident is not None:
            if not resident.managed:
                raise CleanRefusal(
                    ErrorCode.ALREADY_LOADED,
                    f"{name} is held by an ordinary (unmanaged) load; unload it first",
                )
            if resident.attempt == c.attempt and resident.digest == c.digest:
                return True
            raise CleanRefusal(
                ErrorCode.ALREADY_LOADED,
                f"{name} is loaded for attempt {resident.attempt} (digest "
                f"{resident.digest[:16]}); clean it up before attempt {c.attempt}",
            )
        self.fences[name] = Fence(c.attempt)
        self.staging[name] = Staging(c)
        self.managed.add(name)
        return False

    def staging_for(self, name: str, attempt: int, digest: str) -> Staging:
        """The open staging area of exactly this attempt and digest."""
        fence = self.fences.get(name)
        if fence is None:
            raise CleanRefusal(ErrorCode.NOT_PREPARED, f"{name} was never prepared")
        self._check_attempt(name, attempt, fence)
        staging = self.staging.get(name)
        if (
            fence.attempt != attempt
            or staging is None
            or staging.candidate.attempt != attempt
            or staging.candidate.digest != digest
        ):
            raise CleanRefusal(
                ErrorCode.NOT_PREPARED,
                f"{name} attempt {attempt} (digest {digest[:16]}) is not prepared",
            )
        return staging

    def resident_replay(self, name: str, attempt: int, digest: str) -> Resident | None:
        """The resident if this attempt and digest is already loaded (a retried step)."""
        resident = self.residents.get(name)
        if (
            resident is not None
            and resident.managed
            and resident.attempt == attempt
            and resident.digest == digest
        ):
            return resident
        return None

    def drop_staging(self, name: str) -> None:
        self.staging.pop(name, None)

    def fence_cleanup(self, name: str, attempt: int) -> None:
        """Record that ``attempt`` of ``name`` is cleaned up (refusing older attempts)."""
        fence = self.fences.get(name)
        if fence is not None and attempt < fence.attempt:
            raise CleanRefusal(
                ErrorCode.STALE_ATTEMPT,
                f"cleanup of {name} attempt {attempt} refused: attempt {fence.attempt} is newer",
            )
        self.fences[name] = Fence(attempt, closed=True)
        self.staging.pop(name, None)
        self.managed.add(name)

    # --- ordinary (SGLang-style) path ------------------------------------------------------

    def check_ordinary_load(self, name: str) -> None:
        if name in self.managed:
            raise CleanRefusal(
                ErrorCode.NAME_PROTECTED,
                f"LoRA adapter {name} is managed by loraledger; an ordinary load cannot "
                "overwrite or revive it",
            )
        if name in self.residents:
            raise CleanRefusal(
                ErrorCode.ALREADY_LOADED,
                f"Failed to load LoRA adapter {name} because it is already loaded",
            )

    def check_ordinary_unload(self, name: str) -> Resident:
        if name in self.managed:
            raise CleanRefusal(
                ErrorCode.NAME_PROTECTED,
                f"LoRA adapter {name} is managed by loraledger; an ordinary unload cannot "
                "remove it",
            )
        resident = self.residents.get(name)
        if resident is None:
            raise CleanRefusal(
                ErrorCode.NOT_LOADED,
                f"LoRA with name {name} does not exist. Loaded LoRAs: {self.loaded_paths()}",
            )
        return resident

    # --- both paths ------------------------------------------------------------------------

    def register(self, resident: Resident) -> None:
        name = resident.lora_name
        if name in self.residents:
            raise CleanRefusal(ErrorCode.ALREADY_LOADED, f"{name} is already loaded")
        self.residents[name] = resident
        if resident.managed:
            self.reclaimed.discard(name)
        else:
            self.history[name] = resident.path or TENSOR_ROOT

    def unregister(self, name: str) -> Resident:
        """Remove the name at once: the counter closes (no new holder), the resident drains."""
        resident = self.residents.pop(name)
        resident.refs.close()
        self.draining[resident.adapter_id] = resident
        if resident.managed:
            self.reclaimed.add(name)
        return resident

    def freed(self, resident: Resident) -> None:
        self.draining.pop(resident.adapter_id, None)

    def draining_name(self, name: str) -> Resident | None:
        for resident in self.draining.values():
            if resident.lora_name == name:
                return resident
        return None

    def loaded_paths(self) -> dict[str, str]:
        return {n: r.path or TENSOR_ROOT for n, r in self.residents.items()}

    def inventory(self, engine_id: str, incarnation: str) -> Inventory:
        """What this table holds, as the engine contract reports it: residents by name, each
        with the digest it was loaded with, and the names still staging."""
        return Inventory(
            engine_id=engine_id,
            incarnation=incarnation,
            adapters=tuple(
                InventoryEntry(lora_name=r.lora_name, digest=r.digest, path=r.path)
                for r in sorted(self.residents.values(), key=lambda r: r.lora_name)
            ),
            staged=tuple(sorted(self.staging)),
        )

    @staticmethod
    def _check_attempt(name: str, attempt: int, fence: Fence | None) -> None:
        if fence is None:
            return
        if attempt < fence.attempt:
            raise CleanRefusal(
                ErrorCode.STALE_ATTEMPT,
                f"{name} attempt {attempt} is stale: attempt {fence.attempt} is newer",
            )
        if attempt == fence.attempt and fence.closed:
            raise CleanRefusal(
                ErrorCode.STALE_ATTEMPT, f"{name} attempt {attempt} was already cleaned up"
            )
