"""Rendezvous routing (publisher/affinity.py): the same answer in every process, a session
moves only when its engine leaves the holders, and sessions spread over the holders; with
bounded load, no engine over the bound and never off the version's holders."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from publisher.gateway.affinity import (
    least_loaded,
    load_bound,
    moved_by_load,
    place,
    rendezvous,
    weight,
)

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


# --- bounded load: place() ------------------------------------------------------------------

ENGINE_IDS = st.sampled_from([f"e{i}" for i in range(8)])
PLACEMENTS = st.fixed_dictionaries(
    {
        "session": st.text(min_size=1, max_size=12),
        "holders": st.lists(ENGINE_IDS, min_size=1, max_size=8, unique=True),
        "loads": st.dictionaries(ENGINE_IDS, st.integers(0, 40)),
        "eps": st.sampled_from([0.0, 0.1, 0.25, 1.0, 3.0]),
        "floor": st.sampled_from([0, 1, 16]),
        "current": st.none() | ENGINE_IDS,
    }
)


@given(PLACEMENTS)
def test_placement_never_goes_over_the_bound_nor_off_the_holders(p: dict[str, Any]) -> None:
    chosen = place(
        p["session"],
        p["holders"],
        load=p["loads"],
        eps=p["eps"],
        floor=p["floor"],
        current=p["current"],
    )
    # only holders of the version (a session never moves off it), within the bound: one
    # holder always is, so "over the bound while one under it exists" never happens
    assert chosen in p["holders"]
    loads = [p["loads"].get(e, 0) for e in p["holders"]]
    assert p["loads"].get(chosen, 0) + 1 <= load_bound(loads, p["eps"], p["floor"])


@given(PLACEMENTS)
def test_placement_is_deterministic_and_ignores_the_order_of_holders(p: dict[str, Any]) -> None:
    def chosen(holders: list[str]) -> str | None:
        return place(
            p["session"],
            holders,
            load=p["loads"],
            eps=p["eps"],
            floor=p["floor"],
            current=p["current"],
        )

    first = chosen(p["holders"])
    assert chosen(list(reversed(p["holders"]))) == first
    assert chosen(p["holders"]) == first


@given(PLACEMENTS, st.integers(0, 40))
def test_with_equal_loads_placement_is_rendezvous(p: dict[str, Any], level: int) -> None:
    equal = dict.fromkeys(p["holders"], level)
    assert place(
        p["session"], p["holders"], load=equal, eps=p["eps"], floor=p["floor"]
    ) == rendezvous(p["session"], p["holders"])


@given(PLACEMENTS)
def test_infinite_eps_is_pure_rendezvous(p: dict[str, Any]) -> None:
    chosen = place(p["session"], p["holders"], load=p["loads"], eps=math.inf, current=p["current"])
    assert chosen == rendezvous(p["session"], p["holders"], load=p["loads"])


def test_a_session_stays_on_its_engine_within_the_bound_and_leaves_it_over() -> None:
    session = SESSIONS[0]
    home = rendezvous(session, HOLDERS)
    assert home is not None
    other = next(h for h in HOLDERS if h != home)
    # it moved once (its cache is there now): it stays while that engine is within the bound
    assert (
        place(session, HOLDERS, floor=0, load={**dict.fromkeys(HOLDERS, 2), home: 0}, current=other)
        == other
    )
    # its engine far over the mean: the next in its rendezvous order, never an excluded one
    hot = {home: 10}
    chosen = place(session, HOLDERS, floor=0, load=hot)
    assert chosen == rendezvous(session, HOLDERS, exclude=[home])
    assert place(session, HOLDERS, floor=0, load=hot, exclude=[chosen or ""]) not in (home, chosen)
    assert place(session, HOLDERS, load=hot) == home  # the default floor: 10 is not over it
    assert place(session, [], load=hot) is None
    assert place(session, ["e0"], exclude=["e0"]) is None


def test_only_a_move_by_the_bound_is_remembered() -> None:
    session = SESSIONS[0]
    home = rendezvous(session, HOLDERS)
    assert home is not None
    assert not moved_by_load(session, home, HOLDERS)
    # its engine left the holders: the next in its order is no move to remember (it returns)
    fallback = rendezvous(session, HOLDERS, exclude=[home])
    assert fallback is not None
    assert not moved_by_load(session, fallback, [h for h in HOLDERS if h != home])
    assert moved_by_load(session, fallback, HOLDERS)
