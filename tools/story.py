"""The demo's story, told from the log it wrote (and its provenance file), never from memory.

Why from the log: the demo's point is that everything that happened can be reconstructed
afterwards. So the summary it prints is computed here, by a pure fold over the records and
the provenance rows, exactly as an operator's ``replay``/``audit`` would see them; the demo's
own counters (requests retried during the restart) are reported beside it, labelled as such.

Times are seconds since the first record of the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec

from evlog.events import (
    AttemptStarted,
    EngineJoined,
    EngineRepaired,
    EngineRestarted,
    OwnerLeaseExpired,
    PublicationSkipped,
    SessionBound,
    SessionReleased,
    VersionAllocated,
    VersionRestored,
)
from evlog.record import Record
from projections.lifecycle import advance
from projections.registry import RegistryState, VersionState
from publisher.gateway.provenance import REFUSED, ProvenanceRow

# finish reasons of provenance rows whose request did not complete (docs/openai.md); rows
# written before provenance schema 3 say engine_error for a refusal too
FAILED_OUTCOMES = frozenset({"engine_error", "ambiguous", "client_abort", REFUSED})


class VersionStory(msgspec.Struct, frozen=True, kw_only=True):
    version_id: int
    lora_name: str
    state: str  # at the end of the log
    attempts: int
    allocated_at: float
    published_at: float | None
    retired_at: float | None
    reclaimed_at: float | None
    publish_s: float | None  # allocation -> commit
    sessions: int  # sessions that ever bound to it
    generations: int  # provenance rows served by it
    last_release_at: float | None  # when its last session let go
    reclaim_lag_s: float | None  # last release (or retirement) -> reclaimed


class RestartStory(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    at: float
    old: str
    new: str
    restored: tuple[int, ...]
    repaired_at: float | None
    unroutable_s: float | None


class Story(msgspec.Struct, frozen=True, kw_only=True):
    events: int
    started_at: float  # unix time of the first record (every other time is relative to it)
    duration_s: float
    versions: tuple[VersionStory, ...]
    skipped: tuple[int, ...]
    restarts: tuple[RestartStory, ...]
    sessions: int
    owners: int
    sessions_per_version: dict[int, int]
    generations: int
    per_engine: dict[str, int]  # generations served by each engine
    fleet: tuple[str, ...]  # every engine that was a fleet member
    pinned: bool  # every generation was served by its session's bound version
    mismatches: int
    lease_expiries: int
    sessions_open: int  # bound and never released at the end of the log
    spanning: int  # sessions still bound to their version when it was retired (kept pinned)
    example_session: str | None  # the longest held of them, else the first (a first audit)
    # provenance rows of requests that reached an engine and did not complete (an engine's
    # refusal, an ambiguous dispatch, a client abort): retried by the rollout as new requests
    failed_requests: int = 0
    # stickiness: completed later turns (after a session's first), how many ran on the engine
    # of its first turn, and the cached-prompt fraction of those on it and of those moved
    later_turns: int = 0
    later_on_first_engine: int = 0
    cached_same: float | None = None
    cached_moved: float | None = None


def tell(records: Sequence[Record], rows: Iterable[ProvenanceRow] = ()) -> Story:
    """Fold the run's records and provenance rows into its story. Pure."""
    state = RegistryState()
    t0 = records[0].recorded_at if records else 0.0
    allocated: dict[int, float] = {}
    attempts: dict[int, int] = {}
    moved: dict[tuple[int, VersionState], float] = {}
    bound_to: dict[str, int] = {}
    per_version: Counter[int] = Counter()
    owners: set[str] = set()
    last_release: dict[int, float] = {}
    bound_at: dict[str, float] = {}
    held: dict[str, float] = {}  # session -> how long it kept a retired version
    skipped: list[int] = []
    restarts: dict[str, dict[str, object]] = {}
    finished_restarts: list[RestartStory] = []
    expiries = 0
    members: set[str] = set()
    for record in records:
        at, event = record.recorded_at - t0, record.event
        for change in advance(state, record):
            moved.setdefault((change.version_id, change.after), at)
        match event:
            case VersionAllocated():
                allocated[event.version_id] = at
            case AttemptStarted():
                attempts[event.version_id] = event.attempt
            case PublicationSkipped():
                skipped.append(event.version_id)
            case SessionBound():
                bound_to[event.session] = event.version_id
                bound_at[event.session] = at
                per_version[event.version_id] += 1
                owners.add(event.owner)
            case SessionReleased() if event.version_id is not None:
                last_release[event.version_id] = at
                retired_at = moved.get((event.version_id, VersionState.RETIRED))
                if retired_at is not None and retired_at >= bound_at.get(event.session, at):
                    held[event.session] = at - retired_at
            case OwnerLeaseExpired():
                expiries += 1
            case EngineJoined():
                members.add(event.engine)
            case EngineRestarted():
                restarts[event.engine] = {
                    "at": at,
                    "old": event.old,
                    "new": event.new,
                    "restored": [],
                }
            case VersionRestored() if event.engine in restarts:
                restarts[event.engine]["restored"].append(event.version_id)  # type: ignore[attr-defined]
            case EngineRepaired() if event.engine in restarts:
                r = restarts.pop(event.engine)
                finished_restarts.append(_restart(event.engine, r, at))
            case _:
                pass
    finished_restarts.extend(_restart(engine, r, None) for engine, r in restarts.items())

    served: Counter[int] = Counter()
    engines: Counter[str] = Counter()
    mismatches = 0
    total = failed = 0
    turns: dict[str, list[ProvenanceRow]] = {}
    for row in rows:
        if bound_to.get(row.session) != row.version_id:
            mismatches += 1
        if row.finish_reason in FAILED_OUTCOMES:
            failed += 1
            continue
        total += 1
        served[row.version_id] += 1
        engines[row.engine] += 1
        if row.turn is not None:
            turns.setdefault(row.session, []).append(row)
    sticky = _stickiness(turns.values())

    versions = []
    for vid, v in sorted(state.versions.items()):
        published = moved.get((vid, VersionState.PUBLISHED))
        retired = moved.get((vid, VersionState.RETIRED))
        reclaimed = moved.get((vid, VersionState.RECLAIMED))
        freed = max(filter(None, (last_release.get(vid), retired)), default=None)
        versions.append(
            VersionStory(
                version_id=vid,
                lora_name=v.lora_name,
                state=str(v.state),
                attempts=attempts.get(vid, v.attempt),
                allocated_at=allocated.get(vid, 0.0),
                published_at=published,
                retired_at=retired,
                reclaimed_at=reclaimed,
                publish_s=None if published is None else published - allocated.get(vid, published),
                sessions=per_version[vid],
                generations=served[vid],
                last_release_at=last_release.get(vid),
                reclaim_lag_s=None if reclaimed is None or freed is None else reclaimed - freed,
            )
        )
    end = records[-1].recorded_at - t0 if records else 0.0
    # the session that held a retired version longest; else any (the first to bind)
    example = max(held, key=lambda s: (held[s], s)) if held else next(iter(bound_to), None)
    return Story(
        events=len(records),
        started_at=t0,
        duration_s=end,
        versions=tuple(versions),
        skipped=tuple(skipped),
        restarts=tuple(sorted(finished_restarts, key=lambda r: r.at)),
        sessions=len(bound_to),
        owners=len(owners),
        sessions_per_version=dict(sorted(per_version.items())),
        generations=total,
        per_engine=dict(sorted(engines.items())),
        fleet=tuple(sorted(members)),
        pinned=mismatches == 0,
        mismatches=mismatches,
        lease_expiries=expiries,
        sessions_open=len(state.sessions),
        spanning=len(held),
        example_session=example,
        failed_requests=failed,
        later_turns=sticky[0],
        later_on_first_engine=sticky[1],
        cached_same=sticky[2],
        cached_moved=sticky[3],
    )


def _stickiness(
    sessions: Iterable[list[ProvenanceRow]],
) -> tuple[int, int, float | None, float | None]:
    """(later turns, those on the session's first engine, cached-prompt fraction of those on
    it, of those moved): what sticky routing buys, read from provenance alone."""
    later = same = 0
    tokens = {True: [0, 0], False: [0, 0]}  # on the first engine? -> [cached, prompt]
    for rows in sessions:
        first, *rest = sorted(rows, key=lambda r: (r.turn, r.started_at))
        for row in rest:
            on_first = row.engine == first.engine
            later += 1
            same += on_first
            tokens[on_first][0] += row.cached_tokens
            tokens[on_first][1] += row.prompt_tokens

    def fraction(on_first: bool) -> float | None:
        cached, prompt = tokens[on_first]
        return cached / prompt if prompt else None

    return later, same, fraction(True), fraction(False)


def _restart(engine: str, r: dict[str, object], repaired: float | None) -> RestartStory:
    at = float(r["at"])  # type: ignore[arg-type]
    return RestartStory(
        engine=engine,
        at=at,
        old=str(r["old"]),
        new=str(r["new"]),
        restored=tuple(r["restored"]),  # type: ignore[arg-type]
        repaired_at=repaired,
        unroutable_s=None if repaired is None else repaired - at,
    )
