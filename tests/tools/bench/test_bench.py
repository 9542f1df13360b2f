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
    # Where a command's time goes, stage by stage, at 256 sessions in flight.
    profile = out["profile"]
    assert profile["concurrency"] == 256 and profile["commands"] > 0
    stages = ("type_check", "decide", "evolve", "invariants", "seal", "chain")
    for stage in (*stages, "sqlite_append_normal", "sqlite_append_full", "ledger_in_memory_cpu"):
        assert profile[f"{stage}_us"] > 0, stage
    explained = sum(profile[f"{stage}_us"] for stage in stages) + profile["queue_and_answers_us"]
    assert explained >= profile["ledger_in_memory_cpu_us"] - 0.02  # rounding


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


def test_bench_fleet_quick_reports_per_engine_figures_and_serve_capacity(cli: Cli) -> None:
    result = cli("bench", "fleet", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert out["bench"] == "fleet" and f"{os.cpu_count()} cores" in out["machine"]
    assert "FleetStubEngine" in out["engine_double"]  # the protocol stub unless --engines
    rows = out["publication"]
    assert [r["engines"] for r in rows] == [2, 8]
    smallest = rows[0]
    for r in rows:
        assert r["commit_ms"] > 0 and r["decide_ms"] > 0 and r["projection_kib"] > 0
        assert r["commit_cpu_ms"] > 0
        # every engine is prepared and made ready: at least two events each
        assert r["events"] >= 2 * r["engines"]
        assert r["events_per_engine"] == pytest.approx(r["events"] / r["engines"], abs=0.01)
        assert r["commit_vs_smallest"] == pytest.approx(
            r["commit_ms"] / smallest["commit_ms"], rel=0.01
        )
    assert out["scale"]["commit_ratio"] == rows[-1]["commit_vs_smallest"]
    service = out["service"]
    assert "LedgerService" in out["service_called"]
    assert service["binds"] == 512 and service["renewals"] == 4 * 4 and service["rows"] == 512
    for key in ("bind_cpu_us", "renewal_cpu_us", "row_cpu_us"):
        assert service[key] > 0
    assert service["binds_per_s_per_core"] == pytest.approx(1e6 / service["bind_cpu_us"], rel=0.01)
    assert service["gateways_per_serve_core"] >= 1


def test_bench_fleet_runs_local_engines_when_asked(cli: Cli) -> None:
    result = cli("bench", "fleet", "--quick", "--json", "--engines", "local")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert "LocalEngine" in out["engine_double"]
    assert [r["engines"] for r in out["publication"]] == [2, 8]


def test_bench_engines_choice_is_checked(cli: Cli) -> None:
    unknown = cli("bench", "fleet", "--quick", "--engines", "gpu")
    assert unknown.returncode != 0 and "--engines must be one of" in unknown.stderr
    elsewhere = cli("bench", "routing", "--quick", "--engines", "stub")
    assert elsewhere.returncode != 0 and "has no --engines choice" in elsewhere.stderr
