"""Counts never drift: the OpenAI gateway under a long mixed load against the benchmark's stub
engines (vLLM's API, answering at once, each in a process of its own, stopped by PID).

100,000 requests with ``--slow`` (1,500 otherwise) from the official client: half one-turn,
half turns of sessions that go idle and are released by the gateway; ~5% client aborts
mid-stream, ~3% clean engine refusals, ~5% of the time a reset after send on one engine; new
versions publish every second, old ones retire and are reclaimed under the load. At the end
every in-flight count is 0 (gateway, worker, the lease's evidence) and no request met an
adapter the engine no longer held (vLLM's 404 "model does not exist")."""

from __future__ import annotations

import random
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from engines.local.tinymodel import make_adapter
from engines.vllm import VLLMEngine
from evlog.memory import MemoryStore
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.trainer import TrainerClient
from publisher.gateway import Gateway, LocalView
from publisher.openai import (
    OpenAIGateway,
    OpenAIOptions,
    engine_routes,
    openai_app,
)
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, serve_app
from tests.publisher.plane_kit import FAST
from tests.support.relay import Relay
from tools.bench.gateway import Processes, _port_url

pytestmark = pytest.mark.anyio

CONCURRENCY = 32
MESSAGES: list[Any] = [{"role": "user", "content": "count me"}]


async def test_counts_never_drift_over_stub_engines(tmp_path: Path, slow: bool) -> None:
    total = 100_000 if slow else 1_500
    rng = random.Random(29)
    procs = Processes(tmp_path)
    try:
        urls = []
        for i in range(2):
            port_file = tmp_path / f"stub-{i}.port"
            started = procs.start(
                f"stub-e{i}",
                [
                    "-m",
                    "tools.bench.stub_engine",
                    "--port-file",
                    str(port_file),
                    "--chunk-interval-ms",
                    "1",
                ],
            )
            urls.append(await _port_url(started, port_file))
        async with AsyncExitStack() as stack:
            members = [VLLMEngine(url, f"e{i}", served_model="tiny") for i, url in enumerate(urls)]
            for member in members:
                stack.push_async_callback(member.aclose)
            plane = await stack.enter_async_context(
                ControlPlane.open(
                    MemoryStore(),
                    Fleet(members),
                    deployment="drift",
                    prefix="agent",
                    capacity=3,
                    artifact_root=tmp_path / "artifacts",
                    probe_interval_s=0.2,
                    reclaim_tick_s=0.05,
                    timeouts=FAST,
                )
            )
            trainer = TrainerClient(plane)
            statuses: Counter[str] = Counter()

            async def publish(version: int) -> None:
                config, tensors = make_adapter(version)
                outcome = await trainer.publish(tensors, config=config, step=version)
                statuses[str(outcome.status)] += 1

            await publish(1)
            gateway = Gateway(plane.fleet, LocalView(plane.ledger), gateway_id="drift")
            plane.add_inflight_source(gateway)
            worker = await stack.enter_async_context(
                RolloutWorker.open(plane.ledger, gateway, owner="drift", idle_release_s=0.5)
            )
            face = OpenAIGateway(
                worker,
                engine_routes(plane.fleet),
                OpenAIOptions(token=TOKEN),
            )
            stack.push_async_callback(face.aclose)
            url = await stack.enter_async_context(serve_app(openai_app(face)))
            relay = Relay(urls[1], "reset")
            reset_url = await stack.enter_async_context(relay.running())
            healthy = face.engines["e1"]
            faulty = healthy.__class__(engine_id="e1", kind="vllm", base_url=reset_url)
            client = await stack.enter_async_context(
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
            )
            outcomes: Counter[str] = Counter()
            next_index = 0
            done = anyio.Event()

            async def one(i: int) -> None:
                # one-turn requests, and turns of sessions of ~400 requests each (they then go
                # idle: the gateway releases them and their versions can be reclaimed)
                session = f"ep{i // 400}-{i % 8}" if i % 2 else None
                headers = {"x-session-id": session} if session else None
                kind = rng.random()
                try:
                    if kind > 0.95:  # a client that aborts mid-stream
                        stream = await client.chat.completions.create(
                            model="policy",
                            messages=MESSAGES,
                            max_tokens=50,
                            stream=True,
                            extra_headers=headers,
                        )
                        async for _ in stream:
                            break
                        await stream.close()
                        outcomes["aborted"] += 1
                        return
                    await client.chat.completions.create(
                        model="policy",
                        messages=MESSAGES,
                        max_tokens=-1 if kind < 0.03 else 2,  # -1: the engine refuses it
                        extra_headers=headers,
                    )
                    outcomes["ok"] += 1
                except openai.APIStatusError as exc:
                    outcomes[str(exc.code)] += 1

            async def client_loop() -> None:
                nonlocal next_index
                while next_index < total:
                    i = next_index
                    next_index += 1
                    # a reset after send on e1, now and then
                    face.engines["e1"] = faulty if rng.random() < 0.05 else healthy
                    await one(i)

            async def publisher() -> None:
                version = 2
                while not done.is_set():
                    with anyio.move_on_after(1.0):
                        await done.wait()
                    if not done.is_set():
                        await publish(version)
                        version += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher)
                async with anyio.create_task_group() as clients:
                    for _ in range(CONCURRENCY):
                        clients.start_soon(client_loop)
                done.set()
            face.engines["e1"] = healthy

            assert sum(outcomes.values()) == total, outcomes
            assert outcomes["aborted"] > 0 and outcomes["ok"] > total * 0.8, outcomes
            # injected errors only (and a turn of a session released as idle): never vLLM's
            # 404 for an adapter the engine no longer held
            allowed = {"ok", "aborted", "400", "AMBIGUOUS_DISPATCH", "SESSION_CLOSED"}
            assert set(outcomes) <= allowed, outcomes
            assert outcomes["AMBIGUOUS_DISPATCH"] > 0 and outcomes["400"] > 0, outcomes
            assert statuses["PUBLISHED"] >= 2, statuses  # versions changed under the load

            def evidence_left() -> bool:
                return any(
                    x.count
                    for version_id in plane.ledger.state.versions
                    for x in plane.ledger.inflight_evidence(version_id)
                )

            # A count whose end the engine has not confirmed yet (a reset after send, a
            # client's abort) is held until the engine's metrics show the adapter idle; the
            # worker asks again at its renewal and the ledger hears the counts at the same one.
            with anyio.fail_after(20):
                while gateway.inflight_counts() or evidence_left():  # noqa: ASYNC110 -- counters
                    await anyio.sleep(0.02)
            assert not worker.inflight
            reclaimed = [
                v for v in plane.ledger.state.versions.values() if str(v.state) == "RECLAIMED"
            ]
            assert reclaimed, "no version was reclaimed under the load"
    finally:
        procs.stop_all()
    assert all(row["exit"] is not None for row in procs.report())  # stopped and reaped
