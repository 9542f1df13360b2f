"""Rollout actors on a real local Ray instance, against a real ledger actor and its SQLite log:
a rollout actor connects once (``RayRollout``) and calls from any method; Ray restarting it
(``max_restarts``) is a new incarnation of its owner id, so the ledger releases the sessions of
the life that died at once (no waiting for its lease) and the version they pinned becomes
reclaimable; a clean shutdown deregisters, which the incident report does not list, while a
rollout actor killed without one still shows up as a lease expiry."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

from evlog.errors import LoraLedgerError
from evlog.events import OwnerDeregistered, OwnerLeaseExpired, OwnerRegistered, SessionReleased
from evlog.record import Record
from projections.incidents import incidents
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.outcomes import Deregistered, ReclaimGranted
from publisher.ray.client import RayLedger
from publisher.ray.rollout import RayRollout
from tests.publisher.ray.kit import create
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.logfile import open_log

pytestmark = pytest.mark.anyio


class RolloutProbe:
    """A rollout actor as a user writes one: a ``RayRollout`` made in ``__init__`` (eagerly,
    so a restart by Ray registers its new incarnation at once), used from several methods."""

    def __init__(self, owner: str, ledger: str, ttl_s: float, connect: str) -> None:
        self.rollout = RayRollout(
            owner,
            [],  # binding and releasing need no engine; generation is the acceptance test's
            ledger=ledger,
            connect=connect,  # type: ignore[arg-type]
            client_options={"renew_interval": 0.05},
            worker_options={"ttl_s": ttl_s},
        )

    async def bind(self, sessions: list[str]) -> list[int]:
        return [(await self.rollout.bind(s)).version_id for s in sessions]

    async def close_session(self, session: str) -> bool:
        return (await self.rollout.close_session(session)).released

    async def life(self) -> tuple[int, str | None]:
        return os.getpid(), self.rollout.incarnation

    async def shutdown(self) -> int | None:
        deregistered = await self.rollout.close()
        return None if deregistered is None else deregistered.released


def _probe(owner: str, ledger: str, *, ttl_s: float, restarts: int, connect: str) -> Any:
    return (
        ray.remote(RolloutProbe)
        .options(num_cpus=0, max_restarts=restarts, max_task_retries=0)
        .remote(owner, ledger, ttl_s, connect)
    )


async def _records(path: Path) -> list[Record]:
    async with open_log(path) as store:
        return [record async for record in store.iterate(after=0)]


async def test_a_rollout_actor_restarted_by_ray_releases_its_predecessors_sessions(
    ledger_factory: Any,
) -> None:
    lut = ledger_factory(lease_check_s=0.2)
    async with RayLedger.connect(lut.name) as driver:
        await create(driver)
        await publish(driver, 1)
        # a ttl of ten minutes: nothing below can be the lease expiry's doing
        actor = _probe("w1", lut.name, ttl_s=600.0, restarts=1, connect="eager")
        try:
            pid, first = await actor.life.remote()
            assert await actor.bind.remote(["s1", "s2"]) == [1, 1]
            assert (await actor.life.remote()) == (pid, first)  # connected once, same life
            await publish(driver, 2)  # v1 RETIRED, pinned by s1 and s2
            with pytest.raises(LoraLedgerError) as pinned:
                await driver.execute(c.ClaimReclaim(version_id=1))
            assert pinned.value.code == Code.NOT_RECLAIMABLE
            assert "2 sessions bound" in pinned.value.message

            ray.kill(actor, no_restart=False)  # a crash: Ray restarts it (max_restarts=1)
            with anyio.fail_after(60):
                while True:
                    try:
                        again, second = await actor.life.remote()
                    except ray.exceptions.RayActorError:
                        await anyio.sleep(0.1)  # restarting
                        continue
                    if again != pid:
                        break
                    await anyio.sleep(0.1)
            assert second is not None and second != first
            # the new life registered in its __init__: v1 is reclaimable now, long before
            # the dead life's ten-minute lease could run out
            with anyio.fail_after(10):
                while (await driver.status()).sessions_bound:  # noqa: ASYNC110 -- a remote count
                    await anyio.sleep(0.05)
            granted = await driver.execute(c.ClaimReclaim(version_id=1))
            assert isinstance(granted, ReclaimGranted)
            # the restarted actor works, on the new default, and its old sessions stay closed
            assert await actor.bind.remote(["s3"]) == [2]
            with pytest.raises(ray.exceptions.RayTaskError) as closed:
                await actor.bind.remote(["s1"])
            cause = closed.value.cause
            assert isinstance(cause, LoraLedgerError) and cause.code == Code.SESSION_CLOSED
        finally:
            ray.kill(actor, no_restart=True)

    records = await _records(Path(lut.config.path))
    registered = [r.event for r in records if isinstance(r.event, OwnerRegistered)]
    assert [(e.incarnation, e.replaced) for e in registered] == [(first, None), (second, first)]
    released = {
        r.event.session: r.event.cause for r in records if isinstance(r.event, SessionReleased)
    }
    assert released == {"s1": "owner_restarted", "s2": "owner_restarted"}
    assert not any(isinstance(r.event, OwnerLeaseExpired) for r in records)
    found = incidents(records)
    restarts = [i for i in found if i.kind == "owner_restarted"]
    assert len(restarts) == 1 and "2 sessions released" in restarts[0].summary
    assert not [i for i in found if i.kind == "lease_expired"]


async def test_a_clean_shutdown_is_not_an_incident_and_a_killed_actor_still_is(
    ledger_factory: Any,
) -> None:
    lut = ledger_factory(lease_check_s=0.1)
    async with RayLedger.connect(lut.name) as driver:
        await create(driver)
        await publish(driver, 1)
        clean = _probe("clean", lut.name, ttl_s=1.0, restarts=0, connect="lazy")
        killed = _probe("killed", lut.name, ttl_s=1.0, restarts=0, connect="lazy")
        try:
            _, incarnation = await clean.life.remote()
            assert incarnation is None  # lazy: nothing connected before the first call
            # several methods, one connection (one registration, below)
            assert await clean.bind.remote(["c1", "c2", "c3"]) == [1, 1, 1]
            assert await clean.close_session.remote("c1")
            assert await clean.bind.remote(["c4"]) == [1]
            assert await killed.bind.remote(["k1"]) == [1]
            assert await clean.shutdown.remote() == 3  # c2, c3 and c4 were still bound
            assert await clean.shutdown.remote() is None  # idempotent
            ray.kill(killed, no_restart=True)  # no shutdown: only its lease can end it
            with anyio.fail_after(20):
                while (await driver.status()).sessions_bound:  # noqa: ASYNC110 -- a remote count
                    await anyio.sleep(0.1)
            await anyio.sleep(2.5)  # > 2 ttls: an expiry of "clean" would have happened
        finally:
            ray.kill(clean, no_restart=True)
            ray.kill(killed, no_restart=True)

    records = await _records(Path(lut.config.path))
    registered = [r.event.owner for r in records if isinstance(r.event, OwnerRegistered)]
    assert sorted(registered) == ["clean", "killed"]  # each connected once
    ended = [(type(r.event).__name__, r.event.owner) for r in records
             if isinstance(r.event, OwnerDeregistered | OwnerLeaseExpired)]  # fmt: skip
    assert sorted(ended) == [("OwnerDeregistered", "clean"), ("OwnerLeaseExpired", "killed")]
    causes = {
        r.event.session: r.event.cause for r in records if isinstance(r.event, SessionReleased)
    }
    assert causes == {
        "c1": "closed",
        "c2": "owner_exited",
        "c3": "owner_exited",
        "c4": "owner_exited",
        "k1": "lease_expired",
    }
    found = incidents(records)
    assert [i.subject for i in found if i.kind == "lease_expired"] == ["owner killed"]
    assert not any("clean" in i.subject for i in found)


async def test_a_close_during_a_lazy_connect_ends_the_connection_it_waited_for(
    ledger_factory: Any,
) -> None:
    """``close()`` while the first call is still connecting: the close must not return before
    there is nothing left to end. It returned at once, the connect finished after it, and the
    owner stayed registered and renewing with nothing left to deregister it."""
    lut = ledger_factory()
    async with RayLedger.connect(lut.name) as driver:
        await create(driver)
    # The ledger goes away: a lazy connect (its link looking the name up again and again)
    # stays under way until the ledger is back.
    ray.kill(lut.handle, no_restart=True)
    rollout = RayRollout("racer", [], ledger=lut.name, on_dead=None)
    outcomes: dict[str, Any] = {}

    async def first_call() -> None:
        try:
            outcomes["bind"] = await rollout.bind("s1")
        except LoraLedgerError as exc:
            outcomes["bind"] = exc.code

    async def close() -> None:
        outcomes["close"] = await rollout.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first_call)
        await wait_for(
            "the lazy connect to be under way",
            lambda: rollout._opening is not None and rollout._opening.locked(),
        )
        tg.start_soon(close)
        await anyio.to_thread.run_sync(lut.restart)  # the same log under the same name
    assert outcomes["bind"] == Code.LEDGER_CLOSED  # overtaken by the close: nothing was bound
    assert isinstance(outcomes["close"], Deregistered)  # the close ended what the connect made
    assert not rollout.connected
    async with RayLedger.connect(lut.name) as driver:
        status = await driver.status()
    assert (status.owners, status.sessions_bound) == (0, 0)
    records = await _records(Path(lut.config.path))
    lives = [
        type(r.event).__name__
        for r in records
        if isinstance(r.event, OwnerRegistered | OwnerDeregistered | OwnerLeaseExpired)
    ]
    assert lives == ["OwnerRegistered", "OwnerDeregistered"]


async def test_a_clients_clean_exit_deregisters_the_owners_it_registered(
    ledger_factory: Any,
) -> None:
    """Without a RolloutWorker (owners registered on the client itself): leaving
    ``RayLedger.connect`` normally ends them too, unless told to keep them."""
    lut = ledger_factory()
    async with RayLedger.connect(lut.name) as driver:
        await create(driver)
        await publish(driver, 1)
        async with RayLedger.connect(lut.name) as client:
            await client.register_owner("direct", ttl_s=600.0, incarnation="d")
            await client.bind("d1", "direct", incarnation="d")
        assert (await driver.status()).sessions_bound == 0
        async with RayLedger.connect(lut.name, deregister_on_exit=False) as client:
            await client.register_owner("kept", ttl_s=600.0, incarnation="k")
            await client.bind("k1", "kept", incarnation="k")
        assert (await driver.status()).sessions_bound == 1  # kept for a later process
    records = await _records(Path(lut.config.path))
    ended = [r.event.owner for r in records if isinstance(r.event, OwnerDeregistered)]
    assert ended == ["direct"]
    causes = {
        r.event.session: r.event.cause for r in records if isinstance(r.event, SessionReleased)
    }
    assert causes == {"d1": "owner_exited"}
