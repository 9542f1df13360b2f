"""``GET /v1/models`` from a gateway in another process: the list is the ledger's as of the
request, not the gateway's last copy of it. A client that was just served a new version (its
bind's reply routed it there) must find that version listed; the copy is refreshed every
``--refresh-s`` only, so the listing reads the ledger again first.

Real parts: serve's app over a real ledger on loopback, an ``HttpLedger`` whose own refresh
never runs during the test, and the OpenAI routes over it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway
from publisher.openai import OpenAIGateway, OpenAIOptions, openai_app
from publisher.remote import HttpLedger
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import serve_app
from tests.support.ledger import publish
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

pytestmark = pytest.mark.anyio
TOKEN = "models-listing-token"


async def test_a_version_published_after_the_copy_is_listed(tmp_path: Path) -> None:
    async with SQLiteStore.open(tmp_path / "ledger.db") as store, Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=4, fleet=("e0",))
        await ledger.join_engine("e0", "life-1")
        await ledger.repair_engine("e0", "life-1")
        v1 = await publish(ledger, 1)
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token=TOKEN)
        async with (
            serve_app(app) as ledger_url,
            HttpLedger.connect(ledger_url, token=TOKEN, refresh_interval=3600.0) as remote,
        ):
            gateway = Gateway(Fleet(), remote.view, gateway_id="gw")
            async with RolloutWorker.open(remote, gateway, owner="gw") as worker:
                face = OpenAIGateway(worker, {}, OpenAIOptions(token=TOKEN))
                try:
                    v2 = await publish(ledger, 2)  # after the gateway's copy was read
                    assert remote.view.status().default == 1  # the copy is behind
                    async with (
                        serve_app(openai_app(face)) as url,
                        httpx.AsyncClient(
                            base_url=url, headers={"authorization": f"Bearer {TOKEN}"}
                        ) as client,
                    ):
                        listed = (await client.get("/v1/models")).json()["data"]
                        one = await client.get(f"/v1/models/{v2.lora_name}")
                finally:
                    await face.aclose()
        cards = {card["id"]: card for card in listed}
        assert {"policy", v1.lora_name, v2.lora_name} <= set(cards)
        assert cards["policy"]["default_version"] == 2
        assert one.status_code == 200 and one.json()["version_id"] == 2
