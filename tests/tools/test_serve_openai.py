"""``loraledger serve`` answers the OpenAI routes next to the ledger: the official client,
a session pinned across a publication, provenance rows in the store beside the log, and the
token rule."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from engines.local.server import running_server
from tests.publisher.plane_kit import LIMITS
from tests.support.provenance import stored_rows
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
TOKEN = "serve-openai-token"


async def test_serve_answers_the_openai_routes(tmp_path: Path) -> None:
    from tools.service_options import parse_engine

    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]
    async with (
        running_server("e0", limits=LIMITS) as (_, u0),
        running_server("e1", limits=LIMITS) as (_, u1),
        serving(
            tmp_path / "ledger.db",
            token=TOKEN,
            engines=(parse_engine(f"e0=local:{u0}"), parse_engine(f"e1=local:{u1}")),
        ) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN) as client,
    ):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        reply = await http.post(
            "/versions", json={"version_id": 1, "adapter_dir": str(adapters[0])}, headers=auth
        )
        assert reply.status_code == 200, reply.text
        turns = []
        for turn in range(3):
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=3,
                extra_headers={"x-session-id": "laptop-1"},
            )
            turns.append((raw.headers["x-loraledger-version"], raw.headers["x-loraledger-engine"]))
            if turn == 0:
                reply = await http.post(
                    "/versions",
                    json={"version_id": 2, "adapter_dir": str(adapters[1])},
                    headers=auth,
                )
                assert reply.status_code == 200, reply.text
        assert len(set(turns)) == 1 and turns[0][0] == "1", turns
        models = [m.id for m in (await client.models.list()).data]
        assert models[0] == "policy" and len(models) == 3
        with pytest.raises(openai.AuthenticationError):
            await client.with_options(api_key="nope").models.list()
        request_ids = {raw.headers["x-request-id"]}
    rows = await stored_rows(tmp_path / "ledger.db")  # beside the log, drained when serve stopped
    assert len(rows) == 3 and {r.version_id for r in rows} == {1}
    assert request_ids <= {r.request_id for r in rows}


async def test_serve_refuses_a_wrong_model_and_unknown_routes_in_openai_shape(
    tmp_path: Path,
) -> None:
    """Mounted next to the ledger's own routes: an unknown model is a 404 ``model_not_found``
    and a first turn naming a non-default version a 409, neither written to the log; requests
    outside the OpenAI routes under ``/v1/`` answer in OpenAI's shape, while serve's own
    routes keep theirs."""
    from evlog.events import SessionBound, SessionReleased
    from evlog.sqlite import SQLiteStore
    from tools.service_options import parse_engine

    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        running_server("e0", limits=LIMITS) as (_, u0),
        serving(
            tmp_path / "ledger.db", token=TOKEN, engines=(parse_engine(f"e0=local:{u0}"),)
        ) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=auth) as http,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0) as client,
    ):
        for version, adapter in enumerate(adapters, start=1):
            reply = await http.post(
                "/versions", json={"version_id": version, "adapter_dir": str(adapter)}
            )
            assert reply.status_code == 200, reply.text
            if version == 1:  # a session on v1 keeps it from reclaim (RETIRED, listed)
                await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_headers={"x-session-id": "keeps-v1"},
                )
        cards = (await client.models.list()).data
        v1 = next(m.id for m in cards if (m.model_extra or {}).get("version_id") == 1)
        assert (await client.models.retrieve(v1)).id == v1
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.ConflictError) as unbound:
            await client.chat.completions.create(
                model=v1,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-session-id": "wants-v1"},
            )
        assert unbound.value.code == "VERSION_NOT_BOUND"
        with pytest.raises(openai.NotFoundError) as no_route:
            await client.embeddings.create(model="policy", input="x")
        assert no_route.value.code == "UNKNOWN_ROUTE"

        wrong_method = await http.get("/v1/chat/completions")
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
        slash = await http.post("/v1/completions/", json={})
        assert slash.status_code == 404 and slash.json()["error"]["code"] == "UNKNOWN_ROUTE"
        # serve's own routes: their answers and refusals in serve's shape, not OpenAI's
        assert (await http.get("/status")).status_code == 200
        refused = await http.post("/owners", json={"owner": "w"}, headers={"Authorization": ""})
        assert refused.status_code == 401 and refused.json()["code"] == "UNAUTHORIZED"
        outside = await http.get("/nowhere")
        assert outside.status_code == 404 and not outside.text.startswith('{"error"')
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        sessions = [
            r.event
            for r in await store.read()
            if isinstance(r.event, (SessionBound, SessionReleased))
        ]
    # no other session was bound or released (keeps-v1's release: serve's clean stop)
    assert {e.session for e in sessions} == {"keeps-v1"}, sessions


async def test_serve_answers_the_openai_routes_through_an_in_process_engine(
    tmp_path: Path,
) -> None:
    """``--engine e0=local:`` (a local engine inside serve's process): every turn of a session
    is served by it, streamed or not, with its provenance rows. Before, the engine had no
    OpenAI endpoint: the first turn bound the session and was answered ``503 NO_ROUTE``
    "unreachable", as was every turn after it. The engine is reached on a loopback port of its
    own, whose control routes refuse anyone without the token only serve holds."""
    from tools.service_options import parse_engine

    adapter = _adapter_dir(tmp_path, 1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        serving(tmp_path / "ledger.db", token=TOKEN, engines=(parse_engine("e0=local:"),)) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=auth) as http,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0) as client,
    ):
        published = await http.post(
            "/versions", json={"version_id": 1, "adapter_dir": str(adapter)}
        )
        assert published.status_code == 200, published.text
        served = []
        for turn in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=3,
                # the tiny model may sample its end of sequence within 3 tokens: "length" is the
                # reply only when the engine does not stop there
                extra_body={"ignore_eos": True},
                extra_headers={"x-session-id": "in-process"},
            )
            served.append((raw.headers["x-loraledger-engine"], raw.headers["x-loraledger-version"]))
            assert raw.parse().choices[0].finish_reason == "length", turn
        chunks = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            stream=True,
            # the tiny model may sample its end of sequence within 3 tokens: "length" is the
            # reply only when the engine does not stop there
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": "in-process"},
        )
        finish = [c.choices[0].finish_reason async for c in chunks if c.choices]
        assert served == [("e0", "1")] * 2 and finish[-1] == "length"
        (engine,) = (await http.get("/status")).json()["engines"]
        assert engine["endpoint"].startswith("http://127.0.0.1:"), engine
        async with httpx.AsyncClient(trust_env=False, timeout=10) as outsider:
            unload = await outsider.post(
                engine["endpoint"] + "/unload_lora_adapter", json={"lora_name": "x"}
            )
            assert unload.status_code == 401, unload.text
    rows = await stored_rows(tmp_path / "ledger.db")  # beside the log, drained when serve stopped
    assert [(r.engine, r.version_id, r.finish_reason) for r in rows] == [("e0", 1, "length")] * 3
