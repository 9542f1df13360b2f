"""The shared engine contract (tests/engines/contract.py) against the real vLLM CPU server.

The server is the session's (tests/integration/conftest.py); each contract test gets a fresh
``VLLMEngine`` and starts from an empty inventory (leftovers are unloaded on the way in and
out). Capabilities that differ from the defaults, and why:

* ``unload_drains=False``: vLLM's unload only forgets the name; running requests keep going
  (proved in test_vllm_engine.py instead of the draining test);
* ``can_hold=False``: a stock server cannot be frozen between tokens from outside;
* ``reports_cached_tokens=False``: vLLM caches whole KV blocks (128 tokens on the CPU backend),
  so the contract's short prompt never hits; prefix-cache accounting and cache salts are
  checked with a long prompt in test_vllm_engine.py.

``stop`` really stops the server; the factory then starts it again on the same port so the
rest of the run keeps a server (the restart is the price of testing a dead engine for real).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.artifacts import ArtifactStore
from engines.vllm import VLLMEngine
from tests.engines.contract import Capabilities, EngineContract, EngineUnderTest
from tests.integration.conftest import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

CAPS = Capabilities(unload_drains=False, can_hold=False, reports_cached_tokens=False)


async def _unload_everything(engine: VLLMEngine) -> None:
    for entry in (await engine.inventory()).adapters:
        await engine.unload(entry.lora_name)


@contextlib.asynccontextmanager
async def vllm_under_test(server: VLLMServer, tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    engine = VLLMEngine(
        server.base_url,
        "vllm-contract",
        served_model=server.served_model,
        max_lora_rank=server.max_lora_rank,
    )
    stopped = False

    async def stop() -> None:
        nonlocal stopped
        stopped = True
        server.check_slot_headroom()
        server.stop()  # blocking on purpose: start/stop stay on the main thread (PDEATHSIG)

    try:
        await _unload_everything(engine)
        yield EngineUnderTest(
            engine=engine, caps=CAPS, store=ArtifactStore(tmp_path / "artifacts"), stop=stop
        )
    finally:
        try:
            if stopped:
                server.start(same_port=True)
            await _unload_everything(engine)
        finally:
            await engine.aclose()


@pytest.fixture
async def eut(vllm_server: VLLMServer, tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    async with vllm_under_test(vllm_server, tmp_path) as under_test:
        yield under_test


class TestVLLMContract(EngineContract):
    pass
