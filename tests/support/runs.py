"""Runs with injected failures, written by the real ledger on real SQLite files: the fault run
(below), the health run (:func:`write_health_run`) and the repeat run (:func:`write_repeat_run`).

The projections and the tools are tested on logs the ledger itself wrote (not on hand-made
events), so a change in what the ledger records is caught there too. The clock is injected, so
every ``recorded_at`` is known and the expected incidents, timelines and audits can be stated
exactly. The fault run:

====== ===================================================================================
 t (s)  what happens
====== ===================================================================================
 1000   deployment ``dep`` (capacity 3), engines e0, e1 join and are repaired
 1001   owners w1 (ttl 30 s) and w2 (ttl 5 s) register; v1 published (revision 1)
 1002   s-a, s-b (w1) and s-c (w2) bind to v1
 1005   v2 attempt 1: e0 PREPARED, a stale receipt from e1 is REJECTED (ENGINE_RESTARTED),
        then the attempt fails cleanly (absent everywhere)
 1010   v2 attempt 2 published (revision 2): v1 RETIRED with s-a, s-b, s-c still bound
 1011   s-d (w1) binds to v2
 1020   s-a released
 1040   w2's lease expires: s-c released (lease_expired)
 1100   s-b released: v1 reclaimable; 1101 v1 reclaimed (unloaded on e0 and e1)
 1110   v3 attempt 1 ends AMBIGUOUS (timeout): FAILED_FATAL
 1200   inventories of e0 and e1 prove v3 absent: fatal resolved (90 s FAILED_FATAL: stuck)
 1210   v3 attempt 2 published (revision 3): v2 RETIRED, s-d still bound (never released)
 1220   v4 published (revision 4): v3 RETIRED, unbound
 1230   v5 skipped: capacity 3 is full (v2, v3, v4)
 1300   e1 restarts (e1-i2): v2 and v4 restored on it, e1 repaired at 1305
 1310   v3 reclaim: e0 unloads, e1's unload is AMBIGUOUS; 1320 e1's inventory proves it gone
 1400   owner w3 registers (the last record)
====== ===================================================================================
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from evlog.errors import LoraLedgerError
from evlog.record import Record
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Allocated
from tests.support.ledger import digest, publish


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def reclaim(ledger: Ledger, version_id: int) -> None:
    await ledger.claim_reclaim(version_id, ledger.inflight_evidence(version_id))
    for engine, member in sorted(ledger.state.engines.items()):
        await ledger.record_unloaded(version_id, engine, member.incarnation)


async def write_fault_run(path: Path) -> Path:
    """Write the run above to ``path`` (a fresh SQLite file) and return it."""
    clock = Clock(1000.0)
    async with SQLiteStore.open(path) as store, Ledger.open(store, clock=clock) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=3, fleet=("e0", "e1"))
        for engine in ("e0", "e1"):
            await ledger.join_engine(engine, f"{engine}-i1")
            await ledger.repair_engine(engine, f"{engine}-i1")
        clock.now = 1001.0
        await ledger.register_owner("w1", ttl_s=30.0)
        await ledger.register_owner("w2", ttl_s=5.0)
        await publish(ledger, 1)
        clock.now = 1002.0
        for session, owner in (("s-a", "w1"), ("s-b", "w1"), ("s-c", "w2")):
            await ledger.bind(session, owner)

        clock.now = 1005.0
        v2 = await ledger.allocate(2, digest(2))
        assert isinstance(v2, Allocated), v2
        await ledger.claim_transport(2, v2.attempt, "trainer")
        await ledger.record_prepared(2, 1, "e0", "e0-i1", v2.digest, v2.lora_name)
        with pytest.raises(LoraLedgerError, match="ENGINE_RESTARTED"):
            await ledger.record_ready(2, 1, "e1", "e1-i0", v2.digest, v2.lora_name)
        await ledger.fail_attempt(
            2, 1, clean=True, code="LOAD_REFUSED", reason="e1 refused", absent_on=("e0", "e1")
        )
        clock.now = 1010.0
        await publish(ledger, 2)
        clock.now = 1011.0
        await ledger.bind("s-d", "w1")

        clock.now = 1020.0
        await ledger.release("s-a", "w1")
        clock.now = 1040.0
        ledger.renew_lease("w1")
        expired = await ledger.expire_leases()
        assert [e.owner for e in expired] == ["w2"], expired
        clock.now = 1100.0
        await ledger.release("s-b", "w1")
        clock.now = 1101.0
        await reclaim(ledger, 1)

        clock.now = 1110.0
        v3 = await ledger.allocate(3, digest(3))
        assert isinstance(v3, Allocated), v3
        await ledger.claim_transport(3, v3.attempt, "trainer")
        await ledger.fail_attempt(3, 1, clean=False, code="AMBIGUOUS", reason="load timed out")
        clock.now = 1200.0
        for engine in ("e0", "e1"):
            await ledger.observe_inventory(
                engine, f"{engine}-i1", [ledger.state.versions[2].lora_name]
            )
        clock.now = 1210.0
        await publish(ledger, 3)
        clock.now = 1220.0
        await publish(ledger, 4)
        clock.now = 1230.0
        skipped = await ledger.allocate(5, digest(5))
        assert type(skipped).__name__ == "Skipped", skipped

        clock.now = 1300.0
        await ledger.observe_restart("e1", "e1-i2")
        for version_id in ledger.state.needed_versions():
            await ledger.restore_version(version_id, "e1", "e1-i2")
        clock.now = 1305.0
        await ledger.repair_engine("e1", "e1-i2")

        clock.now = 1310.0
        await ledger.claim_reclaim(3, ledger.inflight_evidence(3))
        await ledger.record_unloaded(3, "e0", "e0-i1")
        await ledger.mark_reclaim_ambiguous(3, "e1", "unload timed out")
        clock.now = 1320.0
        held = [ledger.state.versions[v].lora_name for v in (2, 4)]
        await ledger.observe_inventory("e1", "e1-i2", held)

        clock.now = 1330.0  # an incident: e0 lost both versions it serves (external unloads)
        await ledger.observe_inventory("e0", "e0-i1", [])
        for version_id in (2, 4):
            await ledger.restore_version(version_id, "e0", "e0-i1")
        clock.now = 1340.0  # an operator quarantines e1, then lets it back after a repair
        await ledger.suspend_engine("e1", cause="operator", detail="maintenance")
        await ledger.resume_engine("e1")
        await ledger.repair_engine("e1", "e1-i2")

        clock.now = 1400.0
        await ledger.register_owner("w3", ttl_s=30.0)
    return path


async def write_health_run(path: Path) -> Path:
    """A run where engines fall sick, written by the real ledger (``HEALTH`` says when):

    ====== ================================================================================
     t (s)  what happens
    ====== ================================================================================
     2000   deployment ``health`` (capacity 3), e0, e1, e2 join and are repaired; v1 published
     2010   e1's inventory lacks v1: ``AdapterLost``; 2012 e1 refuses the reload: suspended
            (``lost_adapter``); 2020 it restarts (e1-i2), v1 is restored, 2025 repaired
     2030   e2's probes fail: suspended (``unhealthy``); 2031 v2 published on e0 and e1;
            2060 an operator removes e2
     2100   e0 suspended (``unhealthy``), never repaired: still suspended at the end
     2110   owner w1 registers (the last record)
    ====== ================================================================================
    """
    clock = Clock(2000.0)
    async with SQLiteStore.open(path) as store, Ledger.open(store, clock=clock) as ledger:
        engines = ("e0", "e1", "e2")
        await ledger.create_deployment("health", prefix="agent", capacity=3, fleet=engines)
        for engine in engines:
            await ledger.join_engine(engine, f"{engine}-i1")
            await ledger.repair_engine(engine, f"{engine}-i1")
        await publish(ledger, 1)
        clock.now = 2010.0
        await ledger.observe_inventory("e1", "e1-i1", [])
        clock.now = 2012.0
        detail = "version 1 lost and not restored after 1 tries: NAME_RECLAIMED"
        await ledger.suspend_engine("e1", cause="lost_adapter", detail=detail)
        clock.now = 2020.0
        await ledger.observe_restart("e1", "e1-i2")
        await ledger.restore_version(1, "e1", "e1-i2")
        clock.now = 2025.0
        await ledger.repair_engine("e1", "e1-i2")
        clock.now = 2030.0
        await ledger.suspend_engine("e2", cause="unhealthy", detail="probes failed for 30.0 s")
        clock.now = 2031.0
        await publish(ledger, 2)
        clock.now = 2060.0
        await ledger.remove_engine("e2", cause="operator")
        clock.now = 2100.0
        await ledger.suspend_engine("e0", cause="unhealthy", detail="probes failed for 30.0 s")
        clock.now = 2110.0
        await ledger.register_owner("w1", ttl_s=30.0)
    return path


async def write_repeat_run(path: Path) -> Path:
    """A run where the same subject has a second incident before its first one ended (each
    must be listed on its own, ``REPEAT`` says when):

    ====== ================================================================================
     t (s)  what happens
    ====== ================================================================================
     3000   deployment ``repeat`` (capacity 3), e0, e1 join and are repaired; v1 published
     3001   owner w (incarnation a, ttl 5 s) registers, s-1 binds; 3010 its lease expires
     3011   w comes back as incarnation b, s-2 binds; 3020 its lease expires too
     3030   e1 restarts (e1-i2), 3032 restarts again (e1-i3) before its repair: a crash
            loop; v1 restored, 3035 repaired
     3040   e0's probes fail: suspended (``unhealthy``); 3045 an operator resumes it; 3050
            its probes fail again before its repair: suspended again; 3055 repaired
     3060   e0's inventory lacks v1: ``AdapterLost``; 3062 it shows v1 again (loaded outside
            the ledger); 3064 it lacks v1 again; 3066 v1 restored
     3070   owner w4 registers, s-3 binds to v1; 3071 v2 published: v1 RETIRED, still needed
            by s-3; 3072 e0's inventory lacks v1 again; 3073 s-3 released (v1 no longer
            needed, never restored); 3074 v1 reclaimed
     3100   owner w3 registers (the last record)
    ====== ================================================================================
    """
    clock = Clock(3000.0)
    async with SQLiteStore.open(path) as store, Ledger.open(store, clock=clock) as ledger:
        await ledger.create_deployment("repeat", prefix="agent", capacity=3, fleet=("e0", "e1"))
        for engine in ("e0", "e1"):
            await ledger.join_engine(engine, f"{engine}-i1")
            await ledger.repair_engine(engine, f"{engine}-i1")
        await publish(ledger, 1)
        for start, life, session in ((3001.0, "a", "s-1"), (3011.0, "b", "s-2")):
            clock.now = start
            await ledger.register_owner("w", ttl_s=5.0, incarnation=life)
            await ledger.bind(session, "w", incarnation=life)
            clock.now = start + 9.0
            expired = await ledger.expire_leases()
            assert [(e.owner, e.released) for e in expired] == [("w", 1)], expired

        clock.now = 3030.0
        await ledger.observe_restart("e1", "e1-i2")
        clock.now = 3032.0
        await ledger.observe_restart("e1", "e1-i3")
        await ledger.restore_version(1, "e1", "e1-i3")
        clock.now = 3035.0
        await ledger.repair_engine("e1", "e1-i3")

        probes = "probes failed for 30.0 s"
        clock.now = 3040.0
        await ledger.suspend_engine("e0", cause="unhealthy", detail=probes)
        clock.now = 3045.0
        await ledger.resume_engine("e0")
        clock.now = 3050.0
        await ledger.suspend_engine("e0", cause="unhealthy", detail=probes)
        clock.now = 3055.0
        await ledger.repair_engine("e0", "e0-i1")

        v1 = ledger.state.versions[1].lora_name
        for at, held in ((3060.0, []), (3062.0, [v1]), (3064.0, [])):
            clock.now = at
            await ledger.observe_inventory("e0", "e0-i1", held)
        clock.now = 3066.0
        await ledger.restore_version(1, "e0", "e0-i1")

        clock.now = 3070.0
        await ledger.register_owner("w4", ttl_s=600.0)
        await ledger.bind("s-3", "w4")
        clock.now = 3071.0
        await publish(ledger, 2)
        clock.now = 3072.0
        await ledger.observe_inventory("e0", "e0-i1", [ledger.state.versions[2].lora_name])
        clock.now = 3073.0
        await ledger.release("s-3", "w4")
        clock.now = 3074.0
        await reclaim(ledger, 1)

        clock.now = 3100.0
        await ledger.register_owner("w3", ttl_s=30.0)
    return path


def read_back(path: Path) -> list[Record]:
    """The records of the closed log at ``path``, read synchronously (for fixtures)."""

    async def read() -> list[Record]:
        async with SQLiteStore.open(path) as store:
            return await store.read()

    return anyio.run(read)


def repeat_run_records(path: Path) -> list[Record]:
    """Write the repeat run (synchronously) and read it back."""
    return read_back(anyio.run(write_repeat_run, path))


def health_run_records(path: Path) -> list[Record]:
    """Write the health run (synchronously) and read it back."""
    return read_back(anyio.run(write_health_run, path))


def write_fault_run_sync(path: Path) -> Path:
    """:func:`write_fault_run` from synchronous code (session-scoped fixtures, CLI tests)."""
    return anyio.run(write_fault_run, path)
