"""The store contract on ``MemoryStore``; a "file" is a ``MemoryLog`` the tests can tamper with."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from evlog.memory import MemoryLog, MemoryStore
from evlog.record import Row
from evlog.store import EventStore
from tests.evlog.contract import StoreContract, batch_of

_NAMES = (
    "seq",
    "event_id",
    "stream",
    "type",
    "schema",
    "recorded_at",
    "payload",
    "prev_hash",
    "hash",
)


def _index(log: MemoryLog, seq: int) -> int:
    return next(i for i, row in enumerate(log.rows) if row[0] == seq)


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def location(self, tmp_path: Any) -> MemoryLog:
        return MemoryLog()

    def opened(self, location: MemoryLog) -> AbstractAsyncContextManager[EventStore]:
        return MemoryStore.open(location)

    def raw_row(self, location: MemoryLog, seq: int) -> Row:
        return location.rows[_index(location, seq)]

    def rewrite(self, location: MemoryLog, seq: int, **columns: Any) -> None:
        i = _index(location, seq)
        row = dict(zip(_NAMES, location.rows[i], strict=True)) | columns
        location.rows[i] = tuple(row[name] for name in _NAMES)  # type: ignore[assignment]

    def remove(self, location: MemoryLog, seq: int) -> None:
        del location.rows[_index(location, seq)]

    def snapshot_seqs(self, location: MemoryLog, code_version: str) -> list[int]:
        return [s.seq for s in location.snapshots.get(code_version, [])]


@pytest.mark.anyio
async def test_constructs_without_a_running_loop_and_shares_its_log() -> None:
    store = MemoryStore()  # sync construction: simulations build stores before any loop runs
    assert await store.append(batch_of(2)) == [1, 2]
    again = MemoryStore(store.log)  # a "reopen" over the same log after a simulated crash
    assert again.last_seq == 2 and again.head_hash == store.head_hash
    await store.close()
    await again.close()
