"""A frozen engine does not hold publication hostage, under ``loraledger serve`` with its
default settings (docs/publication.md, "Commit").

Three ``loraledger engine`` processes behind one ``loraledger serve``; one engine is frozen
with SIGSTOP (by its PID) before a publication. Its call goes unanswered past the control
timeout (``--probe-timeout``, 10 s) while the reconciler's probes of it fail: the publication
takes it out of the attempt's target set and out of routing (``EngineSuspended``, cause
``unanswered``, the evidence in its detail) and commits on the other two. After SIGCONT the
engine is repaired -- the new version loaded -- before a turn is routed to it again, and then
serves that version. Before this rule, the publication waited for the durable suspension of
failing probes (``--suspend-after``, 30 s after the first failed probe): 54.6 s measured.

Every process is stopped by its PID in a ``finally`` (SIGCONT first: a stopped process cannot
handle SIGTERM).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from evlog.events import EngineRepaired, EngineSuspended, VersionPublished
from publisher.gateway.affinity import rendezvous
from publisher.remote import HttpTrainerClient
from tests.fault.conftest import record_figure
from tests.publisher.remote.test_http_trainer import TOKEN, adapter, logged, serve_process, turn
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.waiting import wait_for
from tests.tools.test_serve import _Process

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

ENGINES = ["e0", "e1", "e2"]
# Generous beside the measured ~11 s (control timeout + one probe interval + the commit): the
# suite runs on loaded machines. The rule's target is 20 s; the old behaviour took 54.6 s.
COMMIT_BOUND_S = 30.0


def session_on(engine: str) -> str:
    """A session id that rendezvous routing sends to ``engine`` when all three hold it."""
    return next(f"s{i}" for i in range(1000) if rendezvous(f"s{i}", ENGINES) == engine)


async def test_a_frozen_engine_leaves_the_publication_which_commits_on_the_rest(
    tmp_path: Path,
) -> None:
    procs = [_Process(tmp_path, e, "engine", "--id", e, "--port", "0", "--json") for e in ENGINES]
    frozen = procs[2].proc
    trainer_home = tmp_path / "trainer"
    trainer_home.mkdir()
    try:
        urls = [str(p.ready()["url"]) for p in procs]
        with serve_process(tmp_path / "serve", urls) as (url, _):
            db = tmp_path / "serve" / "ledger.db"
            async with HttpTrainerClient(url, token=TOKEN) as trainer:
                assert (await trainer.publish(adapter(trainer_home, 1), step=1)).status == (
                    "PUBLISHED"
                )
                step2 = await trainer.upload(adapter(trainer_home, 2))
                os.kill(frozen.pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
                published = await trainer.publish_uploaded(step2.digest, step=2)
                took = time.monotonic() - frozen_at
            record_figure(
                "publication with 1 of 3 engines frozen (serve defaults)", f"{took:.1f} s"
            )
            assert published.status == "PUBLISHED", published
            assert took < COMMIT_BOUND_S, took
            log = await logged(db)
            suspended = [e for e in log if isinstance(e, EngineSuspended)]
            assert [(e.engine, e.cause) for e in suspended] == [("e2", "unanswered")], suspended
            assert "control timeout 10.0 s" in suspended[0].detail, suspended[0].detail
            assert [e.version_id for e in log if isinstance(e, VersionPublished)] == [1, 2]

            # out of routing: e2's own session is served elsewhere, on the new version
            on_e2 = session_on("e2")
            reply = await turn(url, on_e2)
            assert reply.headers["x-loraledger-engine"] in {"e0", "e1"}
            assert reply.headers["x-loraledger-version"] == "2"

            os.kill(frozen.pid, signal.SIGCONT)

            async def repaired() -> bool:
                return any(
                    isinstance(e, EngineRepaired) and e.engine == "e2" for e in await logged(db)
                )

            # no turn reaches e2 before its repair is recorded
            with anyio.fail_after(60):
                while not await repaired():
                    assert (await turn(url, on_e2)).headers["x-loraledger-engine"] != "e2"
            await wait_for(
                "e2's session routed to e2 again",
                lambda: _served_by(url, on_e2, "e2"),
                timeout=60,
            )
            back = await turn(url, on_e2)
            assert back.headers["x-loraledger-engine"] == "e2"
            assert back.headers["x-loraledger-version"] == "2"  # it holds the version
    finally:
        if frozen.poll() is None:
            os.kill(frozen.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        for p in procs:
            p.stop()


async def _served_by(url: str, session: str, engine: str) -> bool:
    return (await turn(url, session)).headers["x-loraledger-engine"] == engine
