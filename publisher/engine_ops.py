"""Bounded, classified engine calls: the only way the publication, reclaim and reconcile drivers
talk to an engine.

Two rules the drivers rely on (a weight sync must never hang forever; clean vs ambiguous,
docs/publication.md):

* **Every call has a deadline** (:class:`EngineTimeouts`). Running out of time is an
  :class:`~engines.contract.AmbiguousReply` (``TIMEOUT``): the engine may still act on the
  request, only a later inventory can tell.
* **Every failure is one of the two kinds.** Adapters already raise ``CleanRefusal`` or
  ``AmbiguousReply``; anything else escaping an adapter (a bug, an unexpected transport error) is
  treated as ambiguous, because it proves nothing about what the engine holds.

It also holds the small pure helpers the drivers share: which names of an inventory belong to
this deployment, and whether an inventory confirms a loaded candidate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec

from engines.contract import AmbiguousReply, EngineError, ErrorCode, Inventory

T = TypeVar("T")


class EngineTimeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds per engine call kind. ``unload`` is long because SGLang's unload blocks until
    the adapter's requests drained (docs/engines.md; the drivers only unload at zero in-flight,
    so it should be instant, but a leaked reference must not hang us forever either)."""

    probe: float = 10.0
    inventory: float = 30.0
    prepare: float = 120.0
    transfer: float = 600.0
    load: float = 300.0
    unload: float = 900.0


async def call(engine_id: str, what: str, timeout: float, fn: Callable[[], Awaitable[T]]) -> T:
    """Run one engine call under ``timeout``; anything but a success or an ``EngineError``
    becomes an ``AmbiguousReply``. Cancellation from outside is never swallowed."""
    try:
        with anyio.fail_after(timeout):
            return await fn()
    except EngineError:
        raise
    except TimeoutError as exc:
        raise AmbiguousReply(
            ErrorCode.TIMEOUT,
            f"{what} on {engine_id}: no reply within {timeout:g}s",
            engine_id=engine_id,
        ) from exc
    except Exception as exc:
        raise AmbiguousReply(
            ErrorCode.MALFORMED_REPLY,
            f"{what} on {engine_id}: unexpected {type(exc).__name__}: {exc}",
            engine_id=engine_id,
        ) from exc


def managed_prefix(prefix: str, deployment: str) -> str:
    """Every engine-side name this deployment ever creates starts with this
    (docs/identities.md)."""
    return f"{prefix}@{deployment}-"


def managed_names(inventory: Inventory, prefix: str) -> tuple[str, ...]:
    """The names of ``inventory`` that belong to this deployment (others are not ours to
    observe, report or unload)."""
    return tuple(sorted(a.lora_name for a in inventory.adapters if a.lora_name.startswith(prefix)))


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
