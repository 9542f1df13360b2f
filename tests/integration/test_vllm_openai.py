"""The OpenAI routes against the real vLLM CPU server, with the official ``openai`` client.

The local engine stands in for vLLM everywhere else; only the real server proves that what the
gateway sends to ``/v1/completions`` (the bound adapter as ``model``, the per-version
``cache_salt``, ``stream_options.include_usage``) is accepted, that vLLM's reply names the
adapter it served (provenance ``attested``), and that its usage chunk is stripped when the
client did not ask for it. Uses the session vLLM server of ``conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from engines.local.tinymodel import make_adapter
from engines.vllm import VLLMEngine
from evlog.memory import MemoryStore
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from publisher.gateway import Gateway, LocalView
from publisher.gateway.provenance import MemorySink, ProvenanceRecorder
from publisher.openai import (
    OpenAIGateway,
    OpenAIOptions,
    engine_routes,
    openai_app,
)
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, serve_app

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

PROMPT = "hello world"


async def test_the_openai_routes_pin_a_session_on_the_real_vllm_server(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    names: list[str] = []
    async with ControlPlane.open(
        MemoryStore(),
        Fleet([engine]),
        deployment="voai",  # names of other tests on this server are not ours
        prefix="agent",
        capacity=2,
        artifact_root=tmp_path / "artifacts",
        probe_interval_s=0.5,
        reclaim_tick_s=0.1,
    ) as plane:

        async def publish(version_id: int) -> None:
            config, tensors = make_adapter(60 + version_id)
            outcome = await plane.publisher.publish(
                AdapterCopy.from_state_dict(tensors, config), version_id=version_id
            )
            assert outcome.status == PublicationStatus.PUBLISHED, outcome
            assert outcome.lora_name is not None
            names.append(outcome.lora_name)

        await publish(1)
        assert engine.capabilities.endpoint  # the face reaches vLLM over its own HTTP API
        sink = MemorySink()
        async with ProvenanceRecorder(sink) as recorder:
            gateway = Gateway(
                plane.fleet, LocalView(plane.ledger), gateway_id="voai", recorder=recorder
            )
            plane.add_inflight_source(gateway)
            async with RolloutWorker.open(plane.ledger, gateway, owner="voai") as worker:
                face = OpenAIGateway(
                    worker,
                    engine_routes(plane.fleet),
                    OpenAIOptions(token=TOKEN),
                )
                async with (
                    serve_app(openai_app(face)) as url,
                    openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN) as client,
                ):
                    session = {"x-session-id": "vllm-episode"}
                    first = await client.completions.with_raw_response.create(
                        model="policy",
                        prompt=PROMPT,
                        max_tokens=6,
                        temperature=0,
                        extra_headers=session,
                    )
                    reply = first.parse()
                    assert first.headers["x-loraledger-version"] == "1"
                    assert reply.model == names[0]  # vLLM served the bound adapter
                    assert reply.usage is not None and reply.usage.completion_tokens == 6

                    await publish(2)  # the session stays on v1
                    async with client.completions.with_streaming_response.create(
                        model="policy",
                        prompt=PROMPT,
                        max_tokens=6,
                        temperature=0,
                        stream=True,
                        extra_headers=session,
                    ) as streamed:
                        assert streamed.headers["x-loraledger-version"] == "1"
                        chunks = [chunk async for chunk in await streamed.parse()]
                    assert all(c.usage is None for c in chunks)  # not asked: stripped
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                    assert text == reply.choices[0].text  # greedy: the same version answered

                    with pytest.raises(openai.ConflictError) as wrong:
                        await client.completions.create(
                            model=names[1], prompt=PROMPT, max_tokens=2, extra_headers=session
                        )
                    assert wrong.value.code == "VERSION_NOT_BOUND"
                    newcomer = await client.completions.with_raw_response.create(
                        model="policy", prompt=PROMPT, max_tokens=2
                    )
                    assert newcomer.headers["x-loraledger-version"] == "2"
                await face.aclose()
                await worker.session("vllm-episode").close()
        rows = sink.rows
        assert len(rows) == 3 and all(row.attested for row in rows), rows
        assert [row.version_id for row in rows] == [1, 1, 2]
        assert gateway.inflight_counts() == {}
    for name in names:  # leave the shared server as we found it
        await engine.unload(name)
