"""Where a durable bind or release spends its time in the ledger, stage by stage, per command.

``bench ledger`` compares the ledger with raw ``executemany`` of the rows it wrote; this says
what the difference is made of. Batches of ``concurrency`` binds, then as many releases (the
shape the closed loop of ``bench ledger`` produces at that many sessions in flight), on a state
bootstrapped as there (one published version, one owner), each stage timed on its own in the
order the writer runs it:

* ``type_check``: the decider's first common step (every field of its declared type);
* ``decide``: the rest of ``decide`` (the handler, the lease and id checks);
* ``evolve``: folding the accepted events into the state;
* ``invariants``: the writer's check after every batch (divided by the batch's commands);
* ``seal``: wrapping each event for the store (stream, type, ids, msgpack payload);
* ``chain``: the append plan (positions, the hash chain), as the store runs it per group;
* ``sqlite_append_normal`` / ``sqlite_append_full``: ``SQLiteStore.append`` of the sealed
  batch (its thread hop, one ``executemany``, COMMIT; with FULL the fsync), wall time.

The stages are timed in process CPU time (``time.process_time``), so the machine's other work
does not count; each is the cheapest of ``repeats`` runs.

Then the whole ledger, end to end, on a :class:`~evlog.memory.MemoryStore` (no disk):
``ledger_in_memory_cpu`` is the process CPU time per command of ``concurrency`` tasks binding
and releasing through :class:`~publisher.core.ledger.Ledger`; what the stages above do not
explain of it (``queue_and_answers``) is the asyncio part: the command queue, the tasks'
wake-ups, the answers. Every figure is microseconds per command.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from evlog.append_plan import plan_appends
from evlog.events import Event
from evlog.memory import MemoryStore
from evlog.record import GENESIS_HASH, Pending, pending_many
from evlog.sqlite import SQLiteStore
from projections import invariants
from projections.registry import RegistryState, evolve
from publisher.core import commands as c
from publisher.core.decider import decide
from publisher.core.decider.checks import _well_typed
from publisher.core.ledger import Ledger
from tools.bench.ledger_workload import bootstrap, drive


async def _bootstrapped() -> RegistryState:

    async with Ledger.open(MemoryStore(), snapshot_on_close=False, watch_every_s=None) as ledger:
        await bootstrap(ledger)
        return ledger.state


def _batches(concurrency: int, rounds: int) -> list[list[c.Command]]:
    batches: list[list[c.Command]] = []
    for r in range(rounds):
        names = [f"p{r}-{i}" for i in range(concurrency)]
        batches.append([c.Bind(session=n, owner="worker") for n in names])
        batches.append([c.Release(session=n, owner="worker") for n in names])
    return batches


async def _stages(concurrency: int, rounds: int, directory: str | None) -> dict[str, float]:
    state, twin = await _bootstrapped(), await _bootstrapped()
    totals = dict.fromkeys(("type_check", "decide", "evolve", "invariants", "seal", "chain"), 0.0)
    sealed: list[list[Pending]] = []
    commands = 0
    clock = time.process_time  # CPU time: a loaded machine's other work is not counted
    for batch in _batches(concurrency, rounds):
        commands += len(batch)
        start = clock()
        for cmd in batch:
            _well_typed(cmd)
        totals["type_check"] += clock() - start
        # As the writer does: each command decided on the state its predecessors left.
        events: list[Event] = []
        start = clock()
        for cmd in batch:
            for event in decide(state, cmd).events:
                evolve(state, event)
                events.append(event)
        totals["decide"] += clock() - start
        # The fold alone, on a twin state: the same events meeting the same states.
        start = clock()
        for event in events:
            evolve(twin, event)
        in_evolve = clock() - start
        totals["decide"] -= in_evolve
        totals["evolve"] += in_evolve
        state.last_seq += len(events)
        start = clock()
        invariants.check(state, deep=False)
        totals["invariants"] += clock() - start
        start = clock()
        sealed.append(pending_many(events, time.time()))
        totals["seal"] += clock() - start
    last_seq, head = 0, GENESIS_HASH
    for pendings in sealed:
        start = clock()
        plan = plan_appends([(pendings, None)], last_seq, head, {})
        totals["chain"] += clock() - start
        last_seq, head = plan.last_seq, plan.head_hash
    # The typed check ran inside ``decide`` too: count it once, under its own name.
    totals["decide"] -= totals["type_check"]
    per_command = {name: seconds / commands * 1e6 for name, seconds in totals.items()}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for sync in ("NORMAL", "FULL"):
            path = os.path.join(tmp, f"profile-{sync}.db")
            async with SQLiteStore.open(path, synchronous=sync) as store:
                start = time.perf_counter()
                for pendings in sealed:
                    await store.append(pendings)
                seconds = time.perf_counter() - start
            per_command[f"sqlite_append_{sync.lower()}"] = seconds / commands * 1e6
    return per_command


async def _ledger_cpu(concurrency: int, rounds: int) -> float:
    """Process CPU seconds per command of the whole ledger on a MemoryStore: ``bench
    ledger``'s own closed loop (its bootstrap included: a few dozen commands)."""

    start = time.process_time()
    _, _, _, written, _ = await drive(MemoryStore(), concurrency, concurrency * rounds)
    return (time.process_time() - start) / written


async def profile_ledger(
    *, concurrency: int = 256, rounds: int = 100, repeats: int = 3, directory: str | None = None
) -> dict[str, Any]:
    """Microseconds per command, stage by stage (see the module docstring): the least of
    ``repeats`` runs for each figure (the machine's other work only ever adds to a figure)."""
    runs = [await _stages(concurrency, rounds, directory) for _ in range(repeats)]
    # One consistent run (the stages are differences of one run's timings): the cheapest.
    stages = min(runs, key=lambda run: sum(run.values()))
    in_memory = min([await _ledger_cpu(concurrency, rounds) for _ in range(repeats)]) * 1e6
    explained = sum(v for k, v in stages.items() if not k.startswith("sqlite_"))
    figures = {
        **stages,
        "ledger_in_memory_cpu": in_memory,
        "queue_and_answers": max(in_memory - explained, 0.0),
    }
    return {
        "concurrency": concurrency,
        "commands": 2 * concurrency * rounds,
        **{f"{name}_us": round(value, 2) for name, value in figures.items()},
    }
