"""The engine book's rules, in process: where the book lives in Ray's key-value store (a key
and namespace a restarted ledger actor of a later release must find again), what a read makes
of an empty, an old-keyed or an unreadable book, the whole-book write that moves an old book,
one engine's change or removal, whose book a ledger actor keeps, what an entry records of an
engine, and the fleet a restarted ledger actor opens with.

Ray's GCS is replaced by a double of its key-value table (:class:`GcsKeyValueDouble`): Ray's
own ``internal_kv`` functions run unchanged over it, their encoding and argument checks
included. Actor names and the runtime context are doubles too (:class:`NamedActorsDouble`,
:class:`RuntimeContextDouble`). No Ray instance is started, so each test takes milliseconds
(the mutation campaign over the book runs them once per mutant); the same book on Ray's real
store, under concurrent changes: ``test_engine_book.py``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import ray
from ray.experimental import internal_kv

from publisher.ray import engine_book
from publisher.ray.engine import RayEngine
from publisher.ray.engine_book import BookEntry, EngineBook, entry_for, fleet_with_book

NAMESPACE = b"loraledger"  # Ray's key-value namespace of every book, in every release


class GcsKeyValueDouble:
    """Test double of the GCS client's key-value table, the calls ``internal_kv`` makes: keys
    per namespace (bytes); a missing key reads as None; a put overwrites only when told to and
    answers how many keys it added; a delete answers how many keys it removed. As Ray's GCS."""

    def __init__(self) -> None:
        self.table: dict[tuple[bytes | None, bytes], bytes] = {}
        self.gets = self.puts = self.deletes = 0

    def internal_kv_get(self, key: bytes, namespace: bytes | None, timeout: Any = None) -> Any:
        self.gets += 1
        return self.table.get((namespace, key))

    def internal_kv_put(
        self,
        key: bytes,
        value: bytes,
        overwrite: bool,
        namespace: bytes | None,
        timeout: Any = None,
    ) -> int:
        self.puts += 1
        if (namespace, key) in self.table:
            if overwrite:
                self.table[(namespace, key)] = value
            return 0
        self.table[(namespace, key)] = value
        return 1

    def internal_kv_del(
        self, key: bytes, del_by_prefix: bool, namespace: bytes | None, timeout: Any = None
    ) -> int:
        assert not del_by_prefix  # the book deletes one key, never a prefix
        self.deletes += 1
        return 0 if self.table.pop((namespace, key), None) is None else 1

    def book(self, key: str) -> Any:
        raw = self.table[(NAMESPACE, key.encode())]
        return msgspec.json.decode(raw, type=dict[str, BookEntry | None])


class NamedActorsDouble:
    """Test double of Ray's named actors: ``get_actor`` by name and namespace, ValueError for
    a name no live actor holds (as ``ray.get_actor``)."""

    def __init__(self, **actors: tuple[str, object]) -> None:
        self.actors = {(name, namespace): handle for name, (namespace, handle) in actors.items()}

    def get_actor(self, name: str, namespace: str | None = None) -> object:
        try:
            return self.actors[(name, namespace or "")]
        except KeyError:
            raise ValueError(f"Failed to look up actor with name '{name}'") from None


class RuntimeContextDouble:
    """Test double of ``ray.get_runtime_context()`` inside an actor (name None outside one)."""

    def __init__(self, name: str | None, namespace: str) -> None:
        self._name, self.namespace = name, namespace

    def get_actor_name(self) -> str | None:
        return self._name


class HandleDouble:
    """Test double of an engine actor's handle: ``actor_name.remote()`` answers its name and
    namespace (``ray.get`` is the double's identity, see ``asked``)."""

    def __init__(self, name: str, namespace: str) -> None:
        self.answer = (name, namespace)
        self.actor_name = self

    def remote(self) -> tuple[str, str]:
        return self.answer


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> GcsKeyValueDouble:
    table = GcsKeyValueDouble()
    monkeypatch.setattr(internal_kv, "global_gcs_client", table)
    return table


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """``ray.get`` over :class:`HandleDouble` answers: the timeouts it was given."""
    timeouts: list[float | None] = []

    def get(answer: object, *, timeout: float | None = None) -> object:
        timeouts.append(timeout)
        return answer

    monkeypatch.setattr(ray, "get", get)
    return timeouts


def entry(n: int, endpoint: str = "") -> BookEntry:
    return BookEntry(
        actor_name=f"engine-{n}",
        actor_namespace="fleet",
        kind="local",
        transport="artifact",
        endpoint=endpoint,
    )


def test_the_book_lives_under_its_deployment_in_the_loraledger_namespace(
    gcs: GcsKeyValueDouble,
) -> None:
    """The key is the book's address across restarts and releases: a ledger actor restarted
    by a later release finds the book an earlier one wrote only at the same key."""
    book = EngineBook("ledger", "prod", "default", log_location="/logs/ledger.db")
    assert book.key == "engine-book/prod/ledger/default"
    book.record("e1", entry(1))
    assert set(gcs.table) == {(NAMESPACE, b"engine-book/prod/ledger/default")}
    assert gcs.book(book.key) == {"e1": entry(1)}


def test_a_book_is_read_from_the_bytes_an_earlier_release_stored(gcs: GcsKeyValueDouble) -> None:
    stored = (
        b'{"e0":{"actor_name":"engine-0","actor_namespace":"fleet","kind":"local",'
        b'"transport":"artifact","endpoint":"http://127.0.0.1:9000"},"e1":null}'
    )
    gcs.table[(NAMESPACE, b"engine-book/prod/ledger/default")] = stored
    book = EngineBook("ledger", "prod", "default")
    assert book.read() == {"e0": entry(0, "http://127.0.0.1:9000"), "e1": None}


def test_no_book_reads_as_empty_and_an_unreadable_one_too(gcs: GcsKeyValueDouble) -> None:
    """An unreadable book is logged and read as empty: the ledger opens with the configured
    fleet rather than not at all."""
    book = EngineBook("ledger", "prod", "default", log_location="/logs/ledger.db")
    assert book.read() == {}
    assert EngineBook("ledger", "prod", "default").read() == {}
    gcs.table[(NAMESPACE, book.key.encode())] = b'{"e0": {"actor_name": 7}}'
    assert book.read() == {}


def test_an_old_url_keyed_book_is_read_until_the_first_write_moves_it(
    gcs: GcsKeyValueDouble,
) -> None:
    """A book written under the old key (the log's location) is read while the new key holds
    nothing; the first write puts the whole book under the new key and deletes the old one
    (it may hold a password). Once the new key holds a book, an old one is never read."""
    url = "postgresql://ledger:pw@db:5432/ledger"
    old_key = f"engine-book/prod/ledger/{url}".encode()
    gcs.table[(NAMESPACE, old_key)] = msgspec.json.encode({"e0": entry(0)})
    book = EngineBook("ledger", "prod", "default", log_location=url)
    assert book.read() == {"e0": entry(0)}
    book.record("e1", None)
    assert set(gcs.table) == {(NAMESPACE, book.key.encode())}
    assert gcs.book(book.key) == {"e0": entry(0), "e1": None}

    gcs.table[(NAMESPACE, old_key)] = msgspec.json.encode({"stale": entry(9)})  # left behind
    assert book.read() == {"e0": entry(0), "e1": None}


def test_a_book_with_no_earlier_location_asks_nothing_of_an_old_key(
    gcs: GcsKeyValueDouble,
) -> None:
    """Each GCS call is a blocking round trip of the ledger actor: a book given no log
    location (none was ever written under one) reads with one call and writes with one."""
    book = EngineBook("ledger", "prod", "default")
    assert book.read() == {}
    assert (gcs.gets, gcs.puts, gcs.deletes) == (1, 0, 0)
    book.record("e1", entry(1))
    assert (gcs.gets, gcs.puts, gcs.deletes) == (2, 1, 0)


def test_each_change_rewrites_the_whole_book_and_keeps_every_other_entry(
    gcs: GcsKeyValueDouble,
) -> None:
    book = EngineBook("ledger", "prod", "default")
    book.record("e1", entry(1))
    book.record("e2", None)  # removed at runtime: a tombstone, not a missing entry
    book.record("e1", entry(3))  # replaced
    assert gcs.book(book.key) == {"e1": entry(3), "e2": None}
    assert book.read() == {"e1": entry(3), "e2": None}


def test_forgetting_drops_one_entry_and_writes_nothing_when_there_was_none(
    gcs: GcsKeyValueDouble,
) -> None:
    book = EngineBook("ledger", "prod", "default")
    book.record("e1", entry(1))
    book.record("e2", None)
    book.forget("e2")  # a tombstone is an entry: forgetting it is a change
    assert gcs.book(book.key) == {"e1": entry(1)}
    puts = gcs.puts
    book.forget("e9")
    assert gcs.puts == puts  # nothing to forget: no GCS round trip
    book.forget("e1")
    assert gcs.book(book.key) == {}


def test_a_named_ledger_actor_keeps_the_book_of_its_name_and_namespace(
    gcs: GcsKeyValueDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unnamed actor (or the driver) has no book: it could not be found again to read it."""
    url = "postgresql://ledger:pw@db:5432/ledger"
    gcs.table[(NAMESPACE, f"engine-book/prod/ledger-a/{url}".encode())] = msgspec.json.encode(
        {"e0": entry(0)}
    )
    context = RuntimeContextDouble("ledger-a", "prod")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    book = EngineBook.of_this_actor("default", url)
    assert book is not None and book.key == "engine-book/prod/ledger-a/default"
    assert book.read() == {"e0": entry(0)}  # the old key, from the log location given

    for unnamed in (None, ""):
        context._name = unnamed
        assert EngineBook.of_this_actor("default", url) is None


def test_an_entry_names_the_engines_actor_and_what_a_handle_needs(
    asked: list[float | None],
) -> None:
    """Asking the actor its name waits at most a minute: a dead actor must not hold the
    ledger's change forever. An unnamed actor gets no entry (it cannot be found again)."""
    engine = RayEngine(HandleDouble("engine-4", "fleet"), "e4", "http", "artifact", "http://h:1")
    assert entry_for(engine) == BookEntry(
        actor_name="engine-4",
        actor_namespace="fleet",
        kind="http",
        transport="artifact",
        endpoint="http://h:1",
    )
    assert len(asked) == 1 and asked[0] is not None and 0 < asked[0] <= 60
    unnamed = RayEngine(HandleDouble("", "fleet"), "e5", "local", "artifact")
    assert entry_for(unnamed) is None


def test_a_restarted_ledger_opens_the_configured_fleet_with_the_books_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configured engines stay unless the book names them; the book's removed engines leave,
    its replaced and added ones are reached by their actor names, and one whose actor is
    gone gets no handle (the start-up pass makes it leave), not its configured predecessor."""
    actors = NamedActorsDouble(
        **{"engine-2": ("fleet", "handle-2"), "engine-3": ("fleet", "handle-3")}
    )
    monkeypatch.setattr(ray, "get_actor", actors.get_actor)
    configured = tuple(
        RayEngine(f"configured-{i}", f"e{i}", "local", "artifact") for i in (0, 1, 2, 4)
    )
    book: dict[str, BookEntry | None] = {
        "e0": None,  # removed at runtime
        "e2": entry(2, "http://h:2"),  # replaced
        "e4": entry(9),  # replaced, but its actor is gone
        "e3": BookEntry(  # added
            actor_name="engine-3", actor_namespace="fleet", kind="http", transport="staged"
        ),
    }
    fleet = fleet_with_book(configured, book)
    assert [
        (e.engine_id, e.handle, e.kind, e.transport, e.capabilities.endpoint) for e in fleet
    ] == [
        ("e1", "configured-1", "local", "artifact", ""),
        ("e2", "handle-2", "local", "artifact", "http://h:2"),
        ("e3", "handle-3", "http", "staged", ""),
    ]
    assert all(isinstance(e, RayEngine) for e in fleet)
    assert fleet_with_book(configured, {}) == list(configured)
    assert engine_book.fleet_with_book((), {"e9": None}) == []
