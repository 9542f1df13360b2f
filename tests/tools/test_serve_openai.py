"""``loraledger serve`` answers the OpenAI routes next to the ledger: the official client,
a session pinned across a publication, provenance rows next to the log, and the token rule."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from engines.local.server import running_server
from publisher.provenance import read_rows
from tests.publisher.plane_kit import LIMITS
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
TOKEN = "serve-openai-token"


async def test_serve_answers_the_openai_routes(tmp_path: Path) -> None:
    from tools.serve import parse_engine

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
    rows = read_rows(tmp_path / "ledger.db.provenance.jsonl")  # drained when serve stopped
    assert len(rows) == 3 and {r.version_id for r in rows} == {1}
    assert request_ids <= {r.request_id for r in rows}
