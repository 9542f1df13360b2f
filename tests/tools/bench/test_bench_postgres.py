"""``loraledger bench ledger --store postgres``: the wrapper runs the real benchmark against its
own throwaway PostgreSQL server (smoke sizes) and reports the ratio to raw asyncpg
``executemany`` of the same rows, the server and the machine."""

from __future__ import annotations

import json
import os

import pytest

from tests.tools.conftest import Cli
from tools.pg_server import PostgresServer


def test_bench_ledger_on_postgres_reports_the_ratio_to_raw_asyncpg(
    cli: Cli, postgres_server: PostgresServer
) -> None:
    # ``postgres_server``: only for its rule (missing binaries fail in CI, skip elsewhere);
    # the bench starts a server of its own, as it does for a user.
    assert postgres_server.pid > 0
    result = cli("bench", "ledger", "--store", "postgres", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    (out,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert out["bench"] == "ledger" and f"{os.cpu_count()} cores" in out["machine"]
    assert out["server"].startswith("PostgreSQL") and "synchronous_commit=on" in out["server"]
    runs = out["sessions"]
    assert [(r["store"], r["concurrency"]) for r in runs] == [("postgres", 1), ("postgres", 16)]
    for r in runs:
        assert r["events_per_s"] > 0 and r["reference_events_per_s"] > 0
        ratio = r["sessions_per_s"] / r["reference_sessions_per_s"]
        assert r["ratio"] == pytest.approx(ratio, rel=0.01)
    assert out["recovery"]["events"] > 20_000


def test_a_bench_without_a_store_choice_refuses_store(cli: Cli) -> None:
    result = cli("bench", "memory", "--store", "postgres", "--quick")
    assert result.returncode != 0 and "no --store" in result.stderr
