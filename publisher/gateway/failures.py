"""How a generation fails, and what each failure proves: the gateway's codes and the rules that
read an engine's error, written once for every face.

An engine's error (:class:`~engines.contract.EngineError`) is clean (the engine answered and
proved what it did) or ambiguous (it may have run). Three questions are asked of it, each
answered in one place:

* :func:`try_elsewhere` -- may the request go to another holder of the same version? Only when
  it provably did not run: never sent (``dispatched`` False: connection refused, a Ray engine
  actor known dead), or refused cleanly by an engine that does not hold the name
  (``NOT_LOADED``: a restarted, empty engine routing has not caught up with) or that is
  draining before it stops (``ENGINE_DRAINING``: it admitted nothing). An ambiguous
  failure never qualifies, whatever its code: a resend could produce a second, different sample
  the trainer never sees.
* :func:`~publisher.drivers.engine_ops.says_about_engine` -- is it evidence about the engine
  (reported through the gateway's ``on_engine_trouble`` hook, so the reconciler looks at that
  engine now), or about the request (``BAD_REQUEST``: nothing to look at)?
* :func:`~publisher.drivers.engine_ops.lacks_adapter` -- does the engine say it lacks the
  adapter (its inventory is then read, not only its health: a probe alone cannot see a lost
  adapter)? Those two read any engine call's failure, so they live with the drivers' engine
  calls; the gateway and the reconciler ask them alike.

The answer a caller gets is a :class:`DispatchError`, whose family says how to retry:
``NO_ROUTE`` (``Unavailable``: nothing was sent), ``GENERATION_FAILED`` (``Refused``: nothing was
generated) and ``AMBIGUOUS_DISPATCH`` (``Ambiguous``: a sample may exist on the engine; it was
not resent).
"""

from __future__ import annotations

from engines.contract import EngineError, ErrorCode
from evlog.errors import Ambiguous, LoraLedgerError, Refused, Unavailable


class DispatchCode:
    """The gateway's codes: why a generation did not come back."""

    NO_ROUTE = "NO_ROUTE"  # no routable engine holds the session's version (or none reachable)
    AMBIGUOUS_DISPATCH = "AMBIGUOUS_DISPATCH"  # sent, outcome unknown: never resent for you
    GENERATION_FAILED = "GENERATION_FAILED"  # the engine refused cleanly (nothing generated)


class DispatchError(LoraLedgerError):
    """A generation that did not come back; ``DispatchError(code, ...)`` is the family class
    below, so a caller retries ``Refused``/``Unavailable`` at will and treats ``Ambiguous`` as
    a sample that may exist on the engine."""


class DispatchRefused(DispatchError, Refused, codes=[DispatchCode.GENERATION_FAILED]):
    """The engine refused cleanly: nothing was generated."""


class DispatchUnavailable(DispatchError, Unavailable, codes=[DispatchCode.NO_ROUTE]):
    """No routable engine holds the version, or none that does could be reached: nothing
    was sent."""


class DispatchAmbiguous(DispatchError, Ambiguous, codes=[DispatchCode.AMBIGUOUS_DISPATCH]):
    """The request may have reached an engine and its outcome is unknown: it was not resent."""


# Clean refusals that say the engine does not hold the name (not that the request is bad):
# another holder may serve it. NAME_RECLAIMED is left out on purpose: an engine that unloaded a
# version a session is still bound to is a premature reclaim, which must surface, not be hidden.
HOLDER_REFUSALS = frozenset({ErrorCode.NOT_LOADED})
# Clean refusals of an engine that admits nothing now (it is stopping): the request never ran.
NOT_ADMITTED = frozenset({ErrorCode.ENGINE_DRAINING})


def try_elsewhere(exc: EngineError) -> bool:
    """Whether a generation that failed with ``exc`` may go to another holder: only when it
    provably did not run (module docstring)."""
    if not exc.dispatched:
        return True
    return exc.clean and exc.code in HOLDER_REFUSALS | NOT_ADMITTED


class NotSent(Exception):
    """A sender's refusal made before anything left this process (the Python face's extra body
    fields for an engine that takes none): ``error`` is what the caller gets, as it is.
    Anything else a sender raises is taken for a request that may have been sent."""

    def __init__(self, error: LoraLedgerError) -> None:
        self.error = error
