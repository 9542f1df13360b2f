"""How many engines one publication drives at once is bounded (``max_engines_at_once``): a
fleet of hundreds is not sent hundreds of prepares, transfers and loads in the same instant;
the engines past the bound wait for a turn and the version still commits on every one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from engines.contract import Candidate, Receipt
from engines.local.engine import LocalEngine
from publisher.drivers.publication import PublicationStatus
from tests.publisher.plane_kit import adapter_copy, local_engines, open_plane

pytestmark = pytest.mark.anyio

IDLE = 3600.0  # no health rounds during the test: only the publication talks to the engines


class _Overlap:
    """How many engines are between their prepare and the end of their load, at most."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.crowd = anyio.Event()


class CountingEngine:
    """A real local engine, with its prepare held until a third engine is mid-publication (or
    half a second passed): an unbounded fan-out shows as three at once, whatever the
    scheduler does; a bounded one waits out the half second and goes on."""

    def __init__(self, inner: LocalEngine, overlap: _Overlap) -> None:
        self._inner = inner
        self._overlap = overlap

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def prepare(self, candidate: Candidate) -> Receipt:
        o = self._overlap
        o.now += 1
        o.most = max(o.most, o.now)
        if o.now >= 3:
            o.crowd.set()
        with anyio.move_on_after(0.5):
            await o.crowd.wait()
        return await self._inner.prepare(candidate)

    async def load(self, candidate: Candidate) -> Receipt:
        try:
            return await self._inner.load(candidate)
        finally:
            self._overlap.now -= 1


async def test_a_publication_drives_at_most_max_engines_at_once(tmp_path: Path) -> None:
    overlap = _Overlap()
    async with local_engines(5) as inner:
        engines = [CountingEngine(e, overlap) for e in inner]
        async with open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane:
            plane.publisher.max_engines_at_once = 2
            with anyio.fail_after(30):  # a guard, not a measurement
                outcome = await plane.publisher.publish(adapter_copy(1), version_id=1)
    assert outcome.status == PublicationStatus.PUBLISHED
    assert {t.engine for t in outcome.engines} == {f"e{i}" for i in range(5)}
    assert overlap.most == 2
