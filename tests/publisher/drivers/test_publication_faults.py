"""Fault injection on the engine contract (FaultyEngine around real, restartable local engines):
every case ends in the state docs/publication.md prescribes, with the events that show why.

* a clean refusal anywhere -> cleanup everywhere, absence proven -> FAILED_RETRYABLE, RETRYABLE;
* an ambiguous reply (lost reply, 5xx, timeout) -> FAILED_FATAL (slot kept), FATAL; the next
  publish finds PUBLICATION_BLOCKED, runs the reconciler once (inventories resolve the entry,
  unloading the candidate where it is still present) and goes on;
* an engine restart mid-publication -> the receipt is refused or the load fails, the attempt
  ends, and the engine is repaired before it is routable again;
* duplicated control messages change nothing; a READY that no inventory confirms is a failure;
* cancellation of ``publish`` never leaves a version LOADING.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest

from engines.contract import Candidate, CleanRefusal, ErrorCode
from evlog.events import (
    AttemptFailed,
    EnginePrepared,
    EngineReady,
    EngineRepaired,
    EngineRestarted,
    EngineUnloaded,
    Event,
    FatalResolved,
    InventoryObserved,
    ReceiptRejected,
    ReclaimAmbiguous,
    VersionAllocated,
    VersionPublished,
    VersionReclaimed,
    VersionRestored,
)
from evlog.memory import MemoryLog, MemoryStore
from projections.recovery import recover
from projections.registry import VersionState
from publisher.core.outcomes import Allocated
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.engine_protocol import READY_UNCONFIRMED
from publisher.drivers.publication import (
    CANCELLED,
    ErrorKind,
    PublicationDriver,
    PublicationError,
    PublicationStatus,
)
from tests.engines.faulty_engine import (
    Delay,
    Drop,
    Duplicate,
    Refuse,
    Restart,
    ServerError,
    Swallow,
)
from tests.publisher.plane_kit import (
    FAST,
    GREEDY,
    PEFT_WARNINGS,
    PROMPT,
    adapter_copy,
    faulty_engines,
    names,
    open_plane,
)
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

IDLE = 3600.0  # health loop interval that never fires during a test: reconciliation happens
# only where the test says (the publish path or an explicit call)


def index(log: Sequence[Event], predicate: Callable[[Event], bool]) -> int:
    return next(i for i, e in enumerate(log) if predicate(e))


async def test_lost_reply_on_load_is_fatal_then_resolved_and_publication_resumes(
    tmp_path: Path,
) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        engines[1].inject("load", Drop())
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        err = info.value
        assert err.kind == ErrorKind.FATAL and err.code == "PUBLICATION_FAILED"
        assert (err.details["cause"], err.details["state"]) == ("CONNECTION_LOST", "FAILED_FATAL")
        state = plane.ledger.state
        assert state.versions[2].state is VersionState.FAILED_FATAL
        assert state.capacity_used() == 2 and state.blocked_by() == [2]
        failed = of_type(await events(plane.ledger), AttemptFailed)[-1]
        assert (failed.version_id, failed.clean, failed.code) == (2, False, "CONNECTION_LOST")
        name = state.versions[2].lora_name
        for e in engines:  # cleaned up anyway (the dropped load had run on e1)
            assert name not in await names(e)

        seq = plane.ledger.state.last_seq
        v3 = await plane.publisher.publish(adapter_copy(3), version_id=3)
        assert v3.status == PublicationStatus.PUBLISHED
        log = await events(plane.ledger, after=seq)
        resolved = index(log, lambda e: isinstance(e, FatalResolved) and e.version_id == 2)
        observed = [
            e.engine
            for e in log[:resolved]
            if isinstance(e, InventoryObserved) and name not in e.adapters
        ]
        assert sorted(observed) == ["e0", "e1"]
        assert resolved < index(log, lambda e: isinstance(e, VersionAllocated))
        assert plane.ledger.state.versions[2].state is VersionState.FAILED_RETRYABLE


async def test_timeout_is_fatal_and_a_retry_of_the_same_version_resumes(tmp_path: Path) -> None:
    quick = EngineTimeouts(probe=2, inventory=5, prepare=0.3, transfer=5, load=5, unload=5)
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, timeouts=quick) as plane,
    ):
        engines[0].inject("prepare", Delay(seconds=30))
        with anyio.fail_after(10), pytest.raises(PublicationError) as info:  # a guard, no hang
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert info.value.kind == ErrorKind.FATAL and info.value.details["cause"] == "TIMEOUT"
        assert plane.ledger.state.versions[1].state is VersionState.FAILED_FATAL
        again = await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert again.status == PublicationStatus.PUBLISHED and again.attempt == 2
        log = await events(plane.ledger)
        assert [f.attempt for f in of_type(log, AttemptFailed)] == [1]
        assert [p.attempt for p in of_type(log, VersionPublished)] == [2]
        assert of_type(log, FatalResolved)[0].version_id == 1


async def test_server_error_on_transfer_is_ambiguous(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[0].inject("transfer", ServerError(status=500))
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert info.value.kind == ErrorKind.FATAL and info.value.details["cause"] == "SERVER_ERROR"
        failed = of_type(await events(plane.ledger), AttemptFailed)[0]
        assert not failed.clean and failed.code == "SERVER_ERROR"


async def test_clean_refusal_cleans_every_engine_and_is_retryable(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[1].inject("load", Refuse(code=ErrorCode.RANK_UNSUPPORTED))
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        err = info.value
        assert err.kind == ErrorKind.RETRYABLE and err.details["state"] == "FAILED_RETRYABLE"
        assert err.details["cause"] == ErrorCode.RANK_UNSUPPORTED
        log = await events(plane.ledger)
        assert [r.engine for r in of_type(log, EngineReady)] == ["e0"]  # e0 had loaded it
        failed = of_type(log, AttemptFailed)[0]
        assert failed.clean and failed.absent_on == ("e0", "e1")
        name = plane.ledger.state.versions[1].lora_name
        for e in engines:
            assert name not in await names(e)
        assert plane.ledger.state.capacity_used() == 0
        retry = await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert retry.status == PublicationStatus.PUBLISHED and retry.attempt == 2
        for e in engines:
            assert name in await names(e)


async def test_ready_without_the_adapter_is_caught_by_the_inventory(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[0].inject("load", Swallow())  # "loaded", but it never was
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert info.value.details["cause"] == READY_UNCONFIRMED
        assert info.value.kind == ErrorKind.RETRYABLE
        log = await events(plane.ledger)
        assert [r.engine for r in of_type(log, EngineReady)] == ["e1"]
        assert plane.ledger.state.default is None  # nothing committed on a lie
        assert of_type(log, AttemptFailed)[0].code == READY_UNCONFIRMED


async def test_duplicated_control_messages_change_nothing(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path) as plane,
    ):
        for e in engines:
            e.inject("prepare", Duplicate())
            e.inject("transfer", Duplicate())
            e.inject("load", Duplicate(delay=0.05))  # a late duplicate, after READY
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert v1.status == PublicationStatus.PUBLISHED
        await wait_for(
            "three duplicates landed on every engine",
            lambda: all(len(e.duplicates) == 3 for e in engines),
        )
        assert {d.outcome for e in engines for d in e.duplicates} == {"ok"}  # replays
        for e in engines:
            e.inject("unload", Duplicate())
        await plane.publisher.publish(adapter_copy(2), version_id=2)
        await wait_for(
            "v1 reclaimed", lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        log = await events(plane.ledger)
        for kind in (EnginePrepared, EngineReady):
            got = sorted((e.version_id, e.engine) for e in of_type(log, kind))
            assert got == [(1, "e0"), (1, "e1"), (2, "e0"), (2, "e1")]
        assert sorted(e.engine for e in of_type(log, EngineUnloaded)) == ["e0", "e1"]
        for e in engines:
            assert await names(e) == {plane.ledger.state.versions[2].lora_name}
            assert [d.method for d in e.duplicates][-1] == "unload"


async def test_restart_mid_publication_then_repair_before_routing(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.05) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        old = ledger.state.engines["e1"].incarnation
        seq = ledger.state.last_seq
        engines[1].inject("load", Restart())  # e1 restarts between transfer and load
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert info.value.kind == ErrorKind.RETRYABLE
        assert info.value.details["cause"] == ErrorCode.NOT_PREPARED  # the new life never saw it
        await wait_for(
            "e1's restart recorded", lambda: ledger.state.engines["e1"].incarnation != old
        )
        await wait_for("e1 routable again", lambda: ledger.state.engines["e1"].routable)
        log = await events(ledger, after=seq)
        failed = of_type(log, AttemptFailed)[0]
        assert failed.clean and failed.absent_on == ("e0", "e1")
        restarted = index(log, lambda e: isinstance(e, EngineRestarted))
        restored = index(log, lambda e: isinstance(e, VersionRestored))
        repaired = index(log, lambda e: isinstance(e, EngineRepaired))
        assert restarted < restored < repaired
        assert (log[restored].version_id, log[restored].engine) == (1, "e1")  # type: ignore[attr-defined]
        # not routable, and not a holder of v1, at any seq before EngineRepaired
        for at in range(seq + restarted + 1, seq + repaired + 1):
            state = await recover(ledger.store, until=at, use_snapshot=False)
            assert not state.engines["e1"].routable
            assert state.holders(v1.lora_name) == ("e0",)  # type: ignore[arg-type]
        g = await engines[1].generate(PROMPT, v1.lora_name, GREEDY)
        assert g.lora_name == v1.lora_name
        again = await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert again.status == PublicationStatus.PUBLISHED and again.attempt == 2


async def test_restart_after_commit_restores_default_and_bound_versions(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.05) as plane,
    ):
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("w1", ttl_s=60)
        await ledger.bind("pinned", "w1")
        v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
        seq = ledger.state.last_seq
        old = ledger.state.engines["e1"].incarnation
        await engines[1].inner.restart()  # type: ignore[attr-defined]
        member = ledger.state.engines["e1"]
        await wait_for(
            "e1's new life recorded and repaired",
            lambda: member.incarnation != old and member.routable,
        )
        log = await events(ledger, after=seq)
        assert sorted(e.version_id for e in of_type(log, VersionRestored)) == [1, 2]
        assert {v1.lora_name, v2.lora_name} <= await names(engines[1])
        assert ledger.state.holders(v1.lora_name) == ("e0", "e1")  # type: ignore[arg-type]


async def test_ambiguous_unload_holds_the_version_until_inventory_decides(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=0.05) as plane,
    ):
        v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
        engines[1].inject("unload", Drop())  # the reclaim's unload runs; its reply is lost
        engines[0].inject("unload", ServerError())  # this one never reaches e0
        seq = plane.ledger.state.last_seq
        v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
        # a failing reclaim of the predecessor never turns the committed publication into an error
        assert v2.status == PublicationStatus.PUBLISHED
        await wait_for(
            "v1 reclaimed", lambda: plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        log = await events(plane.ledger, after=seq)
        ambiguous = of_type(log, ReclaimAmbiguous)
        assert {a.engine for a in ambiguous} <= {"e0", "e1"} and ambiguous
        first = index(log, lambda e: isinstance(e, ReclaimAmbiguous))
        done = index(log, lambda e: isinstance(e, VersionReclaimed))
        evidence = [
            e
            for e in log[first:done]
            if isinstance(e, InventoryObserved) and v1.lora_name not in e.adapters
        ]
        assert evidence  # the decision came from inventories, after the ambiguity
        if any(a.engine == "e0" for a in ambiguous):
            # the unload never reached e0: the reconciler's attempt-fenced unload removed v1
            # before it read the inventory that decided, so no observation of e0 after the
            # ambiguity shows v1 present
            on_e0 = [
                e for e in log[first:done] if isinstance(e, InventoryObserved) and e.engine == "e0"
            ]
            assert on_e0 and all(v1.lora_name not in e.adapters for e in on_e0)
            assert engines[0].count("unload") >= 2
        for e in engines:
            assert v1.lora_name not in await names(e)


async def test_fatal_candidate_still_present_is_unloaded_by_the_reconciler(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        engines[0].inject("load", Drop())
        engines[0].inject("unload", ServerError())  # and its cleanup never arrives
        with pytest.raises(PublicationError):
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        name = plane.ledger.state.versions[2].lora_name
        assert name in await names(engines[0])  # the fatal candidate is still loaded on e0
        seq = plane.ledger.state.last_seq
        v3 = await plane.publisher.publish(adapter_copy(3), version_id=3)
        assert v3.status == PublicationStatus.PUBLISHED
        assert name not in await names(engines[0])
        # unloaded fenced by its attempt: a late duplicate of its publication cannot stage it
        v2 = plane.ledger.state.versions[2]
        late = Candidate(
            lora_name=name, digest=v2.digest, attempt=v2.attempt, manifest=adapter_copy(2).manifest
        )
        with pytest.raises(CleanRefusal):
            await engines[0].prepare(late)
        log = await events(plane.ledger, after=seq)
        on_e0 = [e for e in log if isinstance(e, InventoryObserved) and e.engine == "e0"]
        assert name in on_e0[0].adapters and name not in on_e0[1].adapters
        assert index(log, lambda e: isinstance(e, FatalResolved)) < index(
            log, lambda e: isinstance(e, VersionAllocated)
        )


async def test_cancelled_publish_never_leaves_a_version_loading(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[1].inject("load", Delay(seconds=30))
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: plane.publisher.publish(adapter_copy(1), version_id=1))
            await wait_for("the load call on e1", lambda: engines[1].count("load") == 1)
            tg.cancel_scope.cancel()
        v = plane.ledger.state.versions[1]
        assert v.state is VersionState.FAILED_FATAL  # e1 was mid-call: ambiguous
        failed = of_type(await events(plane.ledger), AttemptFailed)[0]
        assert failed.code == CANCELLED and "e1" in failed.reason
        for e in engines:
            assert v.lora_name not in await names(e)
        again = await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert again.status == PublicationStatus.PUBLISHED and again.attempt == 2


async def test_reentered_publish_never_sends_a_byte_twice(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[0].inject("load", Delay(seconds=0.3))
        snap = adapter_copy(1)
        results = []
        other = PublicationDriver(plane.ledger, plane.fleet, plane.artifacts, owner="other")
        refusals: list[PublicationError] = []

        async def publish() -> None:
            results.append(await plane.publisher.publish(snap, version_id=1))

        async def intruder() -> None:
            try:
                await other.publish(snap, version_id=1)
            except PublicationError as exc:
                refusals.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            await wait_for("the load call on e0", lambda: engines[0].count("load") == 1)
            tg.start_soon(publish)  # re-entered in this process: waits for the first
            tg.start_soon(intruder)  # a second driver: refused, sends nothing
        assert len(results) == 2 and results[0] == results[1]
        assert [e.code for e in refusals] == ["PUBLICATION_IN_PROGRESS"]
        assert refusals[0].kind == ErrorKind.RETRYABLE
        for e in engines:
            assert (e.count("prepare"), e.count("transfer"), e.count("load")) == (1, 1, 1)


async def test_orphaned_attempt_is_ended_when_a_controller_starts(tmp_path: Path) -> None:
    log = MemoryLog()
    async with faulty_engines(2) as engines:
        async with open_plane(
            engines, tmp_path, store=MemoryStore(log), probe_interval_s=IDLE
        ) as plane:
            # a controller that dies mid-publication: allocated, claimed, loaded on e0 only
            snap = adapter_copy(1)
            allocated = await plane.ledger.allocate(1, snap.digest)
            assert isinstance(allocated, Allocated), allocated
            await plane.ledger.claim_transport(1, allocated.attempt, "dead-publisher")
            from engines.contract import Candidate
            from publisher.drivers.adapter_copy import aiter_buckets

            candidate = Candidate(
                lora_name=allocated.lora_name,
                digest=snap.digest,
                attempt=1,
                manifest=snap.manifest,
            )
            await engines[0].prepare(candidate)
            await engines[0].transfer(candidate, aiter_buckets(snap.buckets))
            await engines[0].load(candidate)
        async with open_plane(
            engines, tmp_path, store=MemoryStore(log), probe_interval_s=IDLE
        ) as plane:
            assert plane.started is not None and plane.started.orphans == (1,)
            # cleaned off the engines before its attempt ended: nothing left for the pass
            assert plane.started.unloaded == ()
            v = plane.ledger.state.versions[1]
            assert v.state is VersionState.FAILED_RETRYABLE  # ended, then resolved by inventory
            assert allocated.lora_name not in await names(engines[0])
            # fenced by its attempt on every engine of its fleet, even one the dead driver
            # never reached: a late call of that driver cannot stage it anywhere
            for engine in engines:
                with pytest.raises(CleanRefusal):
                    await engine.prepare(candidate)
            history = await events(plane.ledger)
            failed = of_type(history, AttemptFailed)[0]
            assert failed.code == "ORPHANED_ATTEMPT" and not failed.clean
            assert failed.reason == (
                "attempt 1 was LOADING when this controller started: its driver is gone; "
                "inventories decide"
            )
            assert of_type(history, FatalResolved)[0].version_id == 1
            out = await plane.publisher.publish(snap, version_id=1)
            assert out.status == PublicationStatus.PUBLISHED and out.attempt == 2


async def test_receipt_from_a_restarted_engine_is_recorded_and_refused(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE, timeouts=FAST) as plane,
    ):
        engines[1].inject("prepare", Restart())  # the prepare lands on the next life
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert info.value.details["cause"] == "ENGINE_RESTARTED"
        assert info.value.kind == ErrorKind.RETRYABLE
        rejected = of_type(await events(plane.ledger), ReceiptRejected)
        assert [(r.code, r.engine) for r in rejected] == [("ENGINE_RESTARTED", "e1")]


async def test_a_clean_failure_without_proof_of_absence_stays_fatal(tmp_path: Path) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[1].inject("load", Refuse(code=ErrorCode.INVALID_ADAPTER))  # clean
        engines[0].inject("unload", ServerError())  # but e0's cleanup never arrives
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert info.value.kind == ErrorKind.FATAL
        name = plane.ledger.state.versions[1].lora_name
        assert name in await names(engines[0])  # e0 really still holds it
        failed = of_type(await events(plane.ledger), AttemptFailed)[0]
        assert not failed.clean and failed.absent_on == ("e1",)
        assert plane.ledger.state.versions[1].state is VersionState.FAILED_FATAL


async def test_publication_stays_blocked_when_reconciliation_cannot_resolve(
    tmp_path: Path,
) -> None:
    async with (
        faulty_engines(2) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[1].inject("load", Drop())
        with pytest.raises(PublicationError):
            await plane.publisher.publish(adapter_copy(1), version_id=1)
        engines[1].inject("inventory", ServerError(), times=10)  # e1 cannot prove anything
        seq = plane.ledger.state.last_seq
        with pytest.raises(PublicationError) as info:
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert info.value.code == "PUBLICATION_BLOCKED" and info.value.kind == ErrorKind.FATAL
        assert info.value.details["versions"] == [1]
        log = await events(plane.ledger, after=seq)
        assert [e.engine for e in of_type(log, InventoryObserved)] == ["e0"]  # it tried, once
        assert of_type(log, VersionAllocated) == [] and 2 not in plane.ledger.state.versions


async def test_an_orphans_cleanup_that_hangs_is_bounded_by_the_cleanup_timeout(
    tmp_path: Path,
) -> None:
    """The orphan's cleanup unload never answers: the start-up pass waits ``cleanup_timeout``
    for it, not for the engine, and ends the attempt (the inventories read next decide)."""
    log = MemoryLog()
    async with faulty_engines(2) as engines:
        async with open_plane(
            engines, tmp_path, store=MemoryStore(log), probe_interval_s=IDLE
        ) as plane:
            allocated = await plane.ledger.allocate(1, adapter_copy(1).digest)
            assert isinstance(allocated, Allocated), allocated
            await plane.ledger.claim_transport(1, allocated.attempt, "dead-publisher")
        engines[0].inject("unload", Delay(seconds=60.0))
        with anyio.fail_after(30):
            async with open_plane(
                engines,
                tmp_path,
                store=MemoryStore(log),
                probe_interval_s=IDLE,
                cleanup_timeout=0.5,
            ) as plane:
                assert plane.started is not None and plane.started.orphans == (1,)
