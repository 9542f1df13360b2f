"""The vLLM server launcher (engines/vllm_server.py) without vLLM: a stand-in server
(``fake_vllm_server.py``) behind a fake venv interpreter.

The real server is started by tests/integration (marker ``vllm``) and the vLLM demo; this
module pins what both rely on and a real server rarely shows: a start-up failure (the process
exits, or never turns healthy) raises ``VLLMServerError`` with the log and leaves no process;
stop leaves no process of the group, even one the server did not take down itself; the server
dies with the thread that started it (parent death signal), which is why ``start_async`` spawns
on the event loop's thread; a cancelled ``start_async`` stops what it started.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engines import vllm_server as launcher
from engines.vllm_server import VLLMServer, VLLMServerError

FAKE_SERVER = Path(__file__).with_name("fake_vllm_server.py")


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A venv interpreter that runs the stand-in whatever module it is asked to run."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture
def server(fake_python: Path, tmp_path: Path) -> Iterator[VLLMServer]:
    workdir = tmp_path / "work"
    workdir.mkdir()
    made = VLLMServer(python=fake_python, model_dir=tmp_path / "model", workdir=workdir)
    try:
        yield made
    finally:
        made.stop()  # whatever a failed assertion left running


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped by its parent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def engine_core_pid(server: VLLMServer) -> int:
    """The stand-in's child (printed to the server log once it runs)."""
    assert server.log_path is not None
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        found = re.search(r"engine core pid (\d+)", server.log_path.read_text())
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no engine core pid in {server.log_tail()}")


def test_start_stop_restart_leave_nothing_running(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    server.start()
    pid, core, port = server.pid, engine_core_pid(server), server.port
    assert alive(pid) and alive(core)
    assert server.base_url == f"http://127.0.0.1:{port}"
    assert server.lives == 1 and len(server.start_seconds) == 1
    assert f"--port {port}" in " ".join(server.command())

    server.restart()  # the same URL, a new process
    assert server.port == port and server.pid != pid and server.lives == 2
    assert wait_dead(pid, 0.1) and wait_dead(core, 0.1)  # stopped before restart returned
    pid, core = server.pid, engine_core_pid(server)

    server.stop()
    assert server.proc is None
    assert wait_dead(pid, 0.1) and wait_dead(core, 0.1)
    server.stop()  # idempotent


def test_a_child_the_server_leaves_behind_is_killed_with_its_group(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "orphan")
    server.start()
    pid, core = server.pid, engine_core_pid(server)
    server.stop()  # the server exits at once; its child only goes with the SIGKILL of the group
    assert wait_dead(pid, 0.1) and wait_dead(core, 1.0)


def test_a_server_that_exits_during_start_up_is_an_error_with_its_log(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    with pytest.raises(VLLMServerError) as info:
        server.start()
    message = str(info.value)
    assert "exited with status 3 during start-up" in message
    assert "ImportError: the engine is broken" in message  # the log's tail
    assert server.proc is None and server.start_seconds == []


def test_a_server_never_healthy_is_an_error_and_is_stopped(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "sick")
    server.health_timeout_s = 1.5
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as info:
        server.start()
    assert "not healthy after 2s" in str(info.value)
    assert time.monotonic() - started < 10.0
    assert server.proc is None
    assert wait_dead(engine_core_pid(server), 1.0)


def test_the_server_dies_with_the_thread_that_started_it(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent death signal: a test run or demo killed without running any ``finally``
    leaves no orphan server. The flip side: started from a thread that exits (an anyio worker
    thread retired after 10 idle seconds), the server is terminated with it."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    assert server.proc is not None
    server.proc.wait(timeout=10.0)
    assert "fake vllm: SIGTERM" in server.log_tail()
    assert wait_dead(engine_core_pid(server), 10.0)


@pytest.mark.anyio
async def test_start_async_spawns_on_the_calling_thread(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop's thread lives as long as the demo; a worker thread may not."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    spawned_on: list[threading.Thread] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned_on.append(threading.current_thread())
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)  # the module the launcher spawns with
    with anyio.fail_after(30):
        await server.start_async()
    assert spawned_on == [threading.current_thread()]
    pid = server.pid
    await anyio.sleep(0.2)
    assert alive(pid) and server.proc is not None and server.proc.poll() is None
    await anyio.to_thread.run_sync(server.stop)
    assert wait_dead(pid, 0.1)


@pytest.mark.anyio
async def test_a_cancelled_start_async_stops_what_it_started(
    server: VLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "sick")
    with anyio.move_on_after(1.0) as scope:
        await server.start_async()
    assert scope.cancelled_caught
    assert server.proc is None
    assert wait_dead(engine_core_pid(server), 1.0)


def test_ensure_env_reports_the_scripts_status_and_last_line(tmp_path: Path) -> None:
    """The tests skip on status 2 and fail on any other non-zero status, with this line."""
    script = tmp_path / "env.sh"
    script.write_text(
        'echo "installing into $VLLM_VENV"\necho "pip: warning" >&2\n'
        'echo "vllm_env: FAILED (no wheel)"\nexit 2\n'
    )
    result = launcher.ensure_env(tmp_path / "venv", timeout=30, script=script)
    assert result.returncode == launcher.ENV_UNAVAILABLE
    assert result.line == "vllm_env: FAILED (no wheel)"
    assert result.stderr == "pip: warning\n"
    assert result.python == tmp_path / "venv" / "bin" / "python"
    script.write_text("exit 0\n")
    quiet = launcher.ensure_env(tmp_path / "venv", timeout=30, script=script)
    assert (quiet.returncode, quiet.line) == (launcher.ENV_READY, "(no output)")


def test_the_env_script_ships_next_to_the_launcher() -> None:
    """An installed loraledger carries it (the demo needs no source checkout)."""
    assert launcher.ENV_SCRIPT.exists() and os.access(launcher.ENV_SCRIPT, os.R_OK)
