"""The engine handles this process can reach, by engine id.

The ledger decides membership (join, restart, leave are events); a ``Fleet`` only maps the ids
the ledger knows to live handles (in-process engines, HTTP adapters, Ray actor proxies), so the
drivers and the gateway share one place to find an engine.

``InFlightSource`` is what the reclaim driver asks before claiming a version: every gateway of
this process (and, through the ledger, every remote worker's lease renewals) reports how many
requests it has in flight per (engine, version).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from engines.contract import Engine
from evlog.errors import Refused
from evlog.events import InFlight
from publisher.core.errors import Code


class FleetError(Refused):
    """This process has no handle for an engine (``UNKNOWN_ENGINE``), or already has one
    (``ENGINE_EXISTS``). A fact about this process's handles, not a ledger refusal: the ledger
    may well know the engine."""


class InFlightSource(Protocol):
    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        """This reporter's in-flight counts for ``version_id`` (zero entries included)."""
        ...


@runtime_checkable
class HoldsCounts(Protocol):
    """An in-flight source that holds counts until an engine confirms a request's end (a
    gateway: docs/engines.md, "When a request has ended"). The reclaim driver asks it to ask
    the engines again before each sweep, so a count held while an engine could not answer
    (frozen, unreachable) ends soon after it can, even where no rollout worker renews."""

    async def confirm_ends(self) -> int:
        """Ask again about every held request; returns how many are still held."""
        ...


class Fleet:
    """Mutable on purpose, through three calls only: :meth:`add`, :meth:`replace` and
    :meth:`remove`. Every holder of the object (the drivers of a control plane, a gateway)
    sees a change at its next lookup, and :attr:`version` counts the changes, so a process
    that mirrors another's fleet (a Ray client of the ledger actor) can tell that it is
    behind. Membership itself is the ledger's (events); this is only where the handles are."""

    def __init__(self, engines: Iterable[Engine] = ()) -> None:
        self._engines: dict[str, Engine] = {}
        self.version = 0  # bumped by every add, replace and remove
        for engine in engines:
            self.add(engine)

    def add(self, engine: Engine) -> None:
        if engine.engine_id in self._engines:
            raise FleetError(Code.ENGINE_EXISTS, f"engine {engine.engine_id} is already here")
        self._engines[engine.engine_id] = engine
        self.version += 1

    def replace(self, engine: Engine) -> None:
        """Swap the handle of an engine (a restarted process behind a new handle), or add it."""
        self._engines[engine.engine_id] = engine
        self.version += 1

    def remove(self, engine_id: str) -> Engine | None:
        engine = self._engines.pop(engine_id, None)
        if engine is not None:
            self.version += 1
        return engine

    def __getitem__(self, engine_id: str) -> Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            raise FleetError(
                Code.UNKNOWN_ENGINE, f"no handle for engine {engine_id!r} in this process"
            )
        return engine

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def __iter__(self) -> Iterator[Engine]:
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def ids(self) -> list[str]:
        return sorted(self._engines)
