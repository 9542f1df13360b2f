"""The engine-host agent stages what it receives on disk, not in memory: each verified tensor is
written once, at its place in a directory staged in the agent's own store, and ``load`` only
recomputes the digest from the checksums taken on arrival, fsyncs once and renames the
directory into place. Memory holds the bucket being received, whatever the adapter's size; a
staging dropped (idle, unloaded, replaced by a new attempt) leaves no file behind.

Before, the agent kept every tensor of every staged attempt in memory until its load, then
hashed them all again and serialized the whole file in memory before writing it."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engines.agent import Agent
from engines.artifacts import ArtifactStore
from engines.contract import Bucket, BucketTensor
from engines.local import wire
from engines.local.admission import ServingLimits
from engines.local.server import running_server
from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData, build_manifest
from engines.sglang import SGLangEngine
from publisher.drivers.adapter_copy import plan_buckets
from tests.engines.contract import GREEDY, PROMPT, Published, candidate_for

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]

MiB = 1024 * 1024
RANK = 1024  # four projections of the tiny model at this rank: about 8 MiB of float32


@asynccontextmanager
async def _agent(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Agent, Path]]:
    host = tmp_path / "host"
    host.mkdir()
    limits = ServingLimits(max_lora_rank=RANK)
    async with AsyncExitStack() as stack:
        _, url = await stack.enter_async_context(
            running_server("h0", limits=limits, artifact_root=host)
        )
        agent = Agent(SGLangEngine(url, "h0"), ArtifactStore(host), **options)
        stack.push_async_callback(agent.engine.aclose)
        yield agent, host


def _large(tmp_path: Path) -> Published:
    from engines.contract import Candidate
    from tests.engines.contract import lora_name_for

    config, tensors = make_adapter(71, r=RANK, targets=("k_proj", "o_proj", "q_proj", "v_proj"))
    manifest = build_manifest(config, tensors)
    candidate = Candidate(
        lora_name=lora_name_for(manifest, 71), digest=manifest.digest, attempt=1, manifest=manifest
    )
    return Published(candidate, tensors)


def _received(bucket: Bucket) -> Bucket:
    """The bucket as a request body decodes it: fresh bytes, owned by the receiver."""
    return Bucket(
        bucket.index,
        tuple(
            BucketTensor(
                i.name, TensorData(i.tensor.dtype, i.tensor.shape, bytes(bytearray(i.tensor.data)))
            )
            for i in bucket.tensors
        ),
    )


def _temp_dirs(host: Path) -> list[str]:
    return sorted(p.name for p in host.iterdir() if p.name.startswith("."))


async def test_the_agent_holds_a_bucket_not_the_adapter(tmp_path: Path) -> None:
    p = _large(tmp_path)
    size = p.candidate.manifest.total_bytes
    assert size >= 8 * MiB
    buckets = plan_buckets(p.tensors, MiB)
    async with _agent(tmp_path) as (agent, host):
        await agent.prepare(p.candidate)
        gc.collect()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for bucket in buckets:
                upload = wire.BucketUpload(
                    lora_name=p.name, attempt=1, digest=p.candidate.digest, bucket=_received(bucket)
                )
                await agent.receive_bucket(upload)
                del upload
            gc.collect()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert agent.staged_bytes() == size
        assert held - before < size // 4, (
            f"the agent holds {(held - before) / MiB:.1f} MiB of a {size / MiB:.1f} MiB adapter "
            "after receiving it"
        )
        receipt = await agent.load(p.candidate)
        assert receipt.phase == "ready"
        assert ArtifactStore(host).verify(p.candidate.digest).digest == p.candidate.digest
        assert _temp_dirs(host) == []
        generated = await agent.engine.generate(PROMPT, p.name, GREEDY)
        assert generated.token_ids


@pytest.mark.parametrize("how", ["expired", "unloaded", "prepared again"])
async def test_a_dropped_staging_leaves_no_file(tmp_path: Path, how: str) -> None:
    now = [0.0]
    async with _agent(tmp_path, staging_idle_s=10.0, clock=lambda: now[0]) as (agent, host):
        trainer = ArtifactStore(tmp_path / "trainer")
        p = candidate_for(trainer, 72)
        await agent.prepare(p.candidate)
        for bucket in plan_buckets(p.tensors, 64 * 1024):
            await agent.receive_bucket(
                wire.BucketUpload(
                    lora_name=p.name, attempt=1, digest=p.candidate.digest, bucket=bucket
                )
            )
        assert _temp_dirs(host) != []  # the bytes are on disk, in the agent's own store
        if how == "expired":
            now[0] = 11.0
            assert agent.expire_idle() == [p.name]
        elif how == "unloaded":
            await agent.unload(p.name, 1)
        else:
            import msgspec

            await agent.prepare(msgspec.structs.replace(p.candidate, attempt=2))
        assert _temp_dirs(host) == []
        assert agent.staged_bytes() == 0
