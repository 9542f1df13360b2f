"""The demo's story fold on the fault run, where every number is known in advance."""

from __future__ import annotations

from evlog.record import Record
from publisher.gateway.provenance import ProvenanceRow
from tests.support.ledger import digest
from tools.story import tell


def _row(session: str, version_id: int, engine: str = "e0") -> ProvenanceRow:
    return ProvenanceRow(
        session=session, turn=0, engine=engine, incarnation="i", version_id=version_id,
        lora_name=f"agent@dep-{version_id}-{digest(version_id)[:16]}",
        digest=digest(version_id), bound_revision=1, head_revision=1, head_revision_done=1,
        request_id=f"{session}-r", prompt_tokens=1, completion_tokens=1, cached_tokens=0,
        finish_reason="length", started_at=1003.0, finished_at=1003.5, gateway="g",
    )  # fmt: skip


def test_the_fault_run_told(fault_records: list[Record]) -> None:
    story = tell(fault_records, [_row("s-a", 1), _row("s-d", 2, "e1"), _row("s-b", 1)])
    assert (story.events, story.started_at, story.duration_s) == (82, 1000.0, 400.0)
    assert story.sessions == 4 and story.owners == 2 and story.sessions_per_version == {1: 3, 2: 1}
    assert (story.generations, story.pinned, story.mismatches) == (3, True, 0)
    assert story.per_engine == {"e0": 2, "e1": 1} and story.fleet == ("e0", "e1")
    assert story.skipped == (5,) and story.lease_expiries == 1 and story.sessions_open == 1
    v = {s.version_id: s for s in story.versions}
    assert (v[1].published_at, v[1].retired_at, v[1].reclaimed_at) == (1.0, 10.0, 101.0)
    assert v[1].reclaim_lag_s == 1.0  # last release at +100 s, reclaimed at +101 s
    assert (v[2].attempts, v[2].publish_s) == (2, 5.0)  # allocated at +5, committed at +10
    assert (v[3].attempts, v[3].state) == (2, "RECLAIMED")
    assert v[4].state == "PUBLISHED" and v[4].retired_at is None
    (restart,) = story.restarts
    assert (restart.engine, restart.old, restart.new) == ("e1", "e1-i1", "e1-i2")
    assert (restart.at, restart.restored, restart.unroutable_s) == (300.0, (2, 4), 5.0)
    # s-a, s-b, s-c were still bound when v1 retired; s-b held it longest (90 s)
    assert (story.spanning, story.example_session) == (3, "s-b")


def test_a_generation_on_another_version_is_counted(fault_records: list[Record]) -> None:
    story = tell(fault_records, [_row("s-a", 1), _row("s-a", 2)])
    assert (story.pinned, story.mismatches) == (False, 1)
