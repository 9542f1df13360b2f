"""What the examples share: a ``loraledger serve`` of their own, on loopback, over one
in-process local engine (the tiny model, on CPU), and a trainer's publication of an adapter
directory.

The service is started as its own process (``python -m tools.cli serve ... --json``), ready
once it prints its ``listening`` row (which names the port the OS gave it), and stopped by its
PID with SIGTERM (a clean stop: the log is closed, exit 0). Against a real fleet, start
``loraledger serve --engine e0=sglang:URL ...`` yourself and point the examples' clients at it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TOKEN = "example-token"


@dataclass(frozen=True)
class Service:
    url: str  # serve's base URL; the OpenAI routes are under ``url + "/v1"``
    token: str
    db: Path  # the ledger's log, for ``loraledger audit`` once the service stopped


@contextmanager
def local_service(home: Path, *, ready_within_s: float = 120.0) -> Iterator[Service]:
    """``loraledger serve`` with its log in ``home``; stopped (and waited for) on exit."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text(TOKEN + "\n")
    db = home / "ledger.db"
    argv = [sys.executable, "-m", "tools.cli", "serve", "--db", str(db), "--port", "0"]
    argv += ["--token-file", str(home / "token"), "--engine", "e0=local:", "--json"]
    with open(home / "serve.log", "wb") as stderr:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr)
    try:
        row = _listening_row(process, ready_within_s, home / "serve.log")
        yield Service(url=str(row["url"]), token=TOKEN, db=db)
    finally:
        stop(process)


def _listening_row(
    process: subprocess.Popen[bytes], within_s: float, log: Path
) -> dict[str, object]:
    """The first line serve prints: its ``listening`` row, once it answers."""
    assert process.stdout is not None
    deadline = time.monotonic() + within_s
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        readable, _, _ = select.select([process.stdout], [], [], max(left, 0))
        if not readable:
            raise TimeoutError(f"serve did not listen within {within_s:g} s: see {log}")
        byte = os.read(process.stdout.fileno(), 1)
        if not byte:
            raise RuntimeError(f"serve exited {process.wait()}: {log.read_text()[-2000:]}")
        line += byte
    row: dict[str, object] = json.loads(line)
    assert row["row"] == "listening" and row["pid"] == process.pid, row
    return row


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, then wait; SIGKILL only if it does not end."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


def random_adapter(root: Path, seed: int) -> Path:
    """A PEFT LoRA directory for the tiny model, random but seeded (a stand-in for a trained
    step's ``model.save_pretrained(...)``)."""
    from engines import make_adapter
    from engines.artifacts import serialize_safetensors

    config, tensors = make_adapter(seed)
    out = root / f"adapter-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes(serialize_safetensors(tensors))
    return out
