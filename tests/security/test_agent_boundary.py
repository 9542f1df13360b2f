"""The engine-host agent as a trust boundary (docs/operations.md, the agent's section).

The agent forwards publication steps to its engine with the engine's own token, so it must
never let a caller do what the engine itself would refuse that caller:

* it refuses to start holding an engine token without a token of its own (exit 11, the
  unsafe-configuration code), saying what to pass;
* every request is checked against its token (401 without), and an unload of a managed name
  without its attempt is ``ATTEMPT_REQUIRED`` (as on the local engine): the version stays
  loaded and served;
* staging is per attempt: a stray bad bucket or a stray prepare never wipes a publication's
  staging; all staging is capped in bytes (``STAGING_FULL``) and expires when idle.

The first two run real ``loraledger engine`` and ``loraledger agent`` processes on loopback
(stopped by PID); the staging rules run the agent in process, over HTTP, in front of a real
local engine, to read its staging directly.

Before: the agent started without a token by default, forwarded an unauthenticated ``POST
/loraledger/unload`` with the engine's token (unloading the version sessions were pinned to),
a bad bucket dropped the staging of its name whoever sent it, and staging had no cap and no
expiry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from engines.agent import Agent, AgentEngine, serve_agent
from engines.artifacts import ArtifactStore
from engines.contract import Bucket, BucketTensor, CleanRefusal, ErrorCode
from engines.local import wire
from engines.local.client import LocalHTTPEngine
from engines.local.server import running_server
from engines.manifest import TensorData
from engines.sglang import SGLangEngine
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    Published,
    aiter_list,
    buckets_of,
    candidate_for,
    publish,
)
from tests.engines.test_contract_local import LIMITS
from tests.support.paths import REPO
from tests.support.processes import listening_process
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

ENGINE_TOKEN = "engine-secret-0123"
AGENT_TOKEN = "agent-secret-4567"


def _env(**tokens: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORALEDGER_")}
    return {**env, "PYTHONPATH": str(REPO), **tokens}


@asynccontextmanager
async def _engine(host: Path) -> AsyncIterator[str]:
    """A ``loraledger engine`` process that reads adapters from ``host`` and requires
    :data:`ENGINE_TOKEN` on its control routes; yields its URL."""
    args = ["engine", "--id", "h0", "--port", "0", "--artifacts", str(host), "--json"]
    env = _env(LORALEDGER_ENGINE_TOKEN=ENGINE_TOKEN)
    async with listening_process(args, env=env) as (_, row):
        yield str(row["url"])


def _agent_args(engine_url: str, host: Path) -> list[str]:
    return ["agent", "--engine", f"sglang:{engine_url}", "--artifacts", str(host), "--id", "h0"]


async def test_the_agent_refuses_to_start_with_the_engine_token_and_none_of_its_own(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    async with _engine(host) as engine_url:
        argv = [
            sys.executable,
            "-m",
            "tools.cli",
            *_agent_args(engine_url, host),
            "--port",
            "0",
            "--json",
        ]
        # Before, it started and listened (and would have run until killed: the timeout).
        result = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
                env=_env(LORALEDGER_ENGINE_TOKEN=ENGINE_TOKEN),
            )
        )
    assert result.returncode == 11, result
    assert result.stdout == ""  # never listened
    assert "--token-file" in result.stderr and "LORALEDGER_AGENT_TOKEN" in result.stderr
    assert ENGINE_TOKEN not in result.stderr + result.stdout


async def test_an_unload_without_the_token_or_the_attempt_leaves_the_version_served(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    token_file = tmp_path / "agent-token"
    token_file.write_text(f"{AGENT_TOKEN}\n")
    async with AsyncExitStack() as stack:
        engine_url = await stack.enter_async_context(_engine(host))
        args = [*_agent_args(engine_url, host), "--token-file", str(token_file)]
        _, row = await stack.enter_async_context(
            listening_process(
                [*args, "--port", "0", "--json"],
                env=_env(LORALEDGER_ENGINE_TOKEN=ENGINE_TOKEN),
            )
        )
        engine = SGLangEngine(engine_url, "h0", api_key=ENGINE_TOKEN)
        member = AgentEngine(row["url"], engine, api_key=AGENT_TOKEN)
        stack.push_async_callback(member.aclose)
        published = candidate_for(ArtifactStore(tmp_path / "trainer"), 31)
        await publish(member, published)  # the control plane's own path still works

        unload = f"{row['url']}{wire.PREFIX}/unload"
        body = {"lora_name": published.name}
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            anonymous = await client.post(unload, json=body)
            assert anonymous.status_code == 401, anonymous.text
            wrong = await client.post(unload, json=body, headers=_bearer(ENGINE_TOKEN))
            assert wrong.status_code == 401, wrong.text  # the engine's token is not the agent's
            unfenced = await client.post(unload, json=body, headers=_bearer(AGENT_TOKEN))
            assert unfenced.status_code == 400, unfenced.text
            assert unfenced.json()["error"]["code"] == ErrorCode.ATTEMPT_REQUIRED
            for path in ("/prepare", "/bucket", "/load", "/inventory"):
                method = "GET" if path == "/inventory" else "POST"
                knock = await client.request(method, f"{row['url']}{wire.PREFIX}{path}")
                assert knock.status_code == 401, (path, knock.text)

        names = {a.lora_name for a in (await engine.inventory()).adapters}
        assert published.name in names
        out = await member.generate(PROMPT, published.name, GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens
        # the ledger's own cleanup names its attempt and still goes through
        assert (await member.unload(published.name, attempt=1)).was_loaded is True


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_restarted_agent_still_knows_its_managed_names(tmp_path: Path) -> None:
    """Managed outlives the agent's memory: the engine holds the name from the agent's store.
    A name loaded some other way (a stray the reconciler removes) unloads without an attempt."""
    async with agent_on_engine(tmp_path) as a:
        published = candidate_for(a.trainer, 35)
        await publish(a.client, published)
        restarted = Agent(SGLangEngine(a.engine_url, "h0"), ArtifactStore(a.host))
        try:
            await _refused(
                ErrorCode.ATTEMPT_REQUIRED,
                restarted.unload(published.name, None, fenced_only=True),
            )
            stray = a.host / "manual" / "stray"
            shutil.copytree(candidate_for(a.trainer, 36).candidate.artifact_path or "", stray)
            async with httpx.AsyncClient(base_url=a.engine_url, trust_env=False) as engine:
                body = {"lora_name": "stray-1", "lora_path": str(stray)}
                assert (await engine.post("/load_lora_adapter", json=body)).status_code == 200
            receipt = await restarted.unload("stray-1", None, fenced_only=True)
            assert receipt.was_loaded is True
        finally:
            await restarted.engine.aclose()
        names = {e.lora_name for e in (await a.agent.engine.inventory()).adapters}
        assert names == {published.name}


# --- staging: per attempt, capped, expiring ----------------------------------------------------


@dataclass
class AgentOnEngine:
    agent: Agent
    client: LocalHTTPEngine  # the control plane's client of the agent's staged protocol
    trainer: ArtifactStore
    engine_url: str
    host: Path  # the agent's store, the only directory the engine reads


@asynccontextmanager
async def agent_on_engine(tmp_path: Path, **options: float) -> AsyncIterator[AgentOnEngine]:
    host = tmp_path / "host"
    host.mkdir()
    async with AsyncExitStack() as stack:
        _, url = await stack.enter_async_context(
            running_server("h0", limits=LIMITS, artifact_root=host)
        )
        agent = Agent(SGLangEngine(url, "h0"), ArtifactStore(host), **options)  # type: ignore[arg-type]
        stack.push_async_callback(agent.engine.aclose)
        agent_url = await stack.enter_async_context(serve_agent(agent, token=AGENT_TOKEN))
        client = LocalHTTPEngine(agent_url, "h0", api_key=AGENT_TOKEN)
        stack.push_async_callback(client.aclose)
        yield AgentOnEngine(agent, client, ArtifactStore(tmp_path / "trainer"), url, host)


def _flipped(bucket: Bucket) -> Bucket:
    first = bucket.tensors[0]
    data = bytearray(first.tensor.data)
    data[0] ^= 0xFF
    bad = TensorData(first.tensor.dtype, first.tensor.shape, bytes(data))
    return Bucket(bucket.index, (BucketTensor(first.name, bad), *bucket.tensors[1:]))


async def _refused(code: str, step: object) -> None:
    with pytest.raises(CleanRefusal) as info:
        await step  # type: ignore[misc]
    assert info.value.code == code, info.value


async def test_a_stray_bucket_or_prepare_does_not_wipe_a_publications_staging(
    tmp_path: Path,
) -> None:
    async with agent_on_engine(tmp_path) as a:
        real = candidate_for(a.trainer, 41)
        buckets = buckets_of(real.tensors, max_bytes=1)  # one tensor per bucket
        assert len(buckets) >= 2
        await a.client.prepare(real.candidate)
        await a.client.transfer(real.candidate, aiter_list(buckets[:-1]))

        # a bad bucket under the publication's own (name, attempt, digest)
        stray = _flipped(buckets[0])
        await _refused(
            ErrorCode.DIGEST_MISMATCH, a.client.transfer(real.candidate, aiter_list([stray]))
        )
        # a prepare of the same attempt with other weights
        other = candidate_for(a.trainer, 42)
        imposter = _renamed(other, real)
        await _refused(ErrorCode.BAD_REQUEST, a.client.prepare(imposter.candidate))

        await a.client.transfer(real.candidate, aiter_list(buckets[-1:]))
        receipt = await a.client.load(real.candidate)
        assert (receipt.phase, receipt.digest) == ("ready", real.candidate.digest)
        assert a.agent.staged_names() == ()


def _renamed(other: Published, real: Published) -> Published:
    """``other``'s weights under ``real``'s name and attempt."""
    candidate = msgspec.structs.replace(
        other.candidate, lora_name=real.name, attempt=real.candidate.attempt
    )
    return Published(candidate, other.tensors)


async def test_staging_is_capped_in_bytes(tmp_path: Path) -> None:
    probe = candidate_for(ArtifactStore(tmp_path / "probe"), 51)
    one = probe.candidate.manifest.total_bytes
    async with agent_on_engine(tmp_path, staging_bytes=one + one // 2) as a:
        first = candidate_for(a.trainer, 51)
        await a.client.prepare(first.candidate)
        await a.client.transfer(first.candidate, aiter_list(buckets_of(first.tensors)))
        second = candidate_for(a.trainer, 52)
        await a.client.prepare(second.candidate)
        await _refused(
            ErrorCode.STAGING_FULL,
            a.client.transfer(second.candidate, aiter_list(buckets_of(second.tensors))),
        )
        assert a.agent.staged_bytes() <= one + one // 2
        too_big = candidate_for(a.trainer, 53, r=32)
        await _refused(ErrorCode.STAGING_FULL, a.client.prepare(too_big.candidate))
        # loading the first frees its bytes: the second fits now
        await a.client.load(first.candidate)
        await a.client.transfer(second.candidate, aiter_list(buckets_of(second.tensors)))
        assert (await a.client.load(second.candidate)).phase == "ready"


async def test_staging_prepared_and_never_loaded_expires_when_idle(tmp_path: Path) -> None:
    async with agent_on_engine(tmp_path, staging_idle_s=0.5) as a:
        left = candidate_for(a.trainer, 61)
        await a.client.prepare(left.candidate)
        await a.client.transfer(left.candidate, aiter_list(buckets_of(left.tensors)))
        assert a.agent.staged_names() == (left.name,)
        assert (await a.client.inventory()).staged == (left.name,)
        await wait_for("the idle staging to expire", lambda: a.agent.staged_names() == ())
        assert a.agent.staged_bytes() == 0
        await _refused(ErrorCode.NOT_PREPARED, a.client.load(left.candidate))
