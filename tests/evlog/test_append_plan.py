"""plan_appends, the one definition of how a group of appends resolves (pure: no store).

The stores' contract tests hold it through real stores; here the cases that need several calls
in one group, which a store forms only under concurrency, are stated directly."""

from __future__ import annotations

from evlog.append_plan import plan_appends
from evlog.errors import StoreCode, StoreError
from evlog.record import GENESIS_HASH
from tests.evlog.contract import batch_of


def test_an_event_repeated_across_the_calls_of_one_group_is_stored_once() -> None:
    """A caller's retry queued behind its own first attempt lands in the same group: it gets
    the first attempt's seqs, and nothing is stored twice."""
    first, other = batch_of(2, "a"), batch_of(1, "b")
    plan = plan_appends([(first, None), (other, None), (first, None)], 0, GENESIS_HASH, {})
    assert plan.outcomes == [[1, 2], [3], [1, 2]]
    assert [row[0] for row in plan.rows] == [1, 2, 3]
    assert plan.last_seq == 3 and plan.head_hash == plan.rows[-1][8]


def test_ids_already_stored_keep_their_seq_and_a_stale_expected_seq_refuses_only_new_events() -> (
    None
):
    stored_batch, new = batch_of(2, "old"), batch_of(1, "new")
    stored = {p.event_id: seq for seq, p in enumerate(stored_batch, start=5)}
    plan = plan_appends([(stored_batch, 0), (new, 0), (new, 6)], 6, b"\x07" * 32, stored)
    retry, refused, written = plan.outcomes
    assert retry == [5, 6]  # all stored: a retry, answered although expected_seq is stale
    assert isinstance(refused, StoreError) and refused.code == StoreCode.SEQ_CONFLICT
    assert refused.details == {"expected": 0, "actual": 6}
    assert written == [7]
    assert [row[0] for row in plan.rows] == [7] and plan.rows[0][7] == b"\x07" * 32


def test_an_id_repeated_inside_one_batch_is_stored_once() -> None:
    (p,) = batch_of(1)
    plan = plan_appends([([p, p], None)], 0, GENESIS_HASH, {})
    assert plan.outcomes == [[1, 1]] and len(plan.rows) == 1
