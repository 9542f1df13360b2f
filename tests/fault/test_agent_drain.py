"""Stopping an engine-host agent under a publication (docs/operations.md, "Stopping an
engine under traffic").

Real processes on loopback, started and stopped by PID: a ``loraledger engine`` (the SGLang
stand-in, reading adapters from the agent's directory) and a ``loraledger agent`` beside it. The
agent reaches its engine through a relay (:class:`tests.support.relay.Relay`) that holds the
engine's ``/load_lora_adapter`` until the test lets it go, so the agent's ``load`` step is
provably running (its directory written, its engine asked) when the SIGTERM lands:

* within ``--drain-timeout``: a new ``prepare``, bucket or ``load`` is refused ``503
  ENGINE_DRAINING`` (a clean refusal: nothing ran, so the publisher may try again), unload and
  inventory still answer, the held ``load`` finishes with its ``ready`` receipt, the engine
  holds the adapter, and only then does the agent exit (status 0);
* past ``--drain-timeout``: the agent exits anyway (status 0, saying so on stderr), and its
  caller is told the cut ``load`` ended ambiguously (never a clean refusal: it may have run).

Before: SIGTERM stopped the agent's server after a fixed 2 s, cutting the running step, and a
new step got a refused connection instead of a refusal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from anyio.abc import Process

from engines.artifacts import ArtifactStore
from engines.contract import CleanRefusal, EngineError, ErrorCode, Receipt
from engines.local import wire
from engines.local.client import LocalHTTPEngine
from engines.sglang import SGLangEngine
from tests.engines.contract import Published, aiter_list, buckets_of, candidate_for
from tests.support.outcomes import keep_outcome
from tests.support.processes import listening_process
from tests.support.relay import Relay
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


@dataclass
class AgentHost:
    """An engine process, the agent process beside it, and the relay that holds the engine's
    loads; ``member``: the control plane's client of the agent (its staged protocol)."""

    agent: Process
    agent_url: str
    engine_url: str
    relay: Relay
    member: LocalHTTPEngine
    trainer: ArtifactStore


@asynccontextmanager
async def agent_host(tmp_path: Path, drain_timeout: float) -> AsyncIterator[AgentHost]:
    host = tmp_path / "host"  # the agent writes here; the engine reads only here
    host.mkdir()
    async with AsyncExitStack() as stack:
        _, engine = await stack.enter_async_context(
            listening_process(
                ["engine", "--id", "h0", "--port", "0", "--artifacts", str(host), "--json"],
                stop_with=signal.SIGTERM,
            )
        )
        relay = Relay(engine["url"], "hold", requests=(b"POST /load_lora_adapter",))
        relayed = await stack.enter_async_context(relay.running())
        args = ["agent", "--engine", f"sglang:{relayed}", "--artifacts", str(host), "--id", "h0"]
        args += ["--port", "0", "--drain-timeout", f"{drain_timeout:g}", "--json"]
        agent, row = await stack.enter_async_context(listening_process(args))
        member = LocalHTTPEngine(row["url"], "h0")
        stack.push_async_callback(member.aclose)
        yield AgentHost(
            agent, row["url"], engine["url"], relay, member, ArtifactStore(tmp_path / "trainer")
        )


async def staged(host: AgentHost, seed: int) -> Published:
    """A version prepared on the agent and its buckets sent: what remains is its ``load``."""
    published = candidate_for(host.trainer, seed)
    await host.member.prepare(published.candidate)
    await host.member.transfer(published.candidate, aiter_list(buckets_of(published.tensors)))
    return published


async def exited(process: Process, timeout: float) -> int:
    with anyio.fail_after(timeout):
        return await process.wait()


async def stderr_of(process: Process) -> str:
    """What an exited process wrote on stderr."""
    assert process.stderr is not None
    data = b""
    with contextlib.suppress(anyio.EndOfStream):
        while True:
            data += await process.stderr.receive()
    return data.decode(errors="replace")


async def refused_draining(url: str, published: Published) -> bool:
    """Whether the agent answers a new ``prepare`` with its draining refusal (a prepare it
    still admits just stages that version: harmless to the load the test holds)."""
    body = msgspec.json.encode(published.candidate)
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            reply = await client.post(f"{url}{wire.PREFIX}/prepare", content=body)
    except httpx.HTTPError:
        return False
    return reply.status_code == 503 and reply.json()["error"]["code"] == "ENGINE_DRAINING"


async def test_a_sigterm_during_a_load_finishes_it_refuses_new_steps_and_exits_0(
    tmp_path: Path,
) -> None:
    async with agent_host(tmp_path, drain_timeout=60) as host:
        v1 = await staged(host, 21)
        later = candidate_for(host.trainer, 22)
        loaded: list[Receipt | Exception] = []
        async with anyio.create_task_group() as tg:
            keep_outcome(tg, loaded, host.member.load, v1.candidate)
            await wait_for("the agent's load at its engine", host.relay.arrived.is_set, timeout=60)
            os.kill(host.agent.pid, signal.SIGTERM)
            signalled = time.monotonic()
            await wait_for(
                "the agent refusing a new prepare",
                lambda: refused_draining(host.agent_url, later),
                timeout=30,
            )
            # every new publication step, as the control plane's client reads it: a clean
            # refusal (nothing ran there), while reads and cleanups still answer
            for step in (
                host.member.prepare(later.candidate),
                host.member.transfer(later.candidate, aiter_list(buckets_of(later.tensors))),
                host.member.load(later.candidate),
            ):
                with pytest.raises(CleanRefusal) as refusal:
                    await step
                assert (refusal.value.code, refusal.value.status) == (
                    ErrorCode.ENGINE_DRAINING,
                    503,
                )
            assert (await host.member.unload(later.name)).was_loaded is False
            assert v1.name not in {a.lora_name for a in (await host.member.inventory()).adapters}
            assert loaded == []  # the held load is still running
            host.relay.release()
        code = await exited(host.agent, 60)
        took = time.monotonic() - signalled

        (receipt,) = loaded
        assert isinstance(receipt, Receipt), receipt
        assert (receipt.phase, receipt.lora_name) == ("ready", v1.name)
        engine = SGLangEngine(host.engine_url, "h0")
        try:
            held = {a.lora_name for a in (await engine.inventory()).adapters}
        finally:
            await engine.aclose()
        assert v1.name in held
    assert code == 0
    assert took < 60, took


async def test_a_drain_past_its_timeout_exits_and_the_cut_load_is_ambiguous(
    tmp_path: Path,
) -> None:
    async with agent_host(tmp_path, drain_timeout=1) as host:
        v1 = await staged(host, 21)
        loaded: list[Receipt | Exception] = []
        async with anyio.create_task_group() as tg:
            keep_outcome(tg, loaded, host.member.load, v1.candidate)
            await wait_for("the agent's load at its engine", host.relay.arrived.is_set, timeout=60)
            os.kill(host.agent.pid, signal.SIGTERM)  # and the load stays held: the drain times out
            signalled = time.monotonic()
            code = await exited(host.agent, 30)
        took = time.monotonic() - signalled
        err = await stderr_of(host.agent)

    assert code == 0
    assert 1.0 <= took < 20, took
    assert "drain timed out" in err, err
    (outcome,) = loaded
    assert isinstance(outcome, EngineError), outcome
    assert not isinstance(outcome, CleanRefusal), outcome  # it may have run: never "clean"
