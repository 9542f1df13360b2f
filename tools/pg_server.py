"""A throwaway PostgreSQL server on 127.0.0.1, for the tests and ``loraledger bench ledger``.

:func:`temporary_server` runs ``initdb`` in a fresh temporary directory, starts ``postgres``
in the foreground on a free loopback port (its PID is the one to stop: no ``pg_ctl`` daemon to
lose track of), waits until ``postmaster.pid`` says it accepts connections, and on exit stops
it by that PID (SIGINT: PostgreSQL's "fast" shutdown, which rolls back open transactions and
checkpoints) and removes the directory.

PostgreSQL refuses to run as root. When this process is root (the CI machine, containers),
``initdb`` and ``postgres`` run as the unprivileged ``nobody`` user (``subprocess`` switches
the user itself: no ``sudo``/``runuser`` needed) in a directory that user owns.

The server keeps PostgreSQL's durability defaults (``fsync=on``, ``synchronous_commit=on``):
the benchmark measures durable commits, and the crash tests kill the *client*, whose
acknowledged appends must then be in the server. A test that crashes the server itself
starts it again on its data directory with :func:`restarted`.

The binaries are found on ``PATH`` or in Debian's ``/usr/lib/postgresql/<version>/bin``
(``LORALEDGER_PG_BIN`` names another directory); ``./test.sh`` installs Debian's
``postgresql`` package when none is found.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

PG_BIN_ENV = "LORALEDGER_PG_BIN"
_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_UNPRIVILEGED = "nobody"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries here, or the server would not start (the message says
    which, and how to install them)."""


@dataclass(frozen=True)
class PostgresServer:
    """A running server: where it listens, its PID and its data directory."""

    host: str
    port: int
    pid: int
    data_dir: Path
    user: str = "postgres"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"


@dataclass(frozen=True)
class _RunAs:
    user: int | None
    group: int | None
    extra_groups: list[int] | None


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``, or None if PostgreSQL is missing."""
    candidates: list[Path] = []
    if os.environ.get(PG_BIN_ENV):
        candidates.append(Path(os.environ[PG_BIN_ENV]))
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    if _DEBIAN_ROOT.is_dir():
        versions = sorted(
            (p for p in _DEBIAN_ROOT.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        candidates += [v / "bin" for v in versions]
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "postgres").is_file():
            return directory
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ready(data_dir: Path, pid: int) -> bool:
    """``postmaster.pid``'s last line is the server status; "ready" once it takes clients. Its
    first line is the PID that wrote it: a file left by a crashed server says "ready" too."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


@contextmanager
def temporary_server(
    *, directory: str | None = None, settings: dict[str, str] | None = None
) -> Iterator[PostgresServer]:
    """Start a fresh server for the block (see the module docstring); stop it by its PID."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise PostgresUnavailable(
            "no PostgreSQL server binaries (initdb, postgres) on PATH or in "
            f"{_DEBIAN_ROOT}/*/bin: install Debian's postgresql package "
            f"(./test.sh does when run as root) or set {PG_BIN_ENV}"
        )
    user, run_as = _unprivileged()
    # A world-traversable parent (the system temp dir): the unprivileged user must reach it.
    root = Path(tempfile.mkdtemp(prefix="loraledger-pg-", dir=directory))
    try:
        if user is not None:
            os.chown(root, user.pw_uid, user.pw_gid)
        data_dir = root / "data"
        init = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data_dir),
                "-U",
                "postgres",
                "--auth=trust",  # loopback only, a throwaway server
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",  # initdb's own files only; the server itself keeps fsync on
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
            user=run_as.user,
            group=run_as.group,
            extra_groups=run_as.extra_groups,
        )
        if init.returncode != 0:
            raise PostgresUnavailable(f"initdb failed: {init.stderr.strip() or init.stdout}")
        with _running(bin_dir, root, data_dir, settings or {}, run_as) as server:
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _unprivileged() -> tuple[pwd.struct_passwd | None, _RunAs]:
    """Who the server runs as: ourselves, or ``nobody`` (no supplementary groups) as root."""
    user = pwd.getpwnam(_UNPRIVILEGED) if os.geteuid() == 0 else None
    return user, _RunAs(
        user=user.pw_uid if user else None,
        group=user.pw_gid if user else None,
        extra_groups=[] if user else None,
    )


@contextmanager
def restarted(
    server: PostgresServer, *, settings: dict[str, str] | None = None
) -> Iterator[PostgresServer]:
    """Start the server of ``temporary_server``'s block again, on its data directory, after it
    stopped or crashed (it runs crash recovery from its WAL as any restart does); stop it by its
    PID at the end of this block, which must end inside ``temporary_server``'s. The new server
    listens on a new free port: use the URL of the server this yields."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise PostgresUnavailable("the PostgreSQL server binaries are gone")
    _, run_as = _unprivileged()
    root = server.data_dir.parent
    with _running(bin_dir, root, server.data_dir, settings or {}, run_as) as again:
        yield again


@contextmanager
def _running(
    bin_dir: Path,
    root: Path,
    data_dir: Path,
    settings: dict[str, str],
    run_as: _RunAs,
) -> Iterator[PostgresServer]:
    options = {
        "listen_addresses": "127.0.0.1",
        "unix_socket_directories": str(root),
        "max_connections": "200",
        **settings,
    }
    last_error = ""
    for _attempt in range(5):  # a free port may be taken between the probe and the bind
        port = _free_port()
        log_path = root / "server.log"
        args = [str(bin_dir / "postgres"), "-D", str(data_dir), "-p", str(port)]
        for key, value in options.items():
            args += ["-c", f"{key}={value}"]
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                args,
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a ^C in the terminal is for the tests, not the server
                user=run_as.user,
                group=run_as.group,
                extra_groups=run_as.extra_groups,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while proc.poll() is None and not _ready(data_dir, proc.pid):
                if time.monotonic() > deadline:
                    raise PostgresUnavailable(f"postgres did not start in {START_TIMEOUT_S} s")
                time.sleep(0.02)
            if proc.poll() is None:
                yield PostgresServer(host="127.0.0.1", port=port, pid=proc.pid, data_dir=data_dir)
                return
            last_error = log_path.read_text(errors="replace")[-2000:]
        finally:
            _stop(proc)
    raise PostgresUnavailable(f"postgres would not start: {last_error}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)  # fast shutdown
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


async def create_database(server: PostgresServer, name: str) -> str:
    """Create database ``name`` on ``server``; return its URL."""
    import asyncpg

    conn = await asyncpg.connect(server.url())
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return server.url(name)
