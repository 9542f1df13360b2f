"""Which engine serves a session's turn: rendezvous (highest-random-weight) hashing, pure.

Every gateway process, with no coordination, must send a session's turns to the same engine,
so its prefix cache keeps serving the growing conversation. Rendezvous hashing gives exactly
that: each (session, engine) pair gets a weight from a hash both sides can compute, and the
session goes to the holder with the highest weight. Properties the gateway relies on:

* **Same answer everywhere**: the weight depends only on the session id and the engine id
  (SHA-256, never Python's per-process ``hash``), so two gateways with the same holders agree.
* **Moves only when it must**: removing an engine moves only the sessions it was serving;
  adding one moves only the sessions it now wins. A session leaves its engine only when that
  engine stops holding the version or stops being routable (it drops out of ``holders``).
* **Load breaks ties only among equals**: two engines with the same weight (a hash collision
  in practice never happens, but the rule is total) are ordered by load, then by id.

Requests with no session (one-turn) have no stickiness to keep: :func:`least_loaded` spreads
them, round-robin among equally loaded holders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence


def weight(session: str, engine: str) -> int:
    """The rendezvous weight of ``engine`` for ``session``: 64 bits of SHA-256 over both ids
    (length-prefixed, so ``("ab", "c")`` and ``("a", "bc")`` differ)."""
    key = f"{len(session)}:{session}\x00{engine}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def rendezvous(
    session: str,
    holders: Sequence[str],
    *,
    load: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
) -> str | None:
    """The engine of ``holders`` (minus ``exclude``) that ``session`` goes to, or None."""
    load = load or {}
    best: tuple[int, int, str] | None = None
    chosen: str | None = None
    for engine in holders:
        if engine in exclude:
            continue
        # highest weight first; among equal weights the least loaded, then the smallest id
        rank = (-weight(session, engine), load.get(engine, 0), engine)
        if best is None or rank < best:
            best, chosen = rank, engine
    return chosen


def least_loaded(
    holders: Sequence[str],
    *,
    load: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    start: int = 0,
) -> str | None:
    """For requests without a session: the least loaded holder, the tie among equals broken by
    rotating from ``start`` (a caller's counter, so equal holders take turns)."""
    load = load or {}
    candidates = [e for e in holders if e not in exclude]
    if not candidates:
        return None
    at = start % len(candidates)
    rotated = candidates[at:] + candidates[:at]
    return min(rotated, key=lambda e: load.get(e, 0))
