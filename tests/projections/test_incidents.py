"""Incidents folded from a log the real ledger wrote with injected failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace

from evlog.events import (
    AdapterLost,
    DispatchFailures,
    EngineLeft,
    EngineReachable,
    EngineRepaired,
    EngineRestarted,
    EngineSuspended,
    EngineUnreachable,
    InventoryObserved,
    PublicationBlocked,
    ServedContentMismatch,
    TurnFailures,
    VersionAllocated,
    VersionRestored,
    stream_of,
)
from evlog.record import Record
from projections.incidents import EngineHealthFold, Incident, IncidentFold, incidents
from publisher.core import commands as c
from tests.publisher.core.book import Book, digest_of
from tests.support.runs import health_run_records, repeat_run_records


def _kinds(found: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(i.kind, i.subject) for i in found]


def _seq_of(records: list[Record], type_name: str, **fields: object) -> int:
    for r in records:
        if r.type == type_name and all(getattr(r.event, k) == v for k, v in fields.items()):
            return r.seq
    raise AssertionError(f"no {type_name} {fields}")


def test_every_injected_failure_is_named_with_its_seqs(fault_records: list[Record]) -> None:
    found = incidents(fault_records, stuck_after=60.0)
    assert _kinds(found) == [
        ("receipt_rejected", "v2"),
        ("retried", "v2"),
        ("pinned_retired", "session s-a"),
        ("pinned_retired", "session s-b"),
        ("pinned_retired", "session s-c"),
        ("lease_expired", "owner w2"),
        ("fatal", "v3"),
        ("stuck", "v3"),
        ("retried", "v3"),
        ("pinned_retired", "session s-d"),
        ("stuck", "v3"),
        ("skipped", "v5"),
        ("engine_restart", "e1"),
        ("reclaim_ambiguous", "v3"),
        ("adapter_lost", "e0"),
        ("adapter_lost", "e0"),
        ("engine_suspended", "e1"),
    ]
    by = {(i.kind, i.subject, i.at): i for i in found}

    rejected = by[("receipt_rejected", "v2", 1005.0)]
    assert rejected.seqs == (_seq_of(fault_records, "ReceiptRejected"),)
    assert "ENGINE_RESTARTED" in rejected.summary

    retried = by[("retried", "v2", 1005.0)]
    failed = _seq_of(fault_records, "AttemptFailed", version_id=2)
    second = _seq_of(fault_records, "AttemptStarted", version_id=2, attempt=2)
    published = _seq_of(fault_records, "VersionPublished", version_id=2)
    assert retried.seqs == (failed, second, published)
    assert (retried.resolved, retried.resolution) == (True, "attempt 2 published")

    fatal = by[("fatal", "v3", 1110.0)]
    inventories = [
        r.seq for r in fault_records if r.type == "InventoryObserved" and r.recorded_at == 1200
    ]
    assert fatal.seqs == (
        _seq_of(fault_records, "AttemptFailed", version_id=3),
        *inventories,
        _seq_of(fault_records, "FatalResolved"),
    )
    assert fatal.resolved and fatal.duration_s == 90.0

    stuck = [i for i in found if i.kind == "stuck"]
    assert [(i.summary.split(" for ")[0], i.duration_s) for i in stuck] == [
        ("FAILED_FATAL", 90.0),
        ("RETIRED and unbound (reclaimable, not reclaimed)", 90.0),
    ]

    lease = by[("lease_expired", "owner w2", 1040.0)]
    assert lease.seqs[0] == _seq_of(fault_records, "OwnerLeaseExpired")
    assert lease.summary.endswith("1 sessions released")

    restart = by[("engine_restart", "e1", 1300.0)]
    assert restart.resolved and restart.duration_s == 5.0
    assert restart.seqs[-1] == _seq_of(fault_records, "EngineRepaired", incarnation="e1-i2")

    ambiguous = by[("reclaim_ambiguous", "v3", 1310.0)]
    assert ambiguous.resolved and ambiguous.seqs[-1] == _seq_of(
        fault_records, "VersionReclaimed", version_id=3
    )

    # e0 lost v2 and v4 (external unloads): one incident each, closed by the reload
    lost = [i for i in found if i.kind == "adapter_lost"]
    assert [i.summary.split(" ")[0] for i in lost] == ["v2", "v4"]
    assert [i.seqs for i in lost] == [
        (
            _seq_of(fault_records, "AdapterLost", version_id=v),
            _seq_of(fault_records, "VersionRestored", version_id=v, engine="e0"),
        )
        for v in (2, 4)
    ]
    assert all(i.resolution == "reloaded under its name" for i in lost)
    # an operator's maintenance of e1: suspended, resumed, repaired
    maintenance = by[("engine_suspended", "e1", 1340.0)]
    assert maintenance.summary.startswith("suspended (operator): maintenance")
    assert maintenance.resolution == (
        "resumed by an operator, then repaired: holds exactly the needed versions"
    )
    at_1340 = tuple(r.seq for r in fault_records if r.recorded_at == 1340.0)
    assert [r.type for r in fault_records if r.seq in at_1340] == [
        "EngineSuspended",
        "EngineResumed",
        "EngineRepaired",
    ]
    assert maintenance.seqs == at_1340

    # s-d is still bound to retired v2 at the end of the log: measured to the last record.
    pinned = by[("pinned_retired", "session s-d", 1210.0)]
    assert (pinned.duration_s, pinned.resolved) == (190.0, False)


def test_threshold_and_top_n_change_what_is_reported(fault_records: list[Record]) -> None:
    lenient = IncidentFold(stuck_after=120.0, pinned_top=2).apply_all(fault_records).finish()
    assert not [i for i in lenient if i.kind == "stuck"]
    pinned = [i for i in lenient if i.kind == "pinned_retired"]
    # the two longest: s-d (190 s, still bound) and s-b (90 s)
    assert sorted(i.subject for i in pinned) == ["session s-b", "session s-d"]
    strict = IncidentFold(stuck_after=5.0).apply_all(fault_records).finish()
    stuck = {(i.subject, i.summary.split(" for ")[0]) for i in strict if i.kind == "stuck"}
    # 10 s of RECLAIMING (v3, ambiguous unload) now counts too
    assert ("v3", "RECLAIMING") in stuck


def test_a_prefix_reports_open_incidents_as_unresolved(fault_records: list[Record]) -> None:
    """Replaying up to the moment v3 was FAILED_FATAL shows the incident open, not resolved."""
    cut = _seq_of(fault_records, "InventoryObserved") - 1
    found = incidents([r for r in fault_records if r.seq <= cut], stuck_after=60.0)
    fatal = [i for i in found if i.kind == "fatal"]
    assert len(fatal) == 1 and fatal[0].resolved is False
    assert fatal[0].resolution == "still FAILED_FATAL: no inventory proved it"


def test_engine_health_incidents_open_close_and_name_their_seqs(tmp_path: Path) -> None:
    """The health run (tests/support/runs.py): a lost adapter escalated to a suspension and
    repaired after a restart, a suspension ended by an operator's removal, one still open."""
    records = health_run_records(tmp_path / "health.db")
    found = [i for i in incidents(records) if i.kind in ("adapter_lost", "engine_suspended")]
    seq = {(r.type, r.recorded_at): r.seq for r in records}
    rows = [(i.kind, i.subject, i.at, i.seqs, i.resolved, i.resolution) for i in found]
    assert rows == [
        (
            "adapter_lost",
            "e1",
            2010.0,
            (
                seq[("AdapterLost", 2010.0)],
                seq[("EngineSuspended", 2012.0)],
                seq[("EngineRestarted", 2020.0)],
                seq[("VersionRestored", 2020.0)],
            ),
            True,
            "reloaded under its name after the engine restarted",
        ),
        (
            "engine_suspended",
            "e1",
            2012.0,
            (
                seq[("EngineSuspended", 2012.0)],
                seq[("EngineRestarted", 2020.0)],
                seq[("EngineRepaired", 2025.0)],
            ),
            True,
            "repaired: holds exactly the needed versions",
        ),
        (
            "engine_suspended",
            "e2",
            2030.0,
            (seq[("EngineSuspended", 2030.0)], seq[("EngineLeft", 2060.0)]),
            True,
            "removed by an operator",
        ),
        (
            "engine_suspended",
            "e0",
            2100.0,
            (seq[("EngineSuspended", 2100.0)],),
            False,
            "still suspended",
        ),
    ]
    by = {(i.subject, i.at): i for i in found}
    assert by[("e1", 2012.0)].summary == (
        "suspended (lost_adapter): version 1 lost and not restored after 1 tries: "
        "NAME_RECLAIMED; no new traffic"
    )
    assert by[("e1", 2012.0)].duration_s == 13.0
    assert by[("e0", 2100.0)].duration_s == 10.0  # open: measured to the last record
    # the registry-free fold alone (what verify runs) finds exactly the same
    alone = EngineHealthFold()
    for record in records:
        alone.apply(record)
    assert sorted(alone.finish(), key=lambda i: (i.at, i.seqs)) == found


# --- a second incident of one subject before the first one ended (the repeat run) ----------


class Repeat:
    """The repeat run (tests/support/runs.py), folded: two expired lives of one owner, an
    engine restarted twice before its repair (a crash loop), suspended again after a resumption
    before its repair, and one version lost twice on one engine."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.found = incidents(records)
        self.seq = {(r.type, r.recorded_at): r.seq for r in records}

    def rows(self, kind: str) -> list[tuple[object, ...]]:
        return [
            (i.subject, i.at, i.seqs, i.duration_s, i.resolved, i.resolution)
            for i in self.found
            if i.kind == kind
        ]


@pytest.fixture(scope="module")
def repeat(tmp_path_factory: pytest.TempPathFactory) -> Repeat:
    return Repeat(repeat_run_records(tmp_path_factory.mktemp("repeat") / "repeat.db"))


def test_each_expired_life_of_an_owner_is_an_incident(repeat: Repeat) -> None:
    released = {
        r.event.session: r.seq  # type: ignore[union-attr]
        for r in repeat.records
        if r.type == "SessionReleased"
    }
    assert repeat.rows("lease_expired") == [
        ("owner w", at, (repeat.seq[("OwnerLeaseExpired", at)], released[s]), None, None, "")
        for at, s in ((3010.0, "s-1"), (3020.0, "s-2"))
    ]
    # told apart by the life that ended, each with the sessions it lost
    assert [i.summary for i in repeat.found if i.kind == "lease_expired"] == [
        f"no renewal for 9.0s (incarnation {life}); 1 sessions released" for life in "ab"
    ]


def test_a_crash_loop_lists_every_restart(repeat: Repeat) -> None:
    seq = repeat.seq
    assert repeat.rows("engine_restart") == [
        (
            "e1",
            3030.0,
            (seq[("EngineRestarted", 3030.0)], seq[("EngineRestarted", 3032.0)]),
            2.0,
            True,
            "restarted again (e1-i2 -> e1-i3) before it was repaired",
        ),
        (
            "e1",
            3032.0,
            (
                seq[("EngineRestarted", 3032.0)],
                seq[("VersionRestored", 3032.0)],
                seq[("EngineRepaired", 3035.0)],
            ),
            3.0,
            True,
            "repaired: 1 needed versions reloaded, routable",
        ),
    ]
    restarts = [i.summary for i in repeat.found if i.kind == "engine_restart"]
    assert [s.split(":")[0] for s in restarts] == [
        "restarted (e1-i1 -> e1-i2)",
        "restarted (e1-i2 -> e1-i3)",
    ]


def test_a_suspension_after_a_resumption_before_the_repair_is_a_new_incident(
    repeat: Repeat,
) -> None:
    seq = repeat.seq
    assert repeat.rows("engine_suspended") == [
        (
            "e0",
            3040.0,
            (
                seq[("EngineSuspended", 3040.0)],
                seq[("EngineResumed", 3045.0)],
                seq[("EngineSuspended", 3050.0)],
            ),
            10.0,
            True,
            "resumed by an operator, then suspended again (unhealthy) before a repair",
        ),
        (
            "e0",
            3050.0,
            (seq[("EngineSuspended", 3050.0)], seq[("EngineRepaired", 3055.0)]),
            5.0,
            True,
            "repaired: holds exactly the needed versions",
        ),
    ]
    _same_without_the_registry(repeat)


def test_a_version_lost_again_after_it_reappeared_is_a_new_incident(repeat: Repeat) -> None:
    """v1 vanished from e0, showed up in its inventory again (loaded outside the ledger: the
    ledger routes it there again), then vanished again: two losses, the first one ended by the
    inventory that showed it back."""
    seq = repeat.seq
    assert repeat.rows("adapter_lost")[:2] == [
        (
            "e0",
            3060.0,
            (seq[("AdapterLost", 3060.0)], seq[("InventoryObserved", 3062.0)]),
            2.0,
            True,
            "back in its inventory without a reload by the ledger",
        ),
        (
            "e0",
            3064.0,
            (seq[("AdapterLost", 3064.0)], seq[("VersionRestored", 3066.0)]),
            2.0,
            True,
            "reloaded under its name",
        ),
    ]
    _same_without_the_registry(repeat)


def test_a_lost_version_reclaimed_before_its_restore_is_no_longer_missing(
    repeat: Repeat,
) -> None:
    """v1, retired, lost on e0 while a session still needed it, then released and reclaimed:
    nothing will restore it, so the loss ends at the reclaim instead of staying open (``not
    restored yet``) for the rest of the log."""
    seq = repeat.seq
    assert repeat.rows("adapter_lost")[2:] == [
        (
            "e0",
            3072.0,
            (seq[("AdapterLost", 3072.0)], seq[("VersionReclaimed", 3074.0)]),
            2.0,
            True,
            "reclaimed: no longer needed",
        ),
    ]
    _same_without_the_registry(repeat)


def _same_without_the_registry(repeat: Repeat) -> None:
    """The registry-free fold (what verify runs) finds the same health incidents."""
    alone = EngineHealthFold()
    for record in repeat.records:
        alone.apply(record)
    health = [i for i in repeat.found if i.kind in ("engine_suspended", "adapter_lost")]
    assert sorted(alone.finish(), key=lambda i: (i.at, i.seqs)) == health


def test_a_loss_recorded_again_while_open_ends_the_open_one() -> None:
    """The ledger records a loss once while it is open, but the fold does not rely on it: a
    log with a second ``AdapterLost`` of the same version on the same engine and nothing in
    between (hand-made: no ledger writes one) still lists both losses."""
    events = [AdapterLost(version_id=1, engine="e0", incarnation="e0-i1")] * 2
    records = _hand_made(events)
    fold = EngineHealthFold()
    for record in records:
        fold.apply(record)
    rows = [(i.at, i.seqs, i.resolved, i.resolution) for i in fold.finish()]
    assert rows == [
        (1.0, (1, 2), True, "lost again before it was restored"),
        (2.0, (2,), False, "not restored yet"),
    ]


def test_an_outage_is_one_incident_with_its_window_first_error_and_failed_turns() -> None:
    """An engine's outage, from the record that opened it to the probe that answered, with the
    failed turns the faces counted in it, in all and per session."""
    events = [
        EngineUnreachable(
            engine="e1",
            incarnation="e1-i1",
            at=10.5,
            error="ENGINE_UNREACHABLE: connection refused",
            source="dispatch",
            reporter="gw",
        ),
        DispatchFailures(
            engine="e1",
            incarnation="e1-i1",
            since=10.5,
            failures=(
                TurnFailures(session="s1", not_run=2),
                TurnFailures(session="s2", ambiguous=1),
            ),
        ),
        DispatchFailures(
            engine="e1",
            incarnation="e1-i1",
            since=10.5,
            failures=(TurnFailures(session="s1", not_run=1),),
        ),
        # the probe answered at 13.5 s (the ledger's clock), recorded at 14 s
        EngineReachable(engine="e1", incarnation="e1-i1", at=13.5, since=10.5),
        EngineUnreachable(engine="e1", incarnation="e1-i1", at=20.0, error="E: x", source="probe"),
    ]
    records = _hand_made(events, recorded_from=10.0)
    fold = EngineHealthFold()
    for record in records:
        fold.apply(record)
    first, second = fold.finish()
    assert (first.kind, first.subject, first.at, first.seqs) == (
        "engine_unreachable",
        "e1",
        10.5,
        (1, 2, 3, 4),
    )
    assert (first.duration_s, first.resolved, first.resolution) == (3.0, True, "a probe answered")
    assert first.summary == (
        "unreachable (e1-i1), seen by dispatch (gw): ENGINE_UNREACHABLE: connection refused; "
        "out of routing; failed turns: 3 not run (tried elsewhere), 1 ambiguous "
        "(per session, not run/ambiguous: s1 3/0, s2 0/1)"
    )
    assert (second.at, second.resolved, second.resolution) == (20.0, False, "still unreachable")
    assert second.summary == (  # no reporter named, no failure counted
        "unreachable (e1-i1), seen by probe: E: x; out of routing; no failed turn counted"
    )


def _hand_made(events: list[Any], *, recorded_from: float = 0.0) -> list[Record]:
    """``events`` as records numbered from 1, recorded one second apart after
    ``recorded_from`` (no ledger wrote them: no chain, no payload)."""
    return _hand_made_at(events, [recorded_from + float(seq) for seq in range(1, len(events) + 1)])


def _hand_made_at(events: list[Any], times: list[float]) -> list[Record]:
    """``events`` as records numbered from 1, recorded at ``times`` (no chain, no payload)."""
    return [
        Record(
            seq=seq,
            event_id=b"",
            stream=stream_of(event),
            type=type(event).__name__,
            schema=1,
            recorded_at=at,
            payload=b"",
            prev_hash=b"",
            hash=b"",
            event=event,
        )
        for seq, (event, at) in enumerate(zip(events, times, strict=True), 1)
    ]


# --- every incident, field for field -------------------------------------------------------
# Whoever reads ``replay --incidents`` or ``verify`` reads every field: when it began, the seqs
# that show it (first the one that started it), its words, how long, whether and how it ended.


def test_every_incident_of_the_fault_run_field_for_field(fault_records: list[Record]) -> None:
    assert incidents(fault_records) == FAULT_RUN
    # a lower threshold and one pinned session: RECLAIMING for 10 s is stuck too, and only the
    # longest pinned session (s-d, still bound) is listed
    strict = IncidentFold(stuck_after=5.0, pinned_top=1).apply_all(fault_records).finish()
    assert strict == FAULT_RUN_STRICT


def test_every_incident_of_the_health_and_repeat_runs_field_for_field(
    tmp_path: Path, repeat: Repeat
) -> None:
    assert incidents(health_run_records(tmp_path / "health.db")) == HEALTH_RUN
    assert repeat.found == REPEAT_RUN


REJECTED = (
    "ENGINE_RESTARTED from e1 (e1-i0) attempt 1: receipt from incarnation e1-i0, engine is at e1-i1"
)
SKIPPED = (
    "publication skipped: CAPACITY_ERROR: capacity 3 is full: v2 retired, sessions bound "
    "(1 sessions), v3 retired, unbound: awaiting reclaim (requests in flight or unclaimed), "
    "v4 the default"
)
LOST_ADAPTER_SUSPENSION = (
    "suspended (lost_adapter): version 1 lost and not restored after 1 tries: NAME_RECLAIMED; "
    "no new traffic"
)

FAULT_RUN: list[Incident] = [
    Incident(
        kind="receipt_rejected",
        subject="v2",
        at=1005.0,
        seqs=(24,),
        summary=REJECTED,
        duration_s=None,
        resolved=None,
        resolution="",
    ),
    Incident(
        kind="retried",
        subject="v2",
        at=1005.0,
        seqs=(25, 26, 32),
        summary="needed 2 attempts (attempt 1 clean LOAD_REFUSED)",
        duration_s=5.0,
        resolved=True,
        resolution="attempt 2 published",
    ),
    Incident(
        kind="pinned_retired",
        subject="session s-a",
        at=1010.0,
        seqs=(17, 32, 34),
        summary="kept retired v1 in use for 10.0s",
        duration_s=10.0,
        resolved=True,
        resolution="released",
    ),
    Incident(
        kind="pinned_retired",
        subject="session s-b",
        at=1010.0,
        seqs=(18, 32, 37),
        summary="kept retired v1 in use for 90.0s",
        duration_s=90.0,
        resolved=True,
        resolution="released",
    ),
    Incident(
        kind="pinned_retired",
        subject="session s-c",
        at=1010.0,
        seqs=(19, 32, 36),
        summary="kept retired v1 in use for 30.0s",
        duration_s=30.0,
        resolved=True,
        resolution="released",
    ),
    Incident(
        kind="lease_expired",
        subject="owner w2",
        at=1040.0,
        seqs=(35, 36),
        summary="no renewal for 39.0s; 1 sessions released",
        duration_s=None,
        resolved=None,
        resolution="",
    ),
    Incident(
        kind="fatal",
        subject="v3",
        at=1110.0,
        seqs=(45, 46, 47, 48),
        summary="attempt 1 ended ambiguous: AMBIGUOUS: load timed out",
        duration_s=90.0,
        resolved=True,
        resolution="inventories proved the candidate absent on every engine",
    ),
    Incident(
        kind="stuck",
        subject="v3",
        at=1110.0,
        seqs=(45, 48),
        summary="FAILED_FATAL for 90.0s (threshold 60s)",
        duration_s=90.0,
        resolved=True,
        resolution="left FAILED_FATAL at seq 48",
    ),
    Incident(
        kind="retried",
        subject="v3",
        at=1110.0,
        seqs=(45, 49, 55),
        summary="needed 2 attempts (attempt 1 ambiguous AMBIGUOUS)",
        duration_s=100.0,
        resolved=True,
        resolution="attempt 2 published",
    ),
    Incident(
        kind="pinned_retired",
        subject="session s-d",
        at=1210.0,
        seqs=(33, 55),
        summary="kept retired v2 in use for 190.0s",
        duration_s=190.0,
        resolved=False,
        resolution="still bound",
    ),
    Incident(
        kind="stuck",
        subject="v3",
        at=1220.0,
        seqs=(63, 69),
        summary="RETIRED and unbound (reclaimable, not reclaimed) for 90.0s (threshold 60s)",
        duration_s=90.0,
        resolved=True,
        resolution="left RETIRED at seq 69",
    ),
    Incident(
        kind="skipped",
        subject="v5",
        at=1230.0,
        seqs=(64,),
        summary=SKIPPED,
        duration_s=None,
        resolved=None,
        resolution="",
    ),
    Incident(
        kind="engine_restart",
        subject="e1",
        at=1300.0,
        seqs=(65, 66, 67, 68),
        summary="restarted (e1-i1 -> e1-i2): lost every adapter",
        duration_s=5.0,
        resolved=True,
        resolution="repaired: 2 needed versions reloaded, routable",
    ),
    Incident(
        kind="reclaim_ambiguous",
        subject="v3",
        at=1310.0,
        seqs=(71, 72, 73),
        summary="unload on e1 ambiguous: unload timed out",
        duration_s=10.0,
        resolved=True,
        resolution="unload confirmed on every engine; slot freed",
    ),
    Incident(
        kind="adapter_lost",
        subject="e0",
        at=1330.0,
        seqs=(74, 77),
        summary="v2 missing from its inventory (e0-i1); no longer routed there",
        duration_s=0.0,
        resolved=True,
        resolution="reloaded under its name",
    ),
    Incident(
        kind="adapter_lost",
        subject="e0",
        at=1330.0,
        seqs=(75, 78),
        summary="v4 missing from its inventory (e0-i1); no longer routed there",
        duration_s=0.0,
        resolved=True,
        resolution="reloaded under its name",
    ),
    Incident(
        kind="engine_suspended",
        subject="e1",
        at=1340.0,
        seqs=(79, 80, 81),
        summary="suspended (operator): maintenance; no new traffic",
        duration_s=0.0,
        resolved=True,
        resolution="resumed by an operator, then repaired: holds exactly the needed versions",
    ),
]
# at a 5 s threshold and one pinned session: the same, but the stuck incidents name 5 s, v3's
# 10 s of RECLAIMING is stuck too, and only the longest pinned session (s-d) is listed
FAULT_RUN_STRICT: list[Incident] = sorted(
    [
        *(i for i in FAULT_RUN if i.kind not in ("stuck", "pinned_retired")),
        *(i for i in FAULT_RUN if i.subject == "session s-d"),
        *(
            replace(i, summary=i.summary.replace("threshold 60s", "threshold 5s"))
            for i in FAULT_RUN
            if i.kind == "stuck"
        ),
        Incident(kind="stuck", subject="v3", at=1310.0, seqs=(69, 73),
                 summary="RECLAIMING for 10.0s (threshold 5s)", duration_s=10.0, resolved=True,
                 resolution="left RECLAIMING at seq 73"),
    ],
    key=lambda i: (i.at, i.seqs, i.kind),
)  # fmt: skip
HEALTH_RUN: list[Incident] = [
    Incident(
        kind="adapter_lost",
        subject="e1",
        at=2010.0,
        seqs=(19, 21, 22, 23),
        summary="v1 missing from its inventory (e1-i1); no longer routed there",
        duration_s=10.0,
        resolved=True,
        resolution="reloaded under its name after the engine restarted",
    ),
    Incident(
        kind="engine_suspended",
        subject="e1",
        at=2012.0,
        seqs=(21, 22, 24),
        summary=LOST_ADAPTER_SUSPENSION,
        duration_s=13.0,
        resolved=True,
        resolution="repaired: holds exactly the needed versions",
    ),
    Incident(
        kind="engine_restart",
        subject="e1",
        at=2020.0,
        seqs=(22, 23, 24),
        summary="restarted (e1-i1 -> e1-i2): lost every adapter",
        duration_s=5.0,
        resolved=True,
        resolution="repaired: 1 needed versions reloaded, routable",
    ),
    Incident(
        kind="engine_suspended",
        subject="e2",
        at=2030.0,
        seqs=(25, 34),
        summary="suspended (unhealthy): probes failed for 30.0 s; no new traffic",
        duration_s=30.0,
        resolved=True,
        resolution="removed by an operator",
    ),
    Incident(
        kind="stuck",
        subject="v1",
        at=2031.0,
        seqs=(33,),
        summary="RETIRED and unbound (reclaimable, not reclaimed) for 79.0s (threshold 60s)",
        duration_s=79.0,
        resolved=False,
        resolution="",
    ),
    Incident(
        kind="engine_suspended",
        subject="e0",
        at=2100.0,
        seqs=(35,),
        summary="suspended (unhealthy): probes failed for 30.0 s; no new traffic",
        duration_s=10.0,
        resolved=False,
        resolution="still suspended",
    ),
]
REPEAT_RUN: list[Incident] = [
    Incident(
        kind="lease_expired",
        subject="owner w",
        at=3010.0,
        seqs=(17, 18),
        summary="no renewal for 9.0s (incarnation a); 1 sessions released",
        duration_s=None,
        resolved=None,
        resolution="",
    ),
    Incident(
        kind="lease_expired",
        subject="owner w",
        at=3020.0,
        seqs=(21, 22),
        summary="no renewal for 9.0s (incarnation b); 1 sessions released",
        duration_s=None,
        resolved=None,
        resolution="",
    ),
    Incident(
        kind="engine_restart",
        subject="e1",
        at=3030.0,
        seqs=(23, 24),
        summary="restarted (e1-i1 -> e1-i2): lost every adapter",
        duration_s=2.0,
        resolved=True,
        resolution="restarted again (e1-i2 -> e1-i3) before it was repaired",
    ),
    Incident(
        kind="engine_restart",
        subject="e1",
        at=3032.0,
        seqs=(24, 25, 26),
        summary="restarted (e1-i2 -> e1-i3): lost every adapter",
        duration_s=3.0,
        resolved=True,
        resolution="repaired: 1 needed versions reloaded, routable",
    ),
    Incident(
        kind="engine_suspended",
        subject="e0",
        at=3040.0,
        seqs=(27, 28, 29),
        summary="suspended (unhealthy): probes failed for 30.0 s; no new traffic",
        duration_s=10.0,
        resolved=True,
        resolution="resumed by an operator, then suspended again (unhealthy) before a repair",
    ),
    Incident(
        kind="engine_suspended",
        subject="e0",
        at=3050.0,
        seqs=(29, 30),
        summary="suspended (unhealthy): probes failed for 30.0 s; no new traffic",
        duration_s=5.0,
        resolved=True,
        resolution="repaired: holds exactly the needed versions",
    ),
    Incident(
        kind="adapter_lost",
        subject="e0",
        at=3060.0,
        seqs=(31, 33),
        summary="v1 missing from its inventory (e0-i1); no longer routed there",
        duration_s=2.0,
        resolved=True,
        resolution="back in its inventory without a reload by the ledger",
    ),
    Incident(
        kind="adapter_lost",
        subject="e0",
        at=3064.0,
        seqs=(34, 36),
        summary="v1 missing from its inventory (e0-i1); no longer routed there",
        duration_s=2.0,
        resolved=True,
        resolution="reloaded under its name",
    ),
    Incident(
        kind="pinned_retired",
        subject="session s-3",
        at=3071.0,
        seqs=(38, 46, 49),
        summary="kept retired v1 in use for 2.0s",
        duration_s=2.0,
        resolved=True,
        resolution="released",
    ),
    Incident(
        kind="adapter_lost",
        subject="e0",
        at=3072.0,
        seqs=(47, 53),
        summary="v1 missing from its inventory (e0-i1); no longer routed there",
        duration_s=2.0,
        resolved=True,
        resolution="reclaimed: no longer needed",
    ),
]


# --- runs made through the decider (tests/publisher/core/book.py), at chosen times ---------


def _timed(book: Book, times: dict[int, float]) -> list[Record]:
    """The book's events as records numbered from 1, each recorded at the time of the latest
    mark at or before its seq (``times``: seq -> time; 0.0 before the first mark)."""
    at, timed = 0.0, []
    for seq in range(1, len(book.events) + 1):
        at = times.get(seq, at)
        timed.append(at)
    return _hand_made_at(book.events, timed)


def _fatal_blocked_and_retried() -> tuple[Book, dict[int, float]]:
    """v2's first attempt ends fatal at 10 s; v3 is blocked by it; a contradicting clean
    report comes late; e0's inventory at 20 s proves v2
    absent there, e1's at 30 s everywhere; v2's second attempt starts at 40 s, and the log ends
    before it publishes."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    name = book.state.versions[1].lora_name
    book.allocate(2)
    book.ready_all(2)
    times = {len(book.events) + 1: 10.0}
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="slow"))
    times[len(book.events) + 1] = 11.0
    book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), "PUBLICATION_BLOCKED")
    late = c.FailAttempt(
        version_id=2, attempt=1, clean=True, code="REFUSED", reason="late", absent_on=("e0", "e1")
    )
    book.refuse(late, "VERDICT_CONFLICT")
    for engine, at in (("e0", 20.0), ("e1", 30.0)):
        times[len(book.events) + 1] = at
        book.run(c.ObserveInventory(engine=engine, incarnation=f"{engine}-i1", adapters=(name,)))
    times[len(book.events) + 1] = 40.0
    book.allocate(2)
    return book, times


BLOCKED_BY_V2 = (
    "publication refused: PUBLICATION_BLOCKED (in the way: v2): version 2 attempt 1 ended "
    "FAILED_FATAL (TIMEOUT): it may be loaded somewhere until inventories prove it absent"
)


def test_a_fatal_attempt_its_evidence_the_publications_it_blocked_and_an_unfinished_retry() -> None:
    """The fatal incident lists the inventories recorded at the moment that resolved it (e1's
    at 30 s), not an earlier one that proved nothing yet (e0's at 20 s); a retry whose log ends
    before it publishes is open, measured from the first failure to the last record."""
    book, times = _fatal_blocked_and_retried()
    records = _timed(book, times)
    assert [(r.seq, r.recorded_at, r.type) for r in records[21:]] == [
        (22, 10.0, "AttemptFailed"),
        (23, 11.0, "PublicationBlocked"),
        (24, 11.0, "VerdictConflict"),
        (25, 20.0, "InventoryObserved"),
        (26, 30.0, "InventoryObserved"),
        (27, 30.0, "FatalResolved"),
        (28, 40.0, "AttemptStarted"),
    ]
    proved = "inventories proved the candidate absent on every engine"
    assert incidents(records) == [
        Incident(kind="fatal", subject="v2", at=10.0, seqs=(22, 26, 27),
                 summary="attempt 1 ended ambiguous: TIMEOUT: slow", duration_s=20.0,
                 resolved=True, resolution=proved),
        Incident(kind="retried", subject="v2", at=10.0, seqs=(22, 28),
                 summary="needed 2 attempts (attempt 1 ambiguous TIMEOUT)", duration_s=30.0,
                 resolved=False, resolution="not published"),
        Incident(kind="blocked", subject="v3", at=11.0, seqs=(23,), summary=BLOCKED_BY_V2),
        Incident(kind="verdict_conflict", subject="v2", at=11.0, seqs=(24,),
                 summary="a clean failure report (REFUSED) for attempt 1, which had ended "
                 "FAILED_FATAL: late"),
    ]  # fmt: skip
    # A resolution that names its evidence (the field FatalResolved carries) lists it too,
    # whenever it was recorded.
    named = [
        replace(r, event=replace(r.event, evidence=(25,))) if r.type == "FatalResolved" else r
        for r in records
    ]
    assert incidents(named)[0].seqs == (22, 25, 26, 27)
    # evidence the resolving moment lists too is listed once
    again = [
        replace(r, event=replace(r.event, evidence=(26,))) if r.type == "FatalResolved" else r
        for r in records
    ]
    assert incidents(again)[0].seqs == (22, 26, 27)


def test_a_publication_blocked_by_no_routable_engine_names_no_version() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    for engine in ("e0", "e1"):
        book.run(c.SuspendEngine(engine=engine, cause="operator"))
    book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), "FLEET_MISMATCH")
    found = [i for i in incidents(_timed(book, {})) if i.kind != "engine_suspended"]
    assert found == [
        Incident(
            kind="blocked",
            subject="v2",
            at=0.0,
            seqs=(len(book.events),),
            summary="publication refused: FLEET_MISMATCH: no routable engine to publish to "
            "(members not routable: e0, e1)",
        )
    ]
    suspended = [i.summary for i in incidents(_timed(book, {})) if i.kind == "engine_suspended"]
    assert suspended == ["suspended (operator); no new traffic"] * 2  # no detail given


def test_an_owner_s_end_counts_only_the_sessions_that_end_released() -> None:
    """A restarted owner's incident counts the sessions its replacement released
    (``owner_restarted``), an expired one's those its expiry released (``lease_expired``); a
    session the next life binds and releases itself counts for neither."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.run(c.RegisterOwner(owner="w2", ttl_s=10.0, now=0.0, incarnation="a"))
    for session in ("s1", "s2"):
        book.run(c.Bind(session=session, owner="w2", incarnation="a"))
    times = {len(book.events) + 1: 5.0}
    book.run(c.RegisterOwner(owner="w2", ttl_s=10.0, now=5.0, incarnation="b"))
    restarted = len(book.events) - 2  # OwnerRegistered, then its two releases
    book.run(c.Bind(session="s3", owner="w2", incarnation="b"))
    book.run(c.Release(session="s3", owner="w2", incarnation="b"))
    book.run(c.Bind(session="s4", owner="w1"))
    times[len(book.events) + 1] = 30.0
    book.run(c.ExpireOwner(owner="w1", now=30.0, last_seen=2.5))
    expired = len(book.events) - 1
    book.run(c.RegisterOwner(owner="w1", ttl_s=10.0, now=31.0, incarnation="c"))
    book.run(c.Bind(session="s5", owner="w1", incarnation="c"))
    book.run(c.Release(session="s5", owner="w1", incarnation="c"))
    records = _timed(book, times)
    assert [r.type for r in records[restarted - 1 : restarted + 2]] == [
        "OwnerRegistered",
        "SessionReleased",
        "SessionReleased",
    ]
    assert [r.type for r in records[expired - 1 : expired + 1]] == [
        "OwnerLeaseExpired",
        "SessionReleased",
    ]
    ended = [i for i in incidents(records) if i.kind in ("owner_restarted", "lease_expired")]
    assert ended == [
        Incident(
            kind="owner_restarted",
            subject="owner w2",
            at=5.0,
            seqs=(restarted, restarted + 1, restarted + 2),
            summary="restarted (a -> b) before its lease ran out; 2 sessions released",
        ),
        Incident(
            kind="lease_expired",
            subject="owner w1",
            at=30.0,
            seqs=(expired, expired + 1),
            summary="no renewal for 27.5s; 1 sessions released",
        ),
    ]


def test_a_rollback_an_unload_ambiguous_twice_and_a_session_released_as_its_version_retired() -> (
    None
):
    """A rollback on purpose is a fact of its own; a reclaim left ambiguous by two engines is
    one incident listing both; a session released at the very moment its version retired kept
    nothing in use (no ``pinned_retired``), and the version is reclaimable from that release."""
    book = Book().bootstrap(capacity=4)
    book.publish(5)
    book.run(c.Bind(session="s1", owner="w1"))
    times = {len(book.events) + 1: 8.0}
    rolled = book.run(c.Allocate(version_id=3, digest=digest_of(3), allow_rollback=True))
    book.ready_all(3)
    times[len(book.events) + 1] = 10.0
    book.run(c.Commit(version_id=3, attempt=rolled.attempt))
    published = len(book.events)
    book.run(c.Release(session="s1", owner="w1"))
    released = len(book.events)
    times[len(book.events) + 1] = 20.0
    book.run(c.ClaimReclaim(version_id=5))
    for engine in ("e0", "e1"):
        book.run(c.MarkReclaimAmbiguous(version_id=5, engine=engine, reason=f"{engine} timed out"))
    records = _timed(book, times)
    assert [r.type for r in records[published - 1 : released]] == [
        "VersionPublished",
        "SessionReleased",
    ]
    assert [r.type for r in records[-3:]] == [
        "ReclaimClaimed",
        "ReclaimAmbiguous",
        "ReclaimAmbiguous",
    ]
    assert incidents(records, stuck_after=5.0) == [
        Incident(
            kind="rollback",
            subject="v3",
            at=10.0,
            seqs=(published,),
            summary="rolled the default back from v5 to v3 (revision 2), on purpose",
        ),
        Incident(
            kind="stuck",
            subject="v5",
            at=10.0,
            seqs=(released, released + 1),
            summary="RETIRED and unbound (reclaimable, not reclaimed) for 10.0s (threshold 5s)",
            duration_s=10.0,
            resolved=True,
            resolution=f"left RETIRED at seq {released + 1}",
        ),
        Incident(
            kind="reclaim_ambiguous",
            subject="v5",
            at=20.0,
            seqs=(released + 2, released + 3),
            summary="unload on e0 ambiguous: e0 timed out",
            duration_s=0.0,
            resolved=False,
            resolution="still undecided: no inventory proved it",
        ),
    ]


def test_the_longest_pinned_sessions_are_kept_released_or_not(
    fault_records: list[Record], repeat: Repeat
) -> None:
    """``pinned_top`` keeps the longest: one released session when it is the longest (the
    repeat run's s-3), none at 0; a version retired then released at once is reclaimable from
    that release (the fault run's v1, 1 s before its reclaim)."""
    [pinned] = [
        i for i in IncidentFold(pinned_top=1).apply_all(repeat.records).finish()
        if i.kind == "pinned_retired"
    ]  # fmt: skip
    assert (pinned.subject, pinned.resolution) == ("session s-3", "released")
    none = IncidentFold(pinned_top=0).apply_all(fault_records).finish()
    assert not [i for i in none if i.kind == "pinned_retired"]
    brief = IncidentFold(stuck_after=0.5).apply_all(fault_records).finish()
    assert [i for i in brief if i.kind == "stuck" and i.subject == "v1"] == [
        Incident(
            kind="stuck",
            subject="v1",
            at=1100.0,
            seqs=(37, 38),
            summary="RETIRED and unbound (reclaimable, not reclaimed) for 1.0s (threshold 0.5s)",
            duration_s=1.0,
            resolved=True,
            resolution="left RETIRED at seq 38",
        )
    ]


def test_a_version_that_needed_three_attempts_lists_each_failure() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    first = len(book.events) + 1
    for attempt, code in ((1, "LOAD_REFUSED"), (2, "TIMEOUT")):
        book.allocate(2)
        book.run(
            c.FailAttempt(
                version_id=2, attempt=attempt, clean=True, code=code, reason="r",
                absent_on=("e0", "e1"),
            )
        )  # fmt: skip
    book.publish(2)
    records = _timed(book, {first: 5.0})
    [retried] = [i for i in incidents(records) if i.kind == "retried"]
    assert retried.summary == (
        "needed 3 attempts (attempt 1 clean LOAD_REFUSED; attempt 2 clean TIMEOUT)"
    )
    assert retried.resolution == "attempt 3 published"
    starts = [r.seq for r in records if r.type == "AttemptStarted" and r.event.attempt >= 2]  # type: ignore[union-attr]
    failures = [r.seq for r in records if r.type == "AttemptFailed"]
    published = [r.seq for r in records if r.type == "VersionPublished"][-1]
    assert retried.seqs == tuple(sorted([*failures, *starts, published]))


def test_the_defaults_a_minute_and_the_five_longest_pinned_sessions() -> None:
    """By default a state is stuck after 60 s (60.5 s is), and the five sessions that kept a
    retired version longest are listed (of six)."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    sessions = [f"s{i}" for i in range(1, 7)]
    for session in sessions:
        book.run(c.Bind(session=session, owner="w1"))
    book.publish(2)  # v1 retired at 0 s, the six sessions still on it
    times = {}
    for i, session in enumerate(sessions, 1):
        times[len(book.events) + 1] = float(i)
        book.run(c.Release(session=session, owner="w1"))
    book.allocate(3)
    book.ready_all(3)
    times[len(book.events) + 1] = 10.0
    book.run(c.FailAttempt(version_id=3, attempt=1, clean=False, code="TIMEOUT", reason="t"))
    times[len(book.events) + 1] = 70.5
    name = book.state.versions[2].lora_name
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(name,)))
    found = incidents(_timed(book, times))
    pinned = [(i.subject, i.duration_s) for i in found if i.kind == "pinned_retired"]
    assert pinned == [(f"session s{i}", float(i)) for i in range(2, 7)]
    stuck = [(i.subject, i.duration_s, i.resolved) for i in found if i.kind == "stuck"]
    assert stuck == [("v1", 64.5, False), ("v3", 60.5, False)]


def test_stuck_means_longer_than_the_threshold_open_or_left(
    fault_records: list[Record],
) -> None:
    """v3 was FAILED_FATAL for exactly 90 s: stuck at a threshold just under that, not at 90 s,
    whether the log shows it leaving (FatalResolved) or ends while it is still fatal."""
    until_inventories = [r for r in fault_records if r.seq <= 47]  # 1200 s, still fatal

    def fatal_stuck(records: list[Record], threshold: float) -> list[Incident]:
        found = IncidentFold(stuck_after=threshold).apply_all(records).finish()
        return [i for i in found if i.kind == "stuck" and i.summary.startswith("FAILED_FATAL")]

    assert fatal_stuck(until_inventories, 90.0) == []
    assert fatal_stuck(until_inventories, 89.5) == [
        Incident(kind="stuck", subject="v3", at=1110.0, seqs=(45,),
                 summary="FAILED_FATAL for 90.0s (threshold 89.5s)", duration_s=90.0,
                 resolved=False),
    ]  # fmt: skip
    assert fatal_stuck(fault_records, 90.0) == []
    left = IncidentFold(stuck_after=90.0).apply_all(fault_records).finish()
    assert not [i for i in left if i.kind == "stuck"]  # v3 RETIRED for 90 s too
    assert [i.seqs for i in fatal_stuck(fault_records, 89.5)] == [(45, 48)]
    # RETIRED and unbound: v3 from 1220 s to its reclaim claim at 1310 s, 90 s
    cut = [r for r in fault_records if r.seq <= 68]  # 1305 s: 85 s so far, open
    retired = [
        i for i in IncidentFold(stuck_after=84.5).apply_all(cut).finish()
        if i.kind == "stuck" and i.subject == "v3" and i.summary.startswith("RETIRED")
    ]  # fmt: skip
    assert [(i.seqs, i.duration_s, i.resolved) for i in retired] == [((63,), 85.0, False)]
    assert not [
        i for i in IncidentFold(stuck_after=85.0).apply_all(cut).finish()
        if i.kind == "stuck" and i.subject == "v3" and i.summary.startswith("RETIRED")
    ]  # fmt: skip


def test_the_longest_pinned_session_is_kept_when_the_clock_stepped_back() -> None:
    """Records carry the writer's wall-clock time, which can step back (a clock corrected):
    a session released later in the log may have kept the retired version for less time. The
    longest is listed, not the last released."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    for session in ("s1", "s2"):
        book.run(c.Bind(session=session, owner="w1"))
    book.publish(2)
    times = {len(book.events) + 1: 10.0}
    book.run(c.Release(session="s1", owner="w1"))
    times[len(book.events) + 1] = 5.0  # the clock stepped back 5 s
    book.run(c.Release(session="s2", owner="w1"))
    found = IncidentFold(pinned_top=1).apply_all(_timed(book, times)).finish()
    pinned = [(i.subject, i.duration_s) for i in found if i.kind == "pinned_retired"]
    assert pinned == [("session s1", 10.0)]


def test_a_lost_adapter_ends_with_its_engine_s_repair_or_departure() -> None:
    """A lost version not reloaded by itself ends when its engine is repaired as a whole (the
    repair reloads what is needed), or leaves; a restart then a suspension before its reload
    is still a reload "after the engine restarted" (hand-made: the health fold needs no
    registry)."""
    events = [
        AdapterLost(version_id=1, engine="e0", incarnation="e0-i1"),  # 1
        EngineRepaired(engine="e0", incarnation="e0-i1"),  # 2
        AdapterLost(version_id=1, engine="e1", incarnation="e1-i1"),  # 3
        EngineLeft(engine="e1", cause="operator"),  # 4
        AdapterLost(version_id=1, engine="e2", incarnation="e2-i1"),  # 5
        EngineLeft(engine="e2"),  # 6
        AdapterLost(version_id=1, engine="e3", incarnation="e3-i1"),  # 7
        EngineRestarted(engine="e3", old="e3-i1", new="e3-i2"),  # 8
        EngineSuspended(engine="e3", incarnation="e3-i2", cause="unhealthy"),  # 9
        VersionRestored(version_id=1, engine="e3", incarnation="e3-i2"),  # 10
    ]
    fold = EngineHealthFold()
    for record in _hand_made(events):
        fold.apply(record)
    lost = [
        (i.subject, i.seqs, i.duration_s, i.resolved, i.resolution)
        for i in fold.finish()
        if i.kind == "adapter_lost"
    ]
    assert lost == [
        ("e0", (1, 2), 1.0, True, "engine repaired: holds exactly the needed versions"),
        ("e1", (3, 4), 1.0, True, "removed by an operator"),
        ("e2", (5, 6), 1.0, True, "left the fleet"),
        ("e3", (7, 8, 9, 10), 3.0, True, "reloaded under its name after the engine restarted"),
    ]


def test_an_owner_restarted_from_an_unnamed_life() -> None:
    """(The decider never replaces a live life by an unnamed one: ``OWNER_RESTARTED``.)"""
    book = Book().bootstrap(capacity=4)  # w1's life is unnamed
    book.run(c.RegisterOwner(owner="w1", ttl_s=10.0, now=1.0, incarnation="b"))
    summaries = [i.summary for i in incidents(_timed(book, {})) if i.kind == "owner_restarted"]
    assert summaries == ["restarted ((unnamed) -> b) before its lease ran out; 0 sessions released"]


def test_served_content_mismatches_outages_and_suspensions_each_end_their_own_way() -> None:
    """Hand-made (the health fold needs no registry): served content that is not the
    version's (found after the version was lost there) stays open while the impostor name is
    in the inventory of the life that lost it, is ended by the next
    mismatch or by a reload; an outage is ended by a new process life, by the engine leaving,
    or by a second report (which the ledger never writes while one is open, but the fold does
    not rely on); a suspension again without a resumption says so."""
    expected, seen = "a" * 20, "b" * 20
    events = [
        AdapterLost(version_id=1, engine="e0", incarnation="e0-i1"),  # 1, named below
        ServedContentMismatch(version_id=1, engine="e0", incarnation="e0-i1",
                              evidence="digest", expected=expected, seen=seen),  # 2
        InventoryObserved(engine="e0", incarnation="e0-i1", adapters=("agent@v1",)),  # 3
        ServedContentMismatch(version_id=1, engine="e0", incarnation="e0-i1",
                              evidence="canary", expected=expected, seen=seen),  # 4
        VersionRestored(version_id=1, engine="e0", incarnation="e0-i1"),  # 5
        EngineUnreachable(engine="e1", incarnation="e1-i1", at=6.0, error="E", source="probe"),
        EngineUnreachable(engine="e1", incarnation="e1-i1", at=7.0, error="F", source="probe"),
        EngineRestarted(engine="e1", old="e1-i1", new="e1-i2"),  # 8
        EngineUnreachable(engine="e1", incarnation="e1-i2", at=9.0, error="G", source="probe"),
        EngineLeft(engine="e1"),  # 10
        EngineSuspended(engine="e2", incarnation="e2-i1", cause="unhealthy"),  # 11
        EngineSuspended(engine="e2", incarnation="e2-i1", cause="operator"),  # 12
    ]  # fmt: skip
    fold = EngineHealthFold()
    fold.apply(_hand_made([VersionAllocated(version_id=1, digest="d", lora_name="agent@v1")])[0])
    for record in _hand_made(events):
        fold.apply(record)
    rows = [(i.kind, i.subject, i.at, i.seqs, i.resolved, i.resolution) for i in fold.finish()]
    assert rows == [
        ("adapter_lost", "e0", 1.0, (1, 2), True, "served other content before it was restored"),
        ("content_mismatch", "e0", 2.0, (2, 4), True,
         "served other content before it was restored"),
        ("content_mismatch", "e0", 4.0, (4, 5), True, "reloaded under its name"),
        ("engine_unreachable", "e1", 6.0, (6, 7), True, "unreachable again"),
        ("engine_unreachable", "e1", 7.0, (7, 8), True, "came back as a new process life"),
        ("engine_unreachable", "e1", 9.0, (9, 10), True, "left the fleet"),
        ("engine_suspended", "e2", 11.0, (11, 12), True,
         "suspended again (operator) before a repair"),
        ("engine_suspended", "e2", 12.0, (12,), False, "still suspended"),
    ]  # fmt: skip
    assert fold.finish()[1].summary == (
        f"v1 served with other content (e0-i1, digest: expected {expected[:16]}, seen "
        f"{seen[:16]}); no longer routed there"
    )


def test_a_restart_never_repaired_a_fatal_verdict_late_and_two_blockers() -> None:
    """An engine restarted then removed before its repair, another still unrepaired at the end
    of the log; a fatal report about an attempt already ended clean (a verdict conflict); a
    block naming two versions in the way."""
    book = Book().bootstrap(capacity=4, engines=("e0", "e1", "e2"))
    book.publish(1)
    book.allocate(2)
    book.ready_all(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=True, code="REFUSED", reason="r",
                           absent_on=("e0", "e1", "e2")))  # fmt: skip
    book.refuse(
        c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="late"),
        "VERDICT_CONFLICT",
    )
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    book.run(c.RemoveEngine(engine="e1"))
    book.run(c.ObserveRestart(engine="e2", incarnation="e2-i2"))
    records = _timed(book, {})
    blocked = Record(
        seq=len(records) + 1, event_id=b"", stream="", type="PublicationBlocked", schema=1,
        recorded_at=0.0, payload=b"", prev_hash=b"", hash=b"",
        event=PublicationBlocked(version_id=3, digest="d", code="PUBLICATION_BLOCKED",
                                 cause="c", blocked_by=(1, 2)),
    )  # fmt: skip
    found = incidents([*records, blocked])
    rows = [(i.kind, i.subject, i.seqs, i.resolved, i.resolution) for i in found]
    restart_e1, left_e1, restart_e2 = (
        r.seq for r in records if r.type in ("EngineRestarted", "EngineLeft")
    )
    assert ("engine_restart", "e1", (restart_e1, left_e1), True,
            "left the fleet before it was repaired") in rows  # fmt: skip
    assert ("engine_restart", "e2", (restart_e2,), False, "not repaired yet: not routable") in rows
    [conflict] = [i.summary for i in found if i.kind == "verdict_conflict"]
    assert conflict == (
        "a fatal failure report (TIMEOUT) for attempt 1, which had ended FAILED_RETRYABLE: late"
    )
    [block] = [i.summary for i in found if i.kind == "blocked"]
    assert block == "publication refused: PUBLICATION_BLOCKED (in the way: v1, v2): c"


def test_an_incident_lists_at_most_twelve_seqs() -> None:
    """An expiry may release thousands of sessions: its incident counts them all but lists
    the first twelve records (the expiry and eleven releases)."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    for i in range(13):
        book.run(c.Bind(session=f"s{i}", owner="w1"))
    book.run(c.ExpireOwner(owner="w1", now=30.0, last_seen=0.0))
    expired = len(book.events) - 13
    [lease] = [i for i in incidents(_timed(book, {})) if i.kind == "lease_expired"]
    assert lease.seqs == tuple(range(expired, expired + 12))
    assert lease.summary == "no renewal for 30.0s; 13 sessions released"
