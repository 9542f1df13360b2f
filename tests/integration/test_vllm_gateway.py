"""Generation through the ``Gateway`` against the real vLLM CPU server.

The gateway replaces any client cache key with its own per-version salt (``version_salt``) and
sends it with every generation. Unit tests use the local engine and a scripted vLLM, so only a
real server proves that vLLM accepts that salt and keys its prefix cache by it: the salt used to
be the version's ``lora_name``, which vLLM 0.32 refuses (400: no ``@`` in a ``cache_salt``), and
every generation on a vLLM fleet failed while the whole suite passed.

Uses the session vLLM server of ``conftest.py`` and the ``PeftReference`` of
``peft_reference``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.contract import SamplingParams
from engines.local.tinymodel import make_adapter
from engines.vllm import VLLMEngine
from evlog.memory import MemoryStore
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from publisher.gateway import Gateway, LocalView
from tests.integration.peft_reference import PeftReference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    # the transformers+peft reference's deprecation notices, not ours
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.* is deprecated:FutureWarning"),
]

PROMPT = "hello world"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# vLLM caches whole KV blocks (128 tokens on CPU): 300 token ids span two of them.
LONG_PROMPT = tuple((7 * i) % 300 + 1 for i in range(300))
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def test_salted_gateway_generations_succeed_and_reach_the_prefix_cache(
    engine: VLLMEngine, reference: PeftReference, tmp_path: Path
) -> None:
    """A bound session generates through the gateway (with the gateway's own salt, whatever
    the client sends) and gets its version's exact tokens; the salt really reached vLLM's
    prefix cache: the session's second request hits the blocks of its first, and the same
    prompt on the same adapter without that salt does not."""
    config, tensors = make_adapter(61)
    async with ControlPlane.open(
        MemoryStore(),
        Fleet([engine]),
        deployment="vsalt",  # names of other tests on this server are not ours
        prefix="agent",
        capacity=2,
        artifact_root=tmp_path / "artifacts",
        probe_interval_s=0.5,
        reclaim_tick_s=0.1,
    ) as plane:
        v1 = await plane.publisher.publish(
            AdapterCopy.from_state_dict(tensors, config), version_id=1
        )
        assert v1.status == PublicationStatus.PUBLISHED
        gateway = Gateway(plane.fleet, LocalView(plane.ledger), gateway_id="salt-test")
        plane.add_inflight_source(gateway)
        await plane.ledger.register_owner("w", ttl_s=600)
        bound = await plane.ledger.bind("s1", "w")
        assert "@" in bound.lora_name  # exactly the name vLLM refused as a salt

        served = await gateway.generate(
            bound, PROMPT, GREEDY, extra_body={"cache_salt": "client@salt"}
        )
        expected = reference.greedy(PROMPT, GREEDY.max_tokens, plane.artifacts.path_for(v1.digest))
        assert served.generation.token_ids == expected
        assert served.lora_name == bound.lora_name and served.provenance.attested

        cold = await gateway.generate(bound, LONG_PROMPT, SHORT)
        warm = await gateway.generate(bound, LONG_PROMPT, SHORT)
        unsalted = await engine.generate(LONG_PROMPT, bound.lora_name, SHORT)
        assert cold.generation.cached_tokens == 0
        assert 0 < warm.generation.cached_tokens <= len(LONG_PROMPT)
        assert unsalted.cached_tokens == 0  # another namespace: the gateway's salt was sent
        assert warm.generation.token_ids == cold.generation.token_ids == unsalted.token_ids
        assert gateway.inflight_counts() == {}
        await plane.ledger.release("s1", "w")
    # leave the shared server as we found it (after the plane stopped: its reconciler would
    # restore the default version otherwise)
    await engine.unload(v1.lora_name)  # type: ignore[arg-type]  # published: named
