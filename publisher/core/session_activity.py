"""The last turn of each client-held session: soft state of the ledger's process, never logged.

A client-held session (bound through a relay: an OpenAI face) outlives the face that bound it,
so only the ledger's process can decide that it went idle; but only the faces see its turns (a
turn after the first never reaches the ledger as a command). So the faces report the sessions
they touched with their lease renewals (a turn admitted, a turn ended, every turn still in
flight), and the ledger's process keeps, per session, when it last heard of one, by its own
clock (the faces' clocks are never compared with it). Logging each turn would drown the log;
instead the idle release records the evidence it relied on (``SessionReleased.last_turn`` and
``idle_s``), as an expiry records the last renewal (``publisher/core/leases.py`` is the model).

After the ledger's process restarts the book is empty: a session is first *seen* when the idle
sweep meets it, and that counts as its last turn, so every client-held session gets a full idle
bound of grace (its last turn is not in the log) and a restart never releases a live episode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from projections.registry import Binding

# How long the tombstone of a session released for idleness is kept, so that a late turn is
# refused SESSION_CLOSED (cause idle) rather than bound afresh; then it is forgotten, which keeps
# the projection bounded. A day: far beyond any pause of a live episode.
IDLE_TOMBSTONE_S = 86400.0


class SessionActivity:
    """When each client-held session bound now last had a turn, as far as this process heard."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def touch(self, sessions: Iterable[str], now: float, bound: Mapping[str, Binding]) -> None:
        """The faces report a turn of each of ``sessions`` (admitted, ended or still running)
        at ``now``. Only bound sessions that may go idle are kept (anything else would only
        grow the book: an unknown id, an owner-held session, one that is never idle)."""
        last = self._last
        for session in sessions:
            binding = bound.get(session)
            if binding is not None and binding.idle_s:
                last[session] = max(now, last.get(session, now))

    def last_turn(self, session: str) -> float | None:
        return self._last.get(session)

    def drop(self, session: str) -> None:
        """``session`` was released: nothing more to watch."""
        self._last.pop(session, None)

    def idle(self, now: float, bound: Mapping[str, Binding]) -> list[tuple[str, float]]:
        """The client-held sessions (with their last turn) that had none for their idle bound
        at ``now``. A session never seen before is seen now (the grace above), and sessions no
        longer bound are dropped from the book. One pass over the bound sessions."""
        last = self._last
        found: list[tuple[str, float]] = []
        tracked = 0
        for session, binding in bound.items():
            idle_s = binding.idle_s
            if not idle_s:
                continue
            tracked += 1
            seen = last.get(session)
            if seen is None:
                last[session] = now
            elif now - seen >= idle_s:
                found.append((session, seen))
        if len(last) > tracked:  # some were released (or forgotten) since: drop them
            for session in [s for s in last if s not in bound]:
                del last[session]
        return found

    def __len__(self) -> int:
        return len(self._last)
