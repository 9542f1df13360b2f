"""The reconciler records an engine's outage at its first evidence, on real local engines: a
failed probe alone (no traffic at all) takes the engine out of routing at once and writes one
``EngineUnreachable``; a face's report of a refused connection is recorded by the plane's own
loop within moments, however long its probes are apart; the failures the faces counted are
recorded against the outage once a probe confirmed it; the first probe that answers ends it
and the engine serves again.

Before, a failed probe only counted towards the suspension: the engine stayed routable, and
the log silent, for ``suspend_after_s``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.contract import AmbiguousReply, ErrorCode
from evlog.events import (
    DispatchFailures,
    EngineReachable,
    EngineSuspended,
    EngineUnreachable,
    TurnFailures,
)
from tests.engines.faulty_engine import ServerError
from tests.publisher.drivers.test_reconciler_health import (
    IDLE,
    Clock,
    log_after,
    published_on_two,
    reconciler_for,
)
from tests.publisher.plane_kit import PEFT_WARNINGS, adapter_copy, faulty_engines, open_plane
from tests.support.log import events
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


def refused(engine_id: str) -> AmbiguousReply:
    """What a gateway sees when the engine's port refuses the connection: nothing was sent."""
    return AmbiguousReply(
        ErrorCode.ENGINE_UNREACHABLE,
        "POST /generate: cannot connect: [Errno 111] Connection refused",
        engine_id=engine_id,
        dispatched=False,
    )


async def test_a_failed_probe_alone_takes_the_engine_out_of_routing_at_once(
    tmp_path: Path,
) -> None:
    async with published_on_two(tmp_path) as (engines, plane, v1):
        clock = Clock()
        reconciler = reconciler_for(plane, clock)
        seq = plane.ledger.state.last_seq
        engines[1].inject("incarnation", ServerError(), times=3)
        for second in range(3):  # three failed probes: one outage
            clock.now = float(second)
            await reconciler.health_check()
            assert plane.ledger.state.holders(v1.lora_name) == ("e0",)
            assert plane.ledger.state.routable_engines() == ("e0",)
        written = await log_after(plane, seq)
        assert [type(e) for e in written] == [EngineUnreachable]
        (outage,) = written
        assert isinstance(outage, EngineUnreachable)
        assert (outage.engine, outage.source, outage.reporter) == ("e1", "probe", "reconciler")
        assert outage.error.startswith("SERVER_ERROR")
        assert outage.incarnation == plane.ledger.state.engines["e1"].incarnation
        status = plane.ledger.status().engines[1]
        assert not status.routable and status.unreachable is not None
        assert status.unreachable.since == outage.at
        # the fourth probe answers: the outage ends, the engine serves what it held
        clock.now = 3.0
        await reconciler.health_check()
        ended = (await log_after(plane, seq))[1:]
        assert [type(e) for e in ended] == [EngineReachable]
        assert isinstance(ended[0], EngineReachable) and ended[0].since == outage.at
        assert plane.ledger.state.holders(v1.lora_name) == ("e0", "e1")
        assert not plane.ledger.state.engines["e1"].suspended


async def test_a_refused_connection_is_recorded_at_once_and_its_turns_counted(
    tmp_path: Path,
) -> None:
    """The plane's own loop, probing once an hour: a gateway's report of a refused connection
    records the outage (``source`` dispatch, dated when it was seen) within moments; the probe
    it triggers fails too, and the turns the gateway counted are recorded against it."""
    async with (
        faulty_engines(2) as engines,
        open_plane(
            engines, tmp_path, probe_interval_s=IDLE, full_reconcile_s=IDLE, suspend_after_s=None
        ) as plane,
    ):
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        v1 = plane.ledger.state.versions[1]
        seq = plane.ledger.state.last_seq
        engines[1].inject("incarnation", ServerError(), times=1000)  # it is really down
        life = plane.ledger.state.engines["e1"].incarnation
        reconciler = plane.reconciler
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation=life)
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation=life)
        reconciler.engine_trouble("e1", refused("e1"), session="s2", incarnation=life)
        await wait_for(
            "e1 out of the holders of v1",
            lambda: plane.ledger.state.holders(v1.lora_name) == ("e0",),
            timeout=5.0,
        )

        async def counted() -> bool:
            return any(isinstance(e, DispatchFailures) for e in await log_after(plane, seq))

        await wait_for("the failures recorded", counted, timeout=10.0)
        written = await log_after(plane, seq)
        kinds = [type(e) for e in written]
        assert kinds.count(EngineUnreachable) == 1, kinds
        assert EngineSuspended not in kinds
        outage = next(e for e in written if isinstance(e, EngineUnreachable))
        assert (outage.source, outage.reporter) == ("dispatch", "gateway")
        assert "Connection refused" in outage.error
        counts = next(e for e in written if isinstance(e, DispatchFailures))
        assert counts.since == outage.at
        assert counts.failures == (
            TurnFailures(session="s1", not_run=2),
            TurnFailures(session="s2", not_run=1),
        )


async def test_a_report_about_an_earlier_life_opens_nothing(tmp_path: Path) -> None:
    """e1's failure is reported under a life the ledger no longer knows: nothing is recorded
    for e1. (e0's report, of its current life, is the sentinel that the reports were read.)"""
    async with published_on_two(tmp_path) as (_, plane, v1):
        seq = plane.ledger.state.last_seq
        reconciler = plane.reconciler
        reconciler.engine_trouble("e1", refused("e1"), session="s1", incarnation="old-life")
        life = plane.ledger.state.engines["e0"].incarnation
        reconciler.engine_trouble("e0", refused("e0"), session="s2", incarnation=life)

        async def e0_reported() -> bool:
            written = await events(plane.ledger, after=seq)
            return any(isinstance(e, EngineUnreachable) for e in written)

        await wait_for("e0's outage recorded", e0_reported, timeout=5.0)
        written = await events(plane.ledger, after=seq)
        assert [e for e in written if getattr(e, "engine", "") == "e1"] == []
        assert "e1" in plane.ledger.state.holders(v1.lora_name)
