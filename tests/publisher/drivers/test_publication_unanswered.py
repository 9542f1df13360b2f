"""A publication stops waiting for an engine that does not answer, and only for one that does
not answer (docs/publication.md, "Commit"; docs/operations.md, "Engine health").

Three real local engines, one wrapped in the fault injector (tests/engines/faulty_engine.py):

* its load is held for a minute and its health probes time out too (frozen, as under
  SIGSTOP): once the load has waited the control timeout (the probe timeout) and the outage is
  recorded, the engine is suspended with cause ``unanswered`` and the version commits on the
  other two -- with the durable suspension switched off (``suspend_after_s=None``), so nothing
  else can end the wait. Before this rule the attempt waited for the load's own timeout and
  failed;
* its load takes longer than the control timeout but its probes answer (slow, not frozen): the
  publication waits for it and commits on all three, nothing suspended.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from evlog.events import EngineSuspended
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import PublicationStatus
from tests.engines.faulty_engine import Delay, FaultyEngine
from tests.publisher.plane_kit import FAST, PEFT_WARNINGS, adapter_copy, local_engines, open_plane
from tests.support.log import events, of_type

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


@contextlib.asynccontextmanager
async def fleet_with_faulty_e2(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, FaultyEngine]]:
    """Three local engines, e2 behind the fault injector, version 1 published on all three;
    no durable suspension (``suspend_after_s=None``): only the rule under test can end a wait."""
    async with local_engines(3) as inner:
        e2 = FaultyEngine(inner[2])
        engines: list[Any] = [inner[0], inner[1], e2]
        async with open_plane(
            engines, tmp_path, probe_interval_s=0.2, suspend_after_s=None
        ) as plane:
            await plane.publisher.publish(adapter_copy(1), version_id=1)
            yield plane, e2


async def test_a_frozen_engine_leaves_the_attempt_at_the_control_timeout(tmp_path: Path) -> None:
    async with fleet_with_faulty_e2(tmp_path) as (plane, e2):
        e2.inject("load", Delay(seconds=60))
        e2.inject("incarnation", Delay(seconds=60), times=10_000)
        started = time.monotonic()
        outcome = await plane.publisher.publish(adapter_copy(2), version_id=2)
        took = time.monotonic() - started
        assert outcome.status is PublicationStatus.PUBLISHED
        assert sorted(t.engine for t in outcome.engines) == ["e0", "e1"]
        assert took < FAST.load, took  # not the load's own timeout
        suspended = of_type(await events(plane.ledger), EngineSuspended)
        assert [(e.engine, e.cause) for e in suspended] == [("e2", "unanswered")]
        assert f"(control timeout {FAST.probe:.1f} s)" in suspended[0].detail
        state = plane.ledger.state
        assert state.default == 2
        assert "e2" not in state.routable_engines()


async def test_a_slow_engine_that_answers_probes_is_waited_for(tmp_path: Path) -> None:
    async with fleet_with_faulty_e2(tmp_path) as (plane, e2):
        e2.inject("load", Delay(seconds=FAST.probe + 1.5))
        outcome = await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert outcome.status is PublicationStatus.PUBLISHED
        assert sorted(t.engine for t in outcome.engines) == ["e0", "e1", "e2"]
        assert of_type(await events(plane.ledger), EngineSuspended) == []
