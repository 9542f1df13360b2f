"""Write a golden log: the story below, told to the real ledger of whatever code is on the path.

Run by an old commit's code to keep what that commit wrote (tests/golden/README.md says how):

    PYTHONPATH=<a worktree of that commit> python tests/golden/write_golden_log.py OUT.db

so it imports nothing of ``tests`` (an old commit's ``tests`` is not this one's: the few lines it
shares with tests/support/runs.py are repeated here on purpose) and only the ledger API every
commit since the first golden one has (``publisher.Ledger`` on an ``evlog.SQLiteStore``, both
taken from the packages' faces). What a commit could not record yet is skipped (the story says
so), which is why each step asks the ledger first. The clock is injected: every
``recorded_at`` is the time the story gives.

====== ===================================================================================
 t (s)  what happens
====== ===================================================================================
 1000   deployment ``golden`` (capacity 3), e0 and e1 join and are repaired;
        ``max_staleness`` 2 (where it exists)
 1001   owners w1 (ttl 30 s) and w2 (ttl 5 s) register; v1 published on e0 and e1
 1002   s-a, s-b (w1) and s-c (w2) bind to v1
 1005   v2 attempt 1 fails cleanly (absent on e0 and e1); 1010 attempt 2 published: v1 RETIRED
 1011   s-d (w1) binds to v2; 1020 s-a released
 1040   w1 renews, w2's lease expires: s-c released (``lease_expired``)
 1100   s-b released; 1101 v1 reclaimed (unloaded on e0 and e1)
 1110   v3 attempt 1 ends ambiguous: FAILED_FATAL; 1200 both inventories prove v3 absent
 1210   v3 attempt 2 published; 1220 v4 published (the default); 1230 v5 skipped (full)
 1300   e1 restarts (e1-i2, at a new address where restarts record one); v2 and v4
        restored on it, repaired at 1305
 1310   v3 reclaimed: e0 unloads, e1's unload is ambiguous; 1320 e1's inventory proves it
 1325   e2 joins, and leaves at 1326 (removed by an operator where removal exists)
 1330   (where engine health exists) e0's inventory is empty: v2 and v4 lost and restored;
        1340 e1 suspended by an operator, resumed and repaired
 1400   owner w3 registers (incarnation ``w3-a`` where lives exist); 1401 (where clean exits
        exist) owner w4 binds s-e to v4 and exits cleanly
====== ===================================================================================
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from typing import Any

import anyio

# The packages' faces, not the modules behind them: every commit's face names these two, and
# the modules move (``publisher.ledger`` is not where it was written).
from evlog import SQLiteStore
from publisher import Ledger


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def digest(version_id: int) -> str:
    return hashlib.sha256(f"golden-v{version_id}".encode()).hexdigest()


def takes(method: Any, parameter: str) -> bool:
    """Whether this commit's ``method`` has ``parameter`` (a field added after the first)."""
    return parameter in inspect.signature(method).parameters


async def publish(ledger: Ledger, version_id: int) -> None:
    """Allocate, claim, PREPARED and READY on every engine of the fleet, commit."""
    allocated: Any = await ledger.allocate(version_id, digest(version_id))
    attempt = allocated.attempt
    await ledger.claim_transport(version_id, attempt, "trainer")
    for engine in allocated.fleet:
        incarnation = ledger.state.engines[engine].incarnation
        receipt = (version_id, attempt, engine, incarnation, allocated.digest, allocated.lora_name)
        await ledger.record_prepared(*receipt)
        await ledger.record_ready(*receipt)
    await ledger.commit(version_id, attempt)


async def reclaim(ledger: Ledger, version_id: int) -> None:
    await ledger.claim_reclaim(version_id, ledger.inflight_evidence(version_id))
    for engine, member in sorted(ledger.state.engines.items()):
        await ledger.record_unloaded(version_id, engine, member.incarnation)


async def write(path: str) -> None:
    clock = Clock(1000.0)
    async with SQLiteStore.open(path) as store, Ledger.open(store, clock=clock) as ledger:
        await ledger.create_deployment("golden", prefix="agent", capacity=3)
        for engine in ("e0", "e1"):
            await ledger.join_engine(engine, f"{engine}-i1", endpoint=f"http://{engine}:30000")
            await ledger.repair_engine(engine, f"{engine}-i1")
        if hasattr(ledger, "configure_deployment"):
            await ledger.configure_deployment(max_staleness=2)

        clock.now = 1001.0
        await ledger.register_owner("w1", ttl_s=30.0)
        await ledger.register_owner("w2", ttl_s=5.0)
        await publish(ledger, 1)
        clock.now = 1002.0
        for session, owner in (("s-a", "w1"), ("s-b", "w1"), ("s-c", "w2")):
            await ledger.bind(session, owner)

        clock.now = 1005.0
        v2: Any = await ledger.allocate(2, digest(2))
        await ledger.claim_transport(2, v2.attempt, "trainer")
        await ledger.record_prepared(2, v2.attempt, "e0", "e0-i1", v2.digest, v2.lora_name)
        await ledger.fail_attempt(
            2, v2.attempt, clean=True, code="LOAD_REFUSED", reason="e1 refused the load",
            absent_on=("e0", "e1"),
        )  # fmt: skip
        clock.now = 1010.0
        await publish(ledger, 2)
        clock.now = 1011.0
        await ledger.bind("s-d", "w1")
        clock.now = 1020.0
        await ledger.release("s-a", "w1")

        clock.now = 1040.0
        ledger.renew_lease("w1")
        await ledger.expire_leases()
        clock.now = 1100.0
        await ledger.release("s-b", "w1")
        clock.now = 1101.0
        await reclaim(ledger, 1)

        clock.now = 1110.0
        v3: Any = await ledger.allocate(3, digest(3))
        await ledger.claim_transport(3, v3.attempt, "trainer")
        await ledger.fail_attempt(3, v3.attempt, clean=False, code="AMBIGUOUS", reason="timeout")
        clock.now = 1200.0
        for engine in ("e0", "e1"):
            held = [ledger.state.versions[2].lora_name]
            await ledger.observe_inventory(engine, f"{engine}-i1", held)
        clock.now = 1210.0
        await publish(ledger, 3)
        clock.now = 1220.0
        await publish(ledger, 4)
        clock.now = 1230.0
        await ledger.allocate(5, digest(5))  # capacity 3 is full (v2, v3, v4): skipped

        clock.now = 1300.0
        if takes(ledger.observe_restart, "endpoint"):
            await ledger.observe_restart("e1", "e1-i2", endpoint="http://e1:30001")
        else:
            await ledger.observe_restart("e1", "e1-i2")
        for version_id in (2, 4):
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

        clock.now = 1325.0
        await ledger.join_engine("e2", "e2-i1", endpoint="http://e2:30000")
        clock.now = 1326.0
        if hasattr(ledger, "remove_engine"):
            await ledger.remove_engine("e2", cause="operator")
        else:
            await ledger.leave_engine("e2")

        if hasattr(ledger, "suspend_engine"):
            clock.now = 1330.0
            await ledger.observe_inventory("e0", "e0-i1", [])
            for version_id in (2, 4):
                await ledger.restore_version(version_id, "e0", "e0-i1")
            clock.now = 1340.0
            await ledger.suspend_engine("e1", cause="operator", detail="maintenance")
            await ledger.resume_engine("e1")
            await ledger.repair_engine("e1", "e1-i2")

        clock.now = 1400.0
        if takes(ledger.register_owner, "incarnation"):
            await ledger.register_owner("w3", ttl_s=30.0, incarnation="w3-a")
        else:
            await ledger.register_owner("w3", ttl_s=30.0)
        if hasattr(ledger, "deregister_owner"):
            clock.now = 1401.0
            await ledger.register_owner("w4", ttl_s=30.0, incarnation="w4-a")
            await ledger.bind("s-e", "w4")
            await ledger.deregister_owner("w4", incarnation="w4-a")


if __name__ == "__main__":
    anyio.run(write, sys.argv[1])
