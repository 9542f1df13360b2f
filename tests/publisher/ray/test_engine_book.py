"""The engine book under concurrent changes, on Ray's real key-value store.

The ledger actor changes the book from worker threads, several at once (two engines added by
concurrent calls). A change was a read and a write of the whole book with nothing between
them: two concurrent changes read the same book and the second write dropped the first
engine, which the ledger, once restarted, made leave the fleet."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from publisher.ray.engine_book import BookEntry, EngineBook


def test_concurrent_changes_keep_every_entry(ray_instance: Any) -> None:
    book = EngineBook(f"ledger-{uuid.uuid4().hex[:8]}", "loraledger-test", "/logs/ledger.db")
    entries: dict[str, BookEntry | None] = {
        f"e{i}": BookEntry(
            actor_name=f"engine-{i}", actor_namespace="loraledger", kind="local", transport="path"
        )
        for i in range(24)
    }
    with ThreadPoolExecutor(len(entries)) as pool:
        list(pool.map(lambda item: book.record(*item), entries.items()))
    assert book.read() == entries

    removed = list(entries)[:12]
    with ThreadPoolExecutor(len(removed)) as pool:
        list(pool.map(book.forget, removed))
    assert set(book.read()) == set(entries) - set(removed)
