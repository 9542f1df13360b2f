"""Start-up failures of the commands, as a user meets them: a port already in use, a bad
number or URL, help into a closed pipe. Each is one ``error:`` line and its documented exit
code, and leaves nothing behind: no log file, no new epoch, no owner registered with the
ledger.

The real console script runs as a subprocess where a user would start it; a busy port is a
throwaway socket listening on 127.0.0.1 (port chosen by the OS); every process started here is
stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from tests.support.paths import REPO
from tests.tools.conftest import Cli, console_script, script_env
from tests.tools.serving import serving
from tools.exitcodes import Exit, ToolError
from tools.listen import listening

TOKEN = "startup-token"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process listens on (a plain socket, without ``SO_REUSEADDR``)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _script(*args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    """The console script, run to its end; killed (by ``subprocess.run``) past ``timeout``."""
    return subprocess.run(
        [*console_script(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=script_env(**env),
    )


def _one_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
    return errors[0]


# --- a port already in use -----------------------------------------------------------------


def test_serve_on_a_busy_port_fails_before_it_opens_the_log(busy_port: int, tmp_path: Path) -> None:
    """Was exit 3 ("the log file does not exist") from uvicorn's ``sys.exit(3)``, after the log
    had a new epoch, the deployment and its artifacts directory."""
    db = tmp_path / "ledger.db"
    result = _script("serve", "--db", str(db), "--port", str(busy_port))
    assert result.returncode == Exit.FAILED, (result.returncode, result.stderr)
    line = _one_error(result.stderr)
    assert line.startswith(f"error: cannot listen on 127.0.0.1:{busy_port}: "), line
    assert "in use" in line, line
    assert not db.exists() and not (tmp_path / "ledger.db.artifacts").exists()
    assert list(tmp_path.iterdir()) == []  # nothing at all: no -wal, no provenance file


@pytest.mark.anyio
async def test_a_gateway_on_a_busy_port_registers_no_owner(busy_port: int, tmp_path: Path) -> None:
    """Was exit 3 after the gateway had registered its owner with serve and never
    deregistered it: 30 s later a phantom ``lease_expired`` in the log."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with (
        serving(tmp_path / "ledger.db", token=TOKEN) as ledger,
        httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=30) as http,
    ):
        owners_before = (await http.get("/status")).json()["owners"]
        argv = [*console_script(), "gateway", "--ledger", ledger, "--token-file", str(token_file)]
        provenance = tmp_path / "gw-busy.provenance.jsonl"
        argv += ["--port", str(busy_port), "--owner", "gw-busy", "--provenance", str(provenance)]
        env = script_env()
        env.pop("LORALEDGER_TOKEN", None)
        with anyio.fail_after(60):
            result = await anyio.run_process(argv, cwd=REPO, env=env, check=False)
        stderr = result.stderr.decode()
        assert result.returncode == Exit.FAILED, (result.returncode, stderr)
        line = _one_error(stderr)
        assert line.startswith(f"error: cannot listen on 127.0.0.1:{busy_port}: "), line
        status = (await http.get("/status")).json()
        assert status["owners"] == owners_before == 1  # serve's own OpenAI owner only
        assert not provenance.exists()


def test_serve_on_ipv6_loopback_port_0_announces_a_url_that_answers(tmp_path: Path) -> None:
    """The pre-bound socket keeps what uvicorn did: an IPv6 host, port 0 (the URL names the
    port the OS chose), and a clean SIGTERM stop (exit 0)."""
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    argv = [*console_script(), "serve", "--db", str(tmp_path / "v6.db"), "--host", "::1"]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*argv, "--port", "0", "--json"], cwd=REPO, stdout=stdout, stderr=stderr,
            env=script_env(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not out.read_text().strip():
            assert proc.poll() is None, f"serve exited {proc.returncode}: {err.read_text()}"
            assert time.monotonic() < deadline, f"serve did not listen: {err.read_text()}"
            time.sleep(0.05)
        url = json.loads(out.read_text().splitlines()[0])["url"]
        assert url.startswith("http://[::1]:") and not url.endswith(":0"), url
        with httpx.Client(trust_env=False, timeout=10) as http:
            assert http.get(f"{url}/health").json()["ok"] is True
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=10)
    assert code == 0, err.read_text()


def test_listening_keeps_uvicorns_socket_options() -> None:
    """``SO_REUSEADDR`` as uvicorn set it: a restart rebinds a port whose last connection is
    still in TIME_WAIT, yet a port someone listens on is refused, naming it."""

    async def main() -> None:
        async with listening("127.0.0.1", 0) as sockets:
            (first,) = sockets
            port = first.getsockname()[1]
            assert first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            client = socket.create_connection(("127.0.0.1", port))
            accepted, _ = first.accept()
            accepted.close()  # the server side closes first: its end stays in TIME_WAIT
            client.close()
            with pytest.raises(ToolError) as busy:
                async with listening("127.0.0.1", port):
                    pass
            assert busy.value.exit_code == Exit.FAILED
            assert busy.value.message.startswith(f"cannot listen on 127.0.0.1:{port}: ")
        async with listening("127.0.0.1", port) as again:  # TIME_WAIT does not stop it
            assert again[0].getsockname()[1] == port
        async with listening("::1", 0) as v6:
            assert [s.family for s in v6] == [socket.AF_INET6]
            assert v6[0].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)

    anyio.run(main)


def test_a_host_without_ipv6_still_listens_on_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a kernel booted without IPv6, an IPv6 socket cannot even be created. uvicorn
    (asyncio's ``create_server``) skips such an address; the pre-bound sockets failed the whole
    start instead ("Address family not supported"). IPv6 sockets are refused here as that
    kernel would: ``''`` listens on IPv4 alone; ``::1``, with nothing left, still names why."""
    import errno

    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", no_ipv6)  # the module tools/listen.py calls

    async def main() -> None:
        async with listening("", 0) as sockets:
            assert [s.family for s in sockets] == [socket.AF_INET]
        with pytest.raises(ToolError) as only_v6:
            async with listening("::1", 0):
                pass
        assert only_v6.value.exit_code == Exit.FAILED
        assert "Address family not supported" in only_v6.value.message

    anyio.run(main)


def test_uvicorns_own_start_up_exit_becomes_an_error_not_exit_3() -> None:
    """uvicorn ends a start-up it cannot finish with ``sys.exit(3)`` -- exit 3 means "the log
    file does not exist" here. A real one, whose application fails its lifespan start-up."""
    import uvicorn
    from starlette.applications import Starlette

    from tools.listen import serve_on

    @asynccontextmanager
    async def broken(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("cannot start")
        yield

    async def main() -> None:
        config = uvicorn.Config(Starlette(lifespan=broken), lifespan="on", log_config=None)
        async with listening("127.0.0.1", 0) as sockets:
            with pytest.raises(ToolError) as failed:
                await serve_on(uvicorn.Server(config), sockets)
        assert failed.value.exit_code == Exit.FAILED
        assert "did not start (uvicorn exit 3" in failed.value.message

    anyio.run(main)


# --- bad numbers and URLs: usage errors, before anything exists ----------------------------


def test_serve_capacity_0_is_a_usage_error_with_nothing_on_disk(tmp_path: Path) -> None:
    """Was exit 1 after the log (with ``ControllerStarted``) and the artifacts directory were
    created, and a ``[critical] ledger.writer_stopped`` line."""
    db = tmp_path / "ledger.db"
    result = _script("serve", "--db", str(db), "--port", "0", "--capacity", "0", timeout=30)
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    assert "--capacity 0" in _one_error(result.stderr)
    assert "critical" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--probe-timeout", "0"),  # was accepted: every probe failed "no reply within 0s"
        ("--probe-timeout", "-1"),
        ("--probe-timeout", "nan"),
        ("--probe-timeout", "inf"),
        ("--header-timeout", "inf"),
        ("--suspend-after", "-1"),  # was "never", silently
        ("--suspend-after", "inf"),
        ("--canary-every", "-1"),
        ("--canary-every", "inf"),
    ],
)
def test_serve_seconds_must_be_finite_and_positive(option: str, value: str, tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    result = _script("serve", "--db", str(db), "--port", "0", option, value, timeout=30)
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    line = _one_error(result.stderr)
    assert option in line and "seconds" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("status", "--timeout", "-1"), "--timeout"),  # was internal error: ValueError
        (("status", "--timeout", "0"), "--timeout"),
        (("status", "--timeout", "nan"), "--timeout"),
        (("status", "--url", "127.0.0.1:8766"), "--url"),  # was exit 10 "no ledger answered"
        (("status", "--url", "http://"), "--url"),
        (("status", "--url", "http://[::1"), "--url"),  # was internal error: InvalidURL
        (("fleet", "suspend", "e0", "--url", "localhost:8765"), "--url"),
        (("fleet", "remove", "e0", "--url", "ftp://127.0.0.1:8765"), "--url"),
        (("gateway", "--ledger", "http://", "--port", "0"), "--ledger"),
        (("gateway", "--ledger", "http://127.0.0.1:1", "--max-connections", "0"), "--max-"),
    ],
)
def test_urls_and_timeouts_are_usage_errors(
    cli: Cli, args: tuple[str, ...], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORALEDGER_TOKEN", TOKEN)  # a gateway needs one to get that far
    monkeypatch.delenv("LORALEDGER_URL", raising=False)
    result = cli(*args)
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    assert named in _one_error(result.stderr)


def test_a_well_formed_url_nobody_answers_is_still_unreachable(cli: Cli) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        result = cli("status", "--url", f"http://127.0.0.1:{port}/", "--timeout", "2")
    assert result.returncode == Exit.UNREACHABLE, result.stderr


# --- help into a closed pipe ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [("--help",), ("replay", "--help"), ("fleet", "suspend", "--help"), ()]
)
def test_help_into_a_closed_pipe_is_141(args: tuple[str, ...]) -> None:
    """``loraledger --help | head -1`` was exit 1: help is printed while the options are
    parsed, before any command's guard, and rich exits 1 on a broken pipe. The reader closes
    its end before the command writes, so the write meets a closed pipe every time."""
    child = subprocess.Popen(
        [*console_script(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=script_env(),
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == Exit.BROKEN_PIPE, err
    assert err == "", err


def test_help_to_dev_null_is_still_0() -> None:
    with open(os.devnull, "w") as null:
        code = subprocess.run(
            [*console_script(), "--help"], stdout=null, cwd=REPO, env=script_env(), timeout=60
        ).returncode
    assert code == 0


# --- a log that is not one: refused, and left as it was ------------------------------------


def _foreign_database(path: Path) -> Path:
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    return path


@pytest.mark.parametrize("kind", ["foreign-db", "text", "directory"])
def test_serve_refuses_what_is_not_a_ledger_and_leaves_it_as_it_was(
    cli: Cli, tmp_path: Path, kind: str
) -> None:
    """Was exit 6 (or 1 for a directory) after serve had switched another application's
    database to WAL (its header rewritten, ``-wal`` and ``-shm`` beside it) and created the
    artifacts directory. Now exit 5, as ``verify`` answers, with nothing changed."""
    target = tmp_path / "app.db"
    if kind == "foreign-db":
        _foreign_database(target)
    elif kind == "text":
        target.write_text("not a database\n")
    else:
        target.mkdir()
    before = target.read_bytes() if target.is_file() else None
    result = cli("serve", "--db", target, "--port", "0")
    assert result.returncode == Exit.NOT_A_LEDGER, (result.returncode, result.stderr)
    assert "not a ledger log" in _one_error(result.stderr) or "not a loraledger log" in (
        result.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    if before is not None:
        assert target.read_bytes() == before
    assert cli("verify", target).returncode == Exit.NOT_A_LEDGER  # the same answer


def test_serve_artifacts_naming_a_file_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    """Was an internal error (``FileExistsError``), after the log had been created."""
    (tmp_path / "afile").write_text("x")
    db = tmp_path / "ledger.db"
    result = cli("serve", "--db", db, "--port", "0", "--artifacts", tmp_path / "afile")
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    assert "--artifacts" in _one_error(result.stderr)
    assert not db.exists()


@pytest.mark.parametrize("url", ["postgresql://u@127.0.0.1:99999/db", "postgresql://u@[::1/db"])
@pytest.mark.parametrize("command", ["verify", "replay", "audit"])
def test_an_unusable_postgres_url_is_a_usage_error(cli: Cli, command: str, url: str) -> None:
    """Was an internal error (asyncpg's ``OverflowError`` / ``ValueError``)."""
    args = (command, url, "--all") if command == "audit" else (command, url)
    result = cli(*args)
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    said = result.stderr + result.stdout  # verify reports its failure as its FAILED row
    assert "postgresql:// URL" in said and "internal error" not in said, said


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("serve", "--engine-token-file", "/nonexistent/t"), "--engine-token-file"),
        (("gateway", "--engine-token-file", "/nonexistent/t"), "--engine-token-file"),
        (("gateway", "--session-idle-s", "-1"), ">= 0 (0: never)"),
    ],
)
def test_each_error_names_the_option_given(
    cli: Cli, args: tuple[str, ...], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing --engine-token-file was reported as '--token-file: ...', and the gateway's
    --session-idle-s as needing '> 0' though 0 means never."""
    monkeypatch.setenv("LORALEDGER_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    extra = ("--ledger", "http://127.0.0.1:1") if args[0] == "gateway" else ("--db", "x.db")
    result = cli(*args, *extra, "--port", "0")
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    assert named in _one_error(result.stderr)
