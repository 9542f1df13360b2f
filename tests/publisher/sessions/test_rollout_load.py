"""Load: 1,000 concurrent sessions of 3-5 turns on 2 real local engines while 5 versions are
published, with the control plane's reclaim running throughout.

What must hold at the end, checked from the provenance table and the log (never from the code
under test's own bookkeeping):

* every turn of every session ran on the version of its first generation (provenance, and the
  adapter name each engine echoed), and that version is the one its single ``SessionBound``
  event recorded;
* no lost binding or turn: one bind and one release per session, one row per turn;
* all 1,000 sessions were live at once (each waits for all others' first turn before its
  second), so the five publications happened under a full set of pinned sessions;
* every retired version was reclaimed, the engines hold only the default, tombstones were
  forgotten, and the invariants hold on a state rebuilt from the log by ``recover``.

Publication and reclaim are the real drivers of a :class:`~publisher.drivers.plane.ControlPlane`
(trainer facade -> publication driver; continuous reclaim fed by this gateway's in-flight
counts and the workers' lease renewals). The engine calls go through a bounded limiter (the
tiny model is CPU-bound on 2 cores); the sessions themselves are all live. The throughput
reached is printed (``-s`` to see it); it is a report, not an assertion (performance is
measured by benchmarks, not timed tests).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest

from evlog.events import SessionBound, SessionReleased, VersionReclaimed
from projections import invariants
from projections.recovery import recover
from projections.registry import VersionState
from publisher.sessions import RolloutWorker
from tests.publisher.rollout_kit import ENGINE_WARNINGS, SHORT, plane_rig
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

SESSIONS = 1000
WORKERS = 4
PUBLICATIONS = 5  # v2..v6, after the bootstrap v1
ENGINE_CALLS = 48


def turns_of(index: int) -> int:
    return 3 + index % 3


def prompt_of(index: int, turn: int) -> tuple[int, ...]:
    return (11, 12 + turn, 13, 20 + index % 400)


async def test_a_thousand_pinned_sessions_while_five_versions_are_published(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    async with plane_rig(tmp_path, engines=2, capacity=8) as r:
        await r.publish(1)
        limiter = anyio.CapacityLimiter(ENGINE_CALLS)
        errors: list[tuple[str, BaseException]] = []
        echoed: dict[str, set[str | None]] = defaultdict(set)  # adapters the engines said
        started = 0
        live = peak_live = 0
        all_started = anyio.Event()
        first_turns: dict[int, int] = defaultdict(int)
        t0 = time.perf_counter()

        async with contextlib.AsyncExitStack() as stack:
            workers = [
                await stack.enter_async_context(
                    RolloutWorker.open(r.ledger, r.gateway, owner=f"w{i}", forget_batch=64)
                )
                for i in range(WORKERS)
            ]

            async def session(index: int, wave: int) -> None:
                nonlocal started, live, peak_live
                binder = workers[index % WORKERS].session(f"s{index}")
                try:
                    async with limiter:
                        served = await binder.generate(prompt_of(index, 0), SHORT, turn=0)
                    echoed[binder.session_id].add(served.generation.lora_name)
                    live += 1
                    peak_live = max(peak_live, live)
                finally:
                    first_turns[wave] += 1
                    started += 1
                    if started == SESSIONS:
                        all_started.set()
                await all_started.wait()
                for turn in range(1, turns_of(index)):
                    await anyio.sleep(rng.random() * 0.005)  # a tool call between turns
                    async with limiter:
                        served = await binder.generate(prompt_of(index, turn), SHORT, turn=turn)
                    echoed[binder.session_id].add(served.generation.lora_name)
                await binder.close()
                live -= 1

            async def guarded(index: int, wave: int) -> None:
                try:
                    await session(index, wave)
                except Exception as exc:
                    errors.append((f"s{index}", exc))

            async with anyio.create_task_group() as tg:
                per_wave = SESSIONS // (PUBLICATIONS + 1)
                for wave in range(PUBLICATIONS + 1):
                    end = SESSIONS if wave == PUBLICATIONS else (wave + 1) * per_wave
                    for index in range(wave * per_wave, end):
                        tg.start_soon(guarded, index, wave)
                    if wave < PUBLICATIONS:
                        # publish while this wave is still taking its first turns
                        while first_turns[wave] < per_wave // 2:  # noqa: ASYNC110
                            await anyio.sleep(0.005)
                        await r.publish(wave + 2)
            elapsed = time.perf_counter() - t0
        # workers left: every tombstone forgotten

        assert errors == [], errors[:5]
        assert peak_live == SESSIONS  # all sessions were live at once

        # --- pinning, from the provenance table and the log --------------------------------
        await wait_for(
            "every provenance row to reach the sink", lambda: r.recorder.pending == 0, timeout=10
        )
        rows_of: dict[str, list[Any]] = defaultdict(list)  # ProvenanceRow (turn is set)
        for row in r.sink.rows:
            rows_of[row.session].append(row)
        events = [rec.event async for rec in r.store.iterate()]
        binds = [e for e in events if isinstance(e, SessionBound)]
        released = [e for e in events if isinstance(e, SessionReleased)]
        bound = {e.session: e for e in binds}
        assert len(binds) == len(bound) == SESSIONS  # exactly one bind per session
        assert sorted(e.session for e in released) == sorted(bound)
        assert {e.cause for e in released} == {"closed"}
        for index in range(SESSIONS):
            sid = f"s{index}"
            rows = sorted(rows_of[sid], key=lambda x: x.turn)
            assert [x.turn for x in rows] == list(range(turns_of(index))), sid
            assert {x.version_id for x in rows} == {bound[sid].version_id}, sid
            assert {x.lora_name for x in rows} == {r.names[bound[sid].version_id]}, sid
            # and what the engines themselves say they ran, not only the gateway's record
            assert echoed[sid] == {r.names[bound[sid].version_id]}, sid
        versions_used = {b.version_id for b in bound.values()}
        assert len(versions_used) >= 4, versions_used  # publications interleaved with binds
        stale = sum(1 for row in r.sink.rows if row.staleness > 0)
        assert stale > 0  # pinned turns really outlived later commits

        # --- reclaim (continuous, by the plane's driver) and the final log --------------------
        state = r.ledger.state
        default = PUBLICATIONS + 1
        reclaimed_during_run = sum(1 for e in events if isinstance(e, VersionReclaimed))
        await wait_for(
            "every version but the default reclaimed",
            lambda: all(
                v.state is VersionState.RECLAIMED
                for v in state.versions.values()
                if v.version_id != default
            ),
            timeout=30,
        )
        assert state.default == default
        for version_id in range(1, default):
            assert state.versions[version_id].state is VersionState.RECLAIMED, version_id
        for engine in r.local.values():
            assert set(engine.loaded_adapters()) == {r.names[default]}
        assert state.sessions == {} and state.tombstones == {}
        rebuilt = await recover(r.store, use_snapshot=False, check=True)
        invariants.check(rebuilt)
        assert rebuilt.versions.keys() == state.versions.keys()

        generations = len(r.sink.rows)
        print(
            f"\nload: {SESSIONS} sessions, {generations} generations on 2 engines, "
            f"{PUBLICATIONS} publications ({reclaimed_during_run} reclaimed while sessions "
            f"ran), {elapsed:.1f}s: "
            f"{generations / elapsed:.0f} generations/s, {SESSIONS / elapsed:.0f} sessions/s, "
            f"versions bound {sorted(versions_used)}"
        )
