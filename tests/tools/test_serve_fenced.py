"""Two ``loraledger serve`` on one log: the second fences the first, and the first must not
go on as if nothing happened. It reports itself unhealthy, refuses every turn (its cached
session bindings may have been released by the newcomer), stops, and exits 13 with one
``error:`` line; the newcomer serves on. A writer that died leaves nothing that blocks or
warns its successor.

Network only on loopback, ports the OS picks; every process started here is stopped by PID.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import httpx
import pytest

from engines.local.server import running_server
from publisher.gateway.provenance import read_rows
from tests.publisher.plane_kit import LIMITS
from tests.tools.conftest import Cli
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir, _Process
from tools.exitcodes import Exit, ToolError
from tools.service_options import parse_engine

TOKEN = "serve-fenced-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _turn(session: str) -> dict[str, object]:
    return {
        "model": "policy",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "session_id": session,
    }


async def _health_once_refused(http: httpx.AsyncClient) -> httpx.Response:
    """/health polled until it stops answering 200 (the ledger's watch reads every second)."""
    with anyio.fail_after(30):
        while True:
            health = await http.get("/health")
            if health.status_code != 200:
                return health
            await anyio.sleep(0.05)


def _is_fenced(exc: ToolError) -> bool:
    return exc.exit_code == Exit.FENCED and "FENCED" in exc.message


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
async def test_a_fenced_serve_is_unhealthy_and_refuses_turns_of_its_bound_sessions(
    tmp_path: Path,
) -> None:
    """In process, over one local engine: the first serve bound a session and served a turn;
    a second serve opens the same file (a new epoch, the same OpenAI owner id under a new
    incarnation; the session is client-held, so it stays bound and the second serves it).
    The first then answers /health 503 ``ok: false``
    naming the epoch that fenced it, refuses the session's next turn with FENCED in OpenAI's
    error shape (no provenance row: nothing was sent), and its serve() ends with the
    FENCED exit code. The second serves on, healthy."""
    db = tmp_path / "ledger.db"
    first_rows = tmp_path / "first.provenance.jsonl"
    adapter = _adapter_dir(tmp_path, 1)
    async with running_server("e0", limits=LIMITS) as (_, engine_url):
        engines = (parse_engine(f"e0=local:{engine_url}"),)
        with pytest.RaisesGroup(pytest.RaisesExc(ToolError, check=_is_fenced)):
            async with (
                # a long linger: the test, not a timer, decides when the first one stops
                serving(
                    db,
                    token=TOKEN,
                    engines=engines,
                    provenance=str(first_rows),
                    fenced_linger_s=120.0,
                ) as first_url,
                httpx.AsyncClient(base_url=first_url, trust_env=False, timeout=60) as first,
            ):
                published = await first.post(
                    "/versions", json={"version_id": 1, "adapter_dir": str(adapter)}, headers=AUTH
                )
                assert published.status_code == 200, published.text
                served = await first.post("/v1/chat/completions", json=_turn("s1"), headers=AUTH)
                assert served.status_code == 200, served.text
                healthy = await first.get("/health")
                assert (healthy.status_code, healthy.json()["ok"]) == (200, True)

                async with (
                    serving(
                        db,
                        token=TOKEN,
                        engines=engines,
                        provenance=str(tmp_path / "second.provenance.jsonl"),
                    ) as second_url,
                    httpx.AsyncClient(base_url=second_url, trust_env=False, timeout=60) as second,
                ):
                    status = (await second.get("/status")).json()
                    assert status["epoch"] == 2 and status["sessions_bound"] == 1  # s1 kept

                    health = await _health_once_refused(first)
                    assert health.status_code == 503, health.text
                    body = health.json()
                    assert body["ok"] is False and body["code"] == "FENCED", body
                    assert (body["epoch"], body["fenced_by_epoch"]) == (1, 2), body
                    assert "(epoch 2)" in body["reason"], body

                    refused = await first.post(
                        "/v1/chat/completions", json=_turn("s1"), headers=AUTH
                    )
                    assert refused.status_code == 503, refused.text
                    assert refused.json()["error"]["code"] == "FENCED", refused.text
                    assert refused.headers["x-should-retry"] == "false"
                    bind = await first.post(
                        "/sessions/s2/bind",
                        json={"owner": "openai-serve", "incarnation": "i", "secret": "s" * 64},
                        headers=AUTH,
                    )
                    assert (bind.status_code, bind.json()["code"]) == (503, "FENCED")

                    again = await second.get("/health")
                    assert (again.status_code, again.json()["ok"]) == (200, True)
                    fresh = await second.post(
                        "/v1/chat/completions", json=_turn("s3"), headers=AUTH
                    )
                    assert fresh.status_code == 200, fresh.text
                    resumed = await second.post(
                        "/v1/chat/completions", json=_turn("s1"), headers=AUTH
                    )
                    assert resumed.status_code == 200, resumed.text
                    assert resumed.headers["x-loraledger-version"] == "1"
    # written when the first one stopped: the refused turn sent nothing, so it has no row
    assert [row.session for row in read_rows(first_rows)] == ["s1"]


def test_a_second_serve_stops_the_first_with_exit_13(tmp_path: Path, cli: Cli) -> None:
    """The real command, three processes on one file. The first is killed hard (a crash):
    its successor starts without a warning (a dead writer's leftovers never count). A third
    serve then starts while the second runs: it warns that the log is in use, and the second
    stops by itself with exit 13 and exactly one ``error:`` line naming both epochs; the
    third serves on, and the log verifies."""
    db = tmp_path / "ledger.db"
    started: list[_Process] = []

    def start(name: str) -> tuple[_Process, str]:
        process = _Process(tmp_path, name, "serve", "--db", str(db), "--port", "0", "--json")
        started.append(process)
        return process, str(process.ready()["url"])

    try:
        crashed, _ = start("crashed")
        crashed.proc.kill()  # SIGKILL by PID: no clean shutdown, the -shm and -wal stay
        crashed.proc.wait(timeout=10)
        assert Path(f"{db}-shm").exists()

        second, second_url = start("second")
        assert "serve.log_in_use" not in second.stderr()
        assert httpx.get(f"{second_url}/health", trust_env=False).json()["epoch"] == 2

        third, third_url = start("third")
        assert "serve.log_in_use" in third.stderr()
        try:
            code = second.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the fenced serve did not stop: {second.stderr()[-2000:]}")
        assert code == Exit.FENCED, second.stderr()[-2000:]
        errors = [line for line in second.stderr().splitlines() if line.startswith("error")]
        assert len(errors) == 1, second.stderr()[-2000:]
        assert "FENCED" in errors[0] and "(epoch 3)" in errors[0] and "(epoch 2)" in errors[0]

        health = httpx.get(f"{third_url}/health", trust_env=False)
        assert (health.status_code, health.json()["ok"], health.json()["epoch"]) == (200, True, 3)
        assert third.stop() == 0, third.stderr()[-2000:]
    finally:
        for process in started:
            process.stop()
    check = cli("verify", db, "--json")
    assert check.returncode == 0, check.stdout


def test_every_task_refused_fenced_at_once_is_still_exit_13() -> None:
    """Once fenced, serve's reclaimer and lease expiry can both meet ``FENCED`` in one tick;
    their task group then raises a group of two, which the CLI called an internal error (exit
    1). A group of ledger errors of one code is that code; a mixed group is still internal."""
    import typer

    from publisher.core.errors import Code, LedgerError
    from tools.cli import guarded

    def fenced() -> LedgerError:
        return LedgerError(Code.FENCED, "another controller (epoch 2) appended to this log")

    @guarded
    def both_fenced() -> None:
        raise ExceptionGroup("tasks", [fenced(), ExceptionGroup("inner", [fenced()])])

    @guarded
    def mixed() -> None:
        raise ExceptionGroup("tasks", [fenced(), RuntimeError("a bug")])

    with pytest.raises(typer.Exit) as same:
        both_fenced()
    assert same.value.exit_code == Exit.FENCED
    with pytest.raises(typer.Exit) as other:
        mixed()
    assert other.value.exit_code == Exit.FAILED
