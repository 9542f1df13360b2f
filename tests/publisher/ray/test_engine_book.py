"""The engine book under concurrent changes, on Ray's real key-value store.

The ledger actor changes the book from worker threads, several at once (two engines added by
concurrent calls). A change was a read and a write of the whole book with nothing between
them: two concurrent changes read the same book and the second write dropped the first
engine, which the ledger, once restarted, made leave the fleet."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

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


def test_the_book_is_keyed_by_deployment_and_an_old_url_keyed_book_is_still_read(
    ray_instance: Any,
) -> None:
    """The key was the log's location as given: a PostgreSQL URL's password sat in Ray's
    key-value store in clear, and a rotated password found no book (the engines added at runtime
    left the fleet at the next restart). Now the key names the deployment; a book written under
    the old key is read, and moved (the old key deleted) on the next change."""
    from ray.experimental import internal_kv

    name = f"ledger-{uuid.uuid4().hex[:8]}"
    old_url = "postgresql://ledger:old-pass@db.example:5432/ledger"
    entry = BookEntry(
        actor_name="engine-0", actor_namespace="loraledger", kind="local", transport="path"
    )
    old_key = f"engine-book/loraledger-test/{name}/{old_url}"
    internal_kv._internal_kv_put(
        old_key, msgspec.json.encode({"e0": entry}), overwrite=True, namespace="loraledger"
    )

    book = EngineBook(name, "loraledger-test", "default", log_location=old_url)
    assert "old-pass" not in book.key
    assert book.read() == {"e0": entry}
    book.record("e1", None)
    assert not internal_kv._internal_kv_get(old_key, namespace="loraledger")

    rotated = EngineBook(
        name, "loraledger-test", "default", log_location=old_url.replace("old-pass", "new-pass")
    )
    assert rotated.key == book.key
    assert rotated.read() == {"e0": entry, "e1": None}
