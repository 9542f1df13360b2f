"""The ledger as every face reads it to route and admit a turn: one typed read view.

A face (the Python :class:`~publisher.gateway.dispatch.Gateway`, the OpenAI routes, a gateway
process, a Ray gateway actor) reads the ledger synchronously between a session's lease check and
its request's in-flight increment, so what it reads must be local: :class:`LedgerView` is that
local read. There are two kinds, and only two:

* :class:`LocalView`: the ledger is in this process (``serve``, the embedded demo, a test). It
  reads ``ledger.state`` on every call, never a state object kept from before: the ledger
  replaces its state object when it rebuilds it from the log after a failed append, and a kept
  one would route from a stale projection.
* :class:`~publisher.remote.client.RemoteView`: the ledger is elsewhere (``loraledger gateway``
  against ``serve``, a Ray actor against the ledger actor). It reads the newest routing table
  the ledger sent and the last status it read, and :meth:`LedgerView.refresh` asks again.

Why one protocol for routing *and* admission (incarnations, the version list, whether a session
is provably unbound): a face that read routing from one object and the version list from
another could judge a request on one snapshot and route it on another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import anyio

from projections.status import LedgerStatus
from publisher.logs import get_logger

if TYPE_CHECKING:
    from publisher.core.ledger import Ledger

log = get_logger("loraledger.gateway")

# The longest a face waits for a remote view's refresh before it answers from its copy: a
# ledger that is restarting must not hold a turn (or a /v1/models) for the transport's whole
# reconnect time.
REFRESH_S = 5.0


class LedgerView(Protocol):
    """What the faces read of the ledger: synchronous reads of a local copy, and ``refresh``.

    ``refresh`` brings a remote copy up to date (a no-op in process); the dispatch executor
    awaits it once before it answers ``NO_ROUTE``, and the OpenAI face before it refuses
    ``model_not_found`` or ``VERSION_NOT_BOUND`` (a version may have been published since the
    last copy)."""

    def holders(self, lora_name: str) -> tuple[str, ...]:
        """The routable engines that hold ``lora_name``, in engine-id order."""
        ...

    @property
    def default_revision(self) -> int:
        """The revision of the default version: staleness is measured against it."""
        ...

    @property
    def max_staleness(self) -> int | None:
        """The deployment's bound on a session's staleness (None: unbounded)."""
        ...

    def incarnation(self, engine: str) -> str:
        """The process life of ``engine`` the ledger knows ("" if it knows none)."""
        ...

    def status(self) -> LedgerStatus:
        """The ledger's status (the version list of ``/v1/models``). May raise
        ``LEDGER_CLOSED`` when a remote view has read none yet."""
        ...

    def knows_unbound(self, session: str) -> bool:
        """True only when the view knows for certain that the ledger holds no binding and no
        tombstone of ``session`` now (its first turn would bind it to the current default).
        A remote view, which lists no sessions, always answers False: the bind decides."""
        ...

    async def refresh(self) -> None:
        """Bring a remote copy up to date now (callers during a read share it)."""
        ...


class LocalView:
    """A :class:`LedgerView` over an in-process ledger: always current (module docstring)."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def holders(self, lora_name: str) -> tuple[str, ...]:
        return self._ledger.state.holders(lora_name)

    @property
    def default_revision(self) -> int:
        return self._ledger.state.default_revision

    @property
    def max_staleness(self) -> int | None:
        return self._ledger.state.max_staleness

    def incarnation(self, engine: str) -> str:
        member = self._ledger.state.engines.get(engine)
        return "" if member is None else member.incarnation

    def status(self) -> LedgerStatus:
        return self._ledger.status()

    def knows_unbound(self, session: str) -> bool:
        state = self._ledger.state
        return session not in state.sessions and session not in state.tombstones

    async def refresh(self) -> None:
        return None


async def refreshed(view: LedgerView, *, request_id: str) -> bool:
    """Read ``view`` again, for at most :data:`REFRESH_S`; whether it was read. A failure (the
    ledger unreachable, or slow) is logged with the request it was for, and the caller answers
    from the copy it has: every face refreshes through here."""
    try:
        with anyio.fail_after(REFRESH_S):
            await view.refresh()
    except Exception as exc:
        log.warning("gateway.refresh_failed", request_id=request_id, error=repr(exc))
        return False
    return True
