"""The history of one chaos run: what every client saw, what every engine did, which faults
were injected, and the ledger's log, as plain data the checker reads.

Why plain data, written by the observers themselves: the checker must be independent of the
code under test, so nothing here goes through the projections. Client operations are written
by the run's clients (one record per operation, holding its invocation time and its outcome:
``ok``, ``fail`` with the answer's code, or ``info`` when the outcome is unknown, a cancelled
stream or a lost connection); engine records are written by each engine process as JSON lines
(``tests/chaos/recording_engine.py``: a line is flushed before the reply leaves, so a served
turn always has its record, even when the engine is SIGKILLed right after); the log is read
with the store after the run (:func:`read_log`, SQLite or PostgreSQL alike) and kept as
``(seq, recorded_at, type, fields)``.

Every time is wall-clock seconds (``time.time()``) of this one machine, the ledger's
``recorded_at`` included, so the three sources can be compared.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

Outcome = Literal["ok", "fail", "info"]
OpKind = Literal["turn", "close", "publish"]
EngineKind = Literal["start", "end", "load", "unloading", "unload"]


class ClientOp(msgspec.Struct, frozen=True, kw_only=True):
    """One client operation: a turn of a session (``request_id`` is the ``x-request-id`` the
    client sent), a session's close, or a trainer's publication of ``version``.
    ``version``/``engine``: the answer's ``x-loraledger-version``/``-engine`` headers (a
    publication: the version asked for). ``code``: the refusal's code on ``fail``, what
    happened on ``info``."""

    client: str
    kind: OpKind
    invoked: float
    completed: float
    outcome: Outcome
    session: str = ""
    request_id: str = ""
    version: int | None = None
    engine: str = ""
    stream: bool = False
    code: str = ""
    via: str = ""  # the gateway a turn or close was sent to


class EngineRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One thing an engine process did. ``start``: a request took its adapter's reference (it
    runs from here); ``end``: it gave it back; ``load``: an adapter became resident;
    ``unloading``: an unload of it reached the engine (the name unregistered, its drain
    begins); ``unload``: its weights were freed (after its drain, on a correct engine).
    ``life``: the process's PID, so a restart's records are never joined to an older life's."""

    engine: str
    life: int
    kind: EngineKind
    at: float
    lora_name: str | None = None
    request_id: str = ""
    attempt: int | None = None


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One injected process fault: ``kind`` is ``kill`` (SIGKILL then a restart), ``term``
    (SIGTERM then a restart), ``stop`` (SIGSTOP until ``healed``, then SIGCONT) or ``restart``
    (SIGTERM and at once a new process). ``target`` names the process (``e0``, ``gw-a``,
    ``serve``); ``healed``: when it was serving again (restarted or continued)."""

    target: str
    kind: str
    at: float
    healed: float


class LogEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One record of the ledger's log, its event as plain fields (``msgspec.to_builtins``)."""

    seq: int
    at: float
    type: str
    fields: dict[str, Any]


class History(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one run observed; ``heal`` is when the last fault healed (the start of the
    liveness window)."""

    ops: tuple[ClientOp, ...] = ()
    engine: tuple[EngineRecord, ...] = ()
    faults: tuple[Fault, ...] = ()
    log: tuple[LogEntry, ...] = ()
    heal: float = 0.0

    def of_type(self, *types: str) -> list[LogEntry]:
        return [e for e in self.log if e.type in types]


_UNIQUE_SUFFIX = re.compile(r"-[0-9a-f]{12}$")


def client_request_of(engine_request_id: str) -> str:
    """The client's ``x-request-id`` an engine-side request id was made from: the OpenAI face
    makes the id an engine sees unique by appending ``-`` and 12 hex digits to the client's."""
    return _UNIQUE_SUFFIX.sub("", engine_request_id)


def read_engine_records(paths: Iterable[Path]) -> list[EngineRecord]:
    """Every engine record of the files (a line cut by a SIGKILL mid-write is skipped: the
    record was never complete, so the reply it preceded never left)."""
    decoder = msgspec.json.Decoder(EngineRecord)
    out: list[EngineRecord] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_bytes().splitlines():
            try:
                out.append(decoder.decode(line))
            except msgspec.DecodeError:
                continue
    return out


def log_entries(records: Iterable[Any]) -> list[LogEntry]:
    """The store's records (``evlog.record.Record``) as plain entries."""
    return [
        LogEntry(
            seq=r.seq,
            at=r.recorded_at,
            type=r.type,
            fields=msgspec.to_builtins(r.event),
        )
        for r in records
    ]


async def read_log(location: str) -> list[LogEntry]:
    """Every raw event of the log at ``location`` (``serve``'s ``--db``: a SQLite file or a
    ``postgresql://`` URL), read through the store itself, never the projections."""
    from evlog.stores import open_store

    async with open_store(location) as store:
        return log_entries(await store.read())
