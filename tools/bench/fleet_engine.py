"""A benchmark stub of a staged engine: the engine protocol, and none of an engine's own work.

Test double for ``loraledger bench fleet`` only (named as such). The fleet bench measures what
the control plane spends to publish to hundreds of engines. Real engines run on machines of
their own: the checksums they compute over received tensors and the weights they build are
their CPU, not the control plane's. With an in-process :class:`~engines.local.engine.LocalEngine`
per fleet member, that work (12-19 ms of CPU per engine for 1 MiB) lands in the bench's one
process and hides the control plane behind it. :class:`FleetStubEngine` answers every call of
the staged protocol as a real engine does and spends nothing on the bytes:

* **Names and fences** are the local engine's own :class:`~engines.local.name_table.NameTable`,
  so every refusal a publication or its cleanup can meet is the real engine's: a stale or
  cleaned-up attempt (``STALE_ATTEMPT``), a name already loaded for another attempt or digest
  (``ALREADY_LOADED``), a reclaimed name prepared again (``NAME_RECLAIMED``), a transfer or load
  that was never prepared (``NOT_PREPARED``).
* ``prepare`` checks the name and the attempt and fences it; it does not recompute the
  manifest's digest (the engine does that on its own machine).
* ``transfer`` consumes the bucket stream as a network client's side would (every bucket is
  taken from the iterator), keeps a reference per tensor, and refuses a tensor that is not in
  the manifest or has the wrong dtype or shape; it does not hash the bytes.
* ``load`` refuses a candidate whose tensors did not all arrive, then registers the name with
  the candidate's digest after ``load_latency_s`` (slept with anyio, so the fan-out's
  concurrency shows as it does against engines that load on their own machines); the receipt
  echoes name, digest, attempt and incarnation.
* ``unload`` unregisters at once (nothing holds the adapter: the bench generates nothing);
  an absent name answers ``was_loaded=False``.
* ``inventory`` lists the registered names with their digests and the staged ones, in the
  engine's incarnation (fixed for the stub's life: it never restarts).

Generation is not offered: ``generate`` refuses (``BAD_REQUEST``); the fleet bench publishes
only.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, Sequence
from typing import Literal, Self

import anyio

from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    CleanRefusal,
    EngineCapabilities,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    Receipt,
    SamplingParams,
    Transport,
    UnloadReceipt,
    check_name,
)
from engines.local.name_table import NameTable, Resident
from engines.local.refs import RefCounter


class FleetStubEngine:
    """A staged engine that keeps the protocol's state and does none of the engine's work
    (module docstring). Use it as ``async with FleetStubEngine(...) as engine:`` like the
    engines it stands in for."""

    kind = "local"
    transport: Transport = "staged"
    capabilities = EngineCapabilities()

    def __init__(self, engine_id: str, *, load_latency_s: float = 0.0) -> None:
        self.engine_id = engine_id
        self.load_latency_s = load_latency_s
        self._incarnation = uuid.uuid4().hex
        self._names = NameTable()
        self._loads = 0
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True

    def _check_running(self) -> None:
        if self._closed:  # as the local engine answers once stopped
            raise AmbiguousReply(
                ErrorCode.ENGINE_STOPPED,
                f"engine {self.engine_id} is not running",
                engine_id=self.engine_id,
            )

    def _tag(self, exc: EngineError) -> EngineError:
        exc.engine_id = self.engine_id
        return exc

    # --- the contract -----------------------------------------------------------------------

    async def incarnation(self) -> str:
        self._check_running()
        return self._incarnation

    async def inventory(self) -> Inventory:
        self._check_running()
        return self._names.inventory(self.engine_id, self._incarnation)

    async def prepare(self, candidate: Candidate) -> Receipt:
        self._check_running()
        try:
            check_name(candidate.lora_name)
            if isinstance(candidate.attempt, bool) or candidate.attempt < 1:
                raise CleanRefusal(
                    ErrorCode.BAD_REQUEST, f"attempt {candidate.attempt!r} must be >= 1"
                )
            self._names.begin_prepare(candidate)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "prepared")

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        self._check_running()
        name, attempt, digest = candidate.lora_name, candidate.attempt, candidate.digest
        async for bucket in buckets:
            try:
                if self._names.resident_replay(name, attempt, digest) is not None:
                    continue  # a retried transfer of a loaded attempt: nothing to do
                staging = self._names.staging_for(name, attempt, digest)
                expected = {t.name: t for t in staging.candidate.manifest.tensors}
                for item in bucket.tensors:
                    info = expected.get(item.name)
                    if info is None or (info.dtype, tuple(info.shape)) != (
                        item.tensor.dtype,
                        tuple(item.tensor.shape),
                    ):
                        self._names.drop_staging(name)
                        raise CleanRefusal(
                            ErrorCode.INVALID_ADAPTER,
                            f"tensor {item.name!r} does not match the manifest",
                        )
                    staging.tensors[item.name] = item.tensor
                    staging.checksums[item.name] = info.sha256  # the engine's hash, not ours
            except EngineError as exc:
                raise self._tag(exc) from None

    async def load(self, candidate: Candidate) -> Receipt:
        self._check_running()
        name, attempt, digest = candidate.lora_name, candidate.attempt, candidate.digest
        try:
            check_name(name)
            if self._names.resident_replay(name, attempt, digest) is None:
                staging = self._names.staging_for(name, attempt, digest)
                missing = {t.name for t in candidate.manifest.tensors} - set(staging.tensors)
                if missing:
                    self._names.drop_staging(name)
                    raise CleanRefusal(
                        ErrorCode.INVALID_ADAPTER,
                        f"{len(missing)} manifest tensors never arrived, "
                        f"e.g. {sorted(missing)[:3]}",
                    )
                if self.load_latency_s > 0:
                    await anyio.sleep(self.load_latency_s)
                # the name may have been prepared again or cleaned up while this load slept
                self._names.staging_for(name, attempt, digest)
                self._loads += 1  # an engine-local id, fresh per load (no uuid: no syscall)
                adapter_id = f"l{self._loads}"
                self._names.register(
                    Resident(
                        lora_name=name,
                        adapter_id=adapter_id,
                        digest=digest,
                        path=None,
                        managed=True,
                        attempt=attempt,
                        refs=RefCounter(adapter_id),
                    )
                )
                self._names.drop_staging(name)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "ready")

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        self._check_running()
        try:
            check_name(lora_name)
            if attempt is not None:
                self._names.fence_cleanup(lora_name, attempt)
            else:
                self._names.drop_staging(lora_name)
            was_loaded = lora_name in self._names.residents
            if was_loaded:
                self._names.freed(self._names.unregister(lora_name))  # no holder to drain
        except EngineError as exc:
            raise self._tag(exc) from None
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=lora_name,
            was_loaded=was_loaded,
        )

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        raise self._tag(
            CleanRefusal(ErrorCode.BAD_REQUEST, "the fleet bench's stub engine generates nothing")
        )

    def _receipt(self, c: Candidate, phase: Literal["prepared", "ready"]) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=c.lora_name,
            digest=c.digest,
            attempt=c.attempt,
            phase=phase,
        )
