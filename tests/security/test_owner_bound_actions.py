"""Only an owner's current life acts for it: serve's owner and session routes, on a real ledger
(SQLite) behind serve's app on a loopback port, attacked with the service token alone.

A caller that knows an owner id and its incarnation (both are in the log and in refusals) but
not the life's secret can neither end a face's life, nor release a client's session under a
made-up owner or with a cause only the ledger may write, nor renew another face's lease to
report its requests finished. Every attack is refused and changes nothing. A new life of an
owner id needs no secret (a crash must restart at once): it fences the life it replaces, but
cannot free a version that life's running request holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from evlog.errors import LoraLedgerError
from evlog.events import OwnerDeregistered, SessionReleased
from evlog.sqlite import SQLiteStore
from projections.registry import VersionState
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway, LocalView
from publisher.remote.http import HttpLedger
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import serve_app
from tests.publisher.ray.kit import create
from tests.support.ledger import publish
from tests.support.waiting import wait_for
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "owner-bound-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FORGED = "f" * 64  # a well-formed secret that is not the life's


@asynccontextmanager
async def serve_with_face(
    store: SQLiteStore,
) -> AsyncIterator[tuple[Ledger, RolloutWorker, httpx.AsyncClient, str]]:
    """serve's app over a ledger with version 1 committed, its OpenAI face's relay life
    (``openai-serve``, client-held sessions, as ``serve`` opens it) and an HTTP client holding
    only the service token."""
    async with Ledger.open(store) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        gateway = Gateway(Fleet(), LocalView(ledger))
        async with (
            RolloutWorker.open(
                ledger, gateway, owner="openai-serve", sessions_idle_s=0.0, renew_every=3600
            ) as face,
            serve_app(app) as url,
            httpx.AsyncClient(base_url=url, trust_env=False, headers=AUTH) as http,
        ):
            yield ledger, face, http, url


def _refused(reply: httpx.Response, code: str | None = None) -> dict[str, Any]:
    assert reply.status_code in (400, 409), reply.text
    body: dict[str, Any] = reply.json()
    if code is not None:
        assert body["code"] == code, body
    assert FORGED not in reply.text
    return body


async def test_the_token_alone_cannot_end_the_openai_faces_life(tmp_path: Path) -> None:
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        async with serve_with_face(store) as (ledger, face, http, _):
            await face.session("client-1").bind()
            path = "/owners/openai-serve/deregister"
            for body in ({}, {"incarnation": face.incarnation}):
                _refused(await http.post(path, json=body))
            forged = {"incarnation": face.incarnation, "secret": FORGED}
            refusal = _refused(await http.post(path, json=forged), "OWNER_SECRET_MISMATCH")
            assert refusal["details"]["owner"] == "openai-serve"
            face.ensure_live()  # the face's life goes on: its turns are still served
            assert ledger.state.owners["openai-serve"].live
            assert "client-1" in ledger.state.sessions
        records = [r async for r in store.iterate(after=0)]
    ends = [r.event for r in records if isinstance(r.event, OwnerDeregistered)]
    assert [e.incarnation for e in ends] == [face.incarnation]  # only its own clean exit


async def test_a_clients_session_is_not_released_under_a_made_up_owner_or_a_forged_cause(
    tmp_path: Path,
) -> None:
    async with SQLiteStore.open(tmp_path / "ledger.db") as store:
        async with serve_with_face(store) as (ledger, face, http, _):
            await face.session("client-7").bind()
            forged = {"owner": "made-up", "cause": "lease_expired"}
            _refused(await http.post("/sessions/client-7/release", json=forged))
            as_face = {"owner": "openai-serve", "cause": "lease_expired", "secret": FORGED}
            _refused(await http.post("/sessions/client-7/release", json=as_face))
            release = {"type": "Release", "session": "client-7", **forged}
            answered = await http.post("/sessions/commands", json={"commands": [release]})
            assert answered.status_code == 200, answered.text
            [result] = answered.json()["results"]
            assert result["type"] == "Refusal", result
            assert "client-7" in ledger.state.sessions  # still bound, its version pinned
        records = [r async for r in store.iterate(after=0)]
    causes = {r.event.cause for r in records if isinstance(r.event, SessionReleased)}
    assert "lease_expired" not in causes


async def stream_from_a_gateway(remote: HttpLedger, ledger: Ledger) -> None:
    """A gateway process's relay life (``gw``, life ``gw-1``) streams one request on version 1,
    and serve has heard its count."""
    await remote.register_owner("gw", incarnation="gw-1", sessions_idle_s=0.0)
    remote.renew_lease("gw", {("e0", 1): 1}, incarnation="gw-1")
    await wait_for("the gateway's in-flight count reaches serve", lambda: _streaming(ledger))


def _streaming(ledger: Ledger) -> bool:
    return any(x.reporter == "gw" and x.count == 1 for x in ledger.inflight_evidence(1))


async def test_no_one_but_the_face_that_dispatched_reports_its_requests_finished(
    tmp_path: Path,
) -> None:
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        serve_with_face(store) as (ledger, _, http, url),
        HttpLedger.connect(url, token=TOKEN, renew_interval=0.05) as remote,
    ):
        await stream_from_a_gateway(remote, ledger)
        idle = {"incarnation": "gw-1", "inflight": []}
        _refused(await http.post("/owners/gw/renew", json=idle))
        forged = {**idle, "secret": FORGED}
        _refused(await http.post("/owners/gw/renew", json=forged), "OWNER_SECRET_MISMATCH")
        for proof in ({}, {"secret": FORGED}):
            life = {"owner": "gw", "incarnation": "gw-1", "inflight": [], **proof}
            renewed = await http.post("/leases/renew", json={"lives": [life]})
            assert renewed.status_code == 200, renewed.text
            [lost] = renewed.json()["lost"]
            assert lost["refusal"]["code"] == "OWNER_SECRET_MISMATCH"
        # what a reclaim claim would record: the stream is still in flight
        assert _streaming(ledger)


async def test_a_stranger_registering_a_new_life_cannot_free_a_streaming_version(
    tmp_path: Path,
) -> None:
    """A new incarnation replaces a live life without its secret (a crashed gateway restarts
    at once), so the token alone can fence the gateway's life; but the stream it counted
    still holds its version against a reclaim until that life's lease would have lapsed."""
    async with (
        SQLiteStore.open(tmp_path / "ledger.db") as store,
        serve_with_face(store) as (ledger, _, http, url),
        HttpLedger.connect(url, token=TOKEN, renew_interval=0.05) as remote,
    ):
        await stream_from_a_gateway(remote, ledger)
        await publish(ledger, 2)  # v1 RETIRED: only the stream's count holds it
        stranger = {"owner": "gw", "incarnation": "gw-evil", "secret": FORGED, "ttl_s": 600.0}
        assert (await http.post("/owners", json=stranger)).status_code == 200
        idle = {"incarnation": "gw-evil", "inflight": [], "secret": FORGED}
        renewed = await http.post("/owners/gw/renew", json=idle)
        assert renewed.status_code < 300, renewed.text
        with pytest.raises(LoraLedgerError) as busy:
            await ledger.claim_reclaim(1, ledger.inflight_evidence(1))
        assert busy.value.code == Code.REQUESTS_IN_FLIGHT
        assert "gw (replaced life gw-1)" in busy.value.message
        assert ledger.state.versions[1].state is VersionState.RETIRED
