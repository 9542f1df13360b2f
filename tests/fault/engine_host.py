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

import anyio
import anyio.abc

from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.server import serve

LIMITS = ServingLimits(max_lora_rank=64)


class HostedEngine:
    """One engine id: a life is a ``LocalEngine`` + its HTTP server on ``port``. A restart
    ends the life (its adapters are gone with it) and starts the next one on the same port."""

    def __init__(self, engine_id: str, artifact_root: Path) -> None:
        self.engine_id = engine_id
        self.artifact_root = artifact_root
        self.port = 0
        self.url = ""
        self.engine: LocalEngine | None = None
        self.lives = 0
        self._stop: anyio.Event | None = None
        self._up: anyio.Event | None = None

    async def host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        while True:
            stop = self._stop = anyio.Event()
            async with (
                LocalEngine(self.engine_id, limits=LIMITS, artifact_root=self.artifact_root) as e,
                serve(e, port=self.port) as url,
            ):
                self.url, self.engine = url, e
                self.port = int(url.rsplit(":", 1)[1])
                self.lives += 1
                if self.lives == 1:
                    task_status.started()
                elif self._up is not None:
                    self._up.set()
                await stop.wait()

    async def restart(self) -> None:
        up = self._up = anyio.Event()
        assert self._stop is not None
        self._stop.set()
        await up.wait()


@contextlib.asynccontextmanager
async def hosted_engines(
    engine_ids: Sequence[str], artifact_root: Path
) -> AsyncIterator[dict[str, HostedEngine]]:
    hosts = {e: HostedEngine(e, artifact_root) for e in engine_ids}
    async with anyio.create_task_group() as tg:
        for h in hosts.values():
            await tg.start(h.host)
        try:
            yield hosts
        finally:
            tg.cancel_scope.cancel()
