"""The engine book: which Ray actor serves each engine added or replaced at runtime, kept where
a restarted ledger actor finds it again.

Why it exists. A ledger actor opens its plane with ``PlaneConfig.engines``, the fleet it was
created with, and the reconciler's start-up pass makes every ledger member without a handle
leave. Without more, a restart of the actor (by Ray, or ``start_ledger`` again) would undo
every runtime change: an added engine would leave, a replaced one would be probed at its dead
predecessor and suspended, a removed one would join again. The log records membership (the
fleet events) but not how to reach an actor, and it should not: an actor name is this
deployment's wiring, not a decision.

Why Ray's key-value store. Ray keeps the names of named actors in its GCS; the book is kept
next to them, in the GCS's key-value store, so it has their lifetime exactly: a cluster whose
GCS forgot the book has forgotten the named actors too. It is not on the ledger's disk (a
ledger restarted on another node finds it) and it needs nothing the log store offers. The
store is Ray's internal one (``ray.experimental.internal_kv``, which Ray's own libraries use);
every access is in this module.

What it holds, per ledger actor (``namespace``/``name``) and deployment (never the log's URL,
which may hold a password and changes when the password rotates): for each engine id changed at
runtime, the actor name and namespace of its engine actor plus what a handle needs (kind,
transport, endpoint), or a tombstone for an engine removed at runtime. Only named engine actors
can be found again (``start_engine`` always names them); an unnamed one is served until the
ledger restarts and is logged as such. The ledger actor is its only writer.
"""

from __future__ import annotations

import threading

import msgspec
import ray
from ray.experimental import internal_kv

from publisher.logs import get_logger
from publisher.ray.engine import RayEngine

log = get_logger("loraledger.ray")

_KV_NAMESPACE = "loraledger"
# A change is a read, then a write of the whole book (two GCS calls). The ledger actor makes
# changes from worker threads, several at once (two engines added concurrently): without this,
# both read the same book and the second write drops the first engine, which a restarted
# ledger then makes leave. The actor is the book's only writer, so one lock per process will do.
_CHANGES = threading.Lock()


class BookEntry(msgspec.Struct, frozen=True, kw_only=True):
    actor_name: str
    actor_namespace: str
    kind: str
    transport: str
    endpoint: str = ""


class EngineBook:
    """The book of one ledger actor and deployment. Blocking (GCS round trips): call it from a
    worker thread."""

    def __init__(
        self,
        ledger_name: str,
        ledger_namespace: str,
        deployment: str,
        *,
        log_location: str | None = None,
    ) -> None:
        # Keyed by the deployment: the ledger actor's namespace and name and the deployment
        # its log holds. Never the log's URL: the key would show a PostgreSQL password to
        # whoever lists the GCS, and a rotated password (or a moved server) would lose the
        # book, so the engines added at runtime would leave the fleet at the next restart.
        self.key = f"engine-book/{ledger_namespace}/{ledger_name}/{deployment}"
        # Books written before this rule were keyed by the log location as given: read while
        # the new key holds nothing, deleted by the first write under the new key.
        self._old_key = (
            f"engine-book/{ledger_namespace}/{ledger_name}/{log_location}"
            if log_location is not None
            else None
        )

    @classmethod
    def of_this_actor(cls, deployment: str, log_location: str) -> EngineBook | None:
        """The book of the named actor this code runs in (None outside a named actor)."""
        context = ray.get_runtime_context()
        name = context.get_actor_name()
        if not name:
            return None
        return cls(name, context.namespace, deployment, log_location=log_location)

    def read(self) -> dict[str, BookEntry | None]:
        raw = internal_kv._internal_kv_get(self.key, namespace=_KV_NAMESPACE)
        if not raw and self._old_key is not None:
            raw = internal_kv._internal_kv_get(self._old_key, namespace=_KV_NAMESPACE)
        if not raw:
            return {}
        try:
            return msgspec.json.decode(raw, type=dict[str, BookEntry | None])
        except msgspec.DecodeError as exc:
            log.error("ray.engine_book_unreadable", key=self.key, error=str(exc))
            return {}

    def write(self, entries: dict[str, BookEntry | None]) -> None:
        internal_kv._internal_kv_put(
            self.key, msgspec.json.encode(entries), overwrite=True, namespace=_KV_NAMESPACE
        )
        if self._old_key is not None:  # it may hold a password: gone once the book moved
            internal_kv._internal_kv_del(self._old_key, namespace=_KV_NAMESPACE)

    def record(self, engine_id: str, entry: BookEntry | None) -> None:
        """Set one engine's entry (``None``: removed at runtime)."""
        with _CHANGES:
            entries = self.read()
            entries[engine_id] = entry
            self.write(entries)

    def forget(self, engine_id: str) -> None:
        """Drop one engine's entry (the configured handle, if any, applies again)."""
        with _CHANGES:
            entries = self.read()
            if entries.pop(engine_id, ...) is not ...:
                self.write(entries)


def entry_for(engine: RayEngine) -> BookEntry | None:
    """What the book needs to reach ``engine``'s actor again, or None for an unnamed actor
    (asks the actor who it is: blocking)."""
    name, namespace = ray.get(engine.handle.actor_name.remote(), timeout=60)
    if not name:
        log.warning(
            "ray.engine_unnamed",
            engine=engine.engine_id,
            detail="an unnamed engine actor is not found again after a ledger restart",
        )
        return None
    return BookEntry(
        actor_name=name,
        actor_namespace=namespace,
        kind=engine.kind,
        transport=engine.transport,
        endpoint=engine.capabilities.endpoint,
    )


def fleet_with_book(
    configured: tuple[RayEngine, ...], book: dict[str, BookEntry | None]
) -> list[RayEngine]:
    """The fleet a (re)started ledger actor opens its plane with: the configured engines, with
    the book's runtime changes applied (blocking: resolves actor names). An engine whose actor
    cannot be found any more gets no handle, so the start-up pass makes it leave, as for any
    member the plane has no handle for."""
    engines = {engine.engine_id: engine for engine in configured}
    for engine_id, entry in book.items():
        engines.pop(engine_id, None)
        if entry is None:
            continue
        try:
            handle = ray.get_actor(entry.actor_name, namespace=entry.actor_namespace)
        except ValueError:
            log.warning("ray.engine_book_actor_gone", engine=engine_id, actor=entry.actor_name)
            continue
        engines[engine_id] = RayEngine(
            handle,
            engine_id,
            entry.kind,
            entry.transport,  # type: ignore[arg-type]
            entry.endpoint,
        )
    return list(engines.values())
