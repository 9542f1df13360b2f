"""Requests in flight per (engine, version): the evidence reclaim waits for.

A version is never unloaded under a running request: the reclaim driver reads the counts of
every gateway before it claims a version, and remote owners carry theirs with every lease
renewal. So the counts must never lag behind the requests: the gateway increments one before
an attempt starts, and ends it when the engine's word says the request is over -- its reply,
a clean refusal, a send that provably never left -- or, for a request the gateway lost track
of (cancelled, timed out, reply lost), when the engine confirms it ended. A count the engine
has not confirmed is *held* (:meth:`InFlightCounter.hold`): it keeps counting until a
condition says the request is gone (a later confirmation, the end of the engine's
incarnation), checked whenever the counts are read.
"""

from __future__ import annotations

from collections.abc import Callable


class InFlightCounter:
    """Requests in flight per (engine, version_id). The gateway keeps one for everything it
    sends; a rollout worker keeps its own (its ``inflight``) so its lease renewals report
    exactly its requests, even when several workers share one gateway."""

    __slots__ = ("_counts", "_held")

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}
        self._held: list[tuple[tuple[str, int], Callable[[], bool]]] = []

    def enter(self, key: tuple[str, int]) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def exit(self, key: tuple[str, int]) -> None:
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]

    def hold(self, key: tuple[str, int], gone: Callable[[], bool]) -> None:
        """Keep one request of ``key`` counted until ``gone()`` is true (instead of
        :meth:`exit`): ``gone`` is asked on every read and must be cheap and synchronous."""
        self._held.append((key, gone))

    def _settle(self) -> None:
        if not self._held:
            return
        kept = []
        for key, gone in self._held:
            if gone():
                self.exit(key)
            else:
                kept.append((key, gone))
        self._held = kept

    def get(self, engine: str, version_id: int) -> int:
        self._settle()
        return self._counts.get((engine, version_id), 0)

    def counts(self) -> dict[tuple[str, int], int]:
        """The non-zero counts (a copy)."""
        self._settle()
        return dict(self._counts)

    @property
    def held(self) -> int:
        """Requests counted only until the engine confirms their end (included in the counts)."""
        self._settle()
        return len(self._held)

    def __bool__(self) -> bool:
        self._settle()
        return bool(self._counts)
