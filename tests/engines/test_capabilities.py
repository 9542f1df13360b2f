"""Optional engine capabilities are declared by each adapter (:class:`EngineCapabilities`),
so callers never inspect signatures or read attributes the contract does not name: SGLang's
``generate`` takes ``extra_body``, vLLM's does not; HTTP adapters name their endpoint; the
in-process engine has neither; every adapter can confirm a request's end (and is then an
``EndsRequests``); a fault-injecting wrapper declares what it wraps."""

from __future__ import annotations

import pytest

from engines.contract import EndsRequests, Engine, EngineCapabilities
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from tests.engines.faulty_engine import FaultyEngine

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:30000"


async def test_each_adapter_declares_what_it_offers() -> None:
    sglang = SGLangEngine(URL + "/", "sg")
    vllm = VLLMEngine(URL, "vl")
    staged = LocalHTTPEngine(URL, "st")
    try:
        ends = {"confirms_end": True}
        assert sglang.capabilities == EngineCapabilities(extra_body=True, endpoint=URL, **ends)
        assert vllm.capabilities == EngineCapabilities(extra_body=False, endpoint=URL, **ends)
        assert staged.capabilities == EngineCapabilities(extra_body=True, endpoint=URL, **ends)
        assert LocalEngine.capabilities == EngineCapabilities(confirms_end=True)
        for engine in (sglang, vllm, staged):
            assert isinstance(engine, Engine)
            assert isinstance(engine, EndsRequests)
    finally:
        for engine in (sglang, vllm, staged):
            await engine.aclose()


async def test_a_fault_wrapper_declares_the_capabilities_it_forwards() -> None:
    sglang = SGLangEngine(URL, "sg")
    try:
        wrapped = FaultyEngine(sglang)
        assert wrapped.capabilities == sglang.capabilities
        assert isinstance(wrapped, Engine)
    finally:
        await sglang.aclose()
