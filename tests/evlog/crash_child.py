"""Child process of ``test_store_crash``: appends to a SQLite log until it is killed.

``python -m tests.evlog.crash_child PATH SYNCHRONOUS APPENDERS RUN``

Prints ``open <last_seq>`` once the store is open, then one line ``<seq> <event_id hex>`` per
event, written only after the ``append`` that stored it returned: a line the parent reads is
an acknowledgement, and an acknowledged event must survive the kill. Several appenders run at
once so the kills land inside merged (group-committed) transactions too.
"""

from __future__ import annotations

import sys

import anyio

from evlog.events import SessionBound
from evlog.record import pending
from evlog.sqlite import SQLiteStore


async def main(path: str, synchronous: str, appenders: int, run: str) -> None:
    out = sys.stdout
    async with SQLiteStore.open(path, synchronous=synchronous) as store:  # type: ignore[arg-type]
        out.write(f"open {store.last_seq}\n")
        out.flush()

        async def appender(k: int) -> None:
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

        async with anyio.create_task_group() as tg:
            for k in range(appenders):
                tg.start_soon(appender, k)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
