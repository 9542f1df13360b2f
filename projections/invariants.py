"""Invariants of the registry state, checked by tests, by ``verify`` after every replayed event,
and by the ledger service after every batch (TigerBeetle's habit: assert what must be true,
everywhere, always).

``violations(state)`` lists every broken rule in words; ``check(state)`` raises naming them.
With ``deep=False`` the per-session scans are skipped (O(versions + engines) instead of
O(sessions)), which is what ``verify`` runs after every single event of a long log; the deep
check then runs at the end.
"""

from __future__ import annotations

from collections import Counter

from projections.registry import SERVING_STATES, RegistryState, VersionState


class InvariantViolation(AssertionError):
    """The projection reached a state the protocol forbids: a bug, never a user error."""


def violations(state: RegistryState, *, deep: bool = True) -> list[str]:
    found: list[str] = []
    versions = state.versions

    used = state.capacity_used()
    if state.deployment is not None and used > state.capacity:
        found.append(f"capacity {used} exceeds the limit {state.capacity}")

    published = [v.version_id for v in versions.values() if v.state is VersionState.PUBLISHED]
    if state.default is None:
        if published:
            found.append(f"no default but PUBLISHED versions {published}")
    elif published != [state.default]:
        found.append(f"default {state.default} but PUBLISHED versions are {published}")

    loading = [v.version_id for v in versions.values() if v.state is VersionState.LOADING]
    if len(loading) > 1:
        found.append(f"more than one LOADING version: {loading}")

    if state.default_revision != state.commits:
        found.append(f"default_revision {state.default_revision} != commits {state.commits}")

    for v in versions.values():
        if v.bound < 0:
            found.append(f"version {v.version_id} has a negative binding count")
        elif v.bound > 0 and v.state not in SERVING_STATES:
            found.append(f"version {v.version_id} is {v.state} with {v.bound} sessions bound")

    for member in state.engines.values():
        for name, version_id in member.holds.items():
            held = versions.get(version_id)
            if held is None or held.lora_name != name:
                found.append(f"engine {member.engine} holds {name} unknown to the ledger")
            elif held.state in (VersionState.RECLAIMED, VersionState.FAILED_RETRYABLE):
                found.append(f"engine {member.engine} still holds {held.state} {name}")

    # Each needed version with its attempt's fleet as a set: the check below asks, for every
    # member, whether it took part -- a scan of the fleet tuple there would make this check
    # O(engines^2), run after every batch of a publication to hundreds of engines.
    needed = [(versions[vid], frozenset(versions[vid].fleet)) for vid in state.needed_versions()]
    for member in state.engines.values():
        if member.suspended and member.routable:
            found.append(f"engine {member.engine} is suspended and routable")
        outage = member.unreachable
        if outage is not None and any(min(n) < 0 for n in outage.failures.values()):
            found.append(f"engine {member.engine} counts negative failures in its outage")
        both = sorted(set(member.lacks) & set(member.holds))
        if both:
            found.append(f"engine {member.engine} both holds and lacks {both}")
        impostors = sorted(set(member.mismatched) & set(member.holds))
        if impostors:  # other content under a name is never counted as holding the version
            found.append(f"engine {member.engine} holds names it serves other content under "
                         f"{impostors}")  # fmt: skip
        if member.routable:
            # A routable engine serves every needed version of an attempt it took part in,
            # unless a lost adapter is recorded (routing skips it until it is restored).
            # A version committed while the engine was being repaired is restored later.
            missing = [
                v.version_id
                for v, fleet in needed
                if member.engine in fleet
                and v.lora_name not in member.holds
                and v.lora_name not in member.lacks
            ]
            if missing:
                found.append(f"routable engine {member.engine} lacks needed versions {missing}")
            if member.owes:
                found.append(f"routable engine {member.engine} still owes {sorted(member.owes)}")

    for v in versions.values():
        if v.attempt < 1:
            found.append(f"version {v.version_id} is {v.state} without an attempt")
        if v.revision is not None and v.state is VersionState.LOADING:
            found.append(f"version {v.version_id} has a revision while LOADING")

    if deep:
        found.extend(_session_violations(state))
    return found


def _session_violations(state: RegistryState) -> list[str]:
    found: list[str] = []
    versions = state.versions
    counts = Counter(b.version_id for b in state.sessions.values())
    for version_id, n in counts.items():
        v = versions.get(version_id)
        if v is None:
            found.append(f"{n} sessions bound to unknown version {version_id}")
        elif v.state not in SERVING_STATES:
            found.append(f"version {version_id} is {v.state} with {n} sessions bound")
    for v in versions.values():
        if v.bound != counts.get(v.version_id, 0):
            found.append(
                f"version {v.version_id} counts {v.bound} bindings, "
                f"sessions say {counts.get(v.version_id, 0)}"
            )

    for session, binding in state.sessions.items():
        if session in state.tombstones:
            found.append(f"session {session} is both bound and released")
        if binding.revision > state.default_revision:
            found.append(f"session {session} bound at future revision {binding.revision}")
    for session in state.idle_released:
        if session not in state.tombstones:
            found.append(f"idle release of {session} kept without its tombstone")
    return found


def check(state: RegistryState, *, deep: bool = True) -> None:
    """Raise :class:`InvariantViolation` naming every broken rule."""
    found = violations(state, deep=deep)
    if found:
        raise InvariantViolation("; ".join(found))
