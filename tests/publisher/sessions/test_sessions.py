"""Sessions on real local engines and a real ledger: bind on the first generation, one shared
bind, pinned turns/retries/resumes, close-then-release exactly once, forget in batches, owner
leases (renewal, expiry, stale workers) and the batch API."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import pytest

from engines.contract import SamplingParams
from evlog.errors import LoraLedgerError, StoreCode, StoreError
from evlog.events import (
    Event,
    OwnerDeregistered,
    SessionBound,
    SessionReleased,
    SessionsForgotten,
    VersionPublished,
)
from projections.registry import VersionState
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Bound, Deregistered, Done, Outcome, Released
from publisher.sessions import RetryPolicy, RolloutWorker
from tests.publisher.rollout_kit import (
    ENGINE_WARNINGS,
    PROMPT,
    SHORT,
    KeepsRunning,
    Recording,
    Rig,
    rig,
)
from tests.support.log import events_of, numbered
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

EventT = TypeVar("EventT", bound=Event)

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


class Port:
    """The real ledger behind the worker's port, counting (and optionally gating or losing
    the reply of) what the worker sends. Everything it forwards is decided by the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.calls: list[list[c.Command]] = []
        self.gate: anyio.Event | None = None  # Bind calls wait here when set
        self.waiting = 0
        self.lose_release_replies = 0

    async def register_owner(
        self,
        owner: str,
        *,
        ttl_s: float = 30.0,
        incarnation: str = "",
        sessions_idle_s: float | None = None,
        secret: str = "",
    ) -> Done:
        return await self.ledger.register_owner(
            owner,
            ttl_s=ttl_s,
            incarnation=incarnation,
            sessions_idle_s=sessions_idle_s,
            secret=secret,
        )

    async def deregister_owner(self, owner: str, *, incarnation: str = "", secret: str = ""):  # type: ignore[no-untyped-def]
        return await self.ledger.deregister_owner(owner, incarnation=incarnation, secret=secret)

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
        secret: str = "",
    ) -> None:
        self.ledger.renew_lease(
            owner, inflight, incarnation=incarnation, sessions=sessions, secret=secret
        )

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        self.calls.append(list(commands))
        if self.gate is not None and any(isinstance(x, c.Bind) for x in commands):
            self.waiting += 1
            await self.gate.wait()
        answers = await self.ledger.execute_many(commands)
        if self.lose_release_replies and any(isinstance(x, c.Release) for x in commands):
            self.lose_release_replies -= 1
            raise TimeoutError("reply lost after the ledger committed")
        return answers

    def sent(self, kind: type) -> list[c.Command]:
        return [x for call in self.calls for x in call if isinstance(x, kind)]


@asynccontextmanager
async def worker_on(r: Rig, owner: str = "w1", **kw: object) -> AsyncIterator[RolloutWorker]:
    async with RolloutWorker.open(r.ledger, r.gateway, owner=owner, **kw) as w:  # type: ignore[arg-type]
        yield w


# --- binding ---------------------------------------------------------------------------------


async def test_bind_before_commit_is_old_after_commit_is_new_and_turns_stay_pinned() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        staged = await r.stage(2)  # READY everywhere, not committed
        early, late = w.session("early"), w.session("late")
        assert early.bound is None  # creating a binder binds nothing
        first = await early.generate(PROMPT, SHORT)
        assert first.version_id == 1
        await r.ledger.commit(2, staged.attempt)
        assert (await late.generate(PROMPT, SHORT)).version_id == 2
        for _ in range(3):
            assert (await early.generate(PROMPT, SHORT)).version_id == 1
        bound = {e.session: (seq, e.version_id) for seq, e in await numbered(r.store, SessionBound)}
        ((commit_seq, _),) = [
            x for x in await numbered(r.store, VersionPublished) if x[1].version_id == 2
        ]
        assert bound["early"][0] < commit_seq < bound["late"][0]


async def test_binds_racing_a_commit_follow_the_ledger_order() -> None:
    """60 first generations race the commit of v2, and the ledger order interleaves them: the
    worker's binds are held at its port until 30 of them, then the commit, then 30 more wait
    there; released at once, they reach the ledger's queue in that order (woken first come,
    first served) and are decided in it, one group commit apart at most. Each session gets,
    is served by and keeps the version the ledger order gives it."""
    async with rig() as r:
        await r.publish(1)
        staged = await r.stage(2)
        port = Port(r.ledger)
        gate = port.gate = anyio.Event()
        served: dict[str, int] = {}
        commit_waiting = anyio.Event()
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            async with anyio.create_task_group() as tg:

                async def first(session: str) -> None:
                    result = await w.session(session).generate(PROMPT, SHORT)
                    served[session] = result.version_id

                async def commit() -> None:
                    commit_waiting.set()
                    await gate.wait()
                    await r.ledger.commit(2, staged.attempt)

                for i in range(30):
                    tg.start_soon(first, f"a{i}")
                await wait_for("30 binds waiting at the port", lambda: port.waiting == 30)
                tg.start_soon(commit)
                await commit_waiting.wait()
                for i in range(30):
                    tg.start_soon(first, f"b{i}")
                await wait_for("60 binds waiting at the port", lambda: port.waiting == 60)
                assert len(port.sent(c.Bind)) == 60 and not await events_of(r.store, SessionBound)
                gate.set()
            ((commit_seq, _),) = [
                x for x in await numbered(r.store, VersionPublished) if x[1].version_id == 2
            ]
            bound = await numbered(r.store, SessionBound)
            assert len(bound) == 60
            for seq, event in bound:
                assert event.version_id == (1 if seq < commit_seq else 2)
                assert w.session(event.session).bound.version_id == event.version_id  # type: ignore[union-attr]
                assert served[event.session] == event.version_id
            # the race really happened: 30 binds before the commit, 30 after, as they queued
            on = {v: {e.session for _, e in bound if e.version_id == v} for v in (1, 2)}
            assert on == {1: {f"a{i}" for i in range(30)}, 2: {f"b{i}" for i in range(30)}}


async def test_every_turn_retry_and_resume_uses_the_first_version() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1") as w1:
            s = w1.session("traj")
            assert (await s.generate(PROMPT, SHORT, turn=0)).version_id == 1
            await r.publish(2)
            assert (await s.generate(PROMPT, SHORT, turn=1)).version_id == 1
            await r.publish(3)
            retry = await s.generate(PROMPT, SHORT, turn=1)  # a retry of turn 1
            assert retry.version_id == 1 and retry.staleness == 2
            # Resume elsewhere: another worker (another process in production), later.
            async with worker_on(r, "w2") as w2:
                resumed = w2.session("traj")
                for turn in (2, 3):
                    assert (await resumed.generate(PROMPT, SHORT, turn=turn)).version_id == 1
        assert len(await events_of(r.store, SessionBound)) == 1
        await wait_for("every provenance row to reach the sink", lambda: r.recorder.pending == 0)
        rows = [x for x in r.sink.rows if x.session == "traj"]
        assert [x.turn for x in rows] == [0, 1, 1, 2, 3]
        assert {(x.version_id, x.lora_name) for x in rows} == {(1, r.names[1])}


async def test_a_hundred_concurrent_first_generations_share_one_bind() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            results = []

            async def first() -> None:
                results.append(await w.session("hot").generate(PROMPT, SHORT))

            async with anyio.create_task_group() as tg:
                for _ in range(100):
                    tg.start_soon(first)
            assert len(results) == 100
            assert {x.version_id for x in results} == {1}
            assert len(port.sent(c.Bind)) == 1  # one bind task, not one per waiter
        assert len(await events_of(r.store, SessionBound)) == 1


async def test_cancelling_the_first_waiter_never_cancels_the_bind() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        port.gate = anyio.Event()
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            s = w.session("s")
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.generate, PROMPT, SHORT)
                await wait_for("the bind in flight", lambda: port.waiting == 1)
                tg.cancel_scope.cancel()  # the only waiter goes away
            assert s.bound is None
            port.gate.set()
            await wait_for("the session bound by the bind it left", lambda: s.bound is not None)
            assert r.ledger.state.sessions["s"].version_id == 1
            served = await s.generate(PROMPT, SHORT)
            assert served.version_id == 1
            assert len(port.sent(c.Bind)) == 1  # nobody re-chose
        assert len(await events_of(r.store, SessionBound)) == 1


async def test_a_failed_first_bind_is_asked_again_later() -> None:
    async with rig() as r, worker_on(r) as w:
        s = w.session("s")
        with pytest.raises(LoraLedgerError) as info:
            await s.generate(PROMPT, SHORT)
        assert info.value.code == Code.NO_PUBLISHED_VERSION
        await r.publish(1)
        assert (await s.generate(PROMPT, SHORT)).version_id == 1


class Failing(Port):
    """The real ledger behind the port, except that a call fails with ``failure`` when set
    (a refusal of the whole call, a broken port, a lost reply), or each command is answered
    ``refusal`` when set: nothing then reaches the ledger."""

    failure: Exception | None = None
    refusal: LoraLedgerError | None = None  # when set, the answer to every command

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        failure, refusal = self.failure, self.refusal
        if failure is not None:
            self.calls.append(list(commands))
            raise failure
        if refusal is not None:
            self.calls.append(list(commands))
            return [refusal] * len(commands)
        return await super().execute_many(commands)


async def test_a_call_that_fails_as_a_whole_answers_each_waiter_with_why() -> None:
    """A refusal of the whole call reaches each waiter as it is; any other failure becomes a
    LEDGER_CLOSED naming the call and what broke. Nothing is left bound or waiting, and the
    session can be asked again."""
    async with rig() as r:
        await r.publish(1)
        port = Failing(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            a, b = w.session("a"), w.session("b")
            port.failure = LedgerError(Code.LEDGER_CLOSED, "the ledger is closed")
            results = await w.bind_many([a, b])
            assert [(x.code, x.message) for x in results] == [  # type: ignore[union-attr]
                (Code.LEDGER_CLOSED, "the ledger is closed")
            ] * 2
            port.failure = ValueError("the port broke")
            with pytest.raises(LoraLedgerError) as info:
                await a.bind()
            assert info.value.code == Code.LEDGER_CLOSED
            assert info.value.message == "bind of 1 sessions failed: ValueError('the port broke')"
            assert len(port.calls) == 2 and r.ledger.state.sessions == {}
            port.failure = None
            assert (await a.bind()).version_id == 1


async def test_a_call_failing_every_attempt_is_asked_as_often_as_the_policy_says() -> None:
    """A lost reply and a retryable refusal are asked again, ``attempts`` times in all; then
    each waiter hears the last attempt's own word: the lost reply (as LEDGER_CLOSED naming
    it), the refusal as it came."""
    async with rig() as r:
        await r.publish(1)
        port = Failing(r.ledger)
        retry = RetryPolicy(attempts=3, first_delay=0.0, max_delay=0.0)
        async with RolloutWorker.open(port, r.gateway, owner="w1", retry=retry) as w:
            s = w.session("s")
            port.failure = OSError("the reply was lost")
            with pytest.raises(LoraLedgerError) as lost:
                await s.bind()
            assert (lost.value.code, lost.value.message) == (
                Code.LEDGER_CLOSED,
                "bind of 1 sessions failed: OSError('the reply was lost')",
            )
            assert len(port.calls) == 3
            port.failure, port.refusal = None, StoreError(StoreCode.STORE_FAILED, "disk full")
            with pytest.raises(LoraLedgerError) as refused:
                await s.bind()
            assert refused.value is port.refusal and len(port.calls) == 6
            port.refusal = None
            assert (await s.bind()).version_id == 1


class LostRegistrations(Port):
    """The real ledger behind the port; the replies of the next ``lost`` registrations are
    lost (after the ledger registered the owner: the call is idempotent)."""

    lost = 0
    registrations = 0

    async def register_owner(self, *args: Any, **kwargs: Any) -> Done:
        self.registrations += 1
        done = await super().register_owner(*args, **kwargs)
        if self.lost:
            self.lost -= 1
            raise OSError("the reply was lost")
        return done


async def test_a_registration_whose_replies_are_lost_is_asked_until_the_last_attempt() -> None:
    async with rig() as r:
        port = LostRegistrations(r.ledger)
        port.lost = 2
        retry = RetryPolicy(attempts=3, first_delay=0.0, max_delay=0.0)
        async with RolloutWorker.open(port, r.gateway, owner="w1", retry=retry) as w:
            assert port.registrations == 3 and w.lost is None
            await r.publish(1)
            assert (await w.session("s").bind()).version_id == 1


# --- close -----------------------------------------------------------------------------------


async def test_close_before_the_first_bind_can_never_bind() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        s = w.session("never")
        released = await s.close()
        assert released == Released(session="never", released=False, tombstoned=True)
        for again in (s, w.session("never")):
            with pytest.raises(LoraLedgerError) as info:
                await again.generate(PROMPT, SHORT)
            assert info.value.code == Code.SESSION_CLOSED
        assert await events_of(r.store, SessionBound) == []
        (tomb,) = await events_of(r.store, SessionReleased)
        assert tomb.version_id is None


@pytest.mark.parametrize("by", ["binder", "worker"])
async def test_close_waits_for_running_generations_then_releases_once(by: str) -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        s = w.session("s")
        await s.generate(PROMPT, SHORT)
        for engine in r.local.values():
            engine.pause_generation()
        results: list[object] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                results.append(await s.generate(PROMPT, LONG))

            async def close() -> None:  # by default, close waits for the turn
                results.append(await s.close() if by == "binder" else (await w.close_many([s]))[0])

            tg.start_soon(run)
            await wait_for(
                "the session's turn in flight",
                lambda: s.in_flight == 1 and r.gateway.inflight_counts() != {},
            )
            tg.start_soon(close)
            await wait_for("the session closing", lambda: s.closed)
            with pytest.raises(LoraLedgerError) as info:
                await s.generate(PROMPT, SHORT)  # closing: nothing new starts
            assert info.value.code == Code.SESSION_CLOSED
            await anyio.sleep(0.05)
            assert "s" in r.ledger.state.sessions  # still bound: a generation is running
            for engine in r.local.values():
                engine.continue_generation()
        served, released = results
        assert served.generation.finish_reason == "length"  # type: ignore[attr-defined]
        assert released == Released(session="s", released=True, version_id=1, tombstoned=True)
        assert await s.close() == released  # idempotent, no second event
        assert len(await events_of(r.store, SessionReleased)) == 1


async def test_close_with_cancel_stops_running_generations_first() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        s = w.session("s")
        for engine in r.local.values():
            engine.pause_generation()
        errors: list[LoraLedgerError] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await s.generate(PROMPT, LONG)
                except LoraLedgerError as exc:
                    errors.append(exc)

            tg.start_soon(run)
            await wait_for("a request in flight", lambda: r.gateway.inflight_counts() != {})
            released = await s.close(cancel=True)
        assert [e.code for e in errors] == [Code.SESSION_CLOSED]
        assert released.released and released.version_id == 1
        assert r.gateway.inflight_counts() == {}
        assert all(e.refcount(r.names[1]) == 0 for e in r.local.values())


async def test_a_lost_release_reply_is_retried_and_releases_exactly_once() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        port.lose_release_replies = 1
        retry = RetryPolicy(first_delay=0.001)
        async with RolloutWorker.open(port, r.gateway, owner="w1", retry=retry) as w:
            s = w.session("s")
            await s.generate(PROMPT, SHORT)
            released = await s.close()
            assert released.session == "s"
            assert len(port.sent(c.Release)) == 2  # the lost reply was asked again
            assert "s" not in r.ledger.state.sessions
        (event,) = await events_of(r.store, SessionReleased)
        assert (event.session, event.version_id, event.cause) == ("s", 1, "closed")


async def test_tombstones_are_forgotten_in_batches_once_released() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, forget_batch=4) as w:
            for i in range(10):
                s = w.session(f"s{i}")
                await s.generate(PROMPT, SHORT)
                await s.close()
            await wait_for(
                "two batches of forgets sent in the background", lambda: w.unforgotten == 2
            )
            assert len(r.ledger.state.tombstones) == 2
        # leaving the worker forgets the rest
        assert r.ledger.state.tombstones == {}
        sizes = [len(e.sessions) for e in await events_of(r.store, SessionsForgotten)]
        assert sizes == [4, 4, 2]


async def test_a_released_session_leaves_the_worker_and_only_its_own_binder_does() -> None:
    """A worker holds a session's binder until it is released, then lets it go (its memory
    stays bounded, and the id's next caller gets a binder of its own, which the ledger refuses
    while the tombstone lives). A release removes only the binder it released: a relay that
    dropped an unused binding and made a successor for the id keeps the successor."""
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "relay", sessions_idle_s=60.0) as w:
            s, old = w.session("s"), w.session("old")
            for binder in (s, old):
                await binder.generate(PROMPT, SHORT)
            await s.close()
            assert w.session("s") is not s and w.bindings() == {"old": 1}
            assert w.drop_unused(now=anyio.current_time() + 1e6) == 2
            successor = w.session("old")
            await old.close()  # its holder releases it after the relay made the successor
            assert w.session("old") is successor


# --- batches ---------------------------------------------------------------------------------


async def test_bind_many_and_close_many_take_one_round_trip_each() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            group = [w.session(f"g{i}") for i in range(20)]
            closed_early = w.session("closed-early")
            await closed_early.close()
            port.calls.clear()
            bound = await w.bind_many([*group, closed_early])
            assert len(port.calls) == 1 and len(port.calls[0]) == 20
            assert [b.version_id for b in bound[:20]] == [1] * 20  # type: ignore[union-attr]
            assert bound[20].code == Code.SESSION_CLOSED  # type: ignore[union-attr]
            await r.publish(2)
            for s in group[:3]:
                assert (await s.generate(PROMPT, SHORT)).version_id == 1
            port.calls.clear()
            released = await w.close_many(group)
            assert len(port.calls) == 1
            assert all(isinstance(x, Released) and x.released for x in released)
        assert r.ledger.state.versions[1].bound == 0


# --- owner leases ------------------------------------------------------------------------------


# An owner-held worker, and a relay (its sessions client-held): renewals carry the same counts
# and the same life either way.
KINDS = pytest.mark.parametrize(
    "kind", [{}, {"sessions_idle_s": 60.0}], ids=["owner-held", "relay"]
)


@KINDS
async def test_renewals_keep_a_live_worker_and_carry_its_in_flight_counts(
    kind: dict[str, Any],
) -> None:
    async with rig() as r, worker_on(r, ttl_s=10.0, renew_every=0.01, **kind) as w:
        await r.publish(1)
        s = w.session("s")
        for engine in r.local.values():
            engine.pause_generation()
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.generate, PROMPT, LONG)
            await wait_for("a request in flight", lambda: r.gateway.inflight_counts() != {})
            for _ in range(3):
                r.clock.advance(8.0)  # past the ttl in total, never between two renewals
                seen = w.renewals
                # mypy cannot infer a lambda with a default argument (binding the loop's value)
                await wait_for(
                    "the worker's next lease renewal",
                    lambda seen=seen: w.renewals > seen,  # type: ignore[misc]
                )
                assert await r.ledger.expire_leases() == []
            counts = {x.reporter: x.count for x in r.ledger.inflight_evidence(1) if x.count}
            assert counts == {"w1": 1}
            for engine in r.local.values():
                engine.continue_generation()
        assert w.lost is None


async def test_workers_sharing_a_gateway_report_their_own_requests_and_fresh_counts() -> None:
    async with rig() as r:
        await r.publish(1)
        async with (
            worker_on(r, "w1", renew_every=3600) as w1,
            worker_on(r, "w2", renew_every=3600) as w2,
        ):
            await w2.session("idle").generate(PROMPT, SHORT)
            for engine in r.local.values():
                engine.pause_generation()
            async with anyio.create_task_group() as tg:
                tg.start_soon(w1.session("busy").generate, PROMPT, LONG)
                await wait_for("a request in flight", lambda: r.gateway.inflight_counts() != {})
                w1.report()
                w2.report()
                counts = {x.reporter: x.count for x in r.ledger.inflight_evidence(1) if x.count}
                assert counts == {"w1": 1}  # not w2: it has nothing in flight
                for engine in r.local.values():
                    engine.continue_generation()
            # no renewal tick ran (renew_every is an hour): the end of the generation itself
            # reported the fallen count, so reclaim is not held back by a stale report
            assert [x.count for x in r.ledger.inflight_evidence(1)] == [0, 0]


async def test_a_dead_workers_lease_expires_releases_its_sessions_and_unblocks_reclaim() -> None:
    async with rig() as r:
        await r.publish(1)
        # A worker that dies never says goodbye: deregister_on_exit=False leaves as it does.
        async with worker_on(r, "w1", ttl_s=10.0, renew_every=3600, deregister_on_exit=False) as w:
            await w.session("orphan").generate(PROMPT, SHORT)
        # the worker is gone without closing "orphan"; v1 is retired but still pinned
        await r.publish(2)
        driver = r.reclaimer()
        assert await driver.sweep() == []  # v1 is retired but pinned
        assert r.ledger.state.versions[1].state is VersionState.RETIRED
        r.clock.advance(10.0)
        (expired,) = await r.ledger.expire_leases()
        assert (expired.owner, expired.released) == ("w1", 1)
        (event,) = await events_of(r.store, SessionReleased)
        assert (event.session, event.cause) == ("orphan", "lease_expired")
        assert await driver.sweep() == [1]
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED
        assert all(r.names[1] not in e.loaded_adapters() for e in r.local.values())


async def test_a_clean_exit_deregisters_and_frees_the_version_at_once() -> None:
    """The same worker as above, leaving its block normally: no lease to wait for, no expiry
    recorded; what it left bound is released as ``owner_exited`` and v1 is reclaimable now."""
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1", ttl_s=10.0, renew_every=3600) as w:
            await w.session("orphan").generate(PROMPT, SHORT)
            await w.session("closed").generate(PROMPT, SHORT)
            await w.session("closed").close()
        assert w.deregistered is not None and w.deregistered.released == 1
        await r.publish(2)
        assert await r.reclaimer().sweep() == [1]  # no clock advanced: nothing expired
        assert [e.cause for e in await events_of(r.store, SessionReleased)] == [
            "closed",
            "owner_exited",
        ]
        r.clock.advance(60.0)
        assert await r.ledger.expire_leases() == []
        with pytest.raises(LoraLedgerError) as info:
            await w.session("late").generate(PROMPT, SHORT)
        assert info.value.code == Code.OWNER_DEREGISTERED


async def test_a_stale_worker_is_refused_with_lease_expired_never_rebound() -> None:
    async with rig(wrap=Recording) as r:
        await r.publish(1)
        async with worker_on(r, "w1", ttl_s=10.0, renew_every=3600) as w:
            s = w.session("s")
            await s.generate(PROMPT, SHORT)
            r.clock.advance(11.0)
            await r.ledger.expire_leases()  # the worker was paused past its ttl
            # the rig wraps every engine in Recording (the fleet types them as Engine)
            sent = sum(len(e.calls) for e in r.fleet)  # type: ignore[attr-defined, misc]
            calls: list[Callable[[], Awaitable[object]]] = [
                lambda: s.generate(PROMPT, SHORT),
                s.bind,
                s.close,
                lambda: w.session("new").generate(PROMPT, SHORT),
                lambda: w.bind_many([w.session("new2")]),
            ]
            for call in calls:
                with pytest.raises(LoraLedgerError) as info:
                    await call()
                assert info.value.code == Code.LEASE_EXPIRED
            assert w.lost is not None
            # nothing dispatched
            assert sum(len(e.calls) for e in r.fleet) == sent  # type: ignore[attr-defined, misc]
        assert len(await events_of(r.store, SessionBound)) == 1
        # the expired life cannot come back (a late retry of its registration) ...
        with pytest.raises(LoraLedgerError) as info:
            await r.ledger.register_owner(
                "w1", ttl_s=10.0, incarnation=w.incarnation, secret=w.secret
            )
        assert info.value.code == Code.LEASE_EXPIRED
        # ... but a new life of the owner id may start (a worker restarted after its lease ran
        # out): it binds afresh, and "s" stays released
        async with worker_on(r, "w1", ttl_s=10.0) as again:
            assert again.incarnation != w.incarnation
            await again.session("s-again").generate(PROMPT, SHORT)
            with pytest.raises(LoraLedgerError) as info:
                await again.session("s").generate(PROMPT, SHORT)
            assert info.value.code == Code.SESSION_CLOSED


async def test_a_clean_exit_waits_for_turns_running_beside_the_block() -> None:
    """A host that serves turns beside the worker's block (``RayRollout``: its calls run in a
    portal) can close while a turn runs. The exit deregistered at once: every session released
    (``owner_exited``) and the in-flight evidence dropped while the request still ran, so a
    reclaim could unload its version under it. Now the exit waits for the turn first."""
    async with rig() as r, anyio.create_task_group() as beside:
        await r.publish(1)
        results: list[object] = []
        exited = anyio.Event()

        async def exit_cleanly() -> None:
            async with worker_on(r) as w:
                s = w.session("s")
                await s.generate(PROMPT, SHORT)
                for engine in r.local.values():
                    engine.pause_generation()

                async def run() -> None:
                    results.append(await s.generate(PROMPT, LONG))

                beside.start_soon(run)  # the turn outlives this block
                await wait_for("the session's turn in flight", lambda: s.in_flight == 1)
            exited.set()

        beside.start_soon(exit_cleanly)
        await wait_for("a request in flight", lambda: r.gateway.inflight_counts() != {})
        await anyio.sleep(0.2)
        assert not exited.is_set() and "s" in r.ledger.state.sessions  # still bound: it runs
        assert await events_of(r.store, OwnerDeregistered) == []
        for engine in r.local.values():
            engine.continue_generation()
        with anyio.fail_after(30):
            await exited.wait()
        (served,) = results
        assert served.generation.finish_reason == "length"  # type: ignore[attr-defined]
        assert len(await events_of(r.store, OwnerDeregistered)) == 1
        assert "s" not in r.ledger.state.sessions


# --- rules each shown by a mutant that survived the sessions campaign ------------------------


async def test_bind_alone_returns_the_binding_and_bindings_list_the_bound_sessions() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        s = w.session("s")
        first = await s.bind()
        assert isinstance(first, Bound) and (first.session, first.version_id) == ("s", 1)
        assert await s.bind() is first  # kept: never asked again
        w.session("unbound")
        await w.session("closed").close()
        assert w.bindings() == {"s": 1}


async def test_bind_many_answers_each_binder_in_place() -> None:
    async with rig() as r, worker_on(r) as w:
        (early,) = await w.bind_many([w.session("early")])
        assert isinstance(early, LoraLedgerError) and early.code == Code.NO_PUBLISHED_VERSION
        await r.publish(1)
        closed = w.session("closed")
        await closed.close()
        with pytest.raises(LoraLedgerError) as info:
            await closed.generate(PROMPT, SHORT)
        assert (info.value.code, info.value.message, info.value.details) == (
            Code.SESSION_CLOSED,
            "session closed is closed",
            {"session": "closed"},
        )
        refused, bound = await w.bind_many([closed, w.session("open")])
        assert isinstance(refused, LoraLedgerError) and refused.code == Code.SESSION_CLOSED
        assert (refused.message, refused.details) == (
            "session closed is closed",
            {"session": "closed"},
        )
        assert isinstance(bound, Bound) and (bound.session, bound.version_id) == ("open", 1)


@KINDS
async def test_a_replaced_worker_hears_owner_restarted_naming_itself(
    kind: dict[str, Any],
) -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1", **kind) as old:
            s = old.session("s")
            await s.generate(PROMPT, SHORT)
            async with worker_on(r, "w1", **kind) as new:  # a second incarnation of the owner
                assert new.incarnation != old.incarnation
                with pytest.raises(LoraLedgerError) as first:  # the ledger's refusal
                    await s.generate(PROMPT, SHORT)
                assert first.value.code == Code.OWNER_RESTARTED
                with pytest.raises(LoraLedgerError) as info:  # then the worker's own word
                    await s.generate(PROMPT, SHORT)
                assert info.value.code == Code.OWNER_RESTARTED
                assert info.value.message == (
                    f"owner w1 was restarted: a newer incarnation replaced this worker "
                    f"({old.incarnation}) and its sessions were released. Stop this worker."
                )
                assert info.value.details == {"owner": "w1"} and old.lost is info.value


async def test_a_worker_whose_lease_expired_is_told_why_and_what_to_do() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1", ttl_s=10.0, renew_every=3600) as w:
            await w.session("s").generate(PROMPT, SHORT)
            r.clock.advance(11.0)
            await r.ledger.expire_leases()
            with pytest.raises(LoraLedgerError):  # the ledger's refusal
                await w.session("s").generate(PROMPT, SHORT)
            with pytest.raises(LoraLedgerError) as info:  # then the worker's own word
                await w.session("s").generate(PROMPT, SHORT)
            assert info.value is w.lost
            assert (info.value.code, info.value.details) == (
                Code.LEASE_EXPIRED,
                {"owner": "w1", "cause": Code.LEASE_EXPIRED},
            )
            assert info.value.message == (
                "owner w1 lost its lease (LEASE_EXPIRED); its sessions were released. "
                "Register a new worker under a new owner id."
            )
            assert await w.release_idle(now=anyio.current_time() + 1e6) == 0  # it acts no more


async def test_every_release_names_its_life_and_its_cause() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            a, b = w.session("a"), w.session("b")
            await a.generate(PROMPT, SHORT)
            await w.close_many([a, b], cause="idle")
            assert {(x.session, x.cause) for x in await events_of(r.store, SessionReleased)} == {
                ("a", "idle"),
                ("b", "idle"),
            }
            releases = port.sent(c.Release)
            assert len(releases) == 2
            for release in releases:
                assert isinstance(release, c.Release)
                assert (release.incarnation, release.secret) == (w.incarnation, w.secret)
            (bind,) = port.sent(c.Bind)  # and so does every bind
            assert isinstance(bind, c.Bind)
            assert (bind.incarnation, bind.secret) == (w.incarnation, w.secret)


async def test_a_relay_forgets_only_the_tombstones_it_wrote() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "relay", sessions_idle_s=60.0) as w:
            mine, elsewhere = w.session("mine"), w.session("elsewhere")
            await mine.generate(PROMPT, SHORT)
            await elsewhere.generate(PROMPT, SHORT)
            # another face of the same owner life releases "elsewhere" first
            await r.ledger.execute(
                c.Release(
                    session="elsewhere", owner="relay", incarnation=w.incarnation, secret=w.secret
                )
            )
            assert (await elsewhere.close()).tombstoned is False
            assert w.unforgotten == 0  # its tombstone is its writer's to forget
            assert (await mine.close()).tombstoned is True
            assert w.unforgotten == 1
            assert await w.flush_forgets() == 1
        assert "elsewhere" in r.ledger.state.tombstones


async def test_idle_sessions_are_released_at_their_bound_and_forgotten_after_theirs() -> None:
    """``release_idle(now)``, time as data (anyio's clock, as ``last_used`` is): a session
    with no turn for exactly ``idle_release_s`` is released, cause ``idle``; one used later is
    not; one whose bind failed is dropped without asking the ledger; a late turn is refused
    naming the idle time; the tombstone is forgotten exactly ``idle_tombstone_s`` later."""
    async with rig() as r, worker_on(r, idle_release_s=100.0, idle_tombstone_s=1000.0) as w:
        failed = w.session("failed")
        with pytest.raises(LoraLedgerError):
            await failed.generate(PROMPT, SHORT)  # nothing published yet
        await r.publish(1)
        busy, idle = w.session("busy"), w.session("idle")  # a skipped one first, in order
        await idle.generate(PROMPT, SHORT)
        await busy.generate(PROMPT, SHORT)
        # later than anyio's clock (a `now` ignored shows), integer-valued (exact bounds)
        t = float(math.ceil(anyio.current_time())) + 1000.0
        idle.last_used, busy.last_used, failed.last_used = t, t + 0.5, t
        assert await w.release_idle(now=t + 99.5) == 0
        assert await w.release_idle(now=t + 100.0) == 1
        assert w.idle_releases == 1 and w.session("failed") is not failed
        assert set(r.ledger.state.sessions) == {"busy"}
        (released,) = await events_of(r.store, SessionReleased)
        assert (released.session, released.cause) == ("idle", "idle")
        with pytest.raises(LoraLedgerError) as late:
            await w.session("idle").generate(PROMPT, SHORT)
        assert (late.value.code, late.value.details) == (
            Code.SESSION_CLOSED,
            {"session": "idle", "cause": "idle"},
        )
        assert late.value.message == (
            "session idle was released after 100 s without a turn (cause idle): its version "
            "may be reclaimed; start a new session id"
        )
        at = w._idle_released["idle"]  # when it was released, by anyio's clock
        await w.release_idle(now=at + 999.0)
        assert w.idle_released("idle") and w.unforgotten == 0
        await w.release_idle(now=at + 1000.0)
        assert not w.idle_released("idle") and w.unforgotten == 1
        async with busy.turn():  # a turn in flight: never idle, however long ago the last
            assert await w.release_idle(now=t + 1e5) == 0
        assert await w.release_idle(now=t + 1e5) == 1 and w.idle_releases == 2
        with pytest.raises(LoraLedgerError) as later:  # its binder still knows why
            await idle.generate(PROMPT, SHORT)
        assert later.value.details == {"session": "idle", "cause": "idle"}


async def test_the_idle_loop_releases_an_idle_session_by_itself() -> None:
    async with rig() as r, worker_on(r, idle_release_s=0.2) as w:
        await r.publish(1)
        await w.session("s").generate(PROMPT, SHORT)
        await wait_for("the idle release", lambda: "s" not in r.ledger.state.sessions)
        assert w.idle_releases == 1 and w.idle_released("s")


async def test_a_worker_without_an_idle_bound_releases_nothing_for_idleness() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        await w.session("s").generate(PROMPT, SHORT)
        assert await w.release_idle(now=anyio.current_time() + 1e6) == 0
        assert set(r.ledger.state.sessions) == {"s"}


async def test_a_session_too_stale_is_released_as_such_once_and_refused_after() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.ledger.configure_deployment(max_staleness=1)
        await r.publish(1)
        s = w.session("s")
        await s.generate(PROMPT, SHORT)
        await r.publish(2)
        await r.publish(3)
        with pytest.raises(LoraLedgerError) as info:
            await s.generate(PROMPT, SHORT)
        assert info.value.code == Code.SESSION_TOO_STALE
        with pytest.raises(LoraLedgerError) as again:
            await s.generate(PROMPT, SHORT)
        assert again.value is info.value
        released = await events_of(r.store, SessionReleased)
        assert [(e.session, e.cause) for e in released] == [("s", "too_stale")]


class HeldReleases(Port):
    """The port, holding every release until ``release_gate`` is set."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.release_gate = anyio.Event()
        self.releases_waiting = 0

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        if any(isinstance(x, c.Release) for x in commands):
            self.releases_waiting += 1
            await self.release_gate.wait()
        return await super().execute_many(commands)


@pytest.mark.parametrize("what", ["bind", "release"])
async def test_a_worker_stopped_mid_call_answers_every_waiter(what: str) -> None:
    """The shared bind and release run in the worker's task group: when it stops (its host
    raised) while one is under way, each waiter beside the block hears ``LEDGER_CLOSED``
    naming the worker and the call, never waits forever."""
    async with rig() as r:
        await r.publish(1)
        port = HeldReleases(r.ledger)
        port.gate = anyio.Event() if what == "bind" else None
        heard: list[object] = []
        async with anyio.create_task_group() as beside:
            try:
                async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
                    s = w.session("s")
                    if what == "release":
                        await s.bind()

                    async def wait() -> None:
                        with anyio.fail_after(10):
                            try:
                                await (s.bind() if what == "bind" else s.close())
                            except LoraLedgerError as exc:
                                heard.append(exc)

                    beside.start_soon(wait)
                    await wait_for(
                        f"the {what} held at the port",
                        lambda: (port.waiting if what == "bind" else port.releases_waiting) == 1,
                    )
                    raise RuntimeError("the host stops")
            except* RuntimeError:
                pass
        (error,) = heard
        assert isinstance(error, LoraLedgerError) and error.code == Code.LEDGER_CLOSED
        assert error.message == f"rollout worker w1 stopped during a {what}"


def test_retries_wait_twice_as_long_each_time_up_to_the_longest_wait() -> None:
    policy = RetryPolicy(first_delay=0.02, max_delay=1.0)
    assert [policy.delay(n) for n in range(7)] == [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0]


async def test_a_refused_release_comes_back_in_place_and_is_asked_again() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            s = w.session("s")
            await s.generate(PROMPT, SHORT)
            (first,) = await w.close_many([s], cause="no such cause")
            assert isinstance(first, LoraLedgerError) and first.code == Code.INVALID_INPUT
            with pytest.raises(LoraLedgerError) as again:  # a failed release may be asked again
                await s.close()
            assert again.value.code == first.code and again.value is not first
            assert len(port.sent(c.Release)) == 2
            assert "s" in r.ledger.state.sessions


async def test_a_relay_forgets_bindings_unused_for_its_cache_time_and_only_those() -> None:
    """``drop_unused(now)``, time as data: a relay's binding with no turn here for
    ``binding_cache_s`` is dropped here (the ledger is not asked), so its next turn asks the
    ledger again; a binding with a turn in flight, or used later, is kept, and so is one whose
    bind is under way; a failed bind is dropped. An owner-held worker drops nothing."""
    async with rig() as r:
        port = Port(r.ledger)
        async with (
            worker_on(r, "owner-held") as held,
            RolloutWorker.open(port, r.gateway, owner="relay", sessions_idle_s=60.0) as w,
        ):
            failed = w.session("failed")
            with pytest.raises(LoraLedgerError):
                await failed.generate(PROMPT, SHORT)  # nothing published yet
            await r.publish(1)
            await held.session("h").generate(PROMPT, SHORT)
            unused, used, running = w.session("unused"), w.session("used"), w.session("running")
            for binder in (unused, used, running):
                await binder.generate(PROMPT, SHORT)
            binding = w.session("binding")
            port.gate = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(binding.bind)
                await wait_for("the bind held at the port", lambda: port.waiting == 1)
                t = float(math.ceil(anyio.current_time())) + 1000.0  # exact, later than now
                unused.last_used, used.last_used = t, t + 0.5
                running.last_used = binding.last_used = t
                failed.last_used = t - 100.0
                assert held.drop_unused(now=t + 1e6) == 0
                async with running.turn():
                    assert w.drop_unused(now=t + 59.5) == 1  # the failed bind only
                    assert w.drop_unused(now=t + 60.0) == 1  # "unused", at its bound
                assert w.session("used") is used and w.session("running") is running
                assert w.session("binding") is binding
                port.gate.set()
            again = w.session("unused")
            assert again is not unused and w.session("failed") is not failed
            w.discard(unused)  # a binder no longer this worker's: its successor stays
            assert w.session("unused") is again
            binds = len(port.sent(c.Bind))
            await again.generate(PROMPT, SHORT)  # asks the ledger: the same binding
            assert len(port.sent(c.Bind)) == binds + 1 and again.bound is not None


async def test_the_idle_loop_looks_every_quarter_of_the_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session goes 1 to 1.25 idle periods without a turn before it is released (or, in a
    relay, its cached binding dropped): the loop wakes every quarter of the idle time."""
    slept: list[float] = []
    sleep = anyio.sleep

    async def recording(seconds: float) -> None:
        slept.append(seconds)
        await sleep(seconds)

    monkeypatch.setattr(anyio, "sleep", recording)
    async with rig() as r:
        async with worker_on(r, "w1", ttl_s=3.0, idle_release_s=7.0):
            await wait_for("the idle loop asleep", lambda: 1.75 in slept)
        async with worker_on(r, "relay", ttl_s=3.0, sessions_idle_s=7.0):
            await wait_for("the relay's loop asleep", lambda: slept.count(1.75) == 2)
        async with worker_on(r, "w2", ttl_s=3.0, idle_release_s=1000.0):
            # but never longer than 30 s: a long idle bound still releases within 30 s of it
            await wait_for("the idle loop's longest wait", lambda: 30.0 in slept)


async def test_a_turn_sends_the_callers_request_id_and_extra_body() -> None:
    async with rig() as r, worker_on(r) as w:
        await r.publish(1)
        s = w.session("s")
        served = await s.generate(PROMPT, SHORT, request_id="trace-1")
        assert served.provenance.request_id == "trace-1"
        with pytest.raises(LoraLedgerError) as info:  # a local engine takes no extra fields
            await s.generate(PROMPT, SHORT, extra_body={"top_k": 5})
        assert info.value.message.endswith("takes no extra body fields (['top_k'])")


async def test_a_relays_idle_loop_keeps_dropping_unused_bindings() -> None:
    """A relay's loop drops the cached bindings unused for its idle time (here only: nothing
    is released in the ledger), tick after tick."""
    async with rig() as r, worker_on(r, "relay", sessions_idle_s=0.2) as w:
        await r.publish(1)
        for round_ in range(2):
            s = w.session("s")
            await s.generate(PROMPT, SHORT)
            await wait_for(f"drop {round_ + 1}", lambda: w.session("s") is not s)  # noqa: B023
        assert "s" in r.ledger.state.sessions


class RenewalLog(Port):
    """The real ledger behind the port, keeping the sessions each renewal carried."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.carried: list[set[str]] = []

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
        secret: str = "",
    ) -> None:
        self.carried.append(set(sessions))
        super().renew_lease(
            owner, inflight, incarnation=incarnation, sessions=sessions, secret=secret
        )


async def test_a_relays_renewals_carry_a_session_until_its_last_overlapping_turn_ends() -> None:
    """The ledger counts a client-held session's idleness from the turns its relay reports:
    a session with a turn running is carried by every renewal, and a turn's end by the next
    one. Two turns of one session overlap: when the first ends, every renewal still carries the
    session while the second runs; when the second ends, the renewal made at its end carries
    it (even though renewals during the turn had already reported it), and later ones do
    not."""
    async with rig() as r:
        await r.publish(1)
        port = RenewalLog(r.ledger)
        async with RolloutWorker.open(
            port, r.gateway, owner="relay", sessions_idle_s=60.0, renew_every=0.01
        ) as w:
            s = w.session("s")
            inside: list[int] = []
            ended: list[int] = []  # how many renewals had been made when each turn had ended

            async def hold(until: anyio.Event) -> None:
                async with s.turn():
                    inside.append(len(port.carried))
                    await until.wait()
                ended.append(len(port.carried))  # the turn's end renews as it leaves

            def renewals_after(n: int) -> Callable[[], bool]:
                return lambda: len(port.carried) >= n

            first_ends, second_ends = anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold, first_ends)
                await wait_for("the first turn running", lambda: len(inside) == 1)
                tg.start_soon(hold, second_ends)
                await wait_for("the second turn running", lambda: len(inside) == 2)
                first_ends.set()
                await wait_for("the first turn ended", lambda: len(ended) == 1)
                await wait_for("two renewals more", renewals_after(ended[0] + 2))
                second_ends.set()
            await wait_for("two renewals after the last end", renewals_after(ended[1] + 2))
            while_second_ran = port.carried[ended[0] : ended[1] - 1]
            assert len(while_second_ran) >= 2 and all("s" in x for x in while_second_ran)
            assert port.carried[ended[1] - 1] == {"s"}  # the renewal made as the last turn ended
            assert all("s" not in x for x in port.carried[ended[1] :])
            assert w.renewals == len(port.carried)  # each renewal counted once


async def test_a_relays_turn_ending_while_a_renewal_waits_for_an_engine_is_reported() -> None:
    """A renewal tick first asks the engines about the requests whose end they did not
    confirm (a cancelled turn's), and may wait there. A relay's turn that ends meanwhile is
    still carried by the renewal its end makes: the sessions reported as running at the tick
    and the sessions touched since the last renewal stay two sets, so the end of a turn is
    never dropped from what the ledger counts a client-held session's idleness from."""
    async with rig(timeout=60, wrap=KeepsRunning) as r:
        r.gateway.abort_timeout_s = 30.0  # the renewal's question waits for the engine
        await r.publish(1)
        for engine in r.local.values():
            engine.pause_generation()
            r.fleet[engine.engine_id].unconfirmable = True  # type: ignore[attr-defined]
        port = RenewalLog(r.ledger)
        async with RolloutWorker.open(
            port, r.gateway, owner="relay", sessions_idle_s=60.0, renew_every=0.01
        ) as w:
            inside, ends = anyio.Event(), anyio.Event()
            ended: list[int] = []  # how many renewals had been made when the turn had ended

            async def hold() -> None:
                async with w.session("s").turn():
                    inside.set()
                    await ends.wait()
                ended.append(len(port.carried))

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await inside.wait()
                cancelled = anyio.CancelScope()

                async def cancelled_turn() -> None:
                    with cancelled:
                        await w.session("a").generate(PROMPT, LONG)

                tg.start_soon(cancelled_turn)
                await wait_for("the cancelled turn in flight", lambda: bool(w.inflight.counts()))
                ((busy, _),) = w.inflight.counts()
                member = r.fleet[busy]
                assert isinstance(member, KeepsRunning)
                engine_confirms = member.abort_lands
                cancelled.cancel()
                await wait_for("its count held", lambda: r.gateway.unconfirmed == 1)
                asked = len(member.aborts)
                member.unconfirmable = False  # the next tick's question waits for the engine
                await wait_for("a renewal tick waiting", lambda: len(member.aborts) > asked)
                ends.set()
            assert port.carried[ended[0] - 1] == {"s"}  # the renewal made as the turn ended
            engine_confirms.set()
            await wait_for("the held count ended", lambda: not w.inflight.counts())
            for engine in r.local.values():
                engine.continue_generation()


class RefusedRenewals(RenewalLog):
    """As :class:`RenewalLog`, with the next ``refusals`` renewals failing with ``refusal``
    (by default LEDGER_CLOSED, a ledger stepping down: not a word about the owner's life)."""

    refusals = 0
    refusal: Exception = LedgerError(Code.LEDGER_CLOSED, "the ledger is closing")

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
        secret: str = "",
    ) -> None:
        if self.refusals:
            self.refusals -= 1
            raise self.refusal
        super().renew_lease(
            owner, inflight, incarnation=incarnation, sessions=sessions, secret=secret
        )


async def test_a_renewal_refused_for_another_reason_than_the_owner_is_tried_again() -> None:
    """Only an owner-ending refusal stops the renewals: any other, and a lost reply, is logged
    and the next tick renews again (stopping would let a live worker's lease expire)."""
    async with rig() as r:
        port = RefusedRenewals(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1", renew_every=0.01) as w:
            for refusal in (port.refusal, OSError("the reply was lost")):
                port.refusal, port.refusals = refusal, 3
                await wait_for("the refusals heard", lambda: port.refusals == 0)
                seen = len(port.carried)
                await wait_for("a renewal after them", lambda: len(port.carried) > seen)  # noqa: B023
            assert w.lost is None


async def test_a_workers_defaults_are_the_documented_ones() -> None:
    async with rig() as r:
        direct = RolloutWorker(r.ledger, r.gateway, owner="direct")
        async with worker_on(r, "opened") as opened:
            for w in (direct, opened):
                assert (w.ttl_s, w.renew_every, w.forget_batch) == (30.0, 10.0, 256)
                assert (w.idle_release_s, w.idle_tombstone_s) == (0.0, 86400.0)


class Confirming(Port):
    """The port of a remote ledger (``ConfirmsLeases``): records each confirmation and
    answers it with ``refusal`` when set, as the ledger would."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.confirmed: list[tuple[str, str, str]] = []
        self.refusal: LoraLedgerError | None = None

    async def confirm_lease(self, owner: str, *, incarnation: str = "", secret: str = "") -> None:
        self.confirmed.append((owner, incarnation, secret))
        if self.refusal is not None:
            raise self.refusal


async def test_a_turn_is_confirmed_for_its_life_and_only_an_owners_end_ends_it() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Confirming(r.ledger)
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            s = w.session("s")
            await s.generate(PROMPT, SHORT)
            assert port.confirmed == [("w1", w.incarnation, w.secret)]
            port.refusal = LedgerError(Code.LEDGER_CLOSED, "the ledger is stopping")
            with pytest.raises(LoraLedgerError) as passing:
                await s.generate(PROMPT, SHORT)
            assert passing.value is port.refusal and w.lost is None  # not the owner's end
            port.refusal = LedgerError(Code.OWNER_RESTARTED, "replaced", owner="w1")
            with pytest.raises(LoraLedgerError):
                await s.generate(PROMPT, SHORT)
            assert w.lost is not None and w.lost.code == Code.OWNER_RESTARTED


async def test_a_bind_the_ledger_refuses_for_a_lost_owner_hears_the_workers_word() -> None:
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        port.gate = anyio.Event()
        async with RolloutWorker.open(
            port, r.gateway, owner="w1", ttl_s=10.0, renew_every=3600
        ) as w:
            s = w.session("s")
            heard: list[BaseException] = []

            async def bind() -> None:
                try:
                    await s.bind()
                except LoraLedgerError as exc:
                    heard.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(bind)
                await wait_for("the bind held at the port", lambda: port.waiting == 1)
                r.clock.advance(11.0)
                await r.ledger.expire_leases()  # while the bind was on its way
                port.gate.set()
            (error,) = heard
            assert error is w.lost and error.code == Code.LEASE_EXPIRED


async def test_deregistering_ends_the_life_or_says_why_it_could_not() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1", deregister_on_exit=False) as w:
            assert await w.deregister() is not None and w.deregistered is not None
            assert w.lost is not None and w.lost.code == Code.OWNER_DEREGISTERED
            assert w.lost.details == {"owner": "w1"}
            assert w.lost.message == (
                f"rollout worker w1 deregistered (incarnation {w.incarnation}): "
                "open a new worker to act again"
            )
        # a newer life of w2 registers; the old one has not heard yet
        async with worker_on(r, "w2", deregister_on_exit=False) as w2, worker_on(r, "w2"):
            assert await w2.deregister() is None
            assert w2.lost is not None and w2.lost.code == Code.OWNER_RESTARTED

        class Unreachable(Port):
            def __init__(self, ledger: Ledger, error: Exception) -> None:
                super().__init__(ledger)
                self.error = error

            async def deregister_owner(
                self, owner: str, *, incarnation: str = "", secret: str = ""
            ) -> Deregistered:
                raise self.error

        fast = RetryPolicy(attempts=2, first_delay=0.0)
        lost = Unreachable(r.ledger, ConnectionResetError("reply lost"))
        async with RolloutWorker.open(lost, r.gateway, owner="w3", retry=fast) as w3:
            pass  # an unreachable ledger: logged, the lease left to expire
        assert w3.deregistered is None and w3.lost is None
        broken = Unreachable(r.ledger, RuntimeError("a bug"))
        raised = False
        try:  # not a lost reply: a bug, raised
            async with RolloutWorker.open(broken, r.gateway, owner="w4", retry=fast):
                pass
        except* RuntimeError:
            raised = True
        assert raised


async def test_every_forgotten_tombstone_is_counted_once_across_batches() -> None:
    async with rig() as r, worker_on(r, forget_batch=2) as w:
        await r.publish(1)
        await w.close_many([w.session(f"s{i}") for i in range(3)])  # starts a forget
        await w.flush_forgets()
        await wait_for("every tombstone forgotten", lambda: w.unforgotten == 0)
        assert w.forgotten == 3
        await w.session("s3").close()
        assert await w.flush_forgets() == 1 and w.forgotten == 4


async def test_a_turn_sharing_a_bind_made_for_another_version_asks_again() -> None:
    """A bind in flight is shared whatever it expects: refused for the version the first turn
    named (``VERSION_NOT_BOUND``), a turn that names none asks again and binds the default."""
    async with rig() as r:
        await r.publish(1)
        port = Port(r.ledger)
        port.gate = anyio.Event()
        async with RolloutWorker.open(port, r.gateway, owner="w1") as w:
            s = w.session("s")
            heard: list[object] = []

            async def turn(expect: int | None) -> None:
                try:
                    async with s.turn(expect_version=expect) as bound:
                        heard.append((expect, bound.version_id))
                except LoraLedgerError as exc:
                    heard.append((expect, exc.code))

            async with anyio.create_task_group() as tg:
                tg.start_soon(turn, 7)
                await wait_for("the bind held at the port", lambda: port.waiting == 1)
                tg.start_soon(turn, None)
                await wait_for("both turns in", lambda: s.in_flight == 2)
                port.gate.set()
            assert sorted(heard, key=str) == sorted(
                [(7, Code.VERSION_NOT_BOUND), (None, 1)], key=str
            )


RELAY_BOUNDS = (
    "sessions_idle_s must be finite and >= 0, without idle_release_s (a relay's sessions are "
    "released for idleness by the ledger's process)"
)
LEASE_BOUNDS = "ttl_s must be > 0 and forget_batch >= 1"
IDLE_BOUNDS = "idle_release_s and idle_tombstone_s must be finite and >= 0"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sessions_idle_s": -1.0}, RELAY_BOUNDS),
        ({"sessions_idle_s": math.inf}, RELAY_BOUNDS),
        ({"sessions_idle_s": 60.0, "idle_release_s": 1.0}, RELAY_BOUNDS),
        ({"ttl_s": 0.0}, LEASE_BOUNDS),
        ({"ttl_s": math.inf}, LEASE_BOUNDS),
        ({"forget_batch": 0}, LEASE_BOUNDS),
        ({"idle_release_s": -1.0}, IDLE_BOUNDS),
        ({"idle_release_s": math.inf}, IDLE_BOUNDS),
        ({"idle_tombstone_s": -1.0}, IDLE_BOUNDS),
        ({"idle_tombstone_s": math.inf}, IDLE_BOUNDS),
    ],
)
def test_a_worker_refuses_settings_out_of_bounds_naming_them(
    settings: dict[str, float], message: str
) -> None:
    with pytest.raises(LoraLedgerError) as info:
        RolloutWorker(object(), object(), owner="w", **settings)  # type: ignore[arg-type]
    assert (info.value.code, info.value.message) == ("INVALID_INPUT", message)


def test_a_worker_takes_every_setting_at_its_bound() -> None:
    for settings in (
        {"sessions_idle_s": 0.0},
        {"ttl_s": 0.001, "forget_batch": 1},
        {"idle_release_s": 0.0, "idle_tombstone_s": 0.0},
    ):
        w = RolloutWorker(object(), object(), owner="w", **settings)  # type: ignore[arg-type]
        assert w.deregister_on_exit  # and a clean exit deregisters, by default


def test_a_worker_takes_the_life_it_is_given_or_makes_one() -> None:
    given = RolloutWorker(
        object(),  # type: ignore[arg-type]
        object(),  # type: ignore[arg-type]
        owner="w",
        incarnation="inc-1",
        secret="secret-1",
        renew_every=5.0,
    )
    assert (given.incarnation, given.secret, given.renew_every) == ("inc-1", "secret-1", 5.0)
    made = RolloutWorker(object(), object(), owner="w")  # type: ignore[arg-type]
    assert len(made.secret) == 64 and int(made.secret, 16) >= 0  # 32 random bytes, in hex
    assert made.incarnation != RolloutWorker(object(), object(), owner="w").incarnation  # type: ignore[arg-type]
    assert (made.renewals, made.forgotten, made.idle_releases) == (0, 0, 0)


async def test_turn_labels_count_from_zero_and_move_past_a_label_given() -> None:
    async with rig() as r, worker_on(r) as w:
        s = w.session("s")
        assert [s.next_turn(), s.next_turn()] == [0, 1]
        assert s.next_turn(5) == 5 and s.next_turn() == 6
        assert s.next_turn(2) == 2 and s.next_turn() == 7  # a retry of an old turn


async def test_a_worker_whose_block_ended_starts_nothing_and_says_so() -> None:
    async with rig() as r:
        await r.publish(1)
        async with worker_on(r, "w1", deregister_on_exit=False) as w:
            s = w.session("s")
        with pytest.raises(LoraLedgerError) as info:  # its lease still runs: not lost, stopped
            await s.bind()
        assert (info.value.code, info.value.message) == (
            Code.LEDGER_CLOSED,
            "rollout worker w1 is not running",
        )
