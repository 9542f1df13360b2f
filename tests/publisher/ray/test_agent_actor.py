"""The engine-host agent's Ray form: an engine actor hosting :class:`HostedAgentEngine` (agent
+ the engine's path adapter in the actor's process), driving a local engine served over HTTP
whose artifact root only the actor writes. Buckets reach the actor through Ray; the actor
verifies them, writes the directory and has the engine load it; the caller's artifact store
is never given to the engine."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from engines.agent import hosted_agent
from engines.artifacts import ArtifactStore
from engines.local.admission import ServingLimits
from engines.local.server import running_server
from publisher.ray.engine import start_engine, stop_engine
from tests.engines.contract import GREEDY, PROMPT, candidate_for, publish

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]


async def test_the_agent_actor_publishes_into_its_host_root(
    ray_instance: dict[str, Any], tmp_path: Path
) -> None:
    host = tmp_path / "engine-host"
    host.mkdir()
    limits = ServingLimits(max_lora_rank=32)
    async with running_server("ra-0", limits=limits, artifact_root=host) as (engine, url):
        factory = functools.partial(hosted_agent, f"sglang:{url}", str(host), "ra-0")
        member = start_engine(factory, name="agent-ra-0")
        try:
            assert (member.engine_id, member.transport) == ("ra-0", "staged")
            p = candidate_for(ArtifactStore(tmp_path / "trainer"), 31)
            await publish(member, p)
            assert engine.loaded_adapters() == {p.name: str(host / p.candidate.digest)}
            out = await member.generate(PROMPT, p.name, GREEDY)
            assert len(out.token_ids) == GREEDY.max_tokens and out.lora_name == p.name
            assert (await member.unload(p.name, attempt=1)).was_loaded is True
            assert engine.loaded_adapters() == {}
        finally:
            stop_engine(member)
