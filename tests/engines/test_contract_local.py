"""The engine contract against every engine implementation that runs here.

* ``local``: :class:`LocalEngine` in process (staged transport, managed names);
* ``sglang-face``: :class:`SGLangEngine` (artifact transport) against the local engine's
  SGLang-compatible HTTP face -- the stand-in for a GPU SGLang server, including its implicit
  reload of unloaded names;
* ``staged-http``: :class:`LocalHTTPEngine` driving the staged endpoints over HTTP;
* ``sglang-tensors``: :class:`SGLangTensorEngine` (staged transport) against the same SGLang
  face's ``/load_lora_adapter_from_tensors``: a tensor-loaded adapter is never implicitly
  reloaded, so the generation-after-unload test expects a refusal.

All servers listen on 127.0.0.1 and are stopped by the factory that started them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.artifacts import ArtifactStore
from engines.local.admission import ServingLimits
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import running_server
from engines.sglang import SGLangEngine
from engines.sglang_tensors import SGLangTensorEngine
from tests.engines.contract import (
    Capabilities,
    EngineContract,
    EngineUnderTest,
    contract_fixture,
)

LIMITS = ServingLimits(max_lora_rank=32)


def _store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


def _wired(engine: LocalEngine) -> dict[str, object]:
    """Hooks into the serving engine: freeze/unfreeze decoding, refcounts, stop."""
    return {
        "hold": engine.pause_generation,
        "release": engine.continue_generation,
        "refcount": engine.refcount,
        "stop": engine.aclose,
    }


@contextlib.asynccontextmanager
async def in_process(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    store = _store(tmp_path)
    async with LocalEngine("local-0", limits=LIMITS, artifact_root=store.root) as engine:
        yield EngineUnderTest(
            engine=engine,
            caps=Capabilities(reclaimed_refusal=True, reports_staging=True),
            store=store,
            **_wired(engine),  # type: ignore[arg-type]
        )


@contextlib.asynccontextmanager
async def sglang_face(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    store = _store(tmp_path)
    async with running_server("sg-0", limits=LIMITS, artifact_root=store.root) as (engine, url):
        client = SGLangEngine(url, "sg-0")
        try:
            yield EngineUnderTest(
                engine=client,
                caps=Capabilities(implicit_reload=True),
                store=store,
                **_wired(engine),  # type: ignore[arg-type]
            )
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def staged_http(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    store = _store(tmp_path)
    async with running_server("st-0", limits=LIMITS, artifact_root=store.root) as (engine, url):
        client = LocalHTTPEngine(url, "st-0")
        try:
            yield EngineUnderTest(
                engine=client,
                caps=Capabilities(reclaimed_refusal=True, reports_staging=True),
                store=store,
                **_wired(engine),  # type: ignore[arg-type]
            )
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def sglang_tensors(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    store = _store(tmp_path)
    async with running_server("sgt-0", limits=LIMITS, artifact_root=store.root) as (engine, url):
        client = SGLangTensorEngine(url, "sgt-0")
        try:
            yield EngineUnderTest(
                engine=client,
                caps=Capabilities(),
                store=store,
                **_wired(engine),  # type: ignore[arg-type]
            )
        finally:
            await client.aclose()


eut = contract_fixture(
    {
        "local": in_process,
        "sglang-face": sglang_face,
        "staged-http": staged_http,
        "sglang-tensors": sglang_tensors,
    }
)


class TestLocalEngines(EngineContract):
    pass


# --- agent + engine (no shared filesystem) -------------------------------------------------


@contextlib.asynccontextmanager
async def agent_and_engine(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    """An engine whose artifact root only its agent writes; the harness's store is the
    trainer's side and is never given to the engine."""
    from engines.agent import Agent, AgentEngine, serve_agent

    host = tmp_path / "engine-host"
    host.mkdir()
    async with running_server("ag-0", limits=LIMITS, artifact_root=host) as (engine, url):
        agent = Agent(SGLangEngine(url, "ag-0"), ArtifactStore(host))
        async with serve_agent(agent) as agent_url:
            member = AgentEngine(agent_url, SGLangEngine(url, "ag-0"))
            try:
                yield EngineUnderTest(
                    engine=member,
                    caps=Capabilities(implicit_reload=True),
                    store=_store(tmp_path),
                    **_wired(engine),  # type: ignore[arg-type]
                )
            finally:
                await member.aclose()
                await agent.engine.aclose()


agent_eut = contract_fixture({"agent": agent_and_engine})


class TestAgentAndEngine(EngineContract):
    @pytest.fixture
    def eut(self, agent_eut: EngineUnderTest) -> EngineUnderTest:
        return agent_eut


@contextlib.asynccontextmanager
async def hosted_agent_and_engine(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    """The agent in the caller's process (the form a Ray engine actor hosts on the engine's
    node): same engine, same separate artifact root."""
    from engines.agent import Agent, HostedAgentEngine

    host = tmp_path / "engine-host"
    host.mkdir()
    async with running_server("ha-0", limits=LIMITS, artifact_root=host) as (engine, url):
        member = HostedAgentEngine(Agent(SGLangEngine(url, "ha-0"), ArtifactStore(host)))
        try:
            yield EngineUnderTest(
                engine=member,
                caps=Capabilities(implicit_reload=True),
                store=_store(tmp_path),
                **_wired(engine),  # type: ignore[arg-type]
            )
        finally:
            await member.aclose()


hosted_eut = contract_fixture({"hosted-agent": hosted_agent_and_engine})


class TestHostedAgent(EngineContract):
    @pytest.fixture
    def eut(self, hosted_eut: EngineUnderTest) -> EngineUnderTest:
        return hosted_eut
