"""``loraledger bench``: the wrappers run the real benchmark functions (smoke sizes) and
report each figure with its reference and ratio, and the machine."""

from __future__ import annotations

import json
import os

import pytest

from tests.tools.conftest import Cli


def test_bench_ledger_quick_reports_ratios_and_the_machine(cli: Cli) -> None:
    result = cli("bench", "ledger", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert out["row"] == "bench" and out["bench"] == "ledger" and out["quick"] is True
    assert f"{os.cpu_count()} cores" in out["machine"]
    runs = out["sessions"]
    assert [r["concurrency"] for r in runs] == [1, 16]
    for r in runs:
        assert r["sessions_per_s"] > 0 and r["reference_sessions_per_s"] > 0
        ratio = r["sessions_per_s"] / r["reference_sessions_per_s"]
        assert r["ratio"] == pytest.approx(ratio, rel=0.01)
    assert out["recovery"]["events"] > 20_000


def test_bench_store_quick_human_output(cli: Cli) -> None:
    result = cli("bench", "store", "--quick")
    assert result.returncode == 0, result.stderr
    assert "machine:" in result.stdout and "ratio" in result.stdout
    assert "iterate_events_per_s" in result.stdout


def test_bench_memory_quick_reports_growth_per_shape(cli: Cli) -> None:
    result = cli("bench", "memory", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["shape"] for r in out["runs"]] == ["flood", "waves"]
    for r in out["runs"]:
        assert r["sessions"] == 20_000 and r["peak_mib"] > r["growth_mib"]
        assert r["growth_mib"] < 0.1


def test_bench_routing_quick_compares_the_policies_on_one_replay(cli: Cli) -> None:
    result = cli("bench", "routing", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert out["bench"] == "routing" and f"{os.cpu_count()} cores" in out["machine"]
    assert out["workload"]["engines_simulated"] is True
    rows = {r["policy"]: r for r in out["policies"]}
    assert list(rows) == ["round-robin", "rendezvous", "bounded"]
    reference = rows["rendezvous"]
    for r in rows.values():
        assert r["simulated_wall_s"] > 0 and 0 < r["hit_rate"] <= 1
        ratio = r["simulated_wall_s"] / reference["simulated_wall_s"]
        assert r["wall_vs_rendezvous"] == pytest.approx(ratio, rel=0.01)
    assert out["bounded_vs_rendezvous"]["wall_ratio"] == rows["bounded"]["wall_vs_rendezvous"]
    # the same replay for every policy; pure rendezvous never moves a session
    runs = {r["policy"]: r for r in out["runs"]}
    assert len({r["turns"] for r in runs.values()}) == 1
    assert runs["rendezvous"]["moved_turns"] == 0 < runs["round-robin"]["moved_turns"]
