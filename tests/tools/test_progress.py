"""Progress is for a person at a terminal: the real ``loraledger`` command, its stderr on a
pseudo-terminal, draws a bar (``verify`` counting records, ``publish`` counting bytes
uploaded); on a pipe, or asked for ``--json``, not one progress byte is written, and stdout
holds the answer either way.

Before, ``--json`` at a terminal still drew the bars, and ``publish`` (an upload that can
take minutes) and ``bench`` showed nothing while a person waited.
"""

from __future__ import annotations

import errno
import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.processes import listening_process
from tests.tools.test_serve import _adapter_dir

# rich reads these: a terminal it must treat as an ordinary, interactive, wide one
_RICH_ENV = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")
LIVE = b"\x1b[?25l"  # rich hides the cursor while a live display (a bar) is drawn


def _run(args: list[str], *, terminal: bool, tmp_path: Path) -> tuple[int, bytes, bytes]:
    """``loraledger ARGS`` as its own process: stdout to a file, stderr to a pseudo-terminal
    (``terminal``) or a pipe. Answers (exit code, stdout, everything written to stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in _RICH_ENV}
    env.update(PYTHONPATH=str(REPO), TERM="xterm-256color", COLUMNS="120")
    argv = [sys.executable, "-m", "tools.cli", *args]
    out = tmp_path / f"stdout-{len(list(tmp_path.glob('stdout-*')))}"
    with open(out, "wb") as stdout:
        if not terminal:
            done = subprocess.run(
                argv, stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                cwd=REPO, timeout=300,
            )  # fmt: skip
            return done.returncode, out.read_bytes(), done.stderr
        master, slave = pty.openpty()
        process = subprocess.Popen(argv, stdout=stdout, stderr=slave, stdin=subprocess.DEVNULL,
                                   env=env, cwd=REPO)  # fmt: skip
    os.close(slave)
    written = bytearray()
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # EIO: the command exited and closed the terminal
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            written += data
    finally:
        os.close(master)
        code = process.wait(timeout=300)
    return code, out.read_bytes(), bytes(written)


def test_verify_draws_progress_on_a_terminal_only(fault_log: Path, tmp_path: Path) -> None:
    code, piped_out, piped_err = _run(["verify", str(fault_log)], terminal=False,
                                      tmp_path=tmp_path)  # fmt: skip
    assert code == 0, piped_err
    assert piped_err == b""  # not one progress byte in a pipe
    code, tty_out, tty_err = _run(["verify", str(fault_log)], terminal=True, tmp_path=tmp_path)
    assert code == 0, tty_err
    assert b"verifying" in tty_err or b"chain" in tty_err, tty_err  # the bar, by its phase
    assert LIVE in tty_err
    assert tty_out.startswith(b"OK ") and piped_out.startswith(b"OK ")  # the same answer


def test_json_draws_no_progress_even_on_a_terminal(fault_log: Path, tmp_path: Path) -> None:
    for command in (["verify", str(fault_log), "--json"], ["replay", str(fault_log), "--json"]):
        code, out, err = _run(command, terminal=True, tmp_path=tmp_path)
        assert code == 0, (command, err)
        assert err == b"", (command, err)
        assert all(json.loads(line) for line in out.splitlines())  # rows, nothing else


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
async def test_publish_shows_the_upload_on_a_terminal_only(tmp_path: Path) -> None:
    """A real serve with no engine: the upload completes, the publication is then refused
    (no routable engine), which is beside the point here: the bytes bar is what is watched."""
    adapter = _adapter_dir(tmp_path, seed=3)
    args = ["serve", "--db", str(tmp_path / "ledger.db"), "--port", "0", "--json"]
    token = tmp_path / "token"
    token.write_text("progress-token\n")
    async with listening_process([*args, "--token-file", str(token)],
                                 stop_with=signal.SIGTERM) as (_, row):  # fmt: skip
        base = ["publish", str(adapter), "--url", row["url"], "--token-file", str(token),
                "--retry-for", "5"]  # fmt: skip
        _, _, piped_err = _run([*base, "--version", "1"], terminal=False, tmp_path=tmp_path)
        _, _, tty_err = _run([*base, "--version", "2"], terminal=True, tmp_path=tmp_path)
        _, _, json_err = _run([*base, "--version", "3", "--json"], terminal=True,
                              tmp_path=tmp_path)  # fmt: skip
    # each run ends with the refusal's one error line; the bar is what differs
    assert b"uploading" not in piped_err and LIVE not in piped_err, piped_err
    assert b"uploading" in tty_err and LIVE in tty_err, tty_err
    assert b"uploading" not in json_err and LIVE not in json_err, json_err


def test_a_bench_run_shows_it_is_working_on_a_terminal_only(tmp_path: Path) -> None:
    """A benchmark cannot count its steps: a spinner with its name and the time taken."""
    command = ["bench", "memory", "--quick", "--dir", str(tmp_path)]
    code, _, piped_err = _run(command, terminal=False, tmp_path=tmp_path)
    assert code == 0, piped_err
    assert b"bench memory" not in piped_err and LIVE not in piped_err, piped_err
    code, out, tty_err = _run(command, terminal=True, tmp_path=tmp_path)
    assert code == 0, tty_err
    assert b"bench memory" in tty_err and LIVE in tty_err, tty_err
    assert b"bench memory" in out  # the answer, on stdout as before
