"""Child process of ``test_store_crash``: appends to a log until it is killed.

``python -m tests.evlog.crash_child LOCATION SYNCHRONOUS APPENDERS RUN [KILL_AFTER]``

``LOCATION`` is a SQLite path or a ``postgresql://`` URL (``evlog.open_store``).

Prints ``open <last_seq>`` once the store is open, then one line ``<seq> <event_id hex>`` per
event, written only after the ``append`` that stored it returned: a line the parent reads is
an acknowledgement, and an acknowledged event must survive the kill. Several appenders run at
once so the kills land inside merged (group-committed) transactions too.

``KILL_AFTER`` > 0: once that many events are acknowledged, the child SIGKILLs itself *inside
the next write statement* (a SQLite progress handler on the store's writer connection), after
letting the event loop run everything already ready: any appender a store answered before that
statement's COMMIT prints its acknowledgement first, and the kill then loses its events. On
PostgreSQL the kill lands inside the next group's transaction, between its INSERT and its
COMMIT (the server rolls it back). The parent's kill lands at a random instant instead, which
rarely hits that window.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import anyio

from evlog.events import SessionBound
from evlog.postgres import PostgresStore
from evlog.record import Row, pending
from evlog.sqlite import SQLiteStore
from evlog.store import EventStore
from evlog.stores import open_store


async def arm_kill_inside_next_statement(store: SQLiteStore) -> None:
    """SIGKILL this process a few virtual-machine instructions into the writer's next statement
    (its write transaction open, nothing committed), once the event loop ran two full passes of
    what was ready: an answer given before the COMMIT is printed before the kill."""
    loop = asyncio.get_running_loop()
    calls = 0

    def handler() -> int:  # runs in aiosqlite's thread, inside the statement
        nonlocal calls
        calls += 1
        if calls >= 4:
            passed = threading.Event()
            loop.call_soon_threadsafe(loop.call_soon, passed.set)
            passed.wait(5.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return 0

    await store._writer.set_progress_handler(handler, 1)  # the store's one writer connection


def arm_kill_inside_next_transaction_pg(store: PostgresStore) -> None:
    """SIGKILL this process inside the next group's transaction: its rows inserted, its COMMIT
    not sent, once the event loop ran two more passes (any appender a store answered before
    that COMMIT prints first, and the server then rolls the transaction back: its events are
    lost). The group is sent down the slow path, an explicit transaction, for that."""
    insert = store._insert
    loop = asyncio.get_running_loop()

    async def insert_then_die(rows: list[Row]) -> None:
        await insert(rows)
        passed = asyncio.Event()
        loop.call_soon(loop.call_soon, passed.set)
        await passed.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    store._suspect = True  # re-plan inside a transaction: BEGIN, LOCK, INSERT, (kill), COMMIT
    store._insert = insert_then_die  # type: ignore[method-assign]


async def arm_kill(store: EventStore) -> None:
    if isinstance(store, SQLiteStore):
        await arm_kill_inside_next_statement(store)
    else:
        assert isinstance(store, PostgresStore)
        arm_kill_inside_next_transaction_pg(store)


async def main(location: str, synchronous: str, appenders: int, run: str, kill_after: int) -> None:
    out = sys.stdout
    async with open_store(location, synchronous=synchronous) as store:  # type: ignore[arg-type]
        out.write(f"open {store.last_seq}\n")
        out.flush()
        acknowledged = 0

        async def appender(k: int) -> None:
            nonlocal acknowledged
            i = 0
            while True:
                batch = [
                    pending(
                        SessionBound(
                            session=f"{run}-{k}-{i}-{j}", owner=f"w{k}", version_id=1, revision=1
                        )
                    )
                    for j in range(1 + i % 3)
                ]
                seqs = await store.append(batch)
                out.write(
                    "".join(f"{s} {p.event_id.hex()}\n" for s, p in zip(seqs, batch, strict=True))
                )
                out.flush()
                i += 1
                before, acknowledged = acknowledged, acknowledged + len(seqs)
                if before < kill_after <= acknowledged:
                    await arm_kill(store)

        async with anyio.create_task_group() as tg:
            for k in range(appenders):
                tg.start_soon(appender, k)


if __name__ == "__main__":
    kill_after_ = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], kill_after_)
