"""Served-content attestation against the real vLLM CPU server: other weights loaded under a
managed name fail the version's canary, and the engine leaves routing for that version with an
incident in the log.

vLLM names no digest of what it loaded, only the directory it loaded from, and the ledger reads
the digest from that directory's name. The weights are swapped the way any holder of the
engine's token could: the managed name is unloaded through vLLM's own API and *other* adapter
weights are loaded under the same name from a directory named by the version's digest, so the
digest check alone passes. Only the canary (greedy tokens of a fixed prompt, baseline recorded
once the engine held the version) can tell; both answers are checked against what
transformers+peft computes for each directory, so the test proves the two weights really answer
the canary differently on the tiny model, and that the baseline is the published weights'.
vLLM refuses the reconciler's reload under the name (another path is loaded there), so the
engine is suspended until a restart, like every engine that refuses to reload a lost adapter.

Uses the session vLLM server of ``conftest.py`` and the ``PeftReference`` of
``peft_reference``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from engines.artifacts import ArtifactStore
from engines.vllm import VLLMEngine
from engines.vllm_server import VLLMServer
from evlog.events import (
    CanaryRecorded,
    EngineSuspended,
    ServedContentMismatch,
    VersionRestored,
)
from evlog.memory import MemoryStore
from projections.incidents import incidents
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from publisher.drivers.reconciler import CANARY_PARAMS, CANARY_PROMPT
from tests.engines.contract import candidate_for
from tests.integration.peft_reference import PeftReference
from tests.publisher.plane_kit import adapter_copy
from tests.support.log import events_of, records
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    # the transformers+peft reference's deprecation notices, not ours
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.* is deprecated:FutureWarning"),
]

PERIOD_S = 2.0  # the full reconcile pass and the canary period
# vLLM on a loaded CPU: a canary is a generation of a few tokens, a restore a load
TIMEOUTS = EngineTimeouts(probe=10, inventory=30, prepare=60, transfer=60, load=60, unload=60)


def _tokens(answer: str) -> tuple[int, ...]:
    return tuple(int(t) for t in answer.split(","))


async def test_other_weights_under_the_versions_path_fail_the_canary_on_real_vllm(
    engine: VLLMEngine, vllm_server: VLLMServer, reference: PeftReference, tmp_path: Path
) -> None:
    engine_id = engine.engine_id
    async with ControlPlane.open(
        MemoryStore(),
        Fleet([engine]),
        deployment="vcanary",  # names of other tests on this server are not ours
        prefix="agent",
        capacity=2,
        artifact_root=tmp_path / "artifacts",
        timeouts=TIMEOUTS,
        probe_interval_s=0.5,
        full_reconcile_s=PERIOD_S,
        reclaim_tick_s=0.2,
        suspend_after_s=None,
        canary_every_s=PERIOD_S,
    ) as plane:
        ledger = plane.ledger
        published = await plane.publisher.publish(adapter_copy(31), version_id=1)
        assert published.status == PublicationStatus.PUBLISHED
        v1 = ledger.state.versions[1]
        await wait_for(
            "the canary's baseline",
            lambda: v1.lora_name in ledger.state.engines[engine_id].canaries,
            timeout=60.0,
        )
        assert await events_of(ledger, ServedContentMismatch) == []  # same weights: no incident
        baseline = (await events_of(ledger, CanaryRecorded))[0].answer
        n = CANARY_PARAMS.max_tokens
        own = plane.artifacts.path_for(v1.digest)
        assert _tokens(baseline) == reference.greedy(CANARY_PROMPT, n, own)

        # other weights, in a directory named by v1's digest, that answer the canary otherwise
        other = candidate_for(ArtifactStore(tmp_path / "other"), 77).candidate.artifact_path
        assert other is not None
        lookalike = tmp_path / "elsewhere" / v1.digest
        shutil.copytree(other, lookalike)
        expected_seen = reference.greedy(CANARY_PROMPT, n, lookalike)
        assert expected_seen != _tokens(baseline)

        # between two passes over the engine (its lock held), so no pass sees the name absent
        async with (
            plane.reconciler._lock(engine_id),
            httpx.AsyncClient(base_url=vllm_server.base_url, trust_env=False) as client,
        ):
            body = {"lora_name": v1.lora_name}
            unloaded = await client.post("/v1/unload_lora_adapter", json=body, timeout=60)
            assert unloaded.status_code == 200, unloaded.text
            body["lora_path"] = str(lookalike)
            loaded = await client.post("/v1/load_lora_adapter", json=body, timeout=60)
            assert loaded.status_code == 200, loaded.text
        swapped_at = time.monotonic()
        served = {a.lora_name: (a.path, a.digest) for a in (await engine.inventory()).adapters}
        assert served[v1.lora_name] == (str(lookalike), v1.digest)  # the digest check passes

        await wait_for(
            "the canary's mismatch recorded",
            lambda: v1.lora_name in ledger.state.engines[engine_id].mismatched,
            timeout=PERIOD_S + 60.0,
        )
        took = time.monotonic() - swapped_at
        assert ledger.state.holders(v1.lora_name) == ()  # out of routing for v1
        found = await events_of(ledger, ServedContentMismatch)
        assert [(e.engine, e.version_id, e.evidence, e.expected) for e in found] == [
            (engine_id, 1, "canary", baseline)
        ]
        assert _tokens(found[0].seen) == expected_seen  # the other weights' own answer
        kinds = [i.kind for i in incidents(await records(ledger))]
        assert "content_mismatch" in kinds, kinds
        print(f"real vLLM: canary mismatch recorded {took:.2f} s after the swap")

        # the restore is refused (vLLM: another path under the name) and the inventory
        # proves nothing for it (the directory's name is all vLLM reports): the engine is
        # suspended, and the other weights are never routed for v1 again
        await wait_for(
            "the engine suspended",
            lambda: ledger.state.engines[engine_id].suspended,
            timeout=PERIOD_S + 60.0,
        )
        suspended = await events_of(ledger, EngineSuspended)
        assert [(e.cause, "served with other content" in e.detail) for e in suspended] == [
            ("lost_adapter", True)
        ]
        assert await events_of(ledger, VersionRestored) == []
        assert ledger.state.holders(v1.lora_name) == ()
        served_now = {a.lora_name: a.path for a in (await engine.inventory()).adapters}
        assert served_now[v1.lora_name] == str(lookalike)  # what a restart of vLLM repairs
    # leave the shared server as we found it: the other weights go (vLLM keeps no fence)
    async with httpx.AsyncClient(base_url=vllm_server.base_url, trust_env=False) as client:
        body = {"lora_name": v1.lora_name}
        gone = await client.post("/v1/unload_lora_adapter", json=body, timeout=60)
        assert gone.status_code == 200, gone.text
