"""Requests in flight per (engine, version): the evidence reclaim waits for.

A version is never unloaded under a running request: the reclaim driver reads the counts of
every gateway before it claims a version, and remote owners carry theirs with every lease
renewal. So the counts must never lag behind the requests: the gateway increments one before
an attempt starts and decrements it in a ``finally`` (completion, error, cancellation).
"""

from __future__ import annotations


class InFlightCounter:
    """Requests in flight per (engine, version_id). The gateway keeps one for everything it
    sends; a rollout worker keeps its own (its ``inflight``) so its lease renewals report
    exactly its requests, even when several workers share one gateway."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}

    def enter(self, key: tuple[str, int]) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def exit(self, key: tuple[str, int]) -> None:
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]

    def get(self, engine: str, version_id: int) -> int:
        return self._counts.get((engine, version_id), 0)

    def counts(self) -> dict[tuple[str, int], int]:
        """The non-zero counts (a copy)."""
        return dict(self._counts)

    def __bool__(self) -> bool:
        return bool(self._counts)
