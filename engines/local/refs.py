"""Per-adapter reference counts: the rule that makes "unload only when nothing uses it" safe.

Every request that names an adapter takes exactly one :class:`Lease` before dispatch and gives
it back exactly once on its terminal outcome. SGLang's worst LoRA bugs (issues #34205, #36894,
#25864: aborted requests never releasing, ``n>1`` children releasing once each, counters at -2,
unloads hanging forever) all came from the count drifting away from that rule, so the rule lives
here, in one small unit, and nothing else touches the number:

* :meth:`RefCounter.acquire` is refused once the counter is *closed* (the adapter was
  unregistered): a late acquire can never resurrect a draining adapter.
* :meth:`Lease.release` is idempotent: a duplicated terminal signal (finish + abort echo,
  ``finally`` after an explicit release) is a no-op, so the count never goes negative.
* ``n > 1`` parallel sampling takes *one* lease for the request, not one per child: the
  children run inside the request's task group, which cannot end before every child ended
  (cancellation included), and the lease is released after it. The structure gives the
  guarantee, so there is no per-child bookkeeping to drift (SGLang #25864, #36894).
* :meth:`RefCounter.wait_zero` wakes when the count reaches zero; drains wait on it.

Everything here runs on the event loop thread (no locks): acquire/release are synchronous so
they can sit in ``finally`` blocks that run even under cancellation.
"""

from __future__ import annotations

import anyio


class RefError(RuntimeError):
    """A broken invariant (acquire after close, count below zero): a bug, never an outcome."""


class RefCounter:
    """The number of live requests holding one adapter incarnation (one engine-local id)."""

    __slots__ = ("_closed", "_count", "_zero", "key")

    def __init__(self, key: str) -> None:
        self.key = key
        self._count = 0
        self._closed = False
        self._zero: anyio.Event | None = None

    @property
    def count(self) -> int:
        return self._count

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire(self) -> Lease:
        """Take one reference. Refused once closed: an unregistered adapter gains no holders."""
        if self._closed:
            raise RefError(f"adapter {self.key} is closed to new requests")
        self._count += 1
        return Lease(self)

    def close(self) -> None:
        """No acquire succeeds after this (the name was unregistered); releases still count."""
        self._closed = True

    async def wait_zero(self) -> None:
        """Return once no lease is held. Only meaningful after :meth:`close` (else new leases
        may arrive right after it returns)."""
        if self._count == 0:
            return
        if self._zero is None:
            self._zero = anyio.Event()
        await self._zero.wait()

    def _release_one(self) -> None:
        if self._count <= 0:
            raise RefError(f"adapter {self.key}: release without a matching acquire")
        self._count -= 1
        if self._count == 0 and self._zero is not None:
            self._zero.set()
            self._zero = None


class Lease:
    """One request's reference. Release it in a ``finally``; releasing twice is harmless."""

    __slots__ = ("_counter", "_released")

    def __init__(self, counter: RefCounter) -> None:
        self._counter = counter
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Give the reference back. True the first time, False for every duplicate signal."""
        if self._released:
            return False
        self._released = True
        self._counter._release_one()
        return True
