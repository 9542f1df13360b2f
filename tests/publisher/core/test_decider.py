"""Every command and every error code of the decider (docs/state-machine.md), each reached by
the scenario that leads to it.

The ``Book`` harness checks the invariants after every single decision.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from evlog.errors import LoraLedgerError
from evlog.events import (
    AttemptFailed,
    CommandRecorded,
    EngineRestarted,
    FatalResolved,
    InFlight,
    PublicationBlocked,
    PublicationSkipped,
    ReceiptRejected,
    SessionReleased,
    VerdictConflict,
    VersionPublished,
    VersionReclaimed,
)
from projections.registry import VersionState, encode_state
from publisher.core import commands as c
from publisher.core.decider import check_lease
from publisher.core.errors import Code
from publisher.core.outcomes import Allocated, Bound, Released, Skipped
from tests.publisher.core.book import Book, CountedFleet, digest_of


@pytest.fixture
def book() -> Book:
    return Book().bootstrap()


# --- allocate ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, True, False, "3", 2.0, None])
def test_allocate_refuses_invalid_version_ids(book: Book, bad: Any) -> None:
    assert book.refuse(c.Allocate(version_id=bad, digest=digest_of(1)), Code.INVALID_VERSION) == []


def test_allocate_refuses_a_malformed_digest(book: Book) -> None:
    book.refuse(c.Allocate(version_id=1, digest="abc"), Code.INVALID_INPUT)
    book.refuse(c.Allocate(version_id=1, digest=digest_of(1).upper()), Code.INVALID_INPUT)


def test_version_conflict_in_every_state(book: Book) -> None:
    other = digest_of("other")
    book.allocate(1)  # LOADING
    book.refuse(c.Allocate(version_id=1, digest=other), Code.VERSION_CONFLICT)
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    book.refuse(c.Allocate(version_id=1, digest=other), Code.VERSION_CONFLICT)
    book.publish(1)  # retry attempt 2, PUBLISHED
    book.refuse(c.Allocate(version_id=1, digest=other), Code.VERSION_CONFLICT)
    book.publish(2)  # 1 RETIRED
    book.refuse(c.Allocate(version_id=1, digest=other), Code.VERSION_CONFLICT)
    book.reclaim(1)  # RECLAIMED
    assert book.state.versions[1].state is VersionState.RECLAIMED
    book.refuse(c.Allocate(version_id=1, digest=other), Code.VERSION_CONFLICT)


def test_replay_of_a_completed_version_is_a_no_op_that_never_moves_the_default(
    book: Book,
) -> None:
    book.publish(1)
    book.publish(2)
    before = len(book.events)
    outcome = book.run(c.Allocate(version_id=1, digest=digest_of(1)))
    assert isinstance(outcome, Allocated) and outcome.no_op and outcome.state == "RETIRED"
    assert len(book.events) == before
    assert book.state.default == 2
    replay = book.run(c.Commit(version_id=1, attempt=1))
    assert replay.no_op and book.state.default == 2 and book.state.default_revision == 2


def test_publishing_a_step_lower_than_the_default_is_a_recorded_version_regression() -> None:
    """Regression: publishing step 5 after step 12 committed and silently rolled the policy
    back. It is refused by default (VERSION_REGRESSION, recorded like a skip); an explicit
    rollback (allow_rollback) publishes it and the commit is recorded as a rollback."""
    book = Book().bootstrap(capacity=3)
    book.publish(12)
    before = len(book.events)
    error = book.refusal(c.Allocate(version_id=5, digest=digest_of(5)), Code.VERSION_REGRESSION)
    assert error.details == {"version_id": 5, "default": 12}
    assert "version 5 is lower than the default 12" in error.message
    (skip,) = book.events[before:]  # the log says which version the trainer asked for, and why
    assert skip == PublicationSkipped(
        version_id=5, digest=digest_of(5), code=Code.VERSION_REGRESSION, message=error.message
    )
    assert 5 not in book.state.versions
    assert book.state.default == 12
    allocated = book.run(c.Allocate(version_id=5, digest=digest_of(5), allow_rollback=True))
    assert isinstance(allocated, Allocated) and allocated.attempt == 1
    book.ready_all(5)
    published = book.run(c.Commit(version_id=5, attempt=1))
    assert published.retired == 12 and book.state.default == 5
    assert isinstance(book.events[-1], VersionPublished) and book.events[-1].rollback
    book.publish(13)  # going forward again is not a rollback
    assert not [e for e in book.events if isinstance(e, VersionPublished)][-1].rollback


def test_a_fatally_failed_version_below_the_default_is_blocked_not_a_regression() -> None:
    """The check-order table puts the state step (a ``FAILED_FATAL`` version is
    ``PUBLICATION_BLOCKED``) before the regression check. Before, allocating a fatally failed
    version below the default answered ``VERSION_REGRESSION`` and recorded a skip, as if the
    version could be published once the trainer meant the rollback: it cannot, whatever the
    flag, until inventories prove it absent."""
    book = Book().bootstrap(capacity=3)
    book.publish(12)
    book.run(c.Allocate(version_id=5, digest=digest_of(5), allow_rollback=True))
    book.run(c.FailAttempt(version_id=5, attempt=1, clean=False, code="T", reason="timeout"))
    assert book.state.versions[5].state is VersionState.FAILED_FATAL
    for allow_rollback in (False, True):
        again = c.Allocate(version_id=5, digest=digest_of(5), allow_rollback=allow_rollback)
        error = book.refusal(again, Code.PUBLICATION_BLOCKED)
        assert error.details["versions"] == [5], error.details
    # the stall is recorded once (a PublicationBlocked naming the blocker), never as a skip
    assert not [e for e in book.events if isinstance(e, PublicationSkipped)]
    (blocked,) = [e for e in book.events if isinstance(e, PublicationBlocked)]
    assert (blocked.version_id, blocked.blocked_by) == (5, (5,))


def test_loading_version_returns_the_same_attempt(book: Book) -> None:
    first = book.allocate(1)
    again = book.allocate(1)
    assert again.resumed and again.attempt == first.attempt == 1
    assert book.state.versions[1].attempt == 1


def test_retry_after_clean_failure_starts_the_next_attempt(book: Book) -> None:
    book.allocate(1)
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=True, code="LOAD", reason="4xx",
                           absent_on=("e0", "e1")))  # fmt: skip
    assert book.state.versions[1].state is VersionState.FAILED_RETRYABLE
    assert book.state.capacity_used() == 0
    retry = book.allocate(1)
    assert retry.attempt == 2 and not retry.resumed


def test_capacity_error_at_bootstrap_and_skip_after(book: Book) -> None:
    # Bootstrap (no default yet): a capacity refusal is an error, not a skip.
    small = Book().bootstrap(capacity=1)
    small.allocate(1)  # LOADING: the only slot is taken
    recorded = small.refuse(c.Allocate(version_id=2, digest=digest_of(2)), Code.CAPACITY_ERROR)
    # Recorded once (the stall and its slot holder), nothing allocated.
    assert [(type(e), getattr(e, "blocked_by", None)) for e in recorded] == [
        (PublicationBlocked, (1,))
    ]
    assert 2 not in small.state.versions
    small.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="T", reason="timeout"))
    # FAILED_FATAL keeps its slot; once resolved the slot frees.
    assert small.state.capacity_used() == 1
    for engine in ("e0", "e1"):
        small.run(c.ObserveInventory(engine=engine, incarnation=small.incarnation(engine),
                                     adapters=()))  # fmt: skip
    assert small.state.versions[1].state is VersionState.FAILED_RETRYABLE
    assert small.state.capacity_used() == 0
    # After bootstrap (a default exists): the same refusal is a recorded skip.
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(2)  # v1 RETIRED but bound, v2 PUBLISHED: capacity 2 is full
    before = len(book.events)
    outcome = book.run(c.Allocate(version_id=3, digest=digest_of(3)))
    assert isinstance(outcome, Skipped) and outcome.code == Code.CAPACITY_ERROR
    assert [type(e) for e in book.events[before:]] == [PublicationSkipped]
    assert 3 not in book.state.versions  # nothing allocated, no engine touched
    book.run(c.Release(session="s1", owner="w1"))
    book.reclaim(1)
    assert book.allocate(3).attempt == 1  # succeeds once v1 is reclaimed


def test_capacity_error_before_any_default() -> None:
    book = Book().bootstrap(capacity=1)
    book.allocate(1)
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="T", reason="timeout"))
    # Resolve the fatal entry so the block is not what refuses.
    for engine in ("e0", "e1"):
        book.run(c.ObserveInventory(engine=engine, incarnation=book.incarnation(engine),
                                    adapters=()))  # fmt: skip
    assert book.state.versions[1].state is VersionState.FAILED_RETRYABLE
    book.allocate(1)  # attempt 2 takes the slot again
    book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), Code.CAPACITY_ERROR)


def test_publication_in_progress(book: Book) -> None:
    book.allocate(1)
    book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), Code.PUBLICATION_IN_PROGRESS)


def test_no_routable_engine_refuses_allocation() -> None:
    book = Book()
    book.run(c.CreateDeployment(deployment="d", prefix="p", capacity=2))
    book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.FLEET_MISMATCH)


def test_commands_need_a_deployment() -> None:
    book = Book()
    book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.NOT_INITIALIZED)
    book.refuse(c.Bind(session="s", owner="w"), Code.NOT_INITIALIZED)


def test_create_deployment_validates_and_is_idempotent() -> None:
    book = Book()
    book.refuse(c.CreateDeployment(deployment="a/b", prefix="p", capacity=2), Code.INVALID_INPUT)
    book.refuse(c.CreateDeployment(deployment="d", prefix="p:x", capacity=2), Code.INVALID_INPUT)
    book.refuse(c.CreateDeployment(deployment="d", prefix="p", capacity=0), Code.INVALID_INPUT)
    book.run(c.CreateDeployment(deployment="d", prefix="p", capacity=2))
    assert book.run(c.CreateDeployment(deployment="d", prefix="p", capacity=2)).no_op
    book.refuse(
        c.CreateDeployment(deployment="d", prefix="p", capacity=3), Code.ALREADY_INITIALIZED
    )


def test_lora_name_is_immutable_and_path_safe(book: Book) -> None:
    allocated = book.allocate(7)
    assert allocated.lora_name == f"agent@dep-7-{digest_of(7)[:16]}"
    assert ":" not in allocated.lora_name and "/" not in allocated.lora_name


# --- claim, receipts, commit -------------------------------------------------------------


def test_claim_grants_one_transport_owner_per_attempt(book: Book) -> None:
    book.allocate(1)
    book.run(c.ClaimTransport(version_id=1, attempt=1, owner="a"))
    assert book.run(c.ClaimTransport(version_id=1, attempt=1, owner="a")).owner == "a"
    book.refuse(c.ClaimTransport(version_id=1, attempt=1, owner="b"), Code.PUBLICATION_IN_PROGRESS)
    stale = book.refusal(
        c.ClaimTransport(version_id=1, attempt=2, owner="a"), Code.ATTEMPT_CONFLICT
    )
    assert stale.details == {"version_id": 1}
    book.refuse(c.ClaimTransport(version_id=9, attempt=1, owner="a"), Code.UNKNOWN_VERSION)


def _ready(book: Book, version_id: int, engine: str, **override: object) -> c.RecordReady:
    v = book.state.versions[version_id]
    fields: dict[str, object] = dict(
        version_id=version_id,
        attempt=v.attempt,
        engine=engine,
        incarnation=book.incarnation(engine),
        digest=v.digest,
        lora_name=v.lora_name,
    )
    fields.update(override)
    return c.RecordReady(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "code"),
    [
        ({"digest": digest_of("x")}, Code.READY_MISMATCH),
        ({"lora_name": "agent@dep-1-0000000000000000"}, Code.READY_MISMATCH),
        ({"incarnation": "e0-old"}, Code.ENGINE_RESTARTED),
        ({"attempt": 2}, Code.ATTEMPT_CONFLICT),
    ],
)
def test_mismatched_receipts_are_recorded_and_refused(
    book: Book, override: dict[str, object], code: str
) -> None:
    book.allocate(1)
    recorded = book.refuse(_ready(book, 1, "e0", **override), code)
    assert len(recorded) == 1 and isinstance(recorded[0], ReceiptRejected)
    assert recorded[0].code == code
    assert book.state.versions[1].ready == {}


def test_receipt_from_an_engine_outside_the_fleet_is_fleet_mismatch(book: Book) -> None:
    book.allocate(1)
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))  # joined after allocation
    recorded = book.refuse(_ready(book, 1, "e2"), Code.FLEET_MISMATCH)
    assert isinstance(recorded[0], ReceiptRejected)


def test_receipts_are_checked_against_the_fleet_without_scanning_it() -> None:
    """A publication to n engines decides 2n receipts: each asks whether its engine is in the
    attempt's fleet, which the fold keeps by engine while the attempt loads -- a scan of the
    fleet per receipt would make the publication's decisions O(n^2)."""
    engines = tuple(f"e{i}" for i in range(6))
    book = Book().bootstrap(capacity=3, engines=engines)
    book.allocate(1)
    v = book.state.versions[1]
    assert v.loading_fleet == dict.fromkeys(engines)
    CountedFleet.scans = 0
    v.fleet = CountedFleet(v.fleet)
    book.ready_all(1)
    assert CountedFleet.scans == 0
    book.run(c.Commit(version_id=1, attempt=1))
    assert book.state.versions[1].loading_fleet == {}  # nothing kept once the attempt ended


def test_a_retried_attempt_checks_receipts_against_its_own_fleet(book: Book) -> None:
    book.allocate(1)
    book.claim(1)
    book.run(
        c.FailAttempt(
            version_id=1, attempt=1, clean=True, code="T", reason="t", absent_on=("e0", "e1")
        )
    )
    assert book.state.versions[1].loading_fleet == {}
    book.run(c.SuspendEngine(engine="e1", cause="operator"))
    book.allocate(1)  # attempt 2, on the engines that serve now
    assert book.state.versions[1].loading_fleet == {"e0": None}
    recorded = book.refuse(_ready(book, 1, "e1"), Code.FLEET_MISMATCH)
    assert isinstance(recorded[0], ReceiptRejected)


def _prepared(book: Book, version_id: int, engine: str) -> c.RecordPrepared:
    return c.RecordPrepared(**msgspec.structs.asdict(_ready(book, version_id, engine)))


def test_a_receipt_or_claim_for_a_fatally_failed_attempt_names_its_step_and_the_blocker(
    book: Book,
) -> None:
    """After a fatal failure the attempt blocks publication: a late receipt is recorded with
    the step it was (READY or PREPARED) and why; a claim is refused naming the blocking
    version, which a caller reads to wait for its resolution."""
    book.allocate(1)
    book.claim(1)
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="T", reason="t"))
    for receipt, step in ((_ready(book, 1, "e0"), "READY"), (_prepared(book, 1, "e0"), "PREPARED")):
        (rejected,) = book.refuse(receipt, Code.PUBLICATION_BLOCKED)
        assert isinstance(rejected, ReceiptRejected)
        assert rejected.detail.startswith(f"{step}: attempt 1 of version 1 ended FAILED_FATAL;")
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.ClaimTransport(version_id=1, attempt=1, owner="other"))
    assert info.value.code == Code.PUBLICATION_BLOCKED
    assert info.value.details == {"versions": [1]}
    assert info.value.message.startswith("claim: attempt 1 of version 1 ended FAILED_FATAL;")


def test_ready_without_a_claim_or_prepared_receipt_is_refused_and_recorded(book: Book) -> None:
    """Regression: READY was accepted for an attempt no transport claimed and no engine had
    PREPARED (and a commit then succeeded); PREPARED was accepted without a claim."""
    book.allocate(1)
    for receipt in (_ready(book, 1, "e0"), _prepared(book, 1, "e0")):
        recorded = book.refuse(receipt, Code.RECEIPT_OUT_OF_ORDER)
        (rejected,) = recorded
        assert isinstance(rejected, ReceiptRejected)
        assert rejected.code == Code.RECEIPT_OUT_OF_ORDER
    book.claim(1)
    book.refuse(_ready(book, 1, "e0"), Code.RECEIPT_OUT_OF_ORDER)  # claimed, not PREPARED
    for engine in ("e0", "e1"):
        book.refuse(_ready(book, 1, engine), Code.RECEIPT_OUT_OF_ORDER)
    book.refuse(c.Commit(version_id=1, attempt=1), Code.NOT_READY)
    assert book.state.versions[1].ready == {} and book.state.default is None


def test_ready_at_an_incarnation_that_never_prepared_is_out_of_order(book: Book) -> None:
    """READY means "what I prepared at this incarnation is loaded": a PREPARED from the
    engine's previous life does not count."""
    book.allocate(1)
    book.claim(1)
    book.run(_prepared(book, 1, "e0"))
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    book.refuse(_ready(book, 1, "e0"), Code.RECEIPT_OUT_OF_ORDER)
    book.run(_prepared(book, 1, "e0"))
    book.run(_ready(book, 1, "e0"))
    assert book.state.versions[1].ready == {"e0": "e0-i2"}


def test_ready_from_one_engine_never_moves_the_default(book: Book) -> None:
    book.publish(1)
    book.allocate(2)
    book.claim(2)
    book.run(_prepared(book, 2, "e0"))
    book.run(_ready(book, 2, "e0"))
    book.refuse(c.Commit(version_id=2, attempt=1), Code.NOT_READY)
    assert book.state.default == 1
    book.run(_prepared(book, 2, "e1"))
    book.run(_ready(book, 2, "e1"))
    published = book.run(c.Commit(version_id=2, attempt=1))
    assert published.retired == 1 and published.revision == 2
    assert book.state.versions[1].state is VersionState.RETIRED


def test_duplicate_ready_is_a_no_op(book: Book) -> None:
    book.allocate(1)
    book.claim(1)
    book.run(_prepared(book, 1, "e0"))
    book.run(_ready(book, 1, "e0"))
    before = len(book.events)
    assert book.run(_ready(book, 1, "e0")).no_op
    assert len(book.events) == before


def test_restart_after_ready_invalidates_the_receipt(book: Book) -> None:
    book.allocate(1)
    book.ready_all(1)
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    book.refuse(c.Commit(version_id=1, attempt=1), Code.NOT_READY)
    assert book.state.default is None


def test_commit_of_a_stale_attempt_or_failed_version(book: Book) -> None:
    book.allocate(1)
    stale = book.refusal(c.Commit(version_id=1, attempt=2), Code.ATTEMPT_CONFLICT)
    assert stale.details == {"version_id": 1}
    assert stale.message == "attempt 2 of version 1 is not current (it is LOADING at attempt 1)"
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="T", reason="t"))
    blocked = book.refusal(c.Commit(version_id=1, attempt=1), Code.PUBLICATION_BLOCKED)
    assert blocked.details == {"versions": [1]}


def _ambiguous_reclaim(book: Book, version_id: int) -> None:
    book.run(c.ClaimReclaim(version_id=version_id))
    book.run(c.MarkReclaimAmbiguous(version_id=version_id, engine="e1", reason="unload timed out"))
    assert book.state.blocked_by() == [version_id]


def test_ambiguous_reclaim_blocks_the_claim_and_commit_of_a_loading_candidate() -> None:
    """Regression: while an ambiguous reclaim blocked publication, a LOADING candidate could
    still be claimed, made READY and committed: the default moved while the fleet's memory
    state was unknown. Claim and commit are refused like allocate; receipts and the failure
    of the attempt are still accepted (evidence, and no error path may leave it LOADING)."""
    book = Book().bootstrap(capacity=4)
    for version_id in (1, 2, 3):
        book.publish(version_id)  # 1 and 2 RETIRED, 3 the default
    book.allocate(4)
    _ambiguous_reclaim(book, 1)
    claim = c.ClaimTransport(version_id=4, attempt=1, owner="trainer")
    assert book.refuse(claim, Code.PUBLICATION_BLOCKED) == []
    assert book.refusal(claim, Code.PUBLICATION_BLOCKED).details == {"versions": [1]}
    for engine in ("e0", "e1"):  # inventories prove v1 absent: the block is lifted
        book.run(c.ObserveInventory(engine=engine, incarnation=f"{engine}-i1", adapters=()))
    assert book.state.blocked_by() == []
    book.ready_all(4)
    _ambiguous_reclaim(book, 2)
    before = (encode_state(book.state), len(book.events))
    assert book.refuse(c.Commit(version_id=4, attempt=1), Code.PUBLICATION_BLOCKED) == []
    assert (encode_state(book.state), len(book.events)) == before
    blocked = book.refusal(c.Commit(version_id=4, attempt=1), Code.PUBLICATION_BLOCKED)
    assert blocked.details == {"versions": [2]}  # the version whose unload must be resolved
    assert book.state.default == 3
    names = (book.state.versions[3].lora_name, book.state.versions[4].lora_name)
    for engine in ("e0", "e1"):
        book.run(c.ObserveInventory(engine=engine, incarnation=f"{engine}-i1", adapters=names))
    book.run(c.Commit(version_id=4, attempt=1))
    assert book.state.default == 4


# --- failures and their resolution ---------------------------------------------------------


def test_clean_failure_without_full_absence_proof_is_fatal(book: Book) -> None:
    book.allocate(1)
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0",)))  # fmt: skip
    failed = book.events[-1]
    assert isinstance(failed, AttemptFailed) and not failed.clean
    assert book.state.versions[1].state is VersionState.FAILED_FATAL


def test_fatal_blocks_publication_until_inventories_prove_absence(book: Book) -> None:
    book.publish(1)
    book.allocate(2)
    book.ready_all(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="t"))
    book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), Code.PUBLICATION_BLOCKED)
    name = book.state.versions[2].lora_name
    # e0 still holds the candidate: not resolved.
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(name,)))
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert book.state.versions[2].state is VersionState.FAILED_FATAL
    # cleaned up on e0, observed absent: resolved, and publication resumes.
    outcome = book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    assert outcome.resolved == (2,)
    assert isinstance(book.events[-1], FatalResolved)
    assert book.state.versions[2].state is VersionState.FAILED_RETRYABLE
    assert book.allocate(3).attempt == 1


@pytest.mark.parametrize("first_clean", [True, False])
def test_conflicting_verdict_is_recorded_and_refused_not_dropped(
    book: Book, first_clean: bool
) -> None:
    """Regression: a fatal failure report on an attempt already FAILED_RETRYABLE answered
    AttemptEnded(FAILED_RETRYABLE) and the fatal evidence was dropped; a clean one on a
    FAILED_FATAL attempt was ignored the same way. Now it is recorded and refused."""
    book.allocate(1)
    everywhere = ("e0", "e1")
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=first_clean, code="FIRST",
                           reason="first", absent_on=everywhere))  # fmt: skip
    ended = book.state.versions[1].state
    # Its code and reason are bounded as every recorded text is; absent_on is kept as a set.
    report = c.FailAttempt(version_id=1, attempt=1, clean=not first_clean, code="L" * 201,
                           reason="r" * 2001, absent_on=("e1", "e0", "e1"))  # fmt: skip
    before = len(book.events)
    with pytest.raises(LoraLedgerError) as info:
        book.run(report)
    (conflict,) = book.events[before:]
    assert conflict == VerdictConflict(
        version_id=1,
        attempt=1,
        state=ended,
        clean=not first_clean,
        code="L" * 200,
        reason="r" * 2000,
        absent_on=everywhere,
    )
    assert info.value.code == Code.VERDICT_CONFLICT
    assert info.value.details == {"version_id": 1, "state": ended}
    late, first = ("clean", "fatal") if not first_clean else ("fatal", "clean")
    assert info.value.message.startswith(f"a {late} failure report (")
    assert f"attempt 1 of version 1, which already ended {ended} (FIRST)" in info.value.message
    assert first != late
    assert book.state.versions[1].state is ended  # never applied
    # The same verdict again, or a resend of the report that ended it, is still a no-op.
    before = len(book.events)
    resend = c.FailAttempt(version_id=1, attempt=1, clean=first_clean, code="FIRST",
                           reason="first", absent_on=everywhere)  # fmt: skip
    assert book.run(resend).state == ended and len(book.events) == before


def test_a_resend_of_the_ending_report_is_a_no_op_whatever_its_verdict_now(book: Book) -> None:
    """The report that ended an attempt, sent again, is recognised by its code and its reason as
    stored (bounded to 2,000 characters), even when its verdict now reads the other way (an
    engine it named absent was suspended since, so it can no longer prove a clean failure)."""
    book.allocate(1)
    long_reason = "why " * 700  # 2,800 characters: stored as its first 2,000
    first = c.FailAttempt(version_id=1, attempt=1, clean=True, code="GONE", reason=long_reason,
                          absent_on=("e0", "e1"))  # fmt: skip
    book.run(first)
    assert book.state.versions[1].state is VersionState.FAILED_RETRYABLE
    before = len(book.events)
    fatal_now = c.FailAttempt(version_id=1, attempt=1, clean=False, code="GONE",
                              reason=long_reason, absent_on=("e0", "e1"))  # fmt: skip
    assert book.run(fatal_now).state == VersionState.FAILED_RETRYABLE
    assert len(book.events) == before


def test_fail_of_a_stale_attempt_is_refused_and_repeat_is_idempotent(book: Book) -> None:
    book.allocate(1)
    book.refuse(
        c.FailAttempt(version_id=1, attempt=2, clean=True, code="X", reason="r"),
        Code.ATTEMPT_CONFLICT,
    )
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="X", reason="r"))
    before = len(book.events)
    again = book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="X", reason="r"))
    assert again.state == "FAILED_FATAL" and len(book.events) == before


# --- sessions --------------------------------------------------------------------------------


def test_bind_before_any_publication(book: Book) -> None:
    book.refuse(c.Bind(session="s", owner="w1"), Code.NO_PUBLISHED_VERSION)


def test_bind_is_forever_and_follows_the_default_at_first_bind(book: Book) -> None:
    book.publish(1)
    first = book.run(c.Bind(session="old", owner="w1"))
    book.publish(2)
    again = book.run(c.Bind(session="old", owner="w1"))
    new = book.run(c.Bind(session="new", owner="w1"))
    assert isinstance(first, Bound) and isinstance(again, Bound) and isinstance(new, Bound)
    assert (first.version_id, again.version_id, new.version_id) == (1, 1, 2)
    assert first.new and not again.new
    assert again.lora_name == first.lora_name and again.revision == first.revision == 1
    assert new.revision == 2


def test_a_released_session_cannot_bind_again(book: Book) -> None:
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    released = book.run(c.Release(session="s", owner="w1"))
    assert isinstance(released, Released) and released.released and released.version_id == 1
    assert not book.run(c.Release(session="s", owner="w1")).released  # idempotent
    book.refuse(c.Bind(session="s", owner="w1"), Code.SESSION_CLOSED)


def test_release_cause_is_bounded(book: Book) -> None:
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    bad: Any  # deliberately ill-typed causes
    for bad in ("", "x" * 65, "two\nlines", 7):
        assert book.refuse(c.Release(session="s", owner="w1", cause=bad), Code.INVALID_INPUT) == []
    assert "s" in book.state.sessions


def test_close_before_first_bind_tombstones(book: Book) -> None:
    book.publish(1)
    assert not book.run(c.Release(session="early", owner="w1")).released
    book.refuse(c.Bind(session="early", owner="w1"), Code.SESSION_CLOSED)


def test_bind_needs_a_live_registered_owner(book: Book) -> None:
    book.publish(1)
    book.refuse(c.Bind(session="s", owner="stranger"), Code.UNKNOWN_OWNER)
    book.refuse(c.Bind(session="", owner="w1"), Code.INVALID_INPUT)
    book.refuse(c.Bind(session="x" * 300, owner="w1"), Code.INVALID_INPUT)


def test_forget_is_all_or_nothing(book: Book) -> None:
    book.publish(1)
    for s in ("a", "b"):
        book.run(c.Bind(session=s, owner="w1"))
    book.run(c.Release(session="a", owner="w1"))
    book.refuse(c.Forget(sessions=("a", "b")), Code.SESSION_STILL_BOUND)
    assert "a" in book.state.tombstones
    assert book.run(c.Forget(sessions=("a", "a", "never"))).count == 1
    assert "a" not in book.state.tombstones
    assert book.run(c.Forget(sessions=("a",))).count == 0


# --- owner leases ----------------------------------------------------------------------------


def test_lease_expiry_releases_the_owners_sessions(book: Book) -> None:
    book.publish(1)
    book.run(c.RegisterOwner(owner="w2", ttl_s=5.0, now=0.0))
    for s in ("a", "b"):
        book.run(c.Bind(session=s, owner="w2"))
    book.run(c.Bind(session="mine", owner="w1"))
    book.refuse(c.ExpireOwner(owner="w2", now=4.0, last_seen=0.0), Code.INVALID_INPUT)
    expired = book.run(c.ExpireOwner(owner="w2", now=5.0, last_seen=0.0))
    assert expired.released == 2
    causes = [e.cause for e in book.events if isinstance(e, SessionReleased)]
    assert causes == ["lease_expired", "lease_expired"]
    assert set(book.state.sessions) == {"mine"}
    # A live worker whose lease expired gets a clear error on its next call.
    book.refuse(c.Bind(session="a", owner="w2"), Code.LEASE_EXPIRED)
    book.refuse(c.Bind(session="c", owner="w2"), Code.LEASE_EXPIRED)
    book.refuse(c.RegisterOwner(owner="w2", ttl_s=5.0, now=9.0), Code.LEASE_EXPIRED)
    assert book.run(c.ExpireOwner(owner="w2", now=9.0, last_seen=0.0)).released == 0


def test_lease_expiry_unblocks_reclaim(book: Book) -> None:
    book.publish(1)
    book.run(c.RegisterOwner(owner="dead", ttl_s=1.0, now=0.0))
    book.run(c.Bind(session="pinned", owner="dead"))
    book.publish(2)
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)
    book.run(c.ExpireOwner(owner="dead", now=2.0, last_seen=0.0))
    book.reclaim(1)
    assert book.state.versions[1].state is VersionState.RECLAIMED


# --- reclaim ---------------------------------------------------------------------------------


def test_reclaim_waits_for_the_last_binding_and_is_handed_out_once(book: Book) -> None:
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)  # PUBLISHED
    book.publish(2)
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)  # still bound
    book.run(c.Release(session="s", owner="w1"))
    assert 1 in book.state.reclaimable() and book.state.versions[1].bound == 0
    busy = InFlight(reporter="w1", engine="e0", count=1, at=1.0)
    book.refuse(c.ClaimReclaim(version_id=1, evidence=(busy,)), Code.REQUESTS_IN_FLIGHT)
    idle = InFlight(reporter="w1", engine="*", count=0, at=2.0)
    granted = book.run(c.ClaimReclaim(version_id=1, evidence=(idle,)))
    assert granted.engines == ("e0", "e1")
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)  # handed out once
    assert book.state.capacity_used() == 2  # RECLAIMING still holds the slot
    first = book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert not first.reclaimed and book.state.versions[1].state is VersionState.RECLAIMING
    last = book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    assert last.reclaimed and book.state.versions[1].state is VersionState.RECLAIMED
    assert book.state.capacity_used() == 1
    assert all(book.state.versions[1].lora_name not in e.holds for e in book.state.engines.values())


def test_ambiguous_reclaim_keeps_the_slot_until_inventory_resolves(book: Book) -> None:
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e1", reason="timeout"))
    assert book.state.capacity_used() == 2
    book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), Code.PUBLICATION_BLOCKED)
    name = book.state.versions[1].lora_name
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=(name,)))
    assert book.state.versions[1].state is VersionState.RECLAIMING
    outcome = book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert outcome.reclaimed == (1,) and isinstance(book.events[-1], VersionReclaimed)
    assert book.allocate(3).attempt == 1


def test_an_ambiguous_unload_voids_the_engines_earlier_proof(book: Book) -> None:
    """A reclaim marked ambiguous on an engine blocks until that engine proves the name gone
    again: an unload confirmation or an inventory recorded after the mark. Before, a proof the
    engine gave earlier (a reconciler's unload racing the reclaim driver's ambiguous one) still
    counted, and the other engines' confirmations completed the reclaim with nothing from the
    engine the log last called unknown."""
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason="unload timed out"))
    assert "e0" not in book.state.versions[1].confirmed
    unloaded = book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    assert not unloaded.reclaimed
    assert book.state.versions[1].state is VersionState.RECLAIMING
    assert book.state.blocked_by() == [1]
    book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), Code.PUBLICATION_BLOCKED)
    # e0 proves it again (its unload confirmed at its incarnation): now the reclaim completes
    proof = book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert proof.reclaimed and isinstance(book.events[-1], VersionReclaimed)
    assert book.state.blocked_by() == []


def test_an_inventory_after_an_ambiguous_unload_is_the_proof_it_waits_for(book: Book) -> None:
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e1", reason="clean refusal"))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert book.state.versions[1].state is VersionState.RECLAIMING
    outcome = book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert outcome.reclaimed == (1,) and isinstance(book.events[-1], VersionReclaimed)


def test_unload_from_an_old_incarnation_is_refused(book: Book) -> None:
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    book.refuse(
        c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"), Code.ENGINE_RESTARTED
    )


# --- fleet -----------------------------------------------------------------------------------


def test_restarted_engine_is_repaired_before_it_serves(book: Book) -> None:
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.publish(2)
    name1 = book.state.versions[1].lora_name
    assert book.state.holders(name1) == ("e0", "e1")
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    assert book.state.holders(name1) == ("e0",)  # not routable, holds nothing
    refused = book.refuse(c.RepairEngine(engine="e1", incarnation="e1-i2"), Code.NOT_READY)
    assert refused == []
    book.run(c.RestoreVersion(version_id=1, engine="e1", incarnation="e1-i2"))
    assert name1 in book.state.engines["e1"].holds
    assert book.state.holders(name1) == ("e0",)  # holds v1 again, still not routable
    book.refuse(c.RepairEngine(engine="e1", incarnation="e1-i2"), Code.NOT_READY)  # v2 missing
    book.run(c.RestoreVersion(version_id=2, engine="e1", incarnation="e1-i2"))
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i2"))
    assert book.state.holders(name1) == ("e0", "e1")


def test_join_restart_and_leave(book: Book) -> None:
    assert book.run(c.JoinEngine(engine="e0", incarnation="e0-i1")).no_op
    book.refuse(c.JoinEngine(engine="e0", incarnation="e0-i9"), Code.ENGINE_EXISTS)
    book.refuse(c.ObserveRestart(engine="nope", incarnation="x"), Code.UNKNOWN_ENGINE)
    assert book.run(c.ObserveRestart(engine="e0", incarnation="e0-i1")).no_op
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    book.run(c.LeaveEngine(engine="e1"))  # the last missing confirmation leaves the fleet
    assert book.state.versions[1].state is VersionState.RECLAIMED
    assert book.run(c.LeaveEngine(engine="e1")).no_op


def test_a_restart_records_where_the_new_life_serves_only_when_it_moved(book: Book) -> None:
    """Gateways read each engine's endpoint from the ledger: a server that came back behind
    another address must not leave them sending to the old one."""
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2", endpoint="", kind="local"))
    assert book.events[-1] == EngineRestarted(engine="e0", old="e0-i1", new="e0-i2")
    moved = c.ObserveRestart(engine="e0", incarnation="e0-i3", endpoint="http://h:9", kind="vllm")
    book.run(moved)
    assert book.events[-1] == EngineRestarted(
        engine="e0", old="e0-i2", new="e0-i3", endpoint="http://h:9", kind="vllm"
    )
    member = book.state.engines["e0"]
    assert (member.endpoint, member.kind) == ("http://h:9", "vllm")
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i4"))  # not said: kept
    assert (member.endpoint, member.kind) == ("http://h:9", "vllm")
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i5", endpoint="http://h:8"))
    assert book.events[-1] == EngineRestarted(
        engine="e0", old="e0-i4", new="e0-i5", endpoint="http://h:8"
    )
    assert (member.endpoint, member.kind) == ("http://h:8", "vllm")
    bad = c.ObserveRestart(engine="e0", incarnation="e0-i6", endpoint=5)  # type: ignore[arg-type]
    book.refuse(bad, Code.INVALID_INPUT)


def test_inventory_records_strays(book: Book) -> None:
    book.publish(1)
    outcome = book.run(
        c.ObserveInventory(
            engine="e0", incarnation="e0-i1", adapters=(book.state.versions[1].lora_name, "zzz")
        )
    )
    assert outcome.strays == ("zzz",)
    assert book.state.engines["e0"].strays == ("zzz",)
    book.refuse(
        c.ObserveInventory(engine="e0", incarnation="e0-old", adapters=()), Code.ENGINE_RESTARTED
    )


# --- command ids -----------------------------------------------------------------------------


def test_command_id_yields_the_same_outcome_forever(book: Book) -> None:
    book.publish(1)
    first = book.run(c.Bind(session="s", owner="w1", command_id="k1"))
    assert isinstance(book.events[-1], CommandRecorded)
    book.publish(2)
    before = len(book.events)
    again = book.run(c.Bind(session="s", owner="w1", command_id="k1"))
    assert again == first and len(book.events) == before
    book.refuse(c.Bind(session="other", owner="w1", command_id="k1"), Code.COMMAND_CONFLICT)


def test_a_command_id_recorded_before_allow_rollback_existed_still_names_the_same_command() -> None:
    """Adding ``allow_rollback`` to Allocate must not change the fingerprint of an allocate sent
    without it: the value below is what the code before the field computed for this command."""
    from publisher.core.decider.checks import _fingerprint

    allocate = c.Allocate(version_id=3, digest="a" * 64, size_bytes=7, command_id="k")
    assert _fingerprint(allocate) == "90b626d303afa0b6040837a97d56e205"
    rollback = c.Allocate(version_id=3, digest="a" * 64, size_bytes=7, allow_rollback=True)
    assert _fingerprint(rollback) != _fingerprint(allocate)


# --- stalls explained by the log -------------------------------------------------------------


def test_a_blocked_publication_is_recorded_once_per_stall_with_its_blockers() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.allocate(2)
    book.ready_all(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="t"))
    allocate3 = c.Allocate(version_id=3, digest=digest_of(3))
    (blocked,) = book.refuse(allocate3, Code.PUBLICATION_BLOCKED)
    assert isinstance(blocked, PublicationBlocked)
    assert (blocked.version_id, blocked.code, blocked.blocked_by) == (
        3,
        "PUBLICATION_BLOCKED",
        (2,),
    )
    assert "version 2" in blocked.cause and "FAILED_FATAL" in blocked.cause
    # The trainer retries in a loop: the same refusal writes nothing more.
    for _ in range(5):
        assert book.refuse(allocate3, Code.PUBLICATION_BLOCKED) == []
    # The blockers change (the fatal entry is resolved, another publication is LOADING):
    # a new stall, recorded once.
    for engine in ("e0", "e1"):
        book.run(c.ObserveInventory(engine=engine, incarnation=book.incarnation(engine),
                                    adapters=()))  # fmt: skip
    book.allocate(4)
    (busy,) = book.refuse(allocate3, Code.PUBLICATION_IN_PROGRESS)
    assert isinstance(busy, PublicationBlocked) and busy.blocked_by == (4,)
    assert "version 4 is LOADING" in busy.cause
    assert book.refuse(allocate3, Code.PUBLICATION_IN_PROGRESS) == []
    # Once allocated, the stall is over: the same refusal later is a new stall.
    assert 3 in book.state.stalls
    book.run(c.FailAttempt(version_id=4, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    book.allocate(3)
    assert 3 not in book.state.stalls


def test_no_routable_engine_is_a_recorded_stall_naming_the_members() -> None:
    book = Book().bootstrap()
    book.run(c.ObserveRestart(engine="e0", incarnation="e0-i2"))
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    (event,) = book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.FLEET_MISMATCH)
    assert isinstance(event, PublicationBlocked) and event.blocked_by == ()
    assert "e0" in event.cause and "e1" in event.cause


def test_a_skip_names_every_slot_holder_and_why_it_holds(book: Book) -> None:
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.run(c.Bind(session="s2", owner="w1"))
    book.publish(2)  # capacity 2: v1 retired with 2 sessions, v2 the default
    outcome = book.run(c.Allocate(version_id=3, digest=digest_of(3)))
    assert isinstance(outcome, Skipped)
    skipped = book.events[-1]
    assert isinstance(skipped, PublicationSkipped)
    assert [(h.version_id, h.reason, h.bound) for h in skipped.holders] == [
        (1, "sessions_bound", 2),
        (2, "default", 0),
    ]
    assert "v1 retired, sessions bound (2 sessions)" in skipped.message
    assert "v2 the default" in skipped.message


def test_a_session_too_stale_may_be_released_as_such_and_only_then() -> None:
    book = Book().bootstrap(capacity=4)
    book.run(c.ConfigureDeployment(max_staleness=1))
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.publish(2)  # one behind: within the bound
    book.refuse(c.Release(session="s", owner="w1", cause="too_stale"), Code.INVALID_INPUT)
    assert "s" in book.state.sessions
    book.publish(3)  # two behind: beyond it
    released = book.run(c.Release(session="s", owner="w1", cause="too_stale"))
    assert isinstance(released, Released) and released.released
    assert 1 in book.state.reclaimable() and book.state.versions[1].bound == 0


def test_a_replaced_or_ended_life_of_an_owner_is_refused_by_name(book: Book) -> None:
    """An owner's old incarnation cannot bind, release or deregister once a new one registered
    (``OWNER_RESTARTED``, naming both lives); a deregistered owner's calls are refused
    (``OWNER_DEREGISTERED``); an unknown owner or incarnation is ``UNKNOWN_OWNER``. Each error
    names the owner in its details, for the caller's log and retry logic."""
    book.publish(1)
    book.run(c.RegisterOwner(owner="w", ttl_s=10.0, now=1.0, incarnation="i1"))
    book.run(c.Bind(session="s1", owner="w", incarnation="i1"))
    book.run(c.RegisterOwner(owner="w", ttl_s=10.0, now=2.0, incarnation="i2"))  # a restart
    for stale in (
        c.Bind(session="s2", owner="w", incarnation="i1"),
        c.Release(session="s1", owner="w", incarnation="i1"),
        c.DeregisterOwner(owner="w", now=3.0, incarnation="i1"),
        c.RegisterOwner(owner="w", ttl_s=10.0, now=3.0, incarnation="i1"),  # a late retry
    ):
        with pytest.raises(LoraLedgerError) as info:
            book.run(stale)
        assert info.value.code == Code.OWNER_RESTARTED, stale
        assert info.value.details == {"owner": "w"}
        assert "incarnation 'i1' was replaced by 'i2'" in info.value.message
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.Bind(session="s2", owner="w", incarnation="i9"))
    assert (info.value.code, info.value.details) == (Code.UNKNOWN_OWNER, {"owner": "w"})
    assert "no incarnation 'i9'" in info.value.message
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.DeregisterOwner(owner="ghost", now=3.0))
    assert (info.value.code, info.value.details) == (Code.UNKNOWN_OWNER, {"owner": "ghost"})
    assert "'ghost' is not registered" in info.value.message
    book.run(c.DeregisterOwner(owner="w", now=4.0, incarnation="i2"))
    for ended in (
        c.Bind(session="s3", owner="w", incarnation="i2"),
        c.RegisterOwner(owner="w", ttl_s=10.0, now=5.0, incarnation="i2"),  # a late retry
    ):
        error = book.refusal(ended, Code.OWNER_DEREGISTERED)
        assert error.details == {"owner": "w"}, ended
        assert "owner w (incarnation 'i2') deregistered" in error.message, ended
    # A live owner passes the lease rule whether or not the caller names its life.
    book.run(c.RegisterOwner(owner="v", ttl_s=10.0, now=5.0, incarnation="j1"))
    check_lease(book.state, "v", required=True)
    check_lease(book.state, "v", required=True, incarnation="j1")


def test_an_owner_incarnation_that_is_no_key_is_refused_by_field(book: Book) -> None:
    """An incarnation is an id like the owner's (non-empty, printable, at most 256 characters):
    the refusal names the field, so a client sees which of its ids is wrong."""
    for bad in ("x" * 257, "line\nbreak"):
        error = book.refusal(
            c.RegisterOwner(owner="w", ttl_s=10.0, now=1.0, incarnation=bad), Code.INVALID_INPUT
        )
        assert error.details == {"field": "incarnation"}
        assert error.message.startswith("incarnation must be a non-empty printable string")
    assert "w" not in book.state.owners


def test_a_clean_failure_forgets_the_candidate_on_every_engine_that_held_it(book: Book) -> None:
    """The attempt proven absent everywhere: no engine is still counted as holding its name
    (the registry would otherwise route to, or wait on, a candidate that is gone)."""
    book.allocate(1)
    name = book.state.versions[1].lora_name
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(name,)))
    assert name in book.state.engines["e0"].holds
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    assert book.state.versions[1].state is VersionState.FAILED_RETRYABLE
    assert all(name not in e.holds for e in book.state.engines.values())


def test_only_retired_versions_nobody_is_bound_to_are_reclaimable(book: Book) -> None:
    book.publish(1)  # the default, nobody bound: serving, not reclaimable
    assert book.state.reclaimable() == []
    book.run(c.Bind(session="s1", owner="w1"))  # bound to version 1
    book.publish(2)  # version 1 retires with a session still bound to it
    assert book.state.versions[1].state is VersionState.RETIRED
    assert book.state.versions[1].bound == 1 and book.state.reclaimable() == []
    book.run(c.Release(session="s1", owner="w1"))
    assert book.state.reclaimable() == [1]
