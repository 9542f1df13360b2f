"""Served-content attestation: other weights loaded under a managed name are found by the
reconciler, taken out of routing for that version within one reconcile pass, and recorded as
an incident (``ServedContentMismatch``, ``content_mismatch``).

The weights are swapped the way a caller holding the engine's (or the agent's) token could do
it through the control routes, with the attempts the engines demand: the committed attempt is
unloaded, and another adapter is loaded under the same name at the next attempt. Real
``loraledger engine`` and ``loraledger agent`` processes on loopback, stopped by PID; the
control plane runs in this process, its full reconcile pass every :data:`PERIOD_S`.

Engines fence a committed attempt once it was unloaded, so the reconciler cannot put the
version's bytes back under its name in the same engine life: its restore is refused and the
engine is suspended (``lost_adapter``), to be repaired as a whole once it restarted -- the
rule for any lost adapter an engine refuses to reload (the local-engine case restarts it and
sees the version's own bytes served and routed there again).

Before: the ledger compared only names; the engine went on holding the name, routable, serving
other weights under the published digest's header.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from anyio.abc import Process
from rich.console import Console

from engines.agent import AgentEngine
from engines.artifacts import ArtifactStore
from engines.contract import Candidate, Engine
from engines.local.client import LocalHTTPEngine
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from evlog.events import (
    CanaryRecorded,
    EngineSuspended,
    ServedContentMismatch,
    VersionRestored,
)
from evlog.memory import MemoryStore
from projections.incidents import incidents
from projections.status import status_of
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from tests.engines.contract import Published, candidate_for, publish
from tests.publisher.openai_kit import serve_app
from tests.publisher.plane_kit import PEFT_WARNINGS, adapter_copy
from tests.support.log import events_of, records
from tests.support.paths import REPO
from tests.support.processes import listening_process
from tests.support.waiting import wait_for
from tools.bench.stub_engine import StubEngine
from tools.render import status_view

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

ENGINE_TOKEN = "engine-secret-0123"
AGENT_TOKEN = "agent-secret-4567"
PERIOD_S = 2.0  # the full reconcile pass: every inventory read whatever the ledger believes
TIMEOUTS = EngineTimeouts(probe=5, inventory=10, prepare=30, transfer=30, load=30, unload=30)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORALEDGER_")}
    return {**env, "PYTHONPATH": str(REPO), "LORALEDGER_ENGINE_TOKEN": ENGINE_TOKEN}


@asynccontextmanager
async def _engine_process(
    host: Path | None = None, port: int = 0
) -> AsyncIterator[tuple[Process, str]]:
    """``loraledger engine`` requiring :data:`ENGINE_TOKEN` (reading adapters from ``host``
    when given); yields the process and its URL."""
    args = ["engine", "--id", "e0", "--port", str(port), "--json"]
    if host is not None:
        args += ["--artifacts", str(host)]
    async with listening_process(args, env=_env()) as (process, row):
        yield process, str(row["url"])


@asynccontextmanager
async def _plane(
    member: Engine, tmp_path: Path, *, canary_every_s: float | None = None
) -> AsyncIterator[ControlPlane]:
    async with ControlPlane.open(
        MemoryStore(),
        Fleet([member]),
        deployment="dep",
        prefix="agent",
        capacity=2,
        artifact_root=tmp_path / "artifacts",
        timeouts=TIMEOUTS,
        probe_interval_s=0.2,
        full_reconcile_s=PERIOD_S,
        reclaim_tick_s=0.2,
        cleanup_timeout=5.0,
        suspend_after_s=None,
        canary_every_s=canary_every_s,
    ) as plane:
        yield plane


async def _swap_weights(member: Engine, plane: ControlPlane, tmp_path: Path) -> float:
    """Load other weights under v1's name the way a token holder could: unload the committed
    attempt, then prepare, transfer and load another adapter at the next attempt. Returns when
    the swap was done (monotonic clock)."""
    v1 = plane.ledger.state.versions[1]
    other = candidate_for(ArtifactStore(tmp_path / "other"), 77)
    impostor = Candidate(
        lora_name=v1.lora_name,
        digest=other.candidate.digest,
        attempt=v1.attempt + 1,
        manifest=other.candidate.manifest,
    )
    assert (await member.unload(v1.lora_name, attempt=v1.attempt)).was_loaded
    await publish(member, Published(impostor, other.tensors))
    served = {a.lora_name: a.digest for a in (await member.inventory()).adapters}
    assert served[v1.lora_name] == other.candidate.digest != v1.digest
    return time.monotonic()


async def _out_of_routing_with_an_incident(plane: ControlPlane, swapped_at: float) -> float:
    """Wait for the mismatch to be recorded and routed around; return how long it took."""
    ledger = plane.ledger
    v1 = ledger.state.versions[1]
    await wait_for(
        "the other content under v1's name recorded",
        lambda: v1.lora_name in ledger.state.engines["e0"].mismatched,
        timeout=PERIOD_S + 30.0,
    )
    took = time.monotonic() - swapped_at
    assert ledger.state.holders(v1.lora_name) == ()  # no longer routed there for v1
    found = await events_of(ledger, ServedContentMismatch)
    assert [(e.engine, e.version_id, e.evidence, e.expected) for e in found] == [
        ("e0", 1, "digest", v1.digest)
    ]
    assert found[0].seen != v1.digest
    kinds = [i.kind for i in incidents(await records(ledger))]
    assert "content_mismatch" in kinds, kinds
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(status_view(status_of(ledger.state), title="status"))
    assert f"engine e0 serves other content under v1 ({v1.lora_name})" in console.export_text()
    # the version's bytes cannot go back under its name in this engine life (the committed
    # attempt is fenced): the engine is suspended, to be repaired once it restarted
    await wait_for("e0 suspended", lambda: ledger.state.engines["e0"].suspended, timeout=30.0)
    suspended = await events_of(ledger, EngineSuspended)
    assert [(e.cause, "served with other content" in e.detail) for e in suspended] == [
        ("lost_adapter", True)
    ]
    return took


async def _published_swapped_and_found(
    stack: AsyncExitStack, member: Engine, tmp_path: Path
) -> tuple[ControlPlane, float]:
    """Publish v1 on ``member`` (closed with ``stack``), swap its weights, and check what the
    ledger makes of it; returns the plane and how long after the swap the mismatch was
    recorded."""
    stack.push_async_callback(member.aclose)
    plane = await stack.enter_async_context(_plane(member, tmp_path))
    published = await plane.publisher.publish(adapter_copy(1), version_id=1)
    assert published.status == PublicationStatus.PUBLISHED
    swapped_at = await _swap_weights(member, plane, tmp_path)
    return plane, await _out_of_routing_with_an_incident(plane, swapped_at)


async def test_other_weights_on_a_local_engine_leave_routing_with_an_incident(
    tmp_path: Path,
) -> None:
    """... and once the engine restarted (a new life: no fences), the repair loads the
    version's own bytes under its name and routing comes back."""
    async with AsyncExitStack() as stack:
        process, url = await stack.enter_async_context(_engine_process())
        member = LocalHTTPEngine(url, "e0", api_key=ENGINE_TOKEN)
        plane, took = await _published_swapped_and_found(stack, member, tmp_path)
        print(f"local engine: content mismatch recorded {took:.2f} s after the swap")
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
        port = int(url.rsplit(":", 1)[1])
        await stack.enter_async_context(_engine_process(port=port))
        ledger = plane.ledger
        v1 = ledger.state.versions[1]
        await wait_for(
            "v1 served by the restarted e0",
            lambda: ledger.state.holders(v1.lora_name) == ("e0",),
            timeout=60.0,
        )
        assert ledger.state.engines["e0"].mismatched == {}
        served = {a.lora_name: a.digest for a in (await member.inventory()).adapters}
        assert served == {v1.lora_name: v1.digest}
        found = [i for i in incidents(await records(ledger)) if i.kind == "content_mismatch"]
        assert [(i.subject, i.resolved) for i in found] == [("e0", True)], found


async def test_other_weights_through_the_agent_leave_routing_with_an_incident(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    token_file = tmp_path / "agent-token"
    token_file.write_text(f"{AGENT_TOKEN}\n")
    async with AsyncExitStack() as stack:
        _, engine_url = await stack.enter_async_context(_engine_process(host))
        args = ["agent", "--engine", f"sglang:{engine_url}", "--artifacts", str(host)]
        args += ["--id", "e0", "--token-file", str(token_file), "--port", "0", "--json"]
        _, row = await stack.enter_async_context(listening_process(args, env=_env()))
        engine = SGLangEngine(engine_url, "e0", api_key=ENGINE_TOKEN)
        member = AgentEngine(row["url"], engine, api_key=AGENT_TOKEN)
        _, took = await _published_swapped_and_found(stack, member, tmp_path)
        print(f"agent: content mismatch recorded {took:.2f} s after the swap")


async def test_other_weights_under_the_same_path_on_a_vllm_engine_fail_its_canary(
    tmp_path: Path,
) -> None:
    """A vLLM engine names no digest of what it loaded, only the directory: other weights
    loaded under the name from a directory named like the version's pass the digest check.
    The canary catches them: its baseline was taken once the engine held the version, and the
    next pass finds the engine answering it differently. The engine is the benchmark's vLLM
    stub (a test double for a GPU engine), whose greedy tokens depend on the bytes it loaded
    under the name, as a real engine's depend on its weights."""
    stub = StubEngine()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(stub.app()))
        member = VLLMEngine(url, "e0")
        stack.push_async_callback(member.aclose)
        plane = await stack.enter_async_context(_plane(member, tmp_path, canary_every_s=0.0))
        published = await plane.publisher.publish(adapter_copy(1), version_id=1)
        assert published.status == PublicationStatus.PUBLISHED
        ledger = plane.ledger
        v1 = ledger.state.versions[1]
        await wait_for(
            "the canary's baseline",
            lambda: v1.lora_name in ledger.state.engines["e0"].canaries,
            timeout=30.0,
        )
        assert await events_of(ledger, ServedContentMismatch) == []  # same weights: no incident
        # other weights, in a directory named by v1's digest, loaded under v1's name
        other = candidate_for(ArtifactStore(tmp_path / "other"), 77).candidate.artifact_path
        assert other is not None
        lookalike = tmp_path / "elsewhere" / v1.digest
        shutil.copytree(other, lookalike)
        # between two passes over e0 (its lock held), so no pass sees the name briefly absent
        async with (
            plane.reconciler._lock("e0"),
            httpx.AsyncClient(base_url=url, trust_env=False) as client,
        ):
            body = {"lora_name": v1.lora_name}
            assert (await client.post("/v1/unload_lora_adapter", json=body)).status_code == 200
            body["lora_path"] = str(lookalike)
            assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
        swapped_at = time.monotonic()
        served = {a.lora_name: a.digest for a in (await member.inventory()).adapters}
        assert served[v1.lora_name] == v1.digest  # the digest check alone cannot tell
        await wait_for(
            "the canary's mismatch recorded",
            lambda: v1.lora_name in ledger.state.engines["e0"].mismatched,
            timeout=PERIOD_S + 30.0,
        )
        took = time.monotonic() - swapped_at
        assert ledger.state.holders(v1.lora_name) == ()
        found = await events_of(ledger, ServedContentMismatch)
        baseline = (await events_of(ledger, CanaryRecorded))[0].answer
        assert [(e.engine, e.version_id, e.evidence, e.expected) for e in found] == [
            ("e0", 1, "canary", baseline)
        ]
        assert found[0].seen != baseline
        kinds = [i.kind for i in incidents(await records(ledger))]
        assert "content_mismatch" in kinds, kinds
        print(f"vllm stub: canary mismatch recorded {took:.2f} s after the swap")
        # the restore is refused (another path under the name), and the inventory proves
        # nothing for it: the directory's name is all a path engine reports. The engine is
        # suspended; counting the version restored routed the other weights again, and the
        # canary found them again, in a loop
        await wait_for("e0 suspended", lambda: ledger.state.engines["e0"].suspended, timeout=30.0)
        suspended = await events_of(ledger, EngineSuspended)
        assert [(e.cause, "served with other content" in e.detail) for e in suspended] == [
            ("lost_adapter", True)
        ]
        assert await events_of(ledger, VersionRestored) == []
        assert ledger.state.holders(v1.lora_name) == ()


async def test_a_canary_answer_that_does_not_repeat_is_no_incident(tmp_path: Path) -> None:
    """Greedy decoding on a GPU engine can vary once (batching): an answer that differs from
    the baseline but not on the immediate second ask is no evidence, and nothing is
    recorded; the engine keeps serving the version."""
    stub = StubEngine()
    answers = stub._token_ids
    asked: list[str] = []

    def flickering(model: str, prompt: str, n: int) -> list[int]:
        asked.append(model)
        tokens = answers(model, prompt, n)
        return [t + 1 for t in tokens] if len(asked) == flicker_at else tokens

    flicker_at = -1
    stub._token_ids = flickering  # type: ignore[method-assign]  # the double's one hook
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(stub.app()))
        member = VLLMEngine(url, "e0")
        stack.push_async_callback(member.aclose)
        plane = await stack.enter_async_context(_plane(member, tmp_path, canary_every_s=0.0))
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        ledger = plane.ledger
        v1 = ledger.state.versions[1]
        await wait_for(
            "the canary's baseline",
            lambda: v1.lora_name in ledger.state.engines["e0"].canaries,
            timeout=30.0,
        )
        flicker_at = len(asked) + 1  # the next answer differs, once
        await wait_for("three more canaries", lambda: len(asked) >= flicker_at + 3, timeout=30.0)
        assert await events_of(ledger, ServedContentMismatch) == []
        assert ledger.state.holders(v1.lora_name) == ("e0",)
