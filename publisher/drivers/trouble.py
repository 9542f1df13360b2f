"""Engine trouble: what a face saw fail on an engine, on its way to the reconciler.

Every face sends its generations through the gateway's one executor, which hands each failure
that says something about the engine to one hook (``on_engine_trouble``: the reconciler's
:meth:`~publisher.drivers.reconciler.Reconciler.engine_trouble` in process, a remote ledger's
``engine_failed`` elsewhere, which batches them to the ledger's process). Two readings of such a
failure are written here, once, for all of them:

* :func:`says_unreachable` -- the engine could not be reached: the call provably never reached
  it (``dispatched`` False: a refused connection, a dead engine known before sending, the probe
  an adapter makes before a generation), or the engine is gone for good (``ENGINE_GONE``). That
  is an outage: the engine leaves routing at once (``EngineUnreachable``), and the gateway that
  saw it stops choosing it without waiting for the ledger (``Gateway``'s own mark).
* :class:`FailureTally` -- the failures counted per session, kept until they are recorded
  against the outage (``DispatchFailures``): a turn that provably did not run (tried on another
  holder) or one that may have run (answered ``AMBIGUOUS_DISPATCH``). A clean refusal is the
  engine's answer, not an outage's cost, and is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from engines.contract import EngineError, ErrorCode
from evlog.events import TurnFailures


class TroubleHook(Protocol):
    """The gateway's ``on_engine_trouble``: called synchronously inside the failing dispatch,
    it must not block or await (a receiver only schedules work). ``session`` is the turn's
    session, ``incarnation`` the engine's life as the gateway's view knew it when it chose the
    engine (a report about an earlier life says nothing about the current one)."""

    def __call__(
        self, engine_id: str, error: EngineError, /, *, session: str = "", incarnation: str = ""
    ) -> None: ...


def says_unreachable(error: EngineError) -> bool:
    """Whether ``error`` proves the engine could not be reached (module docstring)."""
    return not error.dispatched or error.code == ErrorCode.ENGINE_GONE


class FailureTally:
    """Dispatch failures per session, accumulated until taken (a report's batch, or a record)."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._counts)

    def add(self, session: str, error: EngineError) -> None:
        """Count one failed turn of ``session`` by what ``error`` proves of it."""
        if not session:
            return
        if not error.dispatched:
            self._count(session, 1, 0)
        elif not error.clean:
            self._count(session, 0, 1)

    def merge(self, failures: Iterable[TurnFailures]) -> None:
        for f in failures:
            self._count(f.session, f.not_run, f.ambiguous)

    def take(self) -> tuple[TurnFailures, ...]:
        """The counts so far, by session, and start again from zero."""
        counts, self._counts = self._counts, {}
        return tuple(
            TurnFailures(session=session, not_run=n, ambiguous=a)
            for session, (n, a) in sorted(counts.items())
        )

    def _count(self, session: str, not_run: int, ambiguous: int) -> None:
        n, a = self._counts.get(session, (0, 0))
        self._counts[session] = (n + max(0, not_run), a + max(0, ambiguous))
