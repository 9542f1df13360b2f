"""The crash-point harness: run the scenario of :mod:`tests.fault.crash_child` in a child
process, SIGKILL it at one chosen point, run a second life to the end, and judge the result.

One crash point is ``(mode, k)``: ``after`` kills right after the COMMIT that stored seq ``k``,
``during`` kills inside the write statement that would have stored it. Each point gets fresh
engines (served by this process, so they outlive the child) and a fresh SQLite file.

:func:`judge` checks what RELIABILITY.md promises for a kill -9, every time:

* no acknowledged event lost, no command answered before it was durable, judged life by life
  against the file *as that life's kill left it* (read before any restart: a later life re-runs
  the scenario and could recreate a lost outcome). Every ``APPENDED`` (seq, event id) of the
  life is in that file, unchanged; every answered command (``ACK``) is backed there by the
  event that records its outcome, at a seq the life had already seen committed (``APPENDED``,
  or in the file when the life started) when it printed the answer;
* one epoch per life that reached its first append (``ControllerStarted``), none missing;
* the chain verifies and every invariant (per-session ones included) holds after every event;
* the final state is one the scenario allows: the last version is the default, every other
  version was reclaimed, each session is bound once to the version it was first answered;
* the engines agree with the ledger: each engine's own inventory is exactly what the ledger
  says it holds, nothing the ledger does not know, no adapter loaded twice or left draining.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from evlog.events import ControllerStarted, SessionBound, SessionReleased, VersionPublished
from evlog.record import Record
from evlog.sqlite import SQLiteStore
from projections import invariants
from projections.registry import RegistryState, VersionState, evolve
from tests.fault.crash_child import FINAL_DEFAULT, SCENARIOS
from tests.fault.engine_host import HostedEngine, hosted_engines
from tests.support.paths import REPO
from tools.verify import verify_log

ROOT = REPO
LIFE_TIMEOUT_S = 120.0
ENGINES = ("e0", "e1")


@dataclass
class Ack:
    """An answered scenario command (``kind``, its fields) and the last seq the life had seen
    committed when it printed the answer: the outcome must be recorded at or before it."""

    kind: str
    fields: list[str]
    durable: int


@dataclass
class Life:
    """What one child process said before it ended, and the log as it left it."""

    started_at: int = 0  # records in the file when the life started
    returncode: int | None = None
    appended: dict[int, str] = field(default_factory=dict)
    durable: int = 0  # the highest seq known committed so far (file at start, APPENDED since)
    acks: list[Ack] = field(default_factory=list)
    done: bool = False
    restarts: list[str] = field(default_factory=list)
    stderr: str = ""
    left: list[Record] = field(default_factory=list)  # the file after the life ended


@dataclass
class Outcome:
    mode: str
    k: int
    lives: list[Life]
    events: int


async def run_life(
    db: Path,
    scenario: str,
    mode: str,
    k: int,
    hosts: dict[str, HostedEngine],
    workdir: Path,
    restarted: set[str],
    number: int,
) -> Life:
    """Start the child, serve its restart requests (once per engine per crash point), wait for
    it to end (killed or done), reap it. A child that outlives ``LIFE_TIMEOUT_S`` is killed by
    its PID and reported."""
    started_at = len(await read_log(db))
    life = Life(started_at=started_at, durable=started_at)
    err_path = workdir / f"stderr-life{number}.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [
        sys.executable,
        "-m",
        "tests.fault.crash_child",
        str(db),
        str(workdir / "artifacts"),
        scenario,
        mode,
        str(k),
        *(hosts[e].url for e in ENGINES),
    ]
    with err_path.open("wb") as err:
        process = await anyio.open_process(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err
        )
    try:
        assert process.stdout is not None
        buffer = b""
        with anyio.move_on_after(LIFE_TIMEOUT_S) as timer:
            async for chunk in process.stdout:
                *lines, buffer = (buffer + chunk).split(b"\n")
                for raw in lines:
                    await _line(raw.decode(), life, hosts, restarted)
            await process.wait()
        if timer.cancelled_caught:
            raise AssertionError(f"the child ran past {LIFE_TIMEOUT_S}s ({mode} {k})")
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGKILL)
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()
    life.returncode = process.returncode
    life.stderr = err_path.read_text(errors="replace")
    life.left = await read_log(db)  # before any other life touches the file
    return life


async def read_log(db: Path) -> list[Record]:
    """Every record of the file as it is now (none if the file was never created)."""
    if not await anyio.Path(db).exists():
        return []
    async with SQLiteStore.open(db) as store:
        return await store.read()


async def _line(line: str, life: Life, hosts: dict[str, HostedEngine], restarted: set[str]) -> None:
    kind, _, rest = line.partition(" ")
    if kind == "APPENDED":
        seq, eid = rest.split()
        assert int(seq) not in life.appended, f"seq {seq} acknowledged twice"
        life.appended[int(seq)] = eid
        life.durable = max(life.durable, int(seq))
    elif kind == "ACK":
        what, *fields = rest.split()
        life.acks.append(Ack(what, fields, life.durable))
    elif kind == "RESTART":
        life.restarts.append(rest)
        if rest not in restarted:
            restarted.add(rest)
            await hosts[rest].restart()
    elif kind == "DONE":
        life.done = True


async def crash_point(scenario: str, mode: str, k: int, workdir: Path) -> Outcome:
    """One crash point on fresh engines and a fresh log: a killed life, then a life that
    finishes the scenario, then the judgement."""
    await anyio.Path(workdir).mkdir(parents=True)
    db = workdir / "ledger.db"
    restarted: set[str] = set()
    async with hosted_engines(ENGINES, workdir / "artifacts") as hosts:
        lives = [await run_life(db, scenario, mode, k, hosts, workdir, restarted, 1)]
        if mode != "none":
            first = lives[0]
            assert first.returncode == -signal.SIGKILL, _report(first, f"{mode} {k}: not killed")
            acked = max(first.appended, default=0)
            if mode == "after":
                assert acked >= k, f"after {k}: killed before seq {k} was acknowledged"
            else:
                assert acked < k, f"during {k}: seq {k} was committed before the kill"
            lives.append(await run_life(db, scenario, "none", 0, hosts, workdir, restarted, 2))
        last = lives[-1]
        assert last.returncode == 0 and last.done, _report(last, f"{mode} {k}: did not finish")
        events = await judge(db, scenario, lives, hosts)
    return Outcome(mode, k, lives, events)


def _report(life: Life, what: str) -> str:
    return f"{what} (exit {life.returncode}); child stderr tail:\n{life.stderr[-3000:]}"


async def judge(db: Path, scenario: str, lives: list[Life], hosts: dict[str, HostedEngine]) -> int:
    """Every check of the module docstring; returns the number of events in the log."""
    verdict = await verify_log(db, deep=True)
    assert verdict.ok, verdict
    async with SQLiteStore.open(db) as store:
        records = await store.read()
    assert [r.seq for r in records] == list(range(1, len(records) + 1))

    # no acknowledged event lost, nothing answered before it was durable: each life against
    # the file its own end left (the lives after it may have recreated what it lost)
    for number, life in enumerate(lives, start=1):
        judge_life(number, life)
        for seq, eid in life.appended.items():  # ... and nothing a later life did lost it
            assert seq <= len(records), f"life {number}: acknowledged seq {seq} is gone"
            assert records[seq - 1].event_id.hex() == eid, f"life {number}: seq {seq} changed"
    assert [r.event_id for r in lives[-1].left] == [r.event_id for r in records]

    # invariants, the deep ones included, after every single event
    state = RegistryState()
    for r in records:
        evolve(state, r.event, r.seq)
        found = invariants.violations(state, deep=True)
        assert not found, f"after seq {r.seq} ({r.type}): {found}"

    events = [r.event for r in records]
    bound = [(e.session, e.version_id) for e in events if isinstance(e, SessionBound)]
    # one epoch per life that reached its first append, each life's first event its start
    started = [life for life in lives if life.appended]
    starts = [r for r in records if isinstance(r.event, ControllerStarted)]
    assert state.epoch == len(starts) == len(started), (state.epoch, len(starts), len(started))
    for epoch, life in enumerate(started, start=1):
        first = records[min(life.appended) - 1].event
        assert isinstance(first, ControllerStarted) and first.epoch == epoch, (epoch, first)

    # the end state the scenario allows
    final = FINAL_DEFAULT[scenario]
    assert state.default == final
    for v in state.versions.values():
        if v.version_id != final:
            assert v.state is VersionState.RECLAIMED, (v.version_id, v.state)
    expected = dict(_pins(scenario))
    assert sorted(bound) == sorted((s, v) for s, v in expected.items()), bound
    assert not state.sessions and set(expected) <= set(state.tombstones)

    # the engines agree with the ledger
    name = state.versions[final].lora_name
    for engine_id, host in hosts.items():
        engine = host.engine
        assert engine is not None
        member = state.engines[engine_id]
        inventory = await engine.inventory()
        assert member.incarnation == inventory.incarnation, engine_id
        assert member.routable, engine_id
        assert inventory.names() == set(member.holds) == {name}, (engine_id, inventory)
        assert len(engine.model_adapters()) == len(engine.residents()) == 1, engine_id
        assert not engine.draining() and not engine.staged(), engine_id
        assert engine.in_flight == 0
    return len(records)


def judge_life(number: int, life: Life) -> None:
    """What life ``number`` acknowledged, against the file as its end left it."""
    records = life.left
    for seq, eid in life.appended.items():
        assert seq <= len(records), f"life {number}: acknowledged seq {seq} is gone"
        assert records[seq - 1].event_id.hex() == eid, f"life {number}: seq {seq} changed"
    for ack in life.acks:
        backed = backing_seq(records, ack)
        assert backed is not None, (
            f"life {number} answered {ack.kind} {ack.fields} but the file it left does not "
            f"record it ({len(records)} records)"
        )
        assert backed <= ack.durable, (
            f"life {number} answered {ack.kind} {ack.fields} before seq {backed}, which records "
            f"it, was committed (committed then: up to seq {ack.durable})"
        )


def backing_seq(records: list[Record], ack: Ack) -> int | None:
    """The seq of the first event that records the answered outcome, if any."""
    return next((r.seq for r in records if _records(r.event, ack)), None)


def _records(e: object, ack: Ack) -> bool:
    if ack.kind == "publish" and isinstance(e, VersionPublished):
        version, revision = ack.fields
        return e.version_id == int(version) and revision in ("None", str(e.revision))
    if ack.kind == "bind" and isinstance(e, SessionBound):
        return [e.session, str(e.version_id)] == ack.fields
    if ack.kind == "release" and isinstance(e, SessionReleased):
        return e.session == ack.fields[0]
    return False


def _pins(scenario: str) -> list[tuple[str, int]]:
    """(session, version it must be bound to): the version published last before its bind."""
    pins: list[tuple[str, int]] = []
    latest = 0
    for step, arg in SCENARIOS[scenario]:
        if step == "publish":
            latest = arg
        elif step == "bind":
            pins.append((arg, latest))
    return pins
