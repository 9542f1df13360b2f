"""``python -m tests.chaos.recording_engine``: ``loraledger engine`` that writes down what it
does, for the chaos run's history -- a test-only wrapper, no change to the engine itself.

Why a wrapper: the checker must know what an engine really ran (which adapter name a request
used, when it held its adapter, when an adapter's weights were freed), not what the gateway
believes it sent. The bundled engine is subclassed here and handed to the very
``tools.local_engine.run_engine`` the command runs, so its server, drain and signals are the
command's; only these observations are added, one JSON line each, flushed before the engine
goes on (so a reply that left has its record, even under a SIGKILL right after):

* ``start`` when a request took its adapter's reference (it runs from here), ``end`` just
  before it gave it back (so an unload waiting for that reference is recorded after it);
* ``load`` when a name became resident (with its attempt), ``unloading`` when an unload of it
  arrived (the name unregistered: what the control plane asked, before the drain hides it),
  ``unload`` when its weights were freed (after the drain).

``--plant`` puts one known bug in this process, to show the checker catches it in a real run
(never in the code under test): ``default`` serves every request on the adapter loaded last
(the newest default) whatever name was asked.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import time
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

import engines.local.engine
from engines.local.name_table import Resident
from engines.local.refs import Lease
from tests.chaos.history import EngineRecord
from tests.chaos.plants import ENGINE_PLANTS
from tools import local_engine, logconfig
from tools.demo import quiet_libraries
from tools.output import emit

_request: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="")


class _Journal:
    def __init__(self, path: Path, engine: str) -> None:
        self._out: TextIO = path.open("a", encoding="utf-8")
        self._engine, self._life = engine, os.getpid()
        self._encoder = msgspec.json.Encoder()

    def write(self, kind: Any, **fields: Any) -> None:
        record = EngineRecord(
            engine=self._engine, life=self._life, kind=kind, at=time.time(), **fields
        )
        self._out.write(self._encoder.encode(record).decode() + "\n")
        self._out.flush()


class _RecordedLease(Lease):
    """A request's reference that writes ``end`` before it is given back."""

    __slots__ = ("_inner", "_on_release")

    def __init__(self, inner: Lease, on_release: Any) -> None:
        self._inner, self._on_release = inner, on_release

    @property
    def released(self) -> bool:
        return self._inner.released

    def release(self) -> bool:
        if not self._inner.released:
            self._on_release()
        return self._inner.release()


def recording_engine(
    journal: _Journal, plant: str | None
) -> type[engines.local.engine.LocalEngine]:
    base = engines.local.engine.LocalEngine

    class RecordingEngine(base):  # type: ignore[valid-type,misc]  # a class made at run time
        _latest: str | None = None

        async def generate(self, prompt: Any, lora_name: str | None, *args: Any, **kw: Any) -> Any:
            _request.set(kw.get("request_id") or "")
            if plant == "default" and lora_name is not None and self._latest is not None:
                lora_name = self._latest
            return await super().generate(prompt, lora_name, *args, **kw)

        async def _acquire(self, name: str | None) -> tuple[Resident | None, Lease | None]:
            resident, lease = await super()._acquire(name)
            if resident is None or lease is None:
                return resident, lease
            rid, lora = _request.get(), resident.lora_name
            journal.write("start", lora_name=lora, request_id=rid)
            ended = lambda: journal.write("end", lora_name=lora, request_id=rid)  # noqa: E731
            return resident, _RecordedLease(lease, ended)

        async def _install(self, name: str, *args: Any, **kw: Any) -> None:
            await super()._install(name, *args, **kw)
            self._latest = name
            journal.write("load", lora_name=name, attempt=kw.get("attempt"))

        async def _free_when_drained(self, resident: Resident) -> None:
            journal.write("unloading", lora_name=resident.lora_name)
            await super()._free_when_drained(resident)
            journal.write("unload", lora_name=resident.lora_name)

    return RecordingEngine


def main() -> None:
    parser = argparse.ArgumentParser(prog="recording_engine")
    parser.add_argument("--id", default="e0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--artifacts", default=None)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--plant", choices=ENGINE_PLANTS, default=None)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logconfig.configure(0)  # as the command: warnings on stderr, stdout holds the one row
    quiet_libraries()
    journal = _Journal(args.record, args.id)
    engines.local.engine.LocalEngine = recording_engine(journal, args.plant)  # type: ignore[misc]
    opts = local_engine.EngineOptions(
        engine_id=args.id,
        port=args.port,
        artifact_root=args.artifacts,
        drain_timeout_s=args.drain_timeout,
    )

    def ready(url: str) -> None:
        emit({"row": "listening", "engine": args.id, "url": url, "pid": os.getpid()})

    anyio.run(lambda: local_engine.run_engine(opts, on_ready=ready))


if __name__ == "__main__":
    main()
