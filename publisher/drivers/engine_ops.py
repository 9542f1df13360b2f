"""Bounded, classified engine calls: the only way the publication, reclaim and reconcile drivers
talk to an engine (the procedures built from them are in :mod:`publisher.drivers.engine_protocol`).

Two rules the drivers rely on (a sync that hangs forever stalls a whole fleet; clean vs
ambiguous is described in docs/publication.md):

* **Every call has a deadline** (:class:`EngineTimeouts`). Running out of time is an
  :class:`~engines.contract.AmbiguousReply` (``TIMEOUT``): the engine may still act on the
  request, only a later inventory can tell.
* **Every failure is one of the two kinds.** Adapters already raise ``CleanRefusal`` or
  ``AmbiguousReply``; anything else escaping an adapter (a bug, an unexpected transport error) is
  treated as ambiguous, because it proves nothing about what the engine holds.

It also holds the small pure helpers the drivers and the gateway share: which names of an
inventory belong to this deployment, and what a failed call says about its engine
(:func:`says_about_engine`, :func:`lacks_adapter`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import msgspec

from engines.contract import AmbiguousReply, EngineError, ErrorCode, Inventory

T = TypeVar("T")


class EngineTimeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds per engine call kind. ``unload`` is long because SGLang's unload blocks until
    the adapter's requests drained (docs/engines.md; the drivers only unload at zero in-flight,
    so it should be instant, but a leaked reference must not hang us forever either)."""

    probe: float = 10.0  # also the control timeout: past it, an unanswered call's engine
    # whose probes fail too leaves the publication (``SuspendUnanswered``)
    inventory: float = 30.0
    prepare: float = 120.0
    transfer: float = 600.0
    load: float = 300.0
    unload: float = 900.0


class CallWatch(Protocol):
    """Anything with a ``busy`` flag that :func:`call` keeps up to date: set while a call is
    outstanding, cleared when it answered or failed, and left set when the caller was cancelled
    midway -- the outcome of that call is then unknown (ambiguous), whatever else happened."""

    busy: bool


async def call(
    engine_id: str,
    what: str,
    timeout: float,
    fn: Callable[[], Awaitable[T]],
    *,
    watch: CallWatch | None = None,
) -> T:
    """Run one engine call under ``timeout``; anything but a success or an ``EngineError``
    becomes an ``AmbiguousReply``. Cancellation from outside is never swallowed (and leaves
    ``watch.busy`` set)."""
    if watch is None:
        return await _bounded(engine_id, what, timeout, fn)
    watch.busy = True
    try:
        result = await _bounded(engine_id, what, timeout, fn)
    except EngineError:  # every failure but cancellation is one (see _bounded)
        watch.busy = False
        raise
    watch.busy = False
    return result


async def _bounded(engine_id: str, what: str, timeout: float, fn: Callable[[], Awaitable[T]]) -> T:
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


# Clean refusals meaning "this engine does not hold the adapter": a possible lost adapter.
MISSING_CODES = frozenset({ErrorCode.NOT_LOADED, ErrorCode.NAME_RECLAIMED})


def says_about_engine(exc: EngineError) -> bool:
    """Whether a failed call is evidence about the engine rather than about the request: every
    failure that is not a clean refusal (unreachable, gone, timed out, lost reply, 5xx: the
    engine may be down or restarted, only a probe can tell), and the clean refusals that say it
    lacks the adapter (:data:`MISSING_CODES`: it may have lost a committed version). Any other
    clean refusal (``BAD_REQUEST``, an invalid name) proves the engine answered and holds what
    it should: nothing to look at."""
    return not exc.clean or exc.code in MISSING_CODES


def lacks_adapter(exc: EngineError) -> bool:
    """Whether ``exc`` is the engine's own clean answer that it does not hold the adapter asked
    for: whoever hears of it reads the engine's inventory, not just its health (a probe alone
    cannot see a lost adapter)."""
    return exc.clean and exc.code in MISSING_CODES
