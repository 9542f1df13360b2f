"""An engine's death, from the kill to routing and the log: three ``loraledger engine``
processes (real subprocesses, SIGKILLed and restarted by PID, on the same port) behind
``serve`` (in this process, on loopback), OpenAI traffic through serve's ``/v1`` routes.

* the killed engine leaves routing (serve's ``/status``) within a second, long before
  ``--suspend-after`` (left at its 30 s default);
* the log says so once, with the first error (``EngineUnreachable``), and ``replay --at``
  inside the window shows the engine unreachable, ``--incidents`` the window and its counts;
* the turns that provably did not run are served by another holder (none is lost for them);
* the engine, restarted on the same port, is back in routing after the reconciler's repair.

The figures this test measures (kill to out of routing, kill to the record) are printed; the
assertions use generous deadlines (the suite runs on loaded machines).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from anyio.abc import Process

from evlog.events import EngineRestarted, EngineUnreachable
from evlog.sqlite import SQLiteStore
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.processes import listening_process
from tests.support.waiting import wait_for
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir
from tools.replay import replay
from tools.service_options import parse_engine

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
TOKEN = "engine-death-token"
ENGINES = ("e0", "e1", "e2")


@asynccontextmanager
async def engine_process(engine_id: str, port: int = 0) -> AsyncIterator[tuple[Process, str]]:
    """``loraledger engine`` in a subprocess; yield it and its URL (its JSON ``listening``
    row). Stopped by PID on exit if still running (SIGKILL: the tests kill it anyway)."""
    args = ["engine", "--id", engine_id, "--port", str(port), "--json"]
    async with listening_process(args, stop_with=signal.SIGKILL) as (process, row):
        yield process, str(row["url"])


async def _engine_row(http: httpx.AsyncClient, engine_id: str) -> dict[str, object]:
    status = (await http.get("/status")).json()
    row: dict[str, object] = next(e for e in status["engines"] if e["engine"] == engine_id)
    return row


async def test_a_killed_engine_leaves_routing_at_once_and_its_outage_is_in_the_log(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.db"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with AsyncExitStack() as stack:
        started = [await stack.enter_async_context(engine_process(e)) for e in ENGINES]
        urls = {e: url for e, (_, url) in zip(ENGINES, started, strict=True)}
        specs = tuple(parse_engine(f"{e}=local:{url}") for e, url in urls.items())
        url = await stack.enter_async_context(serving(db, token=TOKEN, engines=specs))
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=auth)
        )
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
        )
        reply = await http.post(
            "/versions", json={"version_id": 1, "adapter_dir": str(_adapter_dir(tmp_path, 1))}
        )
        assert reply.status_code == 200, reply.text

        async def turn(session: str) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                extra_headers={"x-session-id": session},
            )
            return raw.headers["x-loraledger-engine"]

        sessions = [f"s{i}" for i in range(9)]
        first = {s: await turn(s) for s in sessions}
        victim = first[sessions[0]]
        on_victim = [s for s in sessions if first[s] == victim]
        process, victim_url = started[ENGINES.index(victim)]

        served: list[tuple[float, str, str]] = []  # (when, session, engine)
        failed: list[tuple[float, str, str]] = []  # (when, session, error)
        stop = anyio.Event()

        async def traffic(session: str) -> None:
            while not stop.is_set():
                try:
                    engine = await turn(session)
                    served.append((time.monotonic(), session, engine))
                except openai.APIStatusError as exc:
                    failed.append((time.monotonic(), session, f"{exc.status_code} {exc.code}"))

        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(traffic, s)
            await wait_for("traffic flows", lambda: len(served) >= 2 * len(sessions))
            killed, killed_wall = time.monotonic(), time.time()
            os.kill(process.pid, signal.SIGKILL)

            async def out_of_routing() -> bool:
                return not (await _engine_row(http, victim))["routable"]

            await wait_for(f"{victim} out of routing", out_of_routing, timeout=10, every=0.01)
            left = time.monotonic() - killed
            # after that, every turn of the sessions that were on it is served elsewhere
            await wait_for(
                "turns of the victim's sessions served after the kill",
                lambda: (
                    sum(1 for t, s, _ in served if t > killed + left and s in on_victim)
                    >= 2 * len(on_victim)
                ),
                timeout=30,
            )
            stop.set()
        print(f"\nkill -> out of routing: {left:.3f} s")
        assert left < 30.0  # the suspension's --suspend-after: never waited for

        moved = {e for t, s, e in served if t > killed and s in on_victim}
        assert moved - {victim}, served  # the victim's sessions served by another holder
        assert all(e != victim for t, _, e in served if t > killed + left)
        # a turn in flight at the kill may have run (ambiguous, never resent): only those fail
        assert all("AMBIGUOUS" in error or "502" in error for _, _, error in failed), failed
        assert len(failed) <= len(on_victim), failed

        row = await _engine_row(http, victim)
        outage = row["unreachable"]
        assert isinstance(outage, dict) and outage["error"], row

        async with SQLiteStore.open(db) as store:
            records = await store.read()
        outages = [
            r
            for r in records
            if isinstance(r.event, EngineUnreachable) and r.event.engine == victim
        ]
        assert len(outages) == 1, outages  # once per outage, however many turns failed
        (record,) = outages
        assert isinstance(record.event, EngineUnreachable) and record.event.error
        print(f"kill -> record: {record.recorded_at - killed_wall:.3f} s")

        # replay --at inside the window: the engine is out of routing, its outage named
        at = await replay(db, at=record.recorded_at + 0.001)
        member = at.state.engines[victim]
        assert member.unreachable is not None and not member.serving
        found = await replay(db, incidents=True)
        assert found.incidents is not None
        windows = [i for i in found.incidents if i.kind == "engine_unreachable"]
        assert [(i.subject, i.resolved) for i in windows] == [(victim, False)], windows
        assert "failed turns" in windows[0].summary

        # the engine comes back on the same port: back in routing once repaired
        port = int(victim_url.rsplit(":", 1)[1])
        await stack.enter_async_context(engine_process(victim, port))

        async def back() -> bool:
            row = await _engine_row(http, victim)
            return bool(row["routable"]) and row["unreachable"] is None

        await wait_for(f"{victim} back in routing", back, timeout=60)
        async with SQLiteStore.open(db) as store:
            records = await store.read()
        assert any(isinstance(r.event, EngineRestarted) for r in records)
        assert victim in {await turn(s) for s in sessions}
