"""A ``loraledger`` command started as its own OS process, ready once it says it listens.

The long-running commands (``engine``, ``agent``, ``gateway``, ``serve``) print one JSON
``listening`` row on stdout with ``--json`` once they answer; that row names the URL the OS
gave them (tests ask for port 0) and the PID that printed it. Starting one, reading that row
and stopping the process by its PID is written once here, so every process test waits for the
same evidence (never for a fixed time) and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from tests.support.paths import REPO


@asynccontextmanager
async def listening_process(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    ready_within: float = 120.0,
    stop_with: signal.Signals = signal.SIGKILL,
    module: str = "tools.cli",
    stderr: Any = subprocess.PIPE,
) -> AsyncIterator[tuple[Process, dict[str, Any]]]:
    """``python -m tools.cli ARGS`` (``ARGS`` end in ``--json``) in ``cwd``; yield the process
    and its ``listening`` row, checked to come from that process.

    ``env``: the whole environment (default: this one, with this tree first on the import
    path, so the code under test runs). On exit the process is sent ``stop_with`` by PID if it
    is still running, and reaped; a caller that checks how it exited reads ``returncode``
    after the block (or stops it itself first). ``module``: another program that prints the
    same row (a test-only wrapper around a command, ``tests.chaos.recording_engine``);
    ``stderr``: where its log goes (a file for a long run: an unread pipe fills and blocks it)."""
    if env is None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", module, *args]
    process: Process = await anyio.open_process(argv, cwd=cwd, env=env, stderr=stderr)
    try:
        assert process.stdout is not None
        line = b""
        with anyio.fail_after(ready_within):
            while not line.endswith(b"\n"):
                line += await process.stdout.receive(1)
        row: dict[str, Any] = json.loads(line)
        assert row["row"] == "listening" and row["pid"] == process.pid, row
        yield process, row
    finally:
        if process.returncode is None:
            os.kill(process.pid, stop_with)
        with anyio.fail_after(30):
            await process.wait()
        await process.aclose()
