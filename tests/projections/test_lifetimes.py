"""Version lifetimes (state bands, bound-session steps) folded from a real fault run."""

from __future__ import annotations

import itertools

from evlog.record import Record
from projections.lifetimes import LifetimeFold


def test_bands_cover_each_version_life_without_gaps(fault_records: list[Record]) -> None:
    life = LifetimeFold().apply_all(fault_records).finish()
    assert (life.start, life.end) == (1000.0, 1400.0)
    v1 = [(b.state, b.start, b.end) for b in life.bands if b.version_id == 1]
    assert v1 == [
        ("LOADING", 1001.0, 1001.0),
        ("PUBLISHED", 1001.0, 1010.0),
        ("RETIRED", 1010.0, 1101.0),
        ("RECLAIMING", 1101.0, 1101.0),
        ("RECLAIMED", 1101.0, 1400.0),
    ]
    for vid in {b.version_id for b in life.bands}:
        bands = [b for b in life.bands if b.version_id == vid]
        for earlier, later in itertools.pairwise(bands):
            assert earlier.end == later.start and earlier.end_seq == later.start_seq
        assert bands[-1].end_seq is None and bands[-1].end == life.end
    assert 5 not in {b.version_id for b in life.bands}  # skipped: never took a slot


def test_bound_steps_follow_binds_releases_and_lease_expiry(fault_records: list[Record]) -> None:
    life = LifetimeFold().apply_all(fault_records).finish()
    # three binds in one moment collapse to one step; the lease expiry releases s-c at 1040
    assert life.bound[1] == ((1002.0, 3), (1020.0, 2), (1040.0, 1), (1100.0, 0))
    assert life.bound[2] == ((1011.0, 1),)
    assert [(m.at, m.label) for m in life.markers] == [
        (1300.0, "e1 restarted"),
        (1305.0, "e1 repaired"),
    ]
