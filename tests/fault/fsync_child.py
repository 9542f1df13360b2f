"""Child of ``test_fsync_before_ack``: concurrent appenders on a SQLite log, one ``ACK <seq>``
line on stdout per event, written only after the ``append`` that stored it returned.

``python -m tests.fault.fsync_child PATH SYNCHRONOUS APPENDERS EVENTS_EACH``
"""

from __future__ import annotations

import sys

import anyio

from evlog.events import SessionBound
from evlog.record import pending
from evlog.sqlite import SQLiteStore


async def main(path: str, synchronous: str, appenders: int, each: int) -> None:
    async with SQLiteStore.open(path, synchronous=synchronous) as store:  # type: ignore[arg-type]

        async def appender(k: int) -> None:
            for i in range(each):
                event = SessionBound(session=f"s{k}-{i}", owner="w", version_id=1, revision=1)
                seqs = await store.append([pending(event)])
                sys.stdout.write(f"ACK {seqs[0]}\n")
                sys.stdout.flush()

        async with anyio.create_task_group() as tg:
            for k in range(appenders):
                tg.start_soon(appender, k)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
