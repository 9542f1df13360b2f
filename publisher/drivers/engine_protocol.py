"""The engine protocol: how the drivers put an adapter on an engine and take it off, written once.

The publication driver (a new attempt), the reconciler (restoring a needed version, cleaning up
strays, fatal candidates, versions being reclaimed and orphaned attempts) and the reclaim driver
all drive engines through the procedures below. The drivers decide *when* to call them, with
which attempt, under which deadline, and what to record in the ledger; *how* an engine is driven
-- the order of the calls, what each answer proves, which quirk needs what -- lives here only.

* :func:`stage_and_load` -- prepare, transfer, load, then confirm with a fresh inventory.
* :func:`unload_fenced` -- one attempt-fenced unload, its answer classified (``NOT_LOADED``
  counts as absent).
* :func:`unload_and_prove_absent` -- the same, then a fresh inventory decides.
* :func:`inventory_confirms` -- whether a fresh inventory proves a load happened after all.

Three facts the procedures rest on:

* **Clean vs ambiguous.** Every engine call is bounded and classified
  (:func:`publisher.drivers.engine_ops.call`): a :class:`~engines.contract.CleanRefusal` proves the
  engine did nothing half-way; an :class:`~engines.contract.AmbiguousReply` (timeout, lost reply,
  5xx, anything unexpected) proves nothing -- the engine may have acted, only its inventory can
  tell.
* **Attempt fences.** A candidate is staged, loaded and unloaded under its publication attempt.
  An engine refuses a stale attempt's cleanup of a newer attempt's name, and once it unloaded
  ``(name, attempt)`` it refuses every later prepare of that attempt for the rest of its
  incarnation. So the fence a caller passes decides what a late duplicate of the call can still
  do: the procedures pass the caller's attempt through unchanged and never choose one.
* **What an inventory proves.** An inventory lists what the engine holds in the incarnation it
  names; an adapter is *loaded* only when a fresh inventory of the receipt's incarnation lists
  the name with the digest (the "adapter silently never applied" bug class is caught there), and
  *absent* when a fresh inventory does not list it (a restarted engine holds nothing, so any
  incarnation will do).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec

from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    CleanRefusal,
    Engine,
    EngineError,
    ErrorCode,
    Inventory,
    Receipt,
    UnloadReceipt,
)
from publisher.drivers.adapter_copy import aiter_buckets
from publisher.drivers.adapter_source import Payload
from publisher.drivers.engine_ops import CallWatch, EngineTimeouts, call

READY_UNCONFIRMED = "READY_UNCONFIRMED"


class LoadNotConfirmed(CleanRefusal):
    """The engine answered READY, but a fresh inventory does not prove the adapter loaded (code
    ``READY_UNCONFIRMED``). Clean: the inventory is the engine's own account of what it holds."""

    def __init__(self, engine_id: str, problem: str) -> None:
        super().__init__(
            READY_UNCONFIRMED, f"{engine_id} answered READY but {problem}", engine_id=engine_id
        )


class Loaded(msgspec.Struct, frozen=True, kw_only=True):
    """A load confirmed by inventory: both receipts, the inventory that confirmed the ready one,
    and when each step ended on the caller's clock (``started`` before prepare, ``prepared``
    after the ``on_prepared`` hook returned), so a driver can say where the time went."""

    prepared: Receipt
    ready: Receipt
    inventory: Inventory
    started: float
    prepared_at: float
    transferred_at: float
    loaded_at: float


class UnloadAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """What one attempt-fenced unload proved.

    ``absent``: the engine's own answer says the name is gone -- an unload receipt
    (``receipt``; ``receipt.was_loaded`` False when it was already gone) or the clean refusal
    ``NOT_LOADED`` (``receipt`` None). Otherwise ``error`` says why nothing is proven: a clean
    refusal of another kind (e.g. ``STALE_ATTEMPT``: a newer attempt holds the name, which this
    fence must not touch) or an ambiguous reply (the unload may or may not have happened)."""

    absent: bool
    receipt: UnloadReceipt | None = None
    error: EngineError | None = None


class Absence(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`unload_and_prove_absent` found. ``proven``: a fresh inventory does not list
    the name, or -- when no inventory could be read -- the unload's answer said it is gone.
    ``inventory`` is None when it could not be read."""

    proven: bool
    unload: UnloadAnswer
    inventory: Inventory | None = None


def confirms(inventory: Inventory, lora_name: str, digest: str, incarnation: str) -> str | None:
    """``None`` when ``inventory`` proves ``lora_name`` is loaded with ``digest`` in
    ``incarnation``; otherwise why not (the "adapter silently never applied" check)."""
    if inventory.incarnation != incarnation:
        return (
            f"inventory is from incarnation {inventory.incarnation}, the receipt from "
            f"{incarnation} (the engine restarted)"
        )
    entry = next((a for a in inventory.adapters if a.lora_name == lora_name), None)
    if entry is None:
        return f"a fresh inventory does not list {lora_name}"
    if entry.digest is not None and entry.digest != digest:
        return f"{lora_name} is held with digest {entry.digest[:16]}, not {digest[:16]}"
    return None


async def stage_and_load(
    engine: Engine,
    candidate: Candidate,
    buckets: Iterable[Bucket] | Payload,
    *,
    timeouts: EngineTimeouts,
    incarnation: str | None = None,
    on_prepared: Callable[[Receipt], Awaitable[None]] | None = None,
    watch: CallWatch | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Loaded:
    """Put ``candidate`` on ``engine`` under its attempt and prove it is there.

    The calls, each bounded by its entry of ``timeouts``: ``prepare`` (the engine validates the
    candidate and fences the attempt), ``on_prepared(receipt)`` (the caller records it before
    any byte moves), ``transfer`` of ``buckets`` (empty for an engine that loads the candidate's
    artifact directory by path; a :class:`~publisher.drivers.adapter_source.Payload` sends its bytes
    its own way, e.g. an engine actor pulling them from Ray's object store), ``load``
    (registers the immutable name), then a fresh ``inventory``. A receipt of the wrong phase is
    a malformed reply (ambiguous).

    Confirmed means: the inventory, read in the ready receipt's incarnation, lists the name with
    the receipt's digest -- and, when the caller gives ``incarnation``, the receipt is from that
    incarnation (a restore is for the process life the caller inspected). Anything else raises
    :class:`LoadNotConfirmed` (clean: the inventory proved what the engine holds).

    A failure raises the call's own :class:`~engines.contract.EngineError` (clean or
    ambiguous) and cleans nothing up: what to do with a half-done load is the caller's decision,
    because the right answer differs. A failed publication attempt is cleaned with
    :func:`unload_and_prove_absent`, fenced by that (new, never committed) attempt. A failed
    restore must not be:
    its attempt is a committed version's, which never changes, and an unload fences that
    attempt out of the engine for good (and a late duplicate of an unfenced one would remove
    the version after a later restore succeeded); :func:`inventory_confirms` decides instead.

    ``watch`` (see :class:`~publisher.drivers.engine_ops.CallWatch`) tells a caller cancelled midway
    whether an engine call was in flight, i.e. whether the outcome is unknown."""
    engine_id = engine.engine_id
    started = clock()
    prepared: Receipt = await call(
        engine_id, "prepare", timeouts.prepare, lambda: engine.prepare(candidate), watch=watch
    )
    _check_phase(prepared, "prepared", engine_id)
    if on_prepared is not None:
        await on_prepared(prepared)
    prepared_at = clock()

    async def send() -> None:
        if isinstance(buckets, Payload):
            await buckets.send(engine, candidate)
        else:
            await engine.transfer(candidate, aiter_buckets(buckets))

    await call(engine_id, "transfer", timeouts.transfer, send, watch=watch)
    transferred_at = clock()
    ready: Receipt = await call(
        engine_id, "load", timeouts.load, lambda: engine.load(candidate), watch=watch
    )
    _check_phase(ready, "ready", engine_id)
    loaded_at = clock()
    inventory = await call(
        engine_id, "inventory", timeouts.inventory, engine.inventory, watch=watch
    )
    problem = confirms(inventory, ready.lora_name, ready.digest, ready.incarnation)
    if problem is None and incarnation is not None and ready.incarnation != incarnation:
        problem = f"from incarnation {ready.incarnation}, not {incarnation} (the engine restarted)"
    if problem is not None:
        raise LoadNotConfirmed(engine_id, problem)
    return Loaded(
        prepared=prepared,
        ready=ready,
        inventory=inventory,
        started=started,
        prepared_at=prepared_at,
        transferred_at=transferred_at,
        loaded_at=loaded_at,
    )


async def inventory_confirms(
    engine: Engine, lora_name: str, digest: str, incarnation: str, *, timeout: float
) -> bool:
    """Whether a fresh inventory proves ``lora_name`` loaded with ``digest`` in
    ``incarnation`` -- after a load whose reply was lost or refused, the engine may hold it all
    the same. An inventory that cannot be read proves nothing (False)."""
    try:
        inventory = await call(engine.engine_id, "inventory", timeout, engine.inventory)
    except EngineError:
        return False
    return confirms(inventory, lora_name, digest, incarnation) is None


async def unload_fenced(
    engine: Engine, lora_name: str, *, attempt: int | None, timeout: float
) -> UnloadAnswer:
    """One ``unload(lora_name, attempt=attempt)`` bounded by ``timeout``, its answer
    classified (:class:`UnloadAnswer`); it never raises an engine failure.

    ``attempt`` is required so every caller states its fence: the attempt whose candidate this
    is (a publication's own, a fatal candidate's, a reclaimed or stray version's last one --
    always final, so the fence can never shut out a wanted load), or None only for a name the
    ledger never allocated. ``NOT_LOADED`` is the engine's clean word that the name is absent
    (an idempotent retry, or a restarted engine), as good as a receipt."""
    try:
        receipt = await call(
            engine.engine_id,
            "unload",
            timeout,
            lambda: engine.unload(lora_name, attempt=attempt),
        )
    except CleanRefusal as exc:
        if exc.code == ErrorCode.NOT_LOADED:
            return UnloadAnswer(absent=True)
        return UnloadAnswer(absent=False, error=exc)
    except EngineError as exc:
        return UnloadAnswer(absent=False, error=exc)
    return UnloadAnswer(absent=True, receipt=receipt)


async def unload_and_prove_absent(
    engine: Engine,
    lora_name: str,
    *,
    attempt: int | None,
    unload_timeout: float,
    inventory_timeout: float,
) -> Absence:
    """:func:`unload_fenced`, then a fresh inventory decides whether ``lora_name`` is gone.

    The inventory is the proof whatever the unload answered: read after the unload answered (or
    ran out of time), a listing without the name is absence even after an ambiguous unload, and a
    listing with it is presence even after a receipt. Only when no inventory can be read does the
    unload's own answer stand in (a receipt or ``NOT_LOADED``); an ambiguous or refused unload
    without an inventory proves nothing."""
    answer = await unload_fenced(engine, lora_name, attempt=attempt, timeout=unload_timeout)
    try:
        inventory = await call(engine.engine_id, "inventory", inventory_timeout, engine.inventory)
    except EngineError:
        return Absence(proven=answer.absent, unload=answer)
    return Absence(proven=lora_name not in inventory.names(), unload=answer, inventory=inventory)


def _check_phase(receipt: Receipt, phase: str, engine_id: str) -> None:
    if receipt.phase != phase:
        raise AmbiguousReply(
            ErrorCode.MALFORMED_REPLY,
            f"expected a {phase} receipt, got {receipt.phase}",
            engine_id=engine_id,
        )
