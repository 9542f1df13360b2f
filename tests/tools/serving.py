"""``loraledger serve`` in this process, on a free loopback port, for tests that talk to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from tools.serve import ServeOptions, serve


@asynccontextmanager
async def serving(db: Path, *, token: str, **options: Any) -> AsyncIterator[str]:
    """Yield the base URL once the service listens; stop it (and wait for it) on exit."""
    options.setdefault("port", 0)  # a fixed port: a restart the same clients reach again
    opts = ServeOptions(db=str(db), token=token, **options)
    urls: list[str] = []
    listening, stop = anyio.Event(), anyio.Event()

    def ready(url: str) -> None:
        urls.append(url)
        listening.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(opts, on_ready=ready, handle_signals=False, stop=stop))
        with anyio.fail_after(60):
            await listening.wait()
        try:
            yield urls[0]
        finally:
            stop.set()
