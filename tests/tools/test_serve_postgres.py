"""``loraledger serve --db postgresql://...``: the real console script on a log in a real
PostgreSQL database (the session's throwaway server), stopped by its PID and started again:
the second life resumes the same log, and ``verify``/``replay`` read it. Defaults that sit
"next to the log" go to the working directory, and a location the store does not know is a
usage error before anything opens."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from evlog.postgres import PostgresStore
from tests.tools.conftest import Cli, console_script, script_env
from tools.exitcodes import Exit

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _serve_once(url: str, workdir: Path, act: Any) -> None:
    """Run ``serve`` until ``act(base_url)`` returns, then SIGTERM it (a clean stop: exit 0)."""
    out, err = workdir / "serve.out", workdir / "serve.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*console_script(), "serve", "--db", url, "--port", "0", "--json"],
            cwd=workdir,
            stdout=stdout,
            stderr=stderr,
            env=script_env(LORALEDGER_TOKEN=TOKEN),
        )
    try:
        deadline = time.monotonic() + 30
        while not out.read_text().strip():
            assert proc.poll() is None, f"serve exited {proc.returncode}: {err.read_text()}"
            assert time.monotonic() < deadline, f"serve did not listen: {err.read_text()}"
            time.sleep(0.05)
        ready = json.loads(out.read_text().splitlines()[0])
        act(ready["url"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_on_postgres_resumes_the_same_log(
    postgres_url: str, tmp_path: Path, cli: Cli
) -> None:
    seen: dict[str, Any] = {}

    def first(base: str) -> None:
        with httpx.Client(base_url=base, trust_env=False, timeout=10) as http:
            ok = http.post(
                "/owners",
                json={"owner": "w1", "ttl_s": 600, "incarnation": "i", "secret": "s" * 64},
                headers=AUTH,
            )
            assert ok.status_code == 200, ok.text
            seen["first"] = http.get("/status").json()

    def second(base: str) -> None:
        with httpx.Client(base_url=base, trust_env=False, timeout=10) as http:
            seen["second"] = http.get("/status").json()

    _serve_once(postgres_url, tmp_path, first)
    _serve_once(postgres_url, tmp_path, second)
    assert seen["first"]["owners"] == 2  # w1 and the OpenAI routes' owner
    assert seen["second"]["owners"] == 2
    assert seen["second"]["epoch"] == seen["first"]["epoch"] + 1
    assert seen["second"]["last_seq"] > seen["first"]["last_seq"]
    assert (tmp_path / "loraledger.artifacts").is_dir()  # no directory beside a URL

    async def verify() -> int:
        async with PostgresStore.open(postgres_url) as store:
            report = await store.verify()
            assert report.ok, report
            return report.records

    assert anyio.run(verify) >= seen["second"]["last_seq"]

    # the read-only tools take the URL too
    checked = cli("verify", postgres_url, "--json")
    assert checked.returncode == 0, (checked.stdout, checked.stderr)
    assert json.loads(checked.stdout)["ok"] is True
    replayed = cli("replay", postgres_url, "--json")
    assert replayed.returncode == 0, replayed.stderr


def test_the_read_only_tools_refuse_a_database_without_a_log(postgres_url: str, cli: Cli) -> None:
    empty = cli("verify", postgres_url)
    assert empty.returncode == Exit.EMPTY, (empty.stdout, empty.stderr)
    assert "no ledger" in empty.stderr + empty.stdout


def test_an_unknown_store_location_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    result = cli("serve", "--db", "mysql://127.0.0.1/ledger", "--port", "0")
    assert result.returncode == Exit.USAGE, (result.stdout, result.stderr)
    assert "mysql" in result.stderr
