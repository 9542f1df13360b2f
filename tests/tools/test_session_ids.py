"""Session and owner ids are any printable text (the ledger's rule), over HTTP too.

RL loops name sessions ``task-3/rollout-7``; a turn with such an id was served, but its
release through ``POST /v1/sessions/{id}/release`` was 404 in either spelling (the session
stayed bound, holding its version from reclaim, until the idle release), and a gateway
process, whose ledger client puts the id in a URL path, was refused every bind (serve answered
404 to ``/sessions/task-3%2Frollout-7/bind``: the path is decoded before it is routed), as it
was for ``.`` and ``..``, which URL normalisation resolved away.

Real parts: serve's app and the ``HttpLedger`` client over loopback, and the OpenAI face over
local engines with the official client."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import openai
import pytest

from evlog.sqlite import SQLiteStore
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, rig
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.tools.test_owner_routes import served

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

ODD_IDS = ["task-3/rollout-7", "..", ".", "a b", "50%/x", "ends/bind", "é/ü", "/lead"]


async def test_a_remote_worker_binds_and_releases_any_printable_id(tmp_path: Path) -> None:
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        served(store) as (ledger, _, remote),
    ):
        gateway = Gateway(Fleet(), remote.view, gateway_id="gw")
        async with RolloutWorker.open(remote, gateway, owner="team/a.b") as worker:
            bound = await worker.bind_many([worker.session(s) for s in ODD_IDS])
            assert [getattr(b, "version_id", b) for b in bound] == [1] * len(ODD_IDS)
            assert {s: ledger.state.sessions[s].owner for s in ODD_IDS} == dict.fromkeys(
                ODD_IDS, "team/a.b"
            )
            for session in ODD_IDS:
                await worker.session(session).close()
            assert not set(ODD_IDS) & set(ledger.state.sessions)
            assert set(ODD_IDS) <= set(ledger.state.tombstones)
        assert worker.deregistered is not None  # /owners/team%2Fa%2Eb/deregister was routed


async def test_an_openai_session_with_a_slash_is_released_in_either_spelling(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, engines=1) as r:
        await r.publish(1)
        client = openai.AsyncOpenAI(base_url=r.base_url, api_key=TOKEN, max_retries=0)
        auth = {"authorization": f"Bearer {TOKEN}"}
        async with client, httpx.AsyncClient(base_url=r.url, trust_env=False) as http:
            for session, path in [
                ("task-3/rollout-7", "task-3/rollout-7"),  # as written
                ("task-3/rollout-8", quote("task-3/rollout-8", safe="")),  # escaped
            ]:
                await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_headers={"x-session-id": session},
                )
                assert session in r.plane.ledger.state.sessions
                reply = await http.post(f"/v1/sessions/{path}/release", headers=auth)
                assert reply.status_code == 200, reply.text
                assert session not in r.plane.ledger.state.sessions
