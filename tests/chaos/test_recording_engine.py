"""The recording engine (``tests/chaos/recording_engine.py``) writes what the engine really
did, the ground truth the chaos checker holds the gateways' answers to: a load with its name
and attempt, each request's start and end on the adapter it used with the id it was sent
under, the unload when it arrived, and the weights freed only after the running request ended."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import msgspec
import pytest

from engines.artifacts import ArtifactStore
from engines.local.client import LocalHTTPEngine
from tests.chaos.history import read_engine_records
from tests.engines.contract import GREEDY, PROMPT, candidate_for, publish
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.processes import listening_process
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


async def test_the_engine_records_load_requests_and_unload_after_the_drain(
    tmp_path: Path,
) -> None:
    record = tmp_path / "e0.jsonl"
    args = ["--id", "e0", "--port", "0", "--record", str(record), "--json"]
    started = listening_process(
        args, module="tests.chaos.recording_engine", stop_with=signal.SIGTERM
    )
    async with started as (process, row):
        engine = LocalHTTPEngine(row["url"], "e0")
        try:
            published = candidate_for(ArtifactStore(tmp_path / "artifacts"), 5, attempt=3)
            await publish(engine, published)
            name = published.name
            long = msgspec.structs.replace(GREEDY, max_tokens=200)
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: engine.generate(PROMPT, name, long, request_id="r-1"))
                await wait_for(
                    "r-1 running",
                    lambda: any(r.kind == "start" for r in read_engine_records([record])),
                    timeout=60,
                )
                assert (await engine.unload(name, attempt=3)).was_loaded
        finally:
            await engine.aclose()
    assert process.returncode == 0
    kinds = [(r.kind, r.lora_name, r.request_id, r.attempt) for r in read_engine_records([record])]
    assert kinds == [
        ("load", name, "", 3),
        ("start", name, "r-1", None),
        ("unloading", name, "", None),  # asked while r-1 ran: the drain waits for it
        ("end", name, "r-1", None),
        ("unload", name, "", None),
    ], kinds
    assert {r.life for r in read_engine_records([record])} == {process.pid}
