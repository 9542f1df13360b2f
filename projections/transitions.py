"""The version lifecycle: its states and the one table of the transitions between them.

Every event that concerns a version's lifecycle is a step ``(state before, event) -> state
after`` of :data:`TRANSITIONS`; ``None`` stands for a version id the log has not allocated yet.
The registry fold (:func:`projections.registry.evolve`) takes every new state from this table,
so a step that is not in it -- publishing a version that is not LOADING, reclaiming one that
is not RETIRED -- raises :class:`TransitionViolation` instead of being applied. Such an event
cannot come from the decider (it checks the same states before it decides); it means a bug or
a forged log, and the replay must stop there, naming the version, its state and the event.

Events that never change the state but are only legal in some states (a READY receipt, an
unload proof) are in the table too, as steps to the same state: the table lists everything a
version in a given state accepts. Session bindings are not lifecycle steps (they change a
count, not a state); the binding invariants are checked by :mod:`projections.invariants`.

Two events step in two ways: an ``AttemptFailed`` is ``(clean)`` or ``(fatal)`` depending on
the absence proof it carries, and a ``VersionPublished`` also retires the previous default
(the step ``VersionPublished(retired)`` of that other version).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType


class VersionState(StrEnum):
    LOADING = "LOADING"
    PUBLISHED = "PUBLISHED"
    RETIRED = "RETIRED"
    RECLAIMING = "RECLAIMING"
    RECLAIMED = "RECLAIMED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_FATAL = "FAILED_FATAL"


_LOADING = VersionState.LOADING
_PUBLISHED = VersionState.PUBLISHED
_RETIRED = VersionState.RETIRED
_RECLAIMING = VersionState.RECLAIMING
_RECLAIMED = VersionState.RECLAIMED
_RETRYABLE = VersionState.FAILED_RETRYABLE
_FATAL = VersionState.FAILED_FATAL

# The step names of the two events that step in two ways.
ATTEMPT_FAILED_CLEAN = "AttemptFailed(clean)"
ATTEMPT_FAILED_FATAL = "AttemptFailed(fatal)"
PUBLISHED_RETIRES = "VersionPublished(retired)"

TRANSITIONS: Mapping[tuple[VersionState | None, str], VersionState] = MappingProxyType(
    {
        # state before    event                     state after
        (None,          "VersionAllocated"):        _LOADING,  # attempt 1 opens next
        (_LOADING,      "AttemptStarted"):          _LOADING,  # ... the allocation's attempt 1
        (_RETRYABLE,    "AttemptStarted"):          _LOADING,  # a retry after a clean failure
        (_LOADING,      "TransportClaimed"):        _LOADING,
        (_LOADING,      "EnginePrepared"):          _LOADING,
        (_LOADING,      "EngineReady"):             _LOADING,
        (_LOADING,      "VersionPublished"):        _PUBLISHED,
        (_PUBLISHED,    PUBLISHED_RETIRES):         _RETIRED,  # the previous default
        (_LOADING,      ATTEMPT_FAILED_CLEAN):      _RETRYABLE,  # absent everywhere: slot freed
        (_LOADING,      ATTEMPT_FAILED_FATAL):      _FATAL,  # maybe loaded: blocks publication
        (_FATAL,        "FatalResolved"):           _RETRYABLE,  # inventories proved absence
        (_PUBLISHED,    "VersionRestored"):         _PUBLISHED,  # repair reloaded it
        (_RETIRED,      "VersionRestored"):         _RETIRED,
        (_PUBLISHED,    "AdapterLost"):             _PUBLISHED,  # an engine lost it (incident)
        (_RETIRED,      "AdapterLost"):             _RETIRED,
        (_PUBLISHED,    "ServedContentMismatch"):   _PUBLISHED,  # other content under its name
        (_RETIRED,      "ServedContentMismatch"):   _RETIRED,
        (_PUBLISHED,    "CanaryRecorded"):          _PUBLISHED,  # an engine's canary baseline
        (_RETIRED,      "CanaryRecorded"):          _RETIRED,
        (_RETIRED,      "ReclaimClaimed"):          _RECLAIMING,
        (_RECLAIMING,   "EngineUnloaded"):          _RECLAIMING,
        (_RECLAIMING,   "ReclaimAmbiguous"):        _RECLAIMING,
        (_RECLAIMING,   "VersionReclaimed"):        _RECLAIMED,  # gone from every engine
    }
)  # fmt: skip


class TransitionViolation(AssertionError):
    """An event that cannot follow the state it is applied to: the log, or the code that wrote
    it, is wrong -- never the caller. Like every broken invariant, it stops the replay."""


def impossible(subject: str, state: object, event: str, why: str) -> TransitionViolation:
    """The violation, worded the same way everywhere: who, in which state, which event, why."""
    return TransitionViolation(f"{subject} is {state}: {event} is impossible ({why})")


def next_state(version_id: int, state: VersionState | None, event: str) -> VersionState:
    """The state ``event`` moves version ``version_id`` to from ``state``, or the violation."""
    after = TRANSITIONS.get((state, event))
    if after is None:
        raise impossible(
            f"version {version_id}",
            "ABSENT" if state is None else state,
            event,
            "not a transition of the version lifecycle",
        )
    return after
