"""The whole plane started from Python on a local Ray instance: two engine actors (each a local
engine served over HTTP inside its actor), the ledger actor hosting the control plane, and a
gateway actor per node (``start_gateways``) whose HTTP address the official ``openai`` client uses.

One small test (Ray is slow here): a session's turns stay on one version and one engine while a
new version publishes; a newcomer gets the new one; ``/v1/models`` shows both; every turn's
provenance row reaches the ledger actor's store beside its log (before, a gateway actor wrote
rows only to a file on its own node, when given one); a redeployed gateway actor (its
predecessor stopped, then killed) serves the session's next turn on its version (before, the
stop released the session: the next turn was 409 ``SESSION_CLOSED``); every process is stopped
by its handle."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import openai
import pytest
import ray

from engines.local.client import LocalHTTPEngine
from engines.local.server import running_server
from engines.local.tinymodel import make_adapter
from publisher.ray.engine import RayEngine, start_engine, stop_engine
from publisher.ray.gateway import GatewayConfig, start_gateways, stop_gateway
from publisher.ray.ledger_actor import LedgerConfig, PlaneConfig, start_ledger, stop_ledger
from publisher.ray.trainer import RayTrainerClient
from tests.publisher.ray.scenario import LIMITS, PLANE_OPTIONS
from tests.support.provenance import stored_rows
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings(
        "ignore:Adapter .* was active which is now deleted:UserWarning",
        "ignore:.*is_gradient_checkpointing.*:FutureWarning",
    ),
]
TOKEN = "ray-gateway-token"
NAMESPACE = "loraledger"


@contextlib.asynccontextmanager
async def http_local_engine(engine_id: str) -> AsyncIterator[LocalHTTPEngine]:
    """What an engine actor hosts here: a local engine served on loopback in the actor's
    process, managed through its HTTP adapter (so it has an OpenAI endpoint)."""
    async with (
        running_server(engine_id, limits=LIMITS) as (_, url),
        contextlib.aclosing(LocalHTTPEngine(url, engine_id)) as client,
    ):
        yield client


async def test_a_gateway_actor_serves_the_openai_client(ray_instance: Any, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    ledger_name = f"ledger-{tag}"
    engines: list[RayEngine] = []
    gateway: Any = None
    try:
        for i in range(2):
            factory = functools.partial(http_local_engine, f"e{i}")
            start = functools.partial(
                start_engine, factory, name=f"{tag}-e{i}", namespace=NAMESPACE
            )
            engine = await anyio.to_thread.run_sync(start)
            assert engine.capabilities.endpoint.startswith("http://127.0.0.1:")
            engines.append(engine)
        config = LedgerConfig(
            path=str(tmp_path / "ledger.db"),
            plane=PlaneConfig(
                deployment="dep",
                prefix="agent",
                capacity=4,
                artifact_root=str(tmp_path / "artifacts"),
                engines=tuple(engines),
                options=PLANE_OPTIONS,
            ),
        )
        ledger = await anyio.to_thread.run_sync(
            lambda: start_ledger(config, name=ledger_name, namespace=NAMESPACE)
        )
        trainer = RayTrainerClient(ledger_name, namespace=NAMESPACE)

        async def publish(step: int) -> str:
            adapter_config, tensors = make_adapter(step)
            outcome = await trainer.publish(tensors, adapter_config, step=step)
            assert outcome.status == "PUBLISHED", outcome
            name: str = outcome.lora_name
            return name

        v1 = await publish(1)
        started = await anyio.to_thread.run_sync(
            lambda: start_gateways(
                GatewayConfig(  # no engines: the gateway takes the ledger's fleet
                    token=TOKEN,
                    ledger_name=ledger_name,
                    namespace=NAMESPACE,
                    status_refresh_s=0.2,
                )
            )
        )
        assert len(started) == len([n for n in ray.nodes() if n["Alive"]]) == 1  # one per node
        ((gateway, url),) = started
        assert url.startswith("http://127.0.0.1:")

        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN) as client:
            seen = []
            for turn in range(4):
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"turn {turn}"}],
                    max_tokens=3,
                    extra_headers={"x-session-id": "ray-episode"},
                )
                seen.append(
                    (raw.headers["x-loraledger-version"], raw.headers["x-loraledger-engine"])
                )
                assert raw.parse().choices[0].message.content is not None
                if turn == 1:
                    v2 = await publish(2)
            assert len(set(seen)) == 1 and seen[0][0] == "1", seen

            async with client.chat.completions.with_streaming_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                temperature=0,  # greedy: sampled, the tiny model's EOS ended it early ~1 in 100
                stream=True,
                extra_headers={"x-session-id": "newcomer"},
            ) as response:
                assert response.headers["x-loraledger-version"] == "2"
                chunks = [chunk async for chunk in await response.parse()]
            assert chunks and chunks[-1].choices[0].finish_reason == "length"

            models = {m.id for m in (await client.models.list()).data}
            assert {"policy", v1, v2} <= models
            with pytest.raises(openai.AuthenticationError):
                await client.with_options(api_key="nope", max_retries=0).models.list()
        stats = await gateway.stats.remote()
        assert stats["requests"] == 5 and stats["inflight"] == 0
        assert stats["engines"] == ["e0", "e1"]

        # Every turn's provenance row reached the ledger actor's store, beside its log.
        async def stored() -> bool:
            return len(await stored_rows(tmp_path / "ledger.db")) == 5

        await wait_for("the gateway actor's rows beside the log", stored, timeout=30, every=0.1)
        rows = await stored_rows(tmp_path / "ledger.db", ["ray-episode"])
        assert [(r.turn, r.version_id) for r in rows] == [(0, 1), (1, 1), (2, 1), (3, 1)]
        assert len({r.gateway for r in rows}) == 1 and rows[0].gateway.startswith("gateway-")

        # an engine added at runtime: the running gateway actor routes to it, no restart
        factory = functools.partial(http_local_engine, "e2")
        start = functools.partial(start_engine, factory, name=f"{tag}-e2", namespace=NAMESPACE)
        engines.append(await anyio.to_thread.run_sync(start))
        report = await ledger.add_engine.remote(engines[-1])
        assert report.repaired == ("e2",)
        with anyio.fail_after(30):
            while (await gateway.stats.remote())["engines"] != ["e0", "e1", "e2"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        served_by: set[str] = set()
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN) as client:
            for k in range(40):
                completion = await client.completions.with_raw_response.create(
                    model="policy",
                    prompt="hello",
                    max_tokens=2,
                    extra_headers={"x-session-id": f"after-add-{k}"},
                )
                served_by.add(completion.headers["x-loraledger-engine"])
                if "e2" in served_by:
                    break
        assert "e2" in served_by, served_by

        # A redeployed gateway actor (the old one stopped cleanly: its owner deregistered)
        # serves the next turn of a session bound through its predecessor, on its version;
        # then the same after the new one is killed outright.
        for ends in ("stopped", "killed"):
            if ends == "stopped":
                await anyio.to_thread.run_sync(functools.partial(stop_gateway, gateway))
            else:
                ray.kill(gateway, no_restart=True)
            gateway = None
            ((gateway, url),) = await anyio.to_thread.run_sync(
                lambda: start_gateways(
                    GatewayConfig(token=TOKEN, ledger_name=ledger_name, namespace=NAMESPACE)
                )
            )
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN) as client:
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"after the gateway {ends}"}],
                    max_tokens=3,
                    extra_headers={"x-session-id": "ray-episode"},
                )
                assert raw.headers["x-loraledger-version"] == "1", ends
    finally:
        if gateway is not None:
            await anyio.to_thread.run_sync(lambda: stop_gateway(gateway))
        await anyio.to_thread.run_sync(lambda: stop_ledger(ledger_name, namespace=NAMESPACE))
        for engine in engines:
            await anyio.to_thread.run_sync(functools.partial(stop_engine, engine))
