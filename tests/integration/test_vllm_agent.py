"""Publication through an engine-host agent to the real vLLM CPU server: no shared directory.

The control plane's artifact store and the agent's are separate directories; vLLM only ever
reads the agent's. Proven through the full control plane (one fleet member: agent + vLLM):

* a publication writes the version's directory in the agent's store only, vLLM lists it from
  there, and it generates exactly the greedy tokens transformers+peft computes for it;
* a second publication retires the first, and the reclaim driver unloads it through the agent;
* a third publication whose agent dies between writing and loading (the agent's fault hook)
  is ambiguous, and once the agent answers again the next publication goes through.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.agent import Agent, AgentEngine, serve_agent
from engines.artifacts import ArtifactStore
from engines.contract import SamplingParams
from engines.local.tinymodel import make_adapter
from engines.vllm import VLLMEngine
from evlog.events import AttemptFailed
from evlog.memory import MemoryStore
from projections.registry import VersionState
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationError, PublicationStatus
from tests.integration.conftest import VLLMServer
from tests.integration.peft_reference import PeftReference
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.* is deprecated:FutureWarning"),
]

PROMPT = "hello world"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


class _Killed(Exception):
    """Stands for the agent process dying after the write (in process: the reply is lost)."""


def adapter(seed: int) -> AdapterCopy:
    config, tensors = make_adapter(seed)
    return AdapterCopy.from_state_dict(tensors, config)


def _vllm(server: VLLMServer) -> VLLMEngine:
    return VLLMEngine(
        server.base_url,
        "vllm-agent",
        served_model=server.served_model,
        max_lora_rank=server.max_lora_rank,
    )


async def test_publication_through_an_agent_without_a_shared_directory(
    vllm_server: VLLMServer, reference: PeftReference, tmp_path: Path
) -> None:
    host = ArtifactStore(tmp_path / "engine-host")
    kill = {"armed": False}

    def after_write() -> None:
        if kill["armed"]:
            kill["armed"] = False
            raise _Killed

    agent = Agent(_vllm(vllm_server), host, after_write=after_write)
    async with serve_agent(agent) as agent_url:
        member = AgentEngine(agent_url, _vllm(vllm_server))
        try:
            async with ControlPlane.open(
                MemoryStore(),
                Fleet([member]),
                deployment="vagent",
                prefix="agent",
                capacity=2,
                artifact_root=tmp_path / "trainer",
                probe_interval_s=0.5,
                reclaim_tick_s=0.1,
            ) as plane:
                ledger = plane.ledger
                v1 = await plane.publisher.publish(adapter(31), version_id=1)
                assert v1.status == PublicationStatus.PUBLISHED
                entry = next(
                    a for a in (await member.inventory()).adapters if a.lora_name == v1.lora_name
                )
                assert (entry.path, entry.digest) == (str(host.path_for(v1.digest)), v1.digest)
                out = await member.generate(PROMPT, v1.lora_name, GREEDY)
                assert out.token_ids == reference.greedy(
                    PROMPT, GREEDY.max_tokens, host.path_for(v1.digest)
                )

                v2 = await plane.publisher.publish(adapter(32), version_id=2)
                await wait_for(
                    "v1 reclaimed",
                    lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
                    timeout=60,
                )
                assert (await member.inventory()).names() >= {v2.lora_name}
                assert v1.lora_name not in (await member.inventory()).names()

                kill["armed"] = True
                seq = ledger.state.last_seq
                with pytest.raises(PublicationError):
                    await plane.publisher.publish(adapter(33), version_id=3)
                failed = of_type(await events(ledger, after=seq), AttemptFailed)
                assert failed and not failed[0].clean
                assert host.contains(ledger.state.versions[3].digest)  # written, not loaded
                v4 = await plane.publisher.publish(adapter(34), version_id=4)
                assert v4.status == PublicationStatus.PUBLISHED
                assert v4.lora_name in (await member.inventory()).names()
            for name in (await member.inventory()).names():
                if name.startswith("agent@vagent"):
                    await member.engine.unload(name)
        finally:
            await member.aclose()
            await agent.engine.aclose()
