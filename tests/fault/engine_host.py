"""Engines that outlive the ledger process: real :class:`LocalEngine`\\ s served over loopback
HTTP by the test process, restartable in place (same port, new incarnation, nothing held).

The crash-point harness kills the ledger's process, never the engines': after a crash the
engines still hold whatever the dead controller loaded, exactly as GPU servers would, and the
restarted controller must reconcile with that. Fresh engines per crash point are cheap once the
tiny model is loaded (a deep copy of a cached template).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.server import serve
from engines.testing import RestartableEngine

LIMITS = ServingLimits(max_lora_rank=64)


class HostedEngine:
    """One engine id: a life is a ``LocalEngine`` + its HTTP server on ``port``. A restart
    ends the life (its adapters are gone with it) and starts the next one on the same port.

    The lives are hosted by :class:`engines.testing.RestartableEngine` (one restart loop for
    the whole project: concurrent restarts each get their own life, and a restart that cannot
    come back raises instead of waiting forever). Use as ``async with HostedEngine(...)``."""

    def __init__(self, engine_id: str, artifact_root: Path) -> None:
        self.engine_id = engine_id
        self.artifact_root = artifact_root
        self.port = 0
        self.url = ""
        self._host = RestartableEngine(self._life)

    @contextlib.asynccontextmanager
    async def _life(self) -> AsyncIterator[LocalEngine]:
        async with (
            LocalEngine(self.engine_id, limits=LIMITS, artifact_root=self.artifact_root) as e,
            serve(e, port=self.port) as url,
        ):
            self.url = url
            self.port = int(url.rsplit(":", 1)[1])
            yield e

    async def __aenter__(self) -> HostedEngine:
        await self._host.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._host.__aexit__(*exc)

    @property
    def engine(self) -> LocalEngine:
        return self._host.current  # type: ignore[no-any-return]

    @property
    def lives(self) -> int:
        return self._host.lives

    async def restart(self) -> None:
        await self._host.restart()


@contextlib.asynccontextmanager
async def hosted_engines(
    engine_ids: Sequence[str], artifact_root: Path
) -> AsyncIterator[dict[str, HostedEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        hosts = {}
        for e in engine_ids:
            hosts[e] = await stack.enter_async_context(HostedEngine(e, artifact_root))
        yield hosts
