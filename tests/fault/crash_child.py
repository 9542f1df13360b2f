"""Child process of the crash-point harness: the whole ``ControlPlane`` on a SQLite file,
driving a scripted scenario against engines that live in the parent process.

``python -m tests.fault.crash_child DB ARTIFACTS SCENARIO MODE K URL_E0 URL_E1``

* ``SCENARIO``: ``compact`` or ``full`` (see :data:`SCENARIOS`).
* ``MODE``/``K``: ``none`` (run to the end), ``after`` (SIGKILL itself right after the COMMIT
  of the append that stored seq ``K``, before anybody is answered), ``during`` (SIGKILL itself
  *while the write statement that would store seq K runs*: a SQLite progress handler on the
  store's writer connection, armed just before that append, kills the process from inside
  the statement; the rows of that statement are never committed).

The scenario is resumable: every step reads the ledger first and skips what the log already
shows, so a second life (``MODE none``) finishes what a killed first life began. What the
parent parses from stdout, one line each, flushed:

* ``APPENDED <seq> <event id hex>`` -- printed after ``append`` returned (the events are
  durable): an acknowledged event that must survive every later crash.
* ``ACK <kind> <fields...>`` -- an answered scenario command (publish, bind, release).
* ``RESTART <engine>`` -- the scenario wants that engine restarted (the parent hosts it).
* ``DONE <last seq>`` -- the end state was reached; the plane then closes cleanly.

Logs go to stderr (the parent keeps them for a failure report).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog

from engines.contract import Engine
from engines.local.client import LocalHTTPEngine
from engines.local.tinymodel import make_adapter
from engines.sglang import SGLangTimeouts
from evlog.errors import LoraLedgerError
from evlog.events import EngineRestarted
from evlog.record import Pending
from evlog.sqlite import SQLiteStore
from projections.registry import VersionState
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationError
from publisher.drivers.trainer import TrainerClient
from tests.support.waiting import wait_for

OWNER = "w1"
DEADLINE_S = 60.0
TIMEOUTS = EngineTimeouts(probe=2, inventory=5, prepare=10, transfer=20, load=20, unload=20)

# step name, argument. Sessions are pinned to the version published just before their bind.
SCENARIOS: dict[str, tuple[tuple[str, Any], ...]] = {
    # bootstrap, two publications, a pinned session released -> the retired version reclaimed
    "compact": (
        ("publish", 1),
        ("bind", "s1"),
        ("publish", 2),
        ("release", "s1"),
        ("reclaimed", 1),
    ),
    # ... plus an engine restart repaired while a retired version is still pinned, a third
    # publication, and the second reclaim
    "full": (
        ("publish", 1),
        ("bind", "s1"),
        ("publish", 2),
        ("bind", "s2"),
        ("restart", "e1"),
        ("release", "s1"),
        ("reclaimed", 1),
        ("publish", 3),
        ("release", "s2"),
        ("reclaimed", 2),
    ),
}
FINAL_DEFAULT = {"compact": 2, "full": 3}


def say(*fields: object) -> None:
    sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
    sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingStore:
    """The real ``SQLiteStore``, with the kill hook and the ``APPENDED`` acknowledgements.

    Everything but ``append`` is forwarded untouched."""

    def __init__(self, inner: SQLiteStore, mode: str, k: int) -> None:
        self._inner = inner
        self._mode = mode
        self._k = k

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def last_seq(self) -> int:
        return self._inner.last_seq

    @property
    def head_hash(self) -> bytes:
        return self._inner.head_hash

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        before = self._inner.last_seq
        crosses = before < self._k <= before + len(batch)
        if self._mode == "during" and crosses:
            await self._arm_progress_kill()
        seqs = await self._inner.append(batch, expected_seq=expected_seq)
        fresh = [(s, p) for s, p in zip(seqs, batch, strict=True) if s > before]
        if fresh:
            sys.stdout.write("".join(f"APPENDED {s} {p.event_id.hex()}\n" for s, p in fresh))
            sys.stdout.flush()
        if self._mode == "after" and seqs and max(seqs) >= self._k:
            die()
        return seqs

    async def _arm_progress_kill(self) -> None:
        """SQLite calls a progress handler every N virtual-machine instructions of the
        statement running on that connection. The next statement on the writer is this
        append's INSERT, so the process dies inside it, with the write transaction open:
        the rows are in the page cache, never committed. A handful of instructions in (the
        statement's first instructions only open the transaction), varied with K."""
        calls = 0
        target = 4 + self._k % 12

        def handler() -> int:
            nonlocal calls
            calls += 1
            if calls >= target:
                die()
            return 0

        writer = self._inner._writer  # the store's single writer connection
        await writer.set_progress_handler(handler, 1)


async def _until(what: str, check: Callable[[], bool]) -> None:
    """Wait for a scenario step the drivers take by themselves, then report it done."""
    await wait_for(what, check, timeout=DEADLINE_S, every=0.02)
    say("STEP", what)


async def _retrying(what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    """A scenario command, asked again after a refusal the drivers resolve by themselves
    (a publication blocked by a previous life's orphan, capacity still held by a reclaim)."""
    with anyio.fail_after(DEADLINE_S):
        while True:
            try:
                return await fn()
            except (PublicationError, LoraLedgerError) as exc:
                print(f"{what}: {exc} (asking again)", file=sys.stderr, flush=True)
                await anyio.sleep(0.05)


async def run(plane: ControlPlane, scenario: str) -> None:
    ledger = plane.ledger
    trainer = TrainerClient(plane)
    await _retrying("register", lambda: ledger.register_owner(OWNER, ttl_s=3600))
    # As a worker's renewal loop does at once: this owner runs no request, and says so. After a
    # restart the ledger reads an owner's unknown counts as "maybe running" until it does, and
    # reclaim waits for it (or for its hour-long lease to end).
    ledger.renew_lease(OWNER, {})
    for step, arg in SCENARIOS[scenario]:
        state = ledger.state
        if step == "publish":
            config, tensors = make_adapter(arg)
            outcome = await _retrying(
                f"publish {arg}", functools.partial(trainer.publish, tensors, config, step=arg)
            )
            assert outcome.status in ("PUBLISHED", "NO_OP"), outcome
            say("ACK", "publish", arg, outcome.revision)
        elif step == "bind":
            if arg in state.tombstones:
                continue  # bound and released by an earlier life
            bound = await _retrying(f"bind {arg}", functools.partial(ledger.bind, arg, OWNER))
            say("ACK", "bind", arg, bound.version_id)
        elif step == "release":
            if arg in state.tombstones:
                continue
            released = await _retrying(
                f"release {arg}", functools.partial(ledger.release, arg, OWNER)
            )
            say("ACK", "release", arg, released.version_id)
        elif step == "restart":
            records = await ledger.store.read()
            if any(isinstance(r.event, EngineRestarted) and r.event.engine == arg for r in records):
                continue
            old = state.engines[arg].incarnation
            say("RESTART", arg)
            # (mypy cannot infer a lambda whose defaults bind the loop's values)
            await _until(
                f"restarted {arg}",
                lambda a=arg, o=old: ledger.state.engines[a].incarnation != o,  # type: ignore[misc]
            )
        elif step == "reclaimed":
            await _until(
                f"reclaimed {arg}",
                lambda a=arg: ledger.state.versions[a].state is VersionState.RECLAIMED,  # type: ignore[misc]
            )
    await _final(plane, scenario)


async def _final(plane: ControlPlane, scenario: str) -> None:
    """The end state the scenario allows: the last version is the default and the only one
    every engine holds (by the ledger, and by each engine's own fresh inventory), every
    engine is routable, and every retired version is reclaimed."""
    ledger = plane.ledger
    default = FINAL_DEFAULT[scenario]

    def settled() -> bool:
        s = ledger.state
        if s.default != default:
            return False
        name = s.versions[default].lora_name
        if any(
            v.state is not VersionState.RECLAIMED
            for v in s.versions.values()
            if v.version_id != default
        ):
            return False
        return all(e.routable and set(e.holds) == {name} for e in s.engines.values())

    await _until("settled", settled)
    name = ledger.state.versions[default].lora_name
    for engine in plane.fleet:

        async def holds_only_the_default(engine: Engine = engine) -> bool:
            return (await engine.inventory()).names() == {name}

        await wait_for(
            f"{engine.engine_id} to hold {name} alone",
            holds_only_the_default,
            timeout=DEADLINE_S,
            every=0.02,
        )
    # Everything the state shows is durable once the store caught up with it.
    await _until("durable", lambda: ledger.store.last_seq >= ledger.state.last_seq)
    say("DONE", ledger.store.last_seq)


async def main(
    db: str, artifacts: str, scenario: str, mode: str, k: int, urls: Sequence[str]
) -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    timeouts = SGLangTimeouts(control=10, unload=20)
    engines = [LocalHTTPEngine(url, f"e{i}", timeouts=timeouts) for i, url in enumerate(urls)]
    inner = await SQLiteStore.connect(db)
    store = CrashingStore(inner, mode, k)
    try:
        async with ControlPlane.open(
            store,
            Fleet(engines),
            deployment="crash",
            prefix="agent",
            capacity=3,
            artifact_root=artifacts,
            timeouts=TIMEOUTS,
            probe_interval_s=0.05,
            reclaim_tick_s=0.05,
            lease_check_s=0.2,
            cleanup_timeout=5.0,
        ) as plane:
            await run(plane, scenario)
    finally:
        await inner.close()
        for engine in engines:
            await engine.aclose()


if __name__ == "__main__":
    db_, artifacts_, scenario_, mode_, k_, *urls_ = sys.argv[1:]
    anyio.run(main, db_, artifacts_, scenario_, mode_, int(k_), urls_)
