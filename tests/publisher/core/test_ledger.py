"""The ledger service: group commit, durability before answers, recovery, determinism,
fencing, failed appends, leases. Real stores (memory and SQLite files), no mocks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest

from evlog.errors import LoraLedgerError
from evlog.events import ReclaimClaimed, SessionReleased
from evlog.memory import MemoryStore
from evlog.record import Pending
from evlog.sqlite import SQLiteStore
from projections import invariants
from projections.recovery import recover, save_snapshot
from projections.registry import PROJECTION_VERSION, RegistryState, encode_state
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound, Released
from tests.support.ledger import publish
from tests.support.waiting import wait_for


async def bootstrap(ledger: Ledger, *, capacity: int = 2) -> None:
    await ledger.create_deployment("dep", prefix="agent", capacity=capacity)
    for engine in ("e0", "e1"):
        await ledger.join_engine(engine, f"{engine}-1")
        await ledger.repair_engine(engine, f"{engine}-1")
    await ledger.register_owner("w", ttl_s=30.0)


class GatedStore(MemoryStore):
    """A real MemoryStore whose appends wait for a gate, to observe who is answered when."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = anyio.Event()
        self.gated = False
        self.waiting = 0  # appends that reached the gate (what a test waits for, not time)
        self.fail_next: BaseException | None = None

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        if self.gated:
            self.waiting += 1
            await self.gate.wait()
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return await super().append(batch, expected_seq=expected_seq)


@pytest.mark.anyio
async def test_concurrent_commands_are_group_committed() -> None:
    async with Ledger.open(MemoryStore()) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        batches = ledger.batches
        results: list[Bound] = []

        async def bind(i: int) -> None:
            results.append(await ledger.bind(f"s{i}", "w"))

        async with anyio.create_task_group() as tg:
            for i in range(300):
                tg.start_soon(bind, i)
        assert len(results) == 300
        assert {r.version_id for r in results} == {1}
        assert ledger.batches - batches < 30  # 300 commands, a handful of transactions


@pytest.mark.anyio
async def test_nobody_is_answered_before_the_append_commits() -> None:
    store = GatedStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        durable = store.last_seq
        store.gated = True
        answered: dict[str, int] = {}  # session -> the last durable seq when it was answered

        async def bind(session: str) -> None:
            await ledger.bind(session, "w")
            answered[session] = store.last_seq

        async with anyio.create_task_group() as tg:
            for s in ("a", "b", "c"):
                tg.start_soon(bind, s)
            await wait_for(  # all three decided (pipelined) ...
                "three binds decided", lambda: ledger.state.last_seq == durable + 3
            )
            assert answered == {}  # ... but not durable yet
            assert store.last_seq == durable  # ... and none of them written: the gate holds
            store.gate.set()
        records = await store.read()
        bound_at = {r.event.session: r.seq for r in records if hasattr(r.event, "session")}
        assert set(answered) == {"a", "b", "c"} <= set(bound_at)
        for session, seen in answered.items():
            assert bound_at[session] <= seen, f"{session} answered before its seq was committed"


@pytest.mark.anyio
async def test_a_refusal_writes_nothing() -> None:
    store = MemoryStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        before = store.last_seq
        with pytest.raises(LoraLedgerError) as info:
            await ledger.bind("s", "w")
        assert info.value.code == Code.NO_PUBLISHED_VERSION
        assert store.last_seq == before


@pytest.mark.anyio
async def test_failed_append_fails_the_batch_and_rebuilds_state_from_the_log() -> None:
    store = GatedStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        store.fail_next = OSError("disk full")
        with pytest.raises(OSError, match="disk full"):
            await ledger.bind("lost", "w")
        assert "lost" not in ledger.state.sessions  # the state did not run ahead of the log
        invariants.check(ledger.state)
        bound = await ledger.bind("lost", "w")  # and the ledger keeps working
        assert bound.new


@pytest.mark.anyio
async def test_restart_keeps_every_binding(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        first = {s: await ledger.bind(s, "w") for s in ("a", "b")}
        await publish(ledger, 2)
        await ledger.release("b", "w")
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        assert ledger.state.epoch == 2
        again = await ledger.bind("a", "w")
        assert again == msgspec.structs.replace(first["a"], new=False)
        assert again.version_id == 1 and ledger.state.default == 2
        with pytest.raises(LoraLedgerError) as info:
            await ledger.bind("b", "w")
        assert info.value.code == Code.SESSION_CLOSED


@pytest.mark.anyio
async def test_replay_is_deterministic_and_snapshot_equals_full_replay(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with SQLiteStore.open(path) as store:
        async with Ledger.open(store, snapshot_on_close=False) as ledger:
            await bootstrap(ledger)
            await publish(ledger, 1)
            for i in range(50):
                await ledger.bind(f"s{i}", "w")
            await publish(ledger, 2)
            for i in range(0, 50, 2):
                await ledger.release(f"s{i}", "w")
            midway = ledger.state.last_seq
            await save_snapshot(store, ledger.state)
            await ledger.forget([f"s{i}" for i in range(0, 20, 2)])
            await ledger.bind("late", "w")
        full_a = encode_state(await recover(store, use_snapshot=False))
        full_b = encode_state(await recover(store, use_snapshot=False))
        from_snapshot = encode_state(await recover(store, use_snapshot=True))
        assert full_a == full_b == from_snapshot
        # and the snapshot was really used: it is older than the end of the log
        snap = await store.load_snapshot(PROJECTION_VERSION)
        assert snap is not None and snap.seq == midway < store.last_seq
        at_midway = await recover(store, use_snapshot=False, until=midway)
        assert at_midway.last_seq == midway and "late" not in at_midway.sessions


@pytest.mark.anyio
async def test_a_snapshot_of_other_projection_code_is_ignored() -> None:
    store = MemoryStore()
    async with Ledger.open(store, snapshot_on_close=False) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
    from evlog.store import Snapshot

    await store.save_snapshot(Snapshot(code_version="registry-0", seq=store.last_seq, state=b"x"))
    state = await recover(store)  # would fail to decode b"x" if it were used
    assert state.default == 1


@pytest.mark.anyio
async def test_a_second_controller_fences_the_first() -> None:
    store = MemoryStore()
    async with Ledger.open(store) as old:
        await bootstrap(old)
        await publish(old, 1)
        async with Ledger.open(store) as new:
            assert new.state.epoch == old.state.epoch + 1
            with pytest.raises(LoraLedgerError) as info:
                await old.bind("s", "w")
            assert info.value.code == Code.FENCED
            with pytest.raises(LoraLedgerError) as again:
                await old.bind("t", "w")
            assert again.value.code == Code.FENCED
            assert (await new.bind("s", "w")).version_id == 1


@pytest.mark.anyio
async def test_a_fenced_append_names_the_controller_that_took_the_log_over() -> None:
    """The refused append (no watch) fences the ledger for good, names both epochs, and wakes
    whoever waits for the fence (a service stops on it)."""
    store = MemoryStore()
    async with Ledger.open(store, watch_every_s=None) as old:
        await bootstrap(old)
        async with Ledger.open(store) as new:
            with pytest.raises(LoraLedgerError) as info:
                await old.register_owner("w2")  # an append
            assert old.fenced is info.value and info.value.code == Code.FENCED
            assert info.value.details == {"epoch": 1, "fenced_by_epoch": new.state.epoch}
            assert "(epoch 2)" in info.value.message and "(epoch 1)" in info.value.message
            with anyio.fail_after(1):
                assert await old.wait_fenced() is info.value


@pytest.mark.anyio
async def test_an_idle_ledger_notices_a_second_controller_without_appending(
    tmp_path: Path,
) -> None:
    """Two controllers on one SQLite file, as two processes would open it. The first writes
    nothing after the second started, yet it learns it was fenced (its watch reads the
    second's ControllerStarted) and stops renewing leases: a worker's next turn on a cached
    binding hears FENCED instead of being served a session the second controller released."""
    path = tmp_path / "ledger.db"
    async with (
        SQLiteStore.open(path) as first_store,
        Ledger.open(first_store, watch_every_s=0.05) as old,
    ):
        await bootstrap(old)
        await publish(old, 1)
        await old.bind("s", "w")
        old.renew_lease("w")
        assert old.fenced is None
        async with SQLiteStore.open(path) as second_store, Ledger.open(second_store) as new:
            await new.register_owner("w", ttl_s=30.0, incarnation="second-life")
            assert "s" not in new.state.sessions  # released: owner_restarted
            with anyio.fail_after(10):
                fenced = await old.wait_fenced()
            assert fenced.code == Code.FENCED
            assert fenced.details == {"epoch": 1, "fenced_by_epoch": 2}
            with pytest.raises(LoraLedgerError) as renewal:
                old.renew_lease("w")
            assert renewal.value is fenced
            with pytest.raises(LoraLedgerError) as bind:
                await old.bind("t", "w")
            assert bind.value is fenced
            await new.bind("t", "w", incarnation="second-life")  # the new one writes on


@pytest.mark.anyio
async def test_execute_many_answers_each_command_in_place() -> None:
    async with Ledger.open(MemoryStore()) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        results = await ledger.execute_many(
            [
                c.Bind(session="a", owner="w"),
                c.Bind(session="b", owner="nobody"),
                c.Release(session="a", owner="w"),
                c.Bind(session="a", owner="w"),
            ]
        )
        assert isinstance(results[0], Bound)
        assert isinstance(results[1], LoraLedgerError) and results[1].code == Code.UNKNOWN_OWNER
        assert isinstance(results[2], Released) and results[2].released
        assert isinstance(results[3], LoraLedgerError) and results[3].code == Code.SESSION_CLOSED


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_leases_expire_release_sessions_and_refuse_the_stale_worker() -> None:
    clock = FakeClock()
    store = MemoryStore()
    async with Ledger.open(store, clock=clock) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("worker", ttl_s=10.0)
        await ledger.bind("x", "worker")
        await ledger.bind("y", "worker")
        clock.now += 8
        ledger.renew_lease("worker")
        ledger.renew_lease("w")
        clock.now += 8
        assert await ledger.expire_leases() == []  # renewed 8 s ago, ttl 10 s
        clock.now += 3
        expired = await ledger.expire_leases()
        assert [(e.owner, e.released) for e in expired] == [("worker", 2)]
        released = [r.event for r in await store.read() if isinstance(r.event, SessionReleased)]
        assert {(e.session, e.cause) for e in released} == {
            ("x", "lease_expired"),
            ("y", "lease_expired"),
        }
        with pytest.raises(LoraLedgerError) as info:
            ledger.renew_lease("worker")
        assert info.value.code == Code.LEASE_EXPIRED
        with pytest.raises(LoraLedgerError) as bind:
            await ledger.bind("x", "worker")
        assert bind.value.code == Code.LEASE_EXPIRED
    # After a controller restart every live owner gets a full ttl of grace.
    clock.now += 1000
    async with Ledger.open(store, clock=clock) as ledger:
        assert await ledger.expire_leases() == []
        assert "w" in ledger.state.owners and not ledger.state.owners["w"].expired


@pytest.mark.anyio
async def test_reclaim_claim_records_the_in_flight_evidence_from_lease_renewals() -> None:
    store = MemoryStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        await publish(ledger, 2)
        ledger.renew_lease("w", {("e0", 1): 2})
        with pytest.raises(LoraLedgerError) as busy:
            await ledger.claim_reclaim(1, ledger.inflight_evidence(1))
        assert busy.value.code == Code.REQUESTS_IN_FLIGHT
        ledger.renew_lease("w", {("e0", 1): 0})
        await ledger.claim_reclaim(1, ledger.inflight_evidence(1))
        claim = next(r.event for r in await store.read() if isinstance(r.event, ReclaimClaimed))
        assert [(x.reporter, x.engine, x.count) for x in claim.evidence] == [("w", "*", 0)]


@pytest.mark.anyio
async def test_periodic_snapshots_are_written() -> None:
    store = MemoryStore()
    async with Ledger.open(store, snapshot_every=20, snapshot_on_close=False) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        for i in range(40):
            await ledger.bind(f"s{i}", "w")
    snap = await store.load_snapshot(PROJECTION_VERSION)
    assert snap is not None and snap.seq > 20


@pytest.mark.anyio
async def test_a_closed_ledger_refuses_commands() -> None:
    async with Ledger.open(MemoryStore()) as ledger:
        await bootstrap(ledger)
    with pytest.raises(LoraLedgerError) as info:
        await ledger.bind("s", "w")
    assert info.value.code == Code.LEDGER_CLOSED


@pytest.mark.anyio
async def test_batch_decided_during_a_failed_append_is_decided_again() -> None:
    """Pipelining: the next batch is decided while the previous COMMIT is in flight. If that
    COMMIT fails, the speculative decisions are thrown away and the batch decided again."""
    store = GatedStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        store.gated = True
        outcomes: dict[str, object] = {}

        async def bind(session: str) -> None:
            try:
                outcomes[session] = await ledger.bind(session, "w")
            except OSError as exc:
                outcomes[session] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(bind, "a")
            await wait_for("a's append waiting at the gate", lambda: store.waiting == 1)
            tg.start_soon(bind, "b")  # decided on top of "a", speculatively
            await wait_for("b decided", lambda: "b" in ledger.state.sessions)
            assert {"a", "b"} <= set(ledger.state.sessions)
            store.fail_next = OSError("disk full")
            store.gated = False
            store.gate.set()
        assert isinstance(outcomes["a"], OSError)
        assert isinstance(outcomes["b"], Bound) and outcomes["b"].new
        assert set(ledger.state.sessions) == {"b"}
        durable = await recover(store, use_snapshot=False)
        assert set(durable.sessions) == {"b"}
        invariants.check(ledger.state)


@pytest.mark.anyio
async def test_subscribers_see_each_new_event_once_in_order() -> None:
    async with Ledger.open(MemoryStore()) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        seen: list[str] = []
        start = ledger.state.last_seq

        records = ledger.subscribe()  # from here: whenever the task below first reads

        async def follow() -> None:
            async for record in records:
                seen.append(type(record.event).__name__)
                if len(seen) == 3:
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await ledger.bind("a", "w")
            await ledger.release("a", "w")
            await ledger.bind("b", "w")
        assert seen == ["SessionBound", "SessionReleased", "SessionBound"]
        assert ledger.state.last_seq == start + 3


@pytest.mark.anyio
async def test_a_full_queue_makes_callers_wait_and_loses_nothing() -> None:
    """Back-pressure: with the store stalled, ``max_queued`` commands queue and every later
    caller waits for room (neither refused nor queued beyond the bound); once the store
    moves, every caller is answered and every binding is durable."""
    store = GatedStore()
    async with Ledger.open(store, max_queued=4) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        store.gated = True
        bound: list[str] = []
        batches = ledger.batches

        async def bind(session: str) -> None:
            bound.append((await ledger.bind(session, "w")).session)

        async def group(sessions: list[str]) -> None:
            for result in await ledger.execute_many(
                [c.Bind(session=s, owner="w") for s in sessions]
            ):
                assert isinstance(result, Bound), result
                bound.append(result.session)

        def queue() -> tuple[int, int]:
            stats = ledger.queue_statistics()
            return stats.current_buffer_used, stats.tasks_waiting_send

        async with anyio.create_task_group() as tg:
            tg.start_soon(bind, "a")  # decided; its append waits at the gate
            await wait_for("session a bound", lambda: "a" in ledger.state.sessions)
            tg.start_soon(bind, "b")  # decided on top of "a"; the writer waits for "a"'s COMMIT
            await wait_for("session b bound", lambda: "b" in ledger.state.sessions)
            for i in range(10):
                tg.start_soon(bind, f"q{i}")
            tg.start_soon(group, [f"g{i}" for i in range(6)])
            await wait_for(  # 4 queued; the other 6 binds and the group wait for room
                "4 commands queued and 7 callers waiting for room", lambda: queue() == (4, 7)
            )
            assert bound == [] and ledger.batches == batches  # nothing answered, nothing lost
            store.gated = False
            store.gate.set()
        expected = {"a", "b"} | {f"q{i}" for i in range(10)} | {f"g{i}" for i in range(6)}
        assert sorted(bound) == sorted(expected)
        assert queue() == (0, 0)
        durable = await recover(store, use_snapshot=False)
        assert set(durable.sessions) == expected


@pytest.mark.anyio
async def test_a_caller_cancelled_while_waiting_leaves_the_others_answered() -> None:
    """Each caller waits on a wake-up of its own: one cancelled while the append it waits
    for is in flight withdraws only itself. Its command was taken, so it is still decided and
    durable, and every caller that stayed is answered."""
    store = GatedStore()
    async with Ledger.open(store) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        store.gated = True
        answered: list[str] = []

        async def bind(session: str) -> None:
            answered.append((await ledger.bind(session, "w")).session)

        async with anyio.create_task_group() as tg:
            tg.start_soon(bind, "a")  # decided; its append waits at the gate
            await wait_for("session a bound", lambda: "a" in ledger.state.sessions)
            with anyio.CancelScope() as gone:
                async with anyio.create_task_group() as leaving:
                    leaving.start_soon(bind, "b")
                    tg.start_soon(bind, "c")  # stays
                    leaving.start_soon(bind, "d")
                    await wait_for(  # decided on top of "a", waiting for its COMMIT
                        "b, c, d bound", lambda: {"b", "c", "d"} <= set(ledger.state.sessions)
                    )
                    gone.cancel()
            tg.start_soon(bind, "e")
            store.gated = False
            store.gate.set()
        assert sorted(answered) == ["a", "c", "e"]
        durable = await recover(store, use_snapshot=False)
        assert {"a", "b", "c", "d", "e"} <= set(durable.sessions)


def test_the_queue_bound_must_allow_one_command() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        Ledger(
            MemoryStore(),
            RegistryState(),
            clock=lambda: 0.0,
            code_version="x",
            snapshot_every=10,
            check_invariants=True,
            max_queued=0,
        )


@pytest.mark.anyio
@pytest.mark.parametrize("every", [0.0, -1.0, float("nan"), float("inf")])
async def test_a_watch_period_that_would_spin_or_never_run_is_refused(every: float) -> None:
    """0 s would re-read the log in a tight loop; NaN or infinity would never watch at all."""
    with pytest.raises(ValueError, match="watch_every_s"):
        async with Ledger.open(MemoryStore(), watch_every_s=every):
            pass
