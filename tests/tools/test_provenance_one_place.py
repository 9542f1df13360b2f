"""One place for provenance: every face sends its rows to the ledger's process, which keeps
them beside the log, so ``loraledger audit LOG --session S`` shows every turn of S whichever
process served it, without naming a file.

Before, a gateway process wrote ``./OWNER.provenance.jsonl`` in its own working directory and
serve wrote a file of its own: an audit against serve's file showed none of the turns a
gateway process served, and said nothing about it."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from engines.local.server import running_server
from tests.publisher.plane_kit import LIMITS
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.provenance import stored_rows
from tests.support.waiting import wait_for
from tests.tools.conftest import run_script
from tests.tools.serving import serving
from tests.tools.test_gateway_process import TOKEN, _free_port, gateway_process
from tests.tools.test_serve import _adapter_dir
from tools.service_options import parse_engine

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


async def _turn(client: openai.AsyncOpenAI, session: str) -> str:
    """One turn of ``session``; its request id (the provenance key)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_headers={"x-session-id": session},
    )
    assert raw.headers["x-loraledger-version"] == "1"
    return raw.headers["x-request-id"]


async def _audit(db: Path, session: str) -> dict[str, Any]:
    """``loraledger audit DB --session S --json``, the real command in its own process."""
    result = await anyio.to_thread.run_sync(
        lambda: run_script("audit", db, "--session", session, "--json")
    )
    assert result.returncode == 0, result.stderr
    lines: list[dict[str, Any]] = [json.loads(x) for x in result.stdout.splitlines()]
    (line,) = lines
    assert line["session"] == session and line["mismatches"] == [], line
    return line


async def test_audit_shows_every_turn_of_a_session_whichever_process_served_it(
    tmp_path: Path,
) -> None:
    """A gateway process (real) and serve's own OpenAI routes serve turns of one session and
    of another; serve restarts in the middle, and one turn is served by the gateway while
    serve is down (its row waits, and is sent again until the restarted serve stores it).
    ``audit LOG --session S`` shows all of S's turns, from both processes and both lives of
    serve; the gateway wrote no file of its own."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    gateway_cwd = tmp_path / "gateway-cwd"
    gateway_cwd.mkdir()
    adapter = _adapter_dir(tmp_path, 1)
    db = tmp_path / "ledger.db"
    port = _free_port()
    served: dict[str, list[tuple[str, str]]] = {"S": [], "T": []}  # session -> (face, request)
    async with AsyncExitStack() as stack:
        _, engine_url = await stack.enter_async_context(running_server("e0", limits=LIMITS))
        engines = (parse_engine(f"e0=local:{engine_url}"),)
        first = AsyncExitStack()  # serve's first life
        ledger = await first.enter_async_context(
            serving(db, token=TOKEN, engines=engines, port=port)
        )
        async with httpx.AsyncClient(
            base_url=ledger,
            trust_env=False,
            timeout=60,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as http:
            reply = await http.post(
                "/versions", json={"version_id": 1, "adapter_dir": str(adapter)}
            )
            assert reply.status_code == 200, reply.text
        url = await stack.enter_async_context(
            gateway_process(ledger, token_file, tmp_path, "gw", copy=False, cwd=gateway_cwd)
        )
        via = {
            "gw": await stack.enter_async_context(
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
            ),
            "serve": await stack.enter_async_context(
                openai.AsyncOpenAI(base_url=ledger + "/v1", api_key=TOKEN, max_retries=0)
            ),
        }

        async def turn(face: str, session: str) -> None:
            served[session].append((face, await _turn(via[face], session)))

        for face, session in (("gw", "S"), ("serve", "S"), ("gw", "S"), ("gw", "T")):
            await turn(face, session)
        await first.aclose()  # serve stops (SIGTERM's path): its rows are drained
        await turn("gw", "S")  # served while the ledger is down: the row waits in the gateway
        await stack.enter_async_context(serving(db, token=TOKEN, engines=engines, port=port))
        for face, session in (("serve", "S"), ("gw", "S"), ("serve", "T")):
            await turn(face, session)

        # Every row reaches the store while everything still runs (the gateway's resent one
        # included), read next to the live writer.
        async def all_stored() -> bool:
            return len(await stored_rows(db)) == 8

        await wait_for("every row in the store", all_stored, timeout=30, every=0.1)
        s = await _audit(db, "S")
    assert [f for f in gateway_cwd.iterdir()] == []  # no file stranded where the gateway ran

    for session in ("S", "T"):
        line = s if session == "S" else await _audit(db, session)
        turns = [(g["gateway"], g["request_id"]) for g in line["generations"]]
        want = [("gw" if face == "gw" else "openai-serve", rid) for face, rid in served[session]]
        assert sorted(turns) == sorted(want), (turns, want)
        assert {g["version_id"] for g in line["generations"]} == {1}
    rows = await stored_rows(db)
    assert len(rows) == 8 and len({r.row_id for r in rows}) == 8  # each turn stored once
