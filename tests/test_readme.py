"""Every code block of README.md runs as written: the README is the first program a newcomer
runs, so CI runs it too.

Each fenced block is classified by its info string:

* ``python``: a complete program, run in a fresh interpreter (and linted with the project's
  ruff rules; ``ruff format --check`` already formats it);
* ``bash``: each command runs in bash. A command ending in ``&`` is a server (``loraledger
  engine``, ``loraledger serve``): it is started in the background, waited for until its
  ``/health`` answers on its port, and stopped by its PID (SIGTERM, which must end it cleanly)
  after the last block;
* ``text``: output or an illustration with placeholders, never run.

The blocks run in README order, in one scratch directory, because they build on each other:
the engines started first serve the training loop, whose log the rollout worker, the shell
commands and ``serve`` then use. Any other info string fails, and so does a ``python`` or
``bash`` block that is not run, unless :data:`NOT_RUN` names it with the reason.

The README's ports (30001, 30002 for the engines, 8766 and 8765 for the two ``serve``) are used
as written; if one is taken on this machine the test says so instead of running elsewhere.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.support.paths import REPO
from tools.cli import DEFAULT_PORT as SERVE_PORT

README = REPO / "README.md"

# Blocks that are commands for a person but that this test must not run, each with the reason.
NOT_RUN = {
    "./demo.sh ": "the quick start installs into .venv (pip) and runs the whole suite: ./test.sh "
    "is CI itself, and tests/tools/test_demo.py runs the demo (--quick)",
}
RUN_KINDS = ("python", "bash")
SHOWN_KINDS = ("text",)
PORTS = (30001, 30002, 8766, SERVE_PORT)  # 8766: the OpenAI example's service
BLOCK_TIMEOUT_S = 600.0
SERVER_START_S = 240.0


class Block(msgspec.Struct, frozen=True):
    kind: str
    code: str
    line: int  # where the block starts in README.md (1-based), for messages

    @property
    def label(self) -> str:
        first = self.code.strip().splitlines()[0] if self.code.strip() else ""
        return f"README.md:{self.line} ({self.kind}: {first[:60]})"


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order."""
    found, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(.*)$", lines[i])
        if opening is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        kind = opening.group(1).strip().split(" ")[0]
        found.append(Block(kind=kind, code="\n".join(body) + "\n", line=start + 1))
        i += 1
    return found


def not_run_reason(block: Block) -> str | None:
    for opening, reason in NOT_RUN.items():
        if block.code.lstrip().startswith(opening):
            return reason
    return None


def test_every_block_is_classified() -> None:
    unknown = [b.label for b in blocks(README.read_text()) if b.kind not in RUN_KINDS + SHOWN_KINDS]
    assert not unknown, f"mark each block as one of {RUN_KINDS + SHOWN_KINDS}: {unknown}"
    used = [
        opening
        for opening in NOT_RUN
        for b in blocks(README.read_text())
        if b.code.lstrip().startswith(opening)
    ]
    assert sorted(used) == sorted(NOT_RUN), "a NOT_RUN entry matches no block any more"


def test_links_stay_inside_the_repository() -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        resolved = (REPO / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(REPO), f"{target} points outside the repository"


def test_the_first_screen_gives_the_two_commands() -> None:
    first_screen = "\n".join(README.read_text().splitlines()[:25])
    assert "./demo.sh" in first_screen and "./test.sh" in first_screen


def test_python_blocks_are_ruff_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    for block in blocks(README.read_text()):
        if block.kind != "python":
            continue
        lint = subprocess.run(
            [str(ruff), "check", "--stdin-filename", "readme_block.py", "-"],
            input=block.code,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert lint.returncode == 0, f"{block.label}:\n{lint.stdout}{lint.stderr}"


# --- running them ------------------------------------------------------------------------------


class Servers:
    """The background commands of the bash blocks, stopped by PID at the end."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.running: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, command: str) -> None:
        """Launch ``command`` in the background (:meth:`wait_ready` waits for it)."""
        number = len(self.running)
        out, err = self.workdir / f"server-{number}.out", self.workdir / f"server-{number}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.workdir,
                env=self.env,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
            )
        self.running.append((command, proc, err))

    def wait_ready(self) -> None:
        """Until every server answers ``/health`` on its port (they start concurrently)."""
        deadline = time.monotonic() + SERVER_START_S
        for command, proc, err in self.running:
            port = _port_of(command)
            while not _healthy(port):
                if proc.poll() is not None:
                    pytest.fail(f"`{command}` exited {proc.returncode}:\n{_tail(err)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"`{command}` did not answer on port {port}:\n{_tail(err)}")
                time.sleep(0.2)

    def stop_all(self) -> list[str]:
        """Stop every server (the last started first); the ones that did not stop cleanly."""
        unclean = []
        for command, proc, err in reversed(self.running):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=10)
            if code != 0:
                unclean.append(f"`{command}` exit {code}:\n{_tail(err)}")
        self.running.clear()
        return unclean


def _port_of(command: str) -> int:
    given = re.search(r"--port[ =](\d+)", command)
    if given:
        return int(given.group(1))
    if re.search(r"\bserve\b", command):
        return SERVE_PORT
    raise AssertionError(f"a background command must say its --port: {command}")


def _healthy(port: int) -> bool:
    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def commands(code: str) -> Iterator[tuple[str, bool]]:
    """The block's commands (``\\``-continued lines joined) and whether each runs in the
    background (a trailing ``&``, before any comment)."""
    logical = re.sub(r"\\\n\s*", " ", code)
    for line in logical.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        background = re.match(r"^(.*?)\s&\s*(#.*)?$", line)
        if background:
            yield background.group(1).strip(), True
        else:
            yield line.strip(), False


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _environment(tmp_path: Path) -> dict[str, str]:
    """This interpreter and this tree: ``loraledger`` on PATH runs the code under test."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "loraledger"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tools.cli "$@"\n')
    shim.chmod(0o755)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": path,
        "PYTHONWARNINGS": "ignore",  # third-party deprecation chatter is not the README's
    }


def _run_python(block: Block, workdir: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{block.label} exit {done.returncode}:\n{done.stderr[-4000:]}"


def _run_command(block: Block, command: str, workdir: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (
        f"{block.label}: `{command}` exit {done.returncode}:\n{done.stdout[-2000:]}"
        f"{done.stderr[-2000:]}"
    )


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_every_block_runs_in_order(tmp_path: Path) -> None:
    taken = [port for port in PORTS if _port_taken(port)]
    if taken:
        pytest.fail(f"the README's ports {taken} are in use on this machine: free them first")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = _environment(tmp_path)
    servers = Servers(workdir, env)
    ran = 0
    try:
        for block in blocks(README.read_text()):
            if block.kind in SHOWN_KINDS or not_run_reason(block) is not None:
                continue
            started = time.monotonic()
            if block.kind == "python":
                _run_python(block, workdir, env)
            else:
                for command, background in commands(block.code):
                    if background:
                        servers.start(command)  # as a shell would: on to the next line
                        continue
                    servers.wait_ready()  # a person waits for "listening" before going on
                    _run_command(block, command, workdir, env)
                servers.wait_ready()
            print(f"{block.label}: {time.monotonic() - started:.1f}s")  # shown with -s
            ran += 1
    finally:
        unclean = servers.stop_all()
    assert not unclean, "\n".join(unclean)
    assert ran >= 6  # engines, training loop, rollout, Ray, shell commands, serve
