"""Publication and reclaim through the artifact store against the real vLLM CPU server.

The full control plane (ledger, publication driver, reclaim driver, reconciler) drives one
``VLLMEngine``; nothing below talks to vLLM except through it. Proven:

* a publication: the version is in vLLM's inventory, loaded from its artifact directory, and
  generates exactly the greedy tokens transformers+peft computes here for that directory;
* a second publication while a session stays bound to the first: both generate their own
  reference tokens (the pinned session is still served its version);
* a reclaim: once the session is released, the reclaim driver unloads the old version; the
  inventory no longer lists it, a generation naming it is refused (``NOT_LOADED``), and the
  current version still generates its reference tokens.

Uses the session vLLM server of ``conftest.py`` (skipped with its reason where the engine
cannot be installed; see there) and the ``PeftReference`` of ``peft_reference``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.contract import CleanRefusal, ErrorCode, SamplingParams
from engines.local.tinymodel import make_adapter
from engines.vllm import VLLMEngine
from evlog.events import EngineUnloaded, ReclaimClaimed, VersionPublished, VersionReclaimed
from evlog.memory import MemoryStore
from projections.registry import VersionState
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from tests.integration.peft_reference import PeftReference
from tests.support.log import events, of_type
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    # the transformers+peft reference's deprecation notices, not ours
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.* is deprecated:FutureWarning"),
]

PROMPT = "hello world"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def adapter(seed: int) -> AdapterCopy:
    config, tensors = make_adapter(seed)
    return AdapterCopy.from_state_dict(tensors, config)


async def test_publish_and_reclaim_through_the_artifact_store(
    engine: VLLMEngine, reference: PeftReference, tmp_path: Path
) -> None:
    async with ControlPlane.open(
        MemoryStore(),
        Fleet([engine]),
        deployment="vpub",  # names of other tests on this server are not ours
        prefix="agent",
        capacity=2,
        artifact_root=tmp_path / "artifacts",
        probe_interval_s=0.5,
        reclaim_tick_s=0.1,
    ) as plane:
        ledger = plane.ledger
        v1 = await plane.publisher.publish(adapter(21), version_id=1)
        assert v1.status == PublicationStatus.PUBLISHED
        dir1 = plane.artifacts.path_for(v1.digest)
        inventory = await engine.inventory()
        entry = next(a for a in inventory.adapters if a.lora_name == v1.lora_name)
        assert (entry.path, entry.digest) == (str(dir1), v1.digest)
        out1 = await engine.generate(PROMPT, v1.lora_name, GREEDY)
        expected1 = reference.greedy(PROMPT, GREEDY.max_tokens, dir1)
        assert out1.token_ids == expected1

        await ledger.register_owner("w", ttl_s=600)
        pinned = await ledger.bind("pinned", "w")
        v2 = await plane.publisher.publish(adapter(22), version_id=2)
        assert v2.status == PublicationStatus.PUBLISHED and v2.retired == 1
        dir2 = plane.artifacts.path_for(v2.digest)
        expected2 = reference.greedy(PROMPT, GREEDY.max_tokens, dir2)
        assert expected2 != expected1
        assert (await engine.generate(PROMPT, pinned.lora_name, GREEDY)).token_ids == expected1
        assert (await engine.generate(PROMPT, v2.lora_name, GREEDY)).token_ids == expected2
        assert {v1.lora_name, v2.lora_name} <= (await engine.inventory()).names()

        await ledger.release("pinned", "w")
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=60,
        )
        held = (await engine.inventory()).names()
        assert v1.lora_name not in held and v2.lora_name in held
        with pytest.raises(CleanRefusal) as info:
            await engine.generate(PROMPT, v1.lora_name, GREEDY)
        assert info.value.code == ErrorCode.NOT_LOADED
        assert (await engine.generate(PROMPT, v2.lora_name, GREEDY)).token_ids == expected2
        assert dir1.exists()  # vLLM may re-read from disk: kept unless deletion is configured

        log = await events(ledger)
        assert [p.version_id for p in of_type(log, VersionPublished)] == [1, 2]
        assert [c.version_id for c in of_type(log, ReclaimClaimed)] == [1]
        assert [(u.version_id, u.engine) for u in of_type(log, EngineUnloaded)] == [(1, "vllm-0")]
        assert [r.version_id for r in of_type(log, VersionReclaimed)] == [1]
    # leave the shared server as we found it (after the plane stopped: its reconciler would
    # restore the default version otherwise)
    await engine.unload(v2.lora_name)
