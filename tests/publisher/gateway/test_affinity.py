"""Rendezvous routing (publisher/affinity.py): the same answer in every process, a session
moves only when its engine leaves the holders, and sessions spread over the holders."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from publisher.gateway.affinity import least_loaded, rendezvous, weight

HOLDERS = ["e0", "e1", "e2", "e3"]
SESSIONS = [f"session-{i}" for i in range(2000)]


def test_the_weight_is_the_same_in_another_process() -> None:
    # Python's hash() is salted per process; the weight must not be.
    code = "from publisher.gateway.affinity import weight; print(weight('session-7', 'e1'))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="."
    )
    assert int(other.stdout) == weight("session-7", "e1")


def test_a_session_moves_only_when_its_engine_leaves() -> None:
    before = {s: rendezvous(s, HOLDERS) for s in SESSIONS}
    after = {s: rendezvous(s, [h for h in HOLDERS if h != "e2"]) for s in SESSIONS}
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(before[s] == "e2" for s in moved)
    # and an engine that joins takes sessions only for itself
    grown = {s: rendezvous(s, [*HOLDERS, "e4"]) for s in SESSIONS}
    assert all(grown[s] in (before[s], "e4") for s in SESSIONS)


def test_the_order_of_holders_and_the_load_do_not_change_the_choice() -> None:
    for s in SESSIONS[:200]:
        chosen = rendezvous(s, HOLDERS)
        assert rendezvous(s, list(reversed(HOLDERS))) == chosen
        assert rendezvous(s, HOLDERS, load={chosen or "": 1000}) == chosen


def test_sessions_spread_over_the_holders() -> None:
    counts = Counter(rendezvous(s, HOLDERS) for s in SESSIONS)
    assert set(counts) == set(HOLDERS)
    assert min(counts.values()) > len(SESSIONS) / len(HOLDERS) * 0.8, counts


def test_excluded_and_empty() -> None:
    first = rendezvous("s", HOLDERS)
    second = rendezvous("s", HOLDERS, exclude=[first or ""])
    assert second not in (None, first)
    assert rendezvous("s", []) is None
    assert rendezvous("s", ["e0"], exclude=["e0"]) is None


def test_least_loaded_rotates_among_equals() -> None:
    picks = [least_loaded(HOLDERS, start=i) for i in range(8)]
    assert Counter(picks) == Counter({h: 2 for h in HOLDERS})
    assert least_loaded(HOLDERS, load={"e0": 2, "e1": 0, "e2": 1, "e3": 1}, start=3) == "e1"
    assert least_loaded([], start=0) is None
