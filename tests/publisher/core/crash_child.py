"""Child process for the ledger crash test: runs the ledger service on a SQLite file and drives
publications, binds and releases forever, printing one acknowledgement per answered command.

An acknowledgement is printed only after the ledger answered (so after COMMIT): the parent
kills this process at arbitrary points and then checks that every acknowledged outcome is in
the log. Usage: ``python -m tests.publisher.core.crash_child DB RUN_ID``.

Besides ``ACK <kind> <fields...> <last seq>``, the store prints ``DURABLE <seq>`` as soon as an
append returned (its COMMIT is done), before the ledger can answer anybody: the parent can
tell, for every answer, whether the event recording it had been committed when it was given.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import anyio

from evlog.errors import LoraLedgerError
from evlog.record import Pending
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Skipped
from tests.support.ledger import deliver, digest


def ack(*fields: object) -> None:
    print("ACK", *fields, flush=True)


class ReportingStore:
    """The real ``SQLiteStore``; every append that returned prints ``DURABLE <last seq>``."""

    def __init__(self, inner: SQLiteStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        seqs = await self._inner.append(batch, expected_seq=expected_seq)
        if seqs:
            print("DURABLE", max(seqs), flush=True)
        return seqs


async def publish(ledger: Ledger, version_id: int) -> None:
    """Publish ``version_id`` unless the ledger skips it (capacity) or has it already, then
    acknowledge the revision it published."""
    allocated = await ledger.allocate(version_id, digest(version_id))
    if isinstance(allocated, Skipped) or allocated.no_op:
        return
    published = await deliver(ledger, allocated, owner="crash-child")
    ack("publish", version_id, published.revision, ledger.state.last_seq)


async def main(path: str, run_id: str) -> None:
    async with (
        SQLiteStore.open(path) as inner,
        Ledger.open(ReportingStore(inner)) as ledger,
    ):
        if ledger.state.deployment is None:
            await ledger.create_deployment("crash", prefix="agent", capacity=3)
            for engine in ("e0", "e1"):
                await ledger.join_engine(engine, f"{engine}-1")
                await ledger.repair_engine(engine, f"{engine}-1")
            await ledger.register_owner("w", ttl_s=1e9)
        ack("open", ledger.state.epoch, ledger.state.last_seq)
        step = 0
        while True:
            step += 1
            if step % 7 == 1:
                # Versions come and go: reclaim what is reclaimable so capacity never runs out.
                for version_id in ledger.state.reclaimable():
                    await ledger.claim_reclaim(version_id)
                    for engine in sorted(ledger.state.engines):
                        inc = ledger.state.engines[engine].incarnation
                        await ledger.record_unloaded(version_id, engine, inc)
                    ack("reclaim", version_id, ledger.state.last_seq)
                await publish(ledger, max(ledger.state.versions, default=0) + 1)
            session = f"{run_id}-{step}"

            async def bind(name: str = session, step: int = step) -> None:
                try:
                    bound = await ledger.bind(name, "w")
                except LoraLedgerError as err:
                    ack("refused", name, err.code, ledger.state.last_seq)
                    return
                ack("bind", name, bound.version_id, ledger.state.last_seq)
                if step % 3:
                    await ledger.release(name, "w")
                    ack("release", name, ledger.state.last_seq)

            # A few concurrent commands per step so kills also land inside group commits.
            async with anyio.create_task_group() as tg:
                tg.start_soon(bind)
                tg.start_soon(bind, f"{session}-b")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
