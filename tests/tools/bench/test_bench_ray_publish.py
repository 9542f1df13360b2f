"""``loraledger bench ray-publish`` runs end to end at smoke size, in its own process (it starts
its own local Ray instance), and reports the ratio and the bytes each actor saw (a smoke test
against rot: performance itself is judged from the benchmark's output, never by a timed
test)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.tools.conftest import console_script, script_env


def test_bench_ray_publish_quick_reports_the_ratio_and_where_the_bytes_went(
    tmp_path: Path,
) -> None:
    result = subprocess.run(
        [*console_script(), "bench", "ray-publish", "--quick", "--json", "--dir", str(tmp_path)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (out,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert out["bench"] == "ray-publish" and out["quick"] is True
    size = out["size_bytes"]
    assert size == 4 * 2**20
    local, through_ray = out["figures"]
    assert local["ratio"] == 1.0
    assert through_ray["ratio"] == pytest.approx(
        through_ray["publish_ms"] / local["publish_ms"], rel=0.05
    )
    publications = 2  # the warm-up and one timed round
    assert out["ledger_actor_bytes"] == {
        "descriptors": publications,
        "pulled_bytes": publications * size,
    }
    assert set(out["engine_actor_bytes"]) == {"e0", "e1"}
    for stats in out["engine_actor_bytes"].values():
        assert stats["inline_bytes"] == 0
        assert (stats["pulls"], stats["pulled_bytes"]) == (publications, publications * size)
