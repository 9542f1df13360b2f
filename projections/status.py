"""The ledger's status: a summary of a registry state, for people and for other processes.

``status_of(state)`` is a pure read of the state, so the live ledger (``Ledger.status()``,
``GET /status`` of ``loraledger serve``) and an offline replay of a log (``loraledger replay``)
describe a state with the same struct and render it with the same view. The structs are frozen
msgspec structs: the service sends one as JSON and ``loraledger status`` decodes it back into
the same type, so an incompatible answer fails loudly.
"""

from __future__ import annotations

import msgspec

from evlog.events import TurnFailures
from projections.registry import Outage, RegistryState


class VersionStatus(msgspec.Struct, frozen=True, kw_only=True):
    version_id: int
    lora_name: str
    digest: str
    state: str
    attempt: int
    bound: int
    revision: int | None
    holders: tuple[str, ...]


class OutageStatus(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's outage in progress: since when, its first error and who saw it, and the
    generations that failed on it meanwhile (totals, and per session)."""

    since: float
    error: str
    source: str
    reporter: str
    not_run: int
    ambiguous: int
    failures: tuple[TurnFailures, ...]


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    incarnation: str
    kind: str
    endpoint: str
    routable: bool  # serves now: repaired and reachable
    holds: tuple[str, ...]
    strays: tuple[str, ...]
    unreachable: OutageStatus | None = None
    # committed names it serves other content under (out of routing for those versions)
    mismatched: tuple[str, ...] = ()


def outage_status(outage: Outage) -> OutageStatus:
    failures = tuple(
        TurnFailures(session=session, not_run=n, ambiguous=a)
        for session, (n, a) in sorted(outage.failures.items())
    )
    return OutageStatus(
        since=outage.since,
        error=outage.error,
        source=outage.source,
        reporter=outage.reporter,
        not_run=sum(f.not_run for f in failures),
        ambiguous=sum(f.ambiguous for f in failures),
        failures=failures,
    )


class LedgerStatus(msgspec.Struct, frozen=True, kw_only=True):
    deployment: str | None
    epoch: int
    last_seq: int
    capacity: int
    capacity_used: int
    default: int | None
    default_revision: int
    sessions_bound: int
    tombstones: int
    owners: int
    blocked_by: tuple[int, ...]
    versions: tuple[VersionStatus, ...]
    engines: tuple[EngineStatus, ...]
    max_staleness: int | None = None  # docs/sessions.md#staleness; None: unbounded


def status_of(state: RegistryState) -> LedgerStatus:
    """The status of ``state``: versions by id, engines by name, live owners only."""
    return LedgerStatus(
        deployment=state.deployment,
        epoch=state.epoch,
        last_seq=state.last_seq,
        capacity=state.capacity,
        capacity_used=state.capacity_used(),
        default=state.default,
        default_revision=state.default_revision,
        sessions_bound=len(state.sessions),
        tombstones=len(state.tombstones),
        owners=sum(1 for o in state.owners.values() if o.live),
        blocked_by=tuple(state.blocked_by()),
        max_staleness=state.max_staleness,
        versions=tuple(
            VersionStatus(
                version_id=v.version_id,
                lora_name=v.lora_name,
                digest=v.digest,
                state=v.state,
                attempt=v.attempt,
                bound=v.bound,
                revision=v.revision,
                holders=state.holders(v.lora_name, routable_only=False),
            )
            for v in sorted(state.versions.values(), key=lambda v: v.version_id)
        ),
        engines=tuple(
            EngineStatus(
                engine=e.engine,
                incarnation=e.incarnation,
                kind=e.kind,
                endpoint=e.endpoint,
                routable=e.serving,
                holds=tuple(sorted(e.holds)),
                strays=e.strays,
                unreachable=None if e.unreachable is None else outage_status(e.unreachable),
                mismatched=tuple(sorted(e.mismatched)),
            )
            for e in sorted(state.engines.values(), key=lambda e: e.engine)
        ),
    )
