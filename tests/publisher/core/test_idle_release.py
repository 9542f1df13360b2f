"""The ledger's idle release of client-held sessions, on a real ledger with an injected clock:
the faces report the sessions they had a turn of with their lease renewals (soft state, never
logged); the ledger's process releases a session that had none for its idle bound, whichever
face bound it and whether or not any face still runs; after a restart every client-held session
gets a full idle bound of grace; the tombstones of its idle releases are forgotten a retention
period later, so the projection stays bounded.

Before, only the face that bound a session could release it for idleness (its own
``RolloutWorker``), measured on the turns it served: a session whose face was gone stayed bound
until that face's owner life ended, which released it as ``owner_exited`` or ``lease_expired``
whatever its client was doing."""

from __future__ import annotations

import pytest

from evlog.errors import LoraLedgerError
from evlog.events import SessionReleased, SessionsForgotten
from evlog.memory import MemoryStore
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from tests.publisher.core.test_ledger import FakeClock, bootstrap
from tests.support.ledger import publish
from tests.support.log import events_of

pytestmark = pytest.mark.anyio


async def test_a_session_idle_past_its_bound_is_released_by_the_ledgers_process() -> None:
    clock = FakeClock()
    store = MemoryStore()
    async with Ledger.open(store, clock=clock, watch_every_s=None) as ledger:
        await bootstrap(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("face", ttl_s=30.0, incarnation="a", sessions_idle_s=60.0)
        await ledger.register_owner("worker", ttl_s=1e6)  # owner-held: never idle-released
        for session in ("quiet", "busy", "gone-face"):
            await ledger.bind(session, "face", incarnation="a")
        await ledger.bind("owned", "worker")
        assert await ledger.release_idle_sessions() == 0  # first sight: its grace starts
        # the face stops (cleanly): its sessions stay bound, and the ledger still watches them
        await ledger.deregister_owner("face", incarnation="a")
        await ledger.register_owner("face", ttl_s=30.0, incarnation="b", sessions_idle_s=60.0)
        clock.now += 40
        ledger.renew_lease("face", incarnation="b", sessions=["busy", "unknown", "owned"])
        clock.now += 30  # 70 s after first sight, 30 s after busy's last turn
        assert await ledger.release_idle_sessions() == 2
        released = {e.session: e for e in await events_of(ledger, SessionReleased)}
        assert set(released) == {"quiet", "gone-face"}
        assert released["quiet"] == SessionReleased(
            session="quiet", owner="face", version_id=1, cause="idle", last_turn=1000.0,
            idle_s=60.0, at=1070.0,
        )  # fmt: skip
        assert set(ledger.state.sessions) == {"busy", "owned"}
        assert len(ledger.activity) == 1  # only busy is watched now (owned never was)
        with pytest.raises(LoraLedgerError) as late:
            await ledger.bind("quiet", "face", incarnation="b")
        assert late.value.code == Code.SESSION_CLOSED and late.value.details["cause"] == "idle"
        # renewals that name sessions must name them as strings
        with pytest.raises(LoraLedgerError) as bad:
            ledger.renew_lease("face", incarnation="b", sessions=[3])  # type: ignore[list-item]
        assert bad.value.code == Code.INVALID_INPUT

    # A restart of the ledger's process: "busy" is not released at once (its last turn is
    # not in the log), but a full idle bound after the restart.
    clock.now += 1000
    async with Ledger.open(store, clock=clock, watch_every_s=None) as ledger:
        assert await ledger.release_idle_sessions() == 0
        clock.now += 59
        assert await ledger.release_idle_sessions() == 0
        clock.now += 2
        assert await ledger.release_idle_sessions() == 1
        assert set(ledger.state.sessions) == {"owned"}
        # the tombstones are kept for the retention (a day), then forgotten
        assert await ledger.release_idle_sessions(tombstone_s=2000.0) == 0
        assert set(ledger.state.idle_released) == {"quiet", "gone-face", "busy"}
        clock.now += 1000  # quiet and gone-face were released 2061 s ago, busy 1000 s ago
        await ledger.release_idle_sessions(tombstone_s=2000.0)
        assert set(ledger.state.idle_released) == {"busy"}
        assert set(ledger.state.tombstones) == {"busy"}
        forgotten = await events_of(ledger, SessionsForgotten)
        assert [set(e.sessions) for e in forgotten] == [{"quiet", "gone-face"}]
