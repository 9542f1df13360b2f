"""When a fatal entry or a reclaim has every absence proof it needs, and who owes the drop.

A ``RECLAIMING`` version completes once every active member has proven its name gone; a
``FAILED_FATAL`` candidate once every active member of its attempt's fleet has, and no other
member's last inventory shows it. The proofs arrive several ways -- an inventory without the
name, an unload confirmation, a member that stops counting because it leaves or is suspended --
so the fleet's and the reclaim's handlers share these rules: an entry completes by the same
rule whichever proof came last, and a member left out of the proofs owes the drop
(``owed_by``), which its repair carries out before it serves again.
"""

from __future__ import annotations

from evlog.events import Event, FatalResolved, VersionReclaimed
from projections.registry import RegistryState, VersionRecord, VersionState
from publisher.core.decider.checks import _members


def _held_elsewhere(s: RegistryState, lora_name: str, engine: str) -> bool:
    """Whether an active member other than ``engine`` is known (by its last inventory or
    receipt) to hold ``lora_name``. A fatal candidate is resolved only when no current member
    holds it, whether the member was in the attempt's fleet or joined after it: resolving it
    while one does would leave an engine holding a ``FAILED_RETRYABLE`` name that nothing
    fences any more. A suspended member is not waited for: the resolution records that it owes
    the drop (``owed_by``), and its repair unloads the name before it serves again."""
    return any(
        lora_name in m.holds for e, m in s.engines.items() if e != engine and not m.suspended
    )


def _owed_by(s: RegistryState, v: VersionRecord, active: set[str]) -> tuple[str, ...]:
    """Members left out of ``active`` that did not prove ``v`` gone: each owes the drop. For a
    fatal candidate, only engines of its attempt or known to hold it can have it."""
    confirmed = set(v.confirmed)
    return tuple(
        sorted(
            e
            for e, m in s.engines.items()
            if e not in active
            and e not in confirmed
            and (v.state is not VersionState.FAILED_FATAL or e in v.fleet or v.lora_name in m.holds)
        )
    )


def _completed_without(s: RegistryState, engine: str, *, leaving: bool) -> list[Event]:
    """Fatal entries and reclaims whose only missing proof was from ``engine``, which leaves
    (an engine that is no longer a member cannot hold anything the fleet serves) or is
    suspended (it owes the drop instead: ``owed_by``)."""
    active = s.active_engines() - {engine}
    events: list[Event] = []
    for v in s.versions.values():
        confirmed = set(v.confirmed)
        if v.state is VersionState.FAILED_FATAL:
            if _members(s, v.fleet) & active <= confirmed and not _held_elsewhere(
                s, v.lora_name, engine
            ):
                owed = tuple(e for e in _owed_by(s, v, active) if not (leaving and e == engine))
                events.append(
                    FatalResolved(version_id=v.version_id, attempt=v.attempt, owed_by=owed)
                )
        elif v.state is VersionState.RECLAIMING and active <= confirmed:
            owed = tuple(e for e in _owed_by(s, v, active) if not (leaving and e == engine))
            events.append(VersionReclaimed(version_id=v.version_id, owed_by=owed))
    return events


def _completed_by_leaving(s: RegistryState, engine: str) -> list[Event]:
    return _completed_without(s, engine, leaving=True)
