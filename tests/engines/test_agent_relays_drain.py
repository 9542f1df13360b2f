"""An engine draining behind its ``loraledger agent`` refuses a publication step cleanly, as
it does when reached directly: a draining engine's refusal is spelt ``503 ENGINE_DRAINING``
(:mod:`engines.drain`), the one 5xx that proves nothing ran, so the control plane fails the
step cleanly and tries again later, rather than count the load ambiguous and reclaim it.

A real local engine on loopback with its drain begun (as on SIGTERM), the agent in process in
front of it, and the agent's client the control plane uses.

Before: the agent relayed its engine's refusal as ``400 ENGINE_DRAINING``, a 400 with a code
no agent refusal has, which the client reads as an unrecognised reply: ``MALFORMED_REPLY``,
ambiguous (a chaos run's SIGTERM of the agent's engine during a publication).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from engines.agent import Agent, serve_agent
from engines.artifacts import ArtifactStore
from engines.contract import CleanRefusal, ErrorCode
from engines.drain import Drain
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import serve
from engines.sglang import SGLangEngine
from tests.engines.contract import aiter_list, buckets_of, candidate_for
from tests.engines.test_contract_local import LIMITS

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


async def test_a_load_on_a_draining_engine_behind_the_agent_is_a_clean_refusal(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    drain = Drain("h0")
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(
            LocalEngine("h0", limits=LIMITS, artifact_root=host)
        )
        url = await stack.enter_async_context(serve(engine, drain=drain))
        agent = Agent(SGLangEngine(url, "h0"), ArtifactStore(host))
        stack.push_async_callback(agent.engine.aclose)
        client = LocalHTTPEngine(await stack.enter_async_context(serve_agent(agent)), "h0")
        stack.push_async_callback(client.aclose)
        published = candidate_for(ArtifactStore(tmp_path / "trainer"), 41)
        await client.prepare(published.candidate)
        await client.transfer(published.candidate, aiter_list(buckets_of(published.tensors)))

        drain.begin()  # the engine got SIGTERM: it admits no new work
        with pytest.raises(CleanRefusal) as refused:
            await client.load(published.candidate)
        assert refused.value.code == ErrorCode.ENGINE_DRAINING, refused.value
        assert "draining" in refused.value.message
