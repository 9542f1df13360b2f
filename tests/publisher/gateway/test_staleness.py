"""The staleness bound (docs/sessions.md#staleness) on real local engines and a real ledger:
a long session is refused at the turn after the default moved more than ``max_staleness``
versions past its own, the refusal is recorded (released, cause ``too_stale``), nothing is
dispatched, and its version becomes reclaimable; off by default, nothing changes."""

from __future__ import annotations

import pytest

from evlog.errors import LoraLedgerError
from evlog.events import DeploymentConfigured, SessionReleased
from projections.registry import VersionState
from publisher.core.errors import Code
from publisher.core.outcomes import Bound
from publisher.sessions import RolloutWorker, SessionBinder
from tests.publisher.rollout_kit import ENGINE_WARNINGS, PROMPT, SHORT, Recording, rig
from tests.support.log import events_of

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


async def test_a_long_session_is_refused_at_the_right_turn_and_its_version_reclaimed() -> None:
    async with rig(wrap=Recording) as r:
        await r.ledger.configure_deployment(max_staleness=2)
        await r.publish(1)
        async with RolloutWorker.open(r.ledger, r.gateway, owner="w1") as w:
            long = w.session("long")
            first = await long.generate(PROMPT, SHORT)
            assert (first.version_id, first.staleness, long.staleness) == (1, 0, 0)
            await r.publish(2)
            await r.publish(3)  # two versions behind: still within the bound
            assert long.staleness == 2 and r.gateway.staleness(first_bound(long)) == 2
            served = await long.generate(PROMPT, SHORT)
            assert (served.version_id, served.staleness) == (1, 2)
            await r.publish(4)  # three behind: the next turn is refused before dispatch
            assert long.staleness == 3
            sent = sum(len(e.calls) for e in r.fleet)  # type: ignore[attr-defined, misc]
            with pytest.raises(LoraLedgerError) as info:
                await long.generate(PROMPT, SHORT)
            refusal = info.value
            assert refusal.code == Code.SESSION_TOO_STALE
            assert refusal.details == {
                "session": first_bound(long).session,
                "version_id": 1,
                "staleness": 3,
                "max_staleness": 2,
            }
            assert refusal.message == (
                f"session {first_bound(long).session} is bound to version 1, 3 versions behind "
                "the default (max_staleness 2): drop or restart the episode under a new session id"
            )
            assert sum(len(e.calls) for e in r.fleet) == sent  # type: ignore[attr-defined, misc]
            # Recorded: released as too stale, once; later turns hear the same refusal.
            released = await events_of(r.store, SessionReleased)
            assert [(e.session, e.version_id, e.cause) for e in released] == [
                ("long", 1, "too_stale")
            ]
            with pytest.raises(LoraLedgerError) as again:
                await long.generate(PROMPT, SHORT)
            assert again.value.code == Code.SESSION_TOO_STALE
            assert len(await events_of(r.store, SessionReleased)) == 1
            # A fresh session binds the default and serves.
            fresh = await w.session("fresh").generate(PROMPT, SHORT)
            assert (fresh.version_id, fresh.staleness) == (4, 0)
        # The refused session no longer pins version 1: reclaim takes it.
        assert r.ledger.state.versions[1].bound == 0
        assert 1 in await r.reclaimer().sweep()
        assert r.ledger.state.versions[1].state is VersionState.RECLAIMED


def first_bound(binder: SessionBinder) -> Bound:
    assert binder.bound is not None
    return binder.bound


async def test_off_by_default_a_session_serves_however_far_behind() -> None:
    async with rig() as r:
        await r.publish(1)
        async with RolloutWorker.open(r.ledger, r.gateway, owner="w1") as w:
            long = w.session("long")
            await long.generate(PROMPT, SHORT)
            for version in range(2, 7):
                await r.publish(version)
            served = await long.generate(PROMPT, SHORT)
            assert (served.version_id, served.staleness) == (1, 5)
        assert r.ledger.state.max_staleness is None
        assert await events_of(r.store, DeploymentConfigured) == []
        # released only by the worker's clean exit (it never closed "long"), never as too stale
        assert [e.cause for e in await events_of(r.store, SessionReleased)] == ["owner_exited"]


async def test_the_setting_is_recorded_once_and_a_false_too_stale_release_is_refused() -> None:
    async with rig() as r:
        await r.ledger.configure_deployment(max_staleness=1)
        assert (await r.ledger.configure_deployment(max_staleness=1)).no_op
        with pytest.raises(LoraLedgerError) as bad:
            await r.ledger.configure_deployment(max_staleness=-1)
        assert bad.value.code == Code.INVALID_INPUT
        assert [e.max_staleness for e in await events_of(r.store, DeploymentConfigured)] == [1]
        await r.publish(1)
        await r.ledger.register_owner("w1", ttl_s=30.0)
        await r.ledger.bind("s", "w1")
        # Not stale at all: a release claiming too_stale would make the log lie.
        with pytest.raises(LoraLedgerError) as lie:
            await r.ledger.release("s", "w1", cause="too_stale")
        assert lie.value.code == Code.INVALID_INPUT
        assert "s" in r.ledger.state.sessions


class PublishesThenRefuses(Recording):
    """A double for an engine that restarted empty behind routing's back: it refuses the name
    cleanly (``NOT_LOADED``, nothing run), so the gateway tries another holder; before it
    answers, the trainer publishes (``during``), as happens when the refusal is slow."""

    during: list[object] = []

    async def generate(self, prompt, lora_name, *args, **kw):  # type: ignore[no-untyped-def]
        from engines.contract import CleanRefusal, ErrorCode

        self.calls.append({"lora_name": lora_name, "request_id": kw.get("request_id")})
        for step in self.during:
            await step()  # type: ignore[operator]
        self.during.clear()
        raise CleanRefusal(ErrorCode.NOT_LOADED, f"{lora_name} is not loaded", engine_id="e0")


async def test_a_try_on_another_holder_is_checked_against_the_bound_again() -> None:
    """Found by the simulation (seed 137): the bound was checked once, before the first try;
    versions published while that try failed made the retry on another holder serve beyond
    ``max_staleness``. Now every try is checked, and the session is released as too stale."""
    from publisher.gateway.affinity import rendezvous

    wrap = lambda e: PublishesThenRefuses(e) if e.engine_id == "e0" else Recording(e)  # noqa: E731
    async with rig(wrap=wrap) as r:
        await r.ledger.configure_deployment(max_staleness=1)
        await r.publish(1)
        session = next(
            s for s in (f"s{i}" for i in range(1000)) if rendezvous(s, ("e0", "e1")) == "e0"
        )
        async with RolloutWorker.open(r.ledger, r.gateway, owner="w1") as w:
            binder = w.session(session)
            await binder.bind()
            PublishesThenRefuses.during[:] = [lambda: r.publish(2), lambda: r.publish(3)]
            with pytest.raises(LoraLedgerError) as info:
                await binder.generate(PROMPT, SHORT)
            assert info.value.code == Code.SESSION_TOO_STALE
            e1 = r.fleet["e1"]
            assert isinstance(e1, Recording) and e1.calls == []  # the retry was never sent
            released = await events_of(r.store, SessionReleased)
            assert [(e.session, e.cause) for e in released] == [(session, "too_stale")]
