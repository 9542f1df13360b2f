"""The chaos schedule is a pure function of its seed (byte for byte, in another process with
another hash seed too), seeds differ, every fault kind and process kind is reached, and no
plan takes the whole fleet down: checked here over many seeds by a sweep of its own, not by
the planner's code. The run's own plan (``tests.chaos.run.plan``) is one schedule of process
and network faults on every process kind, and playing a plan never overlaps faults the plan
kept apart, however long a fault really takes."""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from collections import Counter

import anyio
import pytest

from tests.chaos.proxy import Fault, Network
from tests.chaos.schedule import (
    NETWORK_FAULTS,
    PARTITION,
    PROCESS_FAULTS,
    Pace,
    Planned,
    act_on_network,
    format_schedule,
    link_fault,
    play,
    schedule,
)
from tests.support.paths import REPO

PROCESSES = {
    "serve": "serve",
    "gw0": "gateway",
    "gw1": "gateway",
    "e1": "engine",
    "e2": "engine",
    "e3": "engine",
    "agent": "agent",
    "trainer": "trainer",
}
LINKS = [
    "client->gw0",
    "client->gw1",
    "gw0->serve",
    "gw1->serve",
    "gw0->e1",
    "gw0->e2",
    "gw0->e3",
    "gw1->e1",
    "gw1->e2",
    "gw1->e3",
    "serve->e1",
    "serve->e2",
    "serve->agent",
    "trainer->serve",
]
DURATION_S = 60.0


def test_one_seed_gives_one_schedule_byte_for_byte_in_any_process() -> None:
    plan = schedule(7, DURATION_S, LINKS, PROCESSES)
    assert plan == schedule(7, DURATION_S, list(reversed(LINKS)), dict(reversed(PROCESSES.items())))
    printed = format_schedule(7, plan)
    probe = (
        "from tests.chaos.schedule import format_schedule, schedule\n"
        "from tests.chaos.test_schedule import DURATION_S, LINKS, PROCESSES\n"
        "print(format_schedule(7, schedule(7, DURATION_S, LINKS, PROCESSES)), end='')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, check=True
    )
    assert other.stdout == printed.encode()
    lines = printed.splitlines()
    assert lines[0].startswith("chaos schedule: seed 7, ") and len(lines) == len(plan) + 1
    assert all(p.target in line and p.kind in line for p, line in zip(plan, lines[1:], strict=True))


def test_different_seeds_give_different_schedules() -> None:
    printed = {
        format_schedule(0, schedule(seed, DURATION_S, LINKS, PROCESSES)) for seed in range(30)
    }
    assert len(printed) == 30


def _down(fault: Planned) -> set[str]:
    """The sweep's own reading of which processes a fault takes out."""
    if fault.kind == "delay":
        return set()
    if fault.kind in NETWORK_FAULTS:
        caller, server = fault.target.split("->")
        return {caller, server}
    return {fault.target}


@pytest.mark.parametrize("seeds", [range(0, 200)])
def test_no_schedule_takes_the_fleet_down_and_every_fault_heals_in_time(seeds: range) -> None:
    kinds: Counter[str] = Counter()
    targets: set[str] = set()
    for seed in seeds:
        plan = schedule(seed, DURATION_S, LINKS, PROCESSES)
        assert plan, f"seed {seed}: no fault at all"
        assert [p.at_s for p in plan] == sorted(p.at_s for p in plan)
        for fault in plan:
            kinds[fault.kind] += 1
            targets.add(fault.target)
            assert fault.at_s >= 0 and fault.heal_after_s >= 0
            assert fault.heals_at_s <= DURATION_S, f"seed {seed}: {fault} heals after the run"
            assert (fault.kind == "restart") == (fault.heal_after_s == 0), fault
            assert (fault.kind == "delay") == (fault.delay_s > 0), fault
            if fault.kind in NETWORK_FAULTS:
                assert fault.target in LINKS
                assert (link_fault(fault).kind, link_fault(fault).seconds) == (
                    fault.kind,
                    fault.delay_s,
                )
            else:
                assert fault.target in PROCESSES
        # Sweep every instant a fault starts: who is down then (heal instant excluded).
        for instant in sorted({p.at_s for p in plan}):
            active = [p for p in plan if p.at_s <= instant < max(p.heals_at_s, p.at_s + 1e-3)]
            down = set().union(*(_down(p) for p in active))
            for kind in ("engine", "gateway"):
                up = [n for n, k in PROCESSES.items() if k == kind and n not in down]
                assert up, f"seed {seed}: every {kind} down at +{instant}s: {active}"
            on_serve = [p for p in active if "serve" in _down(p)]
            assert len(on_serve) <= 1, f"seed {seed}: serve faults overlap: {on_serve}"
            touched = [p.target for p in active]
            assert len(touched) == len(set(touched)), f"seed {seed}: two faults on one target"
    assert set(kinds) == {*PROCESS_FAULTS, *NETWORK_FAULTS, PARTITION}, kinds
    assert set(PROCESSES) <= targets, "some process is never faulted"
    assert set(LINKS) <= targets, "some link is never faulted"


def test_a_fleet_of_one_engine_never_loses_it_and_bad_links_are_refused() -> None:
    processes = {"serve": "serve", "gw0": "gateway", "gw1": "gateway", "e1": "engine"}
    links = ["gw0->e1", "gw1->e1", "gw0->serve"]
    for seed in range(50):
        plan = schedule(seed, 30.0, links, processes)
        assert not [p for p in plan if "e1" in _down(p)], f"seed {seed}: the only engine faulted"
    with pytest.raises(ValueError, match="CALLER->SERVER"):
        schedule(1, 10.0, ["gw0-serve"], processes)


def test_a_slower_pace_plans_one_fault_at_a_time_and_long_freezes() -> None:
    """A run on a small machine asks for one fault at a time, and for some freezes longer
    than serve's probe timeout (the engine must be suspended, and the log say so)."""
    pace = Pace(first_s=(5.0, 5.0), gap_s=(4.0, 9.0), overlap=False, long_stop_s=13.0)
    long_stops = 0
    for seed in range(50):
        plan = schedule(seed, 120.0, LINKS, PROCESSES, pace)
        assert plan == schedule(seed, 120.0, LINKS, PROCESSES, pace)
        assert plan[0].at_s >= 5.0
        for before, after in itertools.pairwise(plan):
            assert after.at_s >= before.heals_at_s + 4.0, (seed, before, after)
        long_stops += sum(p.kind == "sigstop" and p.heal_after_s == 13.0 for p in plan)
    assert long_stops > 0


@pytest.mark.anyio
async def test_the_network_faults_of_a_plan_are_played_on_the_proxies_and_healed() -> None:
    """The network faults of a plan reach their links (a partition every link of its
    process), each counted once, and every link passes again when the plan is over; a
    process fault goes to the run's own act."""
    plan = [
        Planned(0.0, "gw0->serve", "delay", 0.4, delay_s=0.05),
        Planned(0.05, "e1", "partition", 0.2),
        Planned(0.05, "gw0", "sigkill", 0.1),
        Planned(0.1, "client->gw0", "black_hole", 0.05),
    ]  # distinct instants: the loop's timers fire in order, however late
    signalled: list[Planned] = []

    async def act(net: Network, planned: Planned) -> None:
        if planned.network:
            await act_on_network(net, planned)
        else:
            signalled.append(planned)

    async with Network() as net:
        for link in ("gw0->serve", "gw0->e1", "serve->e1", "client->gw0"):
            await net.link(link, "127.0.0.1", 1)
        started = anyio.current_time()
        await play(plan, started, functools.partial(act, net))
        assert net.counts == {"delay": 1, "partition": 1, "black_hole": 1}
        assert all(p.fault == Fault.passing() for p in net.proxies.values())
    assert signalled == [plan[2]]
    changes = [(link, kind) for _, link, kind in net.applied]
    assert changes == [
        ("gw0->serve", "delay"),
        ("gw0->e1", "black_hole"),  # the partition of e1: both its links at once
        ("serve->e1", "black_hole"),
        ("client->gw0", "black_hole"),
        ("client->gw0", "pass"),
        ("gw0->e1", "pass"),
        ("serve->e1", "pass"),
        ("gw0->serve", "pass"),
    ]
    planned_at = [0.0, 0.05, 0.05, 0.1, 0.15, 0.25, 0.25, 0.4]
    assert all(
        when >= started + at for (when, _, _), at in zip(net.applied, planned_at, strict=True)
    )


@pytest.mark.anyio
async def test_a_fault_that_outlasts_its_plan_delays_what_the_plan_put_after_it() -> None:
    """A restart that takes far longer than planned (a process slow to listen again) holds
    back the faults the plan starts after its recovery, so they never overlap it; a fault the
    plan overlaps with it is not held back."""
    plan = [
        Planned(0.0, "e1", "restart", 0.0),  # planned busy until 0 + RECOVERY_S
        Planned(0.2, "gw0", "sigstop", 0.1),  # overlaps it in the plan
        Planned(1.5, "e2", "sigkill", 0.1),  # after its recovery in the plan
    ]
    slow_restart_done = anyio.Event()
    began: dict[str, bool] = {}

    async def act(planned: Planned) -> None:
        began[planned.target] = slow_restart_done.is_set()
        if planned.target == "e1":
            await anyio.sleep(2.5)  # the restart really takes this long
            slow_restart_done.set()
        else:
            await anyio.sleep(planned.heal_after_s)

    await play(plan, anyio.current_time(), act)
    assert began == {"e1": False, "gw0": False, "e2": True}


def _recovered_at(fault: Planned) -> float:
    """The sweep's own reading of when a fault is over: a process started again takes a
    second more to listen."""
    return fault.heals_at_s + (1.0 if fault.kind in ("sigkill", "sigterm", "restart") else 0.0)


def _overlap(a: Planned, b: Planned) -> bool:
    return a.at_s < _recovered_at(b) and b.at_s < _recovered_at(a)


def test_the_runs_plan_is_one_schedule_of_process_and_network_faults_on_every_kind() -> None:
    """One plan, a pure function of the seed: over a few seeds every fault kind, every
    process (agent and trainer too) and every link is faulted; a process fault never meets
    another fault on the same process; a gateway (it reads serve before it listens) is never
    started again while serve is away; at most two faults at once; an engine and a gateway
    always unimpaired; every fault healed (and recovered) within the run."""
    from tests.chaos import run

    kinds: Counter[str] = Counter()
    targets: set[str] = set()
    for seed in range(1, 31):
        plan = run.plan(seed, 30.0)
        assert plan == run.plan(seed, 30.0)
        for fault in plan:
            kinds[fault.kind] += 1
            targets.add(fault.target)
            assert _recovered_at(fault) <= 30.0, (seed, fault)
        for a, b in itertools.combinations(plan, 2):
            if not _overlap(a, b) or (a.network and b.network):
                continue
            assert not _down(a) & _down(b), f"seed {seed}: {a} meets {b}"
        for restarted, other in itertools.permutations(plan, 2):
            gateway_restarted = restarted.kind in ("sigkill", "sigterm", "restart") and (
                run.PROCESSES.get(restarted.target) == "gateway"
            )
            if gateway_restarted and _overlap(restarted, other):
                assert "serve" not in _down(other), f"seed {seed}: {restarted} under {other}"
        for instant in sorted({p.at_s for p in plan}):
            active = [p for p in plan if p.at_s <= instant < p.heals_at_s + 1e-3]
            assert len(active) <= 2, f"seed {seed}: {len(active)} faults at +{instant}s"
            down = set().union(*(_down(p) for p in active))
            for kind in ("engine", "gateway"):
                assert [n for n, k in run.PROCESSES.items() if k == kind and n not in down]
    assert set(kinds) == {*PROCESS_FAULTS, *NETWORK_FAULTS, PARTITION}, kinds
    assert {"agent", "trainer", *run.PROCESSES, *run.LINKS} <= targets
