"""Reading what the ledger recorded: the one reader of a log's events in the tests.

A test asserts on the log, not only on answers: the log is the ledger's truth. Given the
:class:`~publisher.core.ledger.Ledger` itself, the reader first waits until everything the ledger's
state already shows is durable: that state runs up to one batch ahead of the store (it is
decided before it is written), so reading the store at once could miss the last events.
"""

from __future__ import annotations

from typing import Any, TypeVar

from evlog.events import Event
from evlog.record import Record
from evlog.store import EventStore
from publisher.core.ledger import Ledger
from tests.support.waiting import wait_for

EventT = TypeVar("EventT", bound=Event)


async def records(source: EventStore | Ledger, after: int = 0) -> list[Record]:
    """The records of the log after seq ``after`` (from the ledger: once they are durable)."""
    if isinstance(source, Ledger):
        target = source.state.last_seq
        store = source.store
        await wait_for(
            f"the store to hold the ledger's events up to seq {target}",
            lambda: store.last_seq >= target,
        )
    else:
        store = source
    return await store.read(after=after)


async def events(source: EventStore | Ledger, after: int = 0) -> list[Event]:
    """The events of the log after seq ``after``, in order."""
    return [r.event for r in await records(source, after)]


async def events_of(source: EventStore | Ledger, kind: type[EventT]) -> list[EventT]:
    """The events of one class, in log order."""
    return [e for e in await events(source) if isinstance(e, kind)]


async def numbered(source: EventStore | Ledger, kind: type[EventT]) -> list[tuple[int, EventT]]:
    """The events of one class with their seqs, in log order (to compare their order with
    another class's)."""
    return [(r.seq, r.event) for r in await records(source) if isinstance(r.event, kind)]


def of_type(items: list[Event], *kinds: type) -> list[Any]:
    """The events of ``items`` that are of any of ``kinds`` (one read, several filters)."""
    return [e for e in items if isinstance(e, kinds)]
