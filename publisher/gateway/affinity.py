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

**Bounded load** (:func:`place`, what the gateway calls): pure rendezvous ignores load, so a
few long sessions hashed to one engine queue behind each other while its peers idle. As in
consistent hashing with bounded loads, no engine takes a turn that would lift it over
``ceil((1 + eps) * (in flight + 1) / holders)``, the mean load of the session's version's
holders (the turn being placed counted) times ``1 + eps``, nor any below a floor of requests
an engine serves at once anyway (:data:`DEFAULT_LOAD_FLOOR`). A session stays on the engine that
served its last turn while that engine is within the bound, else walks its rendezvous order to
the first holder within it; one always is (the least loaded holder is at most the floor of the
mean, the bound at least one more). Only holders of the session's version are ever candidates,
so a session never moves off its version. ``eps = inf`` is pure rendezvous; with equal loads
the choice is rendezvous's, so "same answer everywhere" holds whenever no engine is over the
bound, and a session moved by the bound stays where it moved (its prefix cache is there now;
:func:`moved_by_load` says when to remember it).

Requests with no session (one-turn) have no stickiness to keep: :func:`least_loaded` spreads
them, round-robin among equally loaded holders.
"""

from __future__ import annotations

import hashlib
import math
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


# How far over the holders' mean load an engine may go before a session is placed elsewhere:
# 25% keeps most turns on their engine (and its prefix cache) while capping the queue behind a
# hot engine; the routing benchmark (BENCHMARKS.md) measured it.
DEFAULT_LOAD_EPS = 0.25
# Below this many requests in flight an engine is never over the bound: every engine this
# project drives batches far more than that at once (vLLM's ``max_num_seqs`` is 256 by
# default), so moving a session off it would gain no queueing and cost its prefix cache; at
# small counts the integer bound alone would move sessions on every fluctuation.
DEFAULT_LOAD_FLOOR = 16


def load_bound(loads: Sequence[int], eps: float, floor: int = DEFAULT_LOAD_FLOOR) -> int:
    """The most requests in flight an engine may have once the one being placed is counted:
    ``ceil((1 + eps) * (sum(loads) + 1) / len(loads))`` (``loads``: one per candidate), and
    never less than ``floor``."""
    return max(floor, math.ceil((1.0 + eps) * (sum(loads) + 1) / len(loads)))


def place(
    session: str,
    holders: Sequence[str],
    *,
    load: Mapping[str, int] | None = None,
    eps: float = DEFAULT_LOAD_EPS,
    floor: int = DEFAULT_LOAD_FLOOR,
    current: str | None = None,
    exclude: Collection[str] = (),
) -> str | None:
    """The engine of ``holders`` (minus ``exclude``) that ``session``'s next turn goes to, with
    bounded load (module docstring), or None. ``current`` is the engine that served the
    session's last turn (kept while within the bound; ignored when no longer a candidate);
    ``eps = inf`` is :func:`rendezvous`; ``floor`` is :data:`DEFAULT_LOAD_FLOOR`."""
    load = load or {}
    candidates = [e for e in holders if e not in exclude]
    if not candidates:
        return None
    if math.isinf(eps):
        return rendezvous(session, candidates, load=load)
    bound = load_bound([load.get(e, 0) for e in candidates], eps, floor)

    def fits(engine: str) -> bool:
        return load.get(engine, 0) + 1 <= bound

    if current is not None and current in candidates and fits(current):
        return current
    ordered = sorted(candidates, key=lambda e: (-weight(session, e), load.get(e, 0), e))
    # One always fits (module docstring); the least loaded is the answer should it not.
    return next((e for e in ordered if fits(e)), min(ordered, key=lambda e: load.get(e, 0)))


def moved_by_load(
    session: str, engine: str, holders: Sequence[str], exclude: Collection[str] = ()
) -> bool:
    """Whether :func:`place` put ``session`` on ``engine`` rather than on its rendezvous engine
    among ``holders`` (minus ``exclude``): only then is ``engine`` the session's ``current``
    to remember. A session that went to its rendezvous engine needs no memory, so one that
    only left an engine because it stopped being a holder returns to it once it is one again,
    as with pure rendezvous."""
    return engine != rendezvous(session, holders, exclude=exclude)


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
