"""The publication benchmark runs end to end at a small size and reports what it claims to
(a smoke test against rot: performance itself is judged from the benchmark's output, never by a
timed test)."""

from __future__ import annotations

import math

import pytest

from tools.bench.publish import bench_publish, max_gap, render

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
]


def test_max_gap_counts_only_intervals_that_overlap_the_window() -> None:
    times = [0.0, 0.1, 0.5, 0.6, 2.0, 2.1]
    assert max_gap(times, 0.55, 0.58) == pytest.approx(0.1)  # 0.5 -> 0.6
    assert max_gap(times, 0.7, 1.0) == pytest.approx(1.4)  # 0.6 -> 2.0 spans the window
    assert max_gap(times, 0.0, 0.2) == pytest.approx(0.4)
    assert math.isnan(max_gap([1.0], 0.0, 2.0))


async def test_bench_publish_small(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = await bench_publish(size_mib=1, repeats=2, streams=1, tokens=4, workdir=str(tmp_path))
    assert result["size_bytes"] == 1024 * 1024
    assert len(result["publish_all_s"]) == 2
    assert result["ratio_vs_copy_twice"] == pytest.approx(
        result["publish_s"] / result["copy_twice_s"]
    )
    assert set(result["engine_phases_s"]) == {"e0", "e1"}
    assert result["publication_during_traffic_status"] == "PUBLISHED"
    assert result["traffic"]["completions"] > 0
    for key in ("max_gap_without_publication_s", "max_gap_during_publication_s"):
        assert set(result[key]) == {"all", "e0", "e1"}
    assert result["machine"]["cores"] >= 1
    text = render(result)
    assert "ratio" in text and "longest gap" in text
