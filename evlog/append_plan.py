"""How a group of append calls resolves against the log: the one definition every store uses.

Pure (no I/O): the memory store applies the plan to its lists, the durable stores write its
rows in one transaction. Kept apart from the contract (:mod:`evlog.store`) because it is an
algorithm the backends share, not a promise they make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from evlog.errors import StoreCode, StoreError
from evlog.record import Pending, Row, seal_row

AppendRequest = tuple[Sequence[Pending], int | None]
"""One ``append`` call: its batch and its ``expected_seq``."""


class AppendPlan(NamedTuple):
    """What a group of append calls does to the log: the rows to insert (in seq order), one
    outcome per call (its seqs, or the refusal it gets), and the new tail."""

    rows: list[Row]
    outcomes: list[list[int] | StoreError]
    last_seq: int
    head_hash: bytes


def plan_appends(
    requests: Sequence[AppendRequest],
    last_seq: int,
    head_hash: bytes,
    stored: Mapping[bytes, int],
) -> AppendPlan:
    """Resolve ``requests`` in order, as if each ran alone right after the previous one.

    Pure: ``stored`` maps the event ids already in the log to their seq (it must hold at least
    the ids named by ``requests``; an empty mapping asserts there are none). An id stored or
    given a seq earlier in the group, or earlier in its own batch, keeps that seq and is not
    stored again. ``expected_seq`` is compared with the tail *at that call's turn*, so calls
    merged into one transaction behave exactly like calls committed one by one; a refused call
    contributes nothing and does not affect the calls after it. A call whose events are all
    already stored is answered with their seqs even when its ``expected_seq`` is stale: it is a
    retry of an append that committed.
    """
    rows: list[Row] = []
    outcomes: list[list[int] | StoreError] = []
    assigned: dict[bytes, int] = {}
    for batch, expected in requests:
        seq = last_seq
        prev = head_hash
        local: dict[bytes, int] = {}
        fresh: list[Row] = []
        seqs: list[int] = []
        for p in batch:
            eid = p.event_id
            known = stored.get(eid) or assigned.get(eid) or local.get(eid)
            if known is None:
                seq += 1
                row = seal_row(p, seq, prev)
                prev = row[8]
                fresh.append(row)
                local[eid] = known = seq
            seqs.append(known)
        if fresh and expected is not None and expected != last_seq:
            outcomes.append(
                StoreError(
                    StoreCode.SEQ_CONFLICT,
                    f"expected the log to end at seq {expected}, it ends at {last_seq}",
                    expected=expected,
                    actual=last_seq,
                )
            )
            continue
        rows.extend(fresh)
        assigned.update(local)
        last_seq = seq
        head_hash = prev
        outcomes.append(seqs)
    return AppendPlan(rows, outcomes, last_seq, head_hash)
