"""``loraledger verify``: is this log intact, and is every state it passes through legal?

Two checks, in this order, because they answer different questions:

1. **The chain** (``store.verify()``): every record matches its hash and links to its
   predecessor. A failure means the file was altered or damaged *after* the ledger wrote it.
2. **The invariants**: every event is applied in order and the registry invariants are checked
   after each one (the cheap ones every step, the per-session ones at the end, or every step
   with ``deep``): the checked replay of ``projections.recovery`` (``recover(check=True)``
   runs the same one). A failure on an intact chain means the ledger *itself*
   decided something illegal (a bug), or someone re-forged the chain; either way the seq
   names where.

On the way, the engine-health incidents (``engine_suspended``, ``adapter_lost``: see
``projections.incidents``) are collected from the same pass and listed with the verdict: an
intact log can still record an engine that lost an adapter or was quarantined, and whoever
checks a log wants to see that first.

Nothing here raises for a bad log: the result says what failed, where, and which exit code
reports it, so ``--json`` can describe a broken file as precisely as a good one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec

from evlog.errors import LoraLedgerError
from evlog.record import Record
from evlog.store import EventStore
from evlog.stores import describe
from projections.incidents import EngineHealthFold, Incident
from projections.recovery import CheckedReplay
from tools.exitcodes import Exit, ToolError
from tools.logfile import open_log

Progress = Callable[[str, int, int], None]  # (phase, done, total)


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    ok: bool
    exit_code: int
    stage: str  # "open", "chain", "invariants", "done", or "internal" (a bug: the problem says)
    records: int = 0
    last_seq: int = 0
    head_hash: str = ""
    first_bad_seq: int | None = None
    code: str | None = None
    problem: str = ""
    seconds: float = 0.0
    # engine-health incidents of the records replayed (all of them when ``ok``)
    incidents: tuple[Incident, ...] = ()


async def verify_log(
    path: str | os.PathLike[str], *, deep: bool = False, progress: Progress | None = None
) -> VerifyResult:
    start = time.perf_counter()
    where = describe(path)

    def failed(stage: str, exit_code: Exit, problem: str, **fields: object) -> VerifyResult:
        return VerifyResult(
            path=where,
            ok=False,
            exit_code=int(exit_code),
            stage=stage,
            problem=problem,
            seconds=round(time.perf_counter() - start, 3),
            **fields,  # type: ignore[arg-type]
        )

    try:
        async with open_log(path, allow_empty=True) as store:
            if store.last_seq == 0:
                return failed("open", Exit.EMPTY, f"{where}: the ledger holds no events")
            if progress is not None:
                progress("chain", 0, store.last_seq)
            report = await store.verify()
            if not report.ok:
                code = ToolError.from_ledger(LoraLedgerError(report.code or "", report.message))
                return failed(
                    "chain",
                    code.exit_code,
                    report.message,
                    records=report.records,
                    last_seq=report.last_seq,
                    head_hash=report.head_hash.hex(),
                    first_bad_seq=report.first_bad_seq,
                    code=report.code,
                )
            if progress is not None:
                progress("chain", report.last_seq, report.last_seq)
            health = EngineHealthFold()
            bad = await _replay_checked(store, deep, report.last_seq, progress, health.apply)
            if bad is not None:
                seq, problem = bad
                return failed(
                    "invariants",
                    Exit.INVARIANT,
                    problem,
                    records=report.records,
                    last_seq=report.last_seq,
                    head_hash=report.head_hash.hex(),
                    first_bad_seq=seq,
                    code="INVARIANT",
                    incidents=tuple(health.finish()),
                )
    except ToolError as exc:
        return failed("open", exc.exit_code, exc.message, first_bad_seq=exc.seq)
    except Exception as exc:  # a verdict whatever happens: --json must always print one
        return failed("internal", Exit.FAILED, f"internal error: {exc!r}")
    return VerifyResult(
        path=where,
        ok=True,
        exit_code=int(Exit.OK),
        stage="done",
        records=report.records,
        last_seq=report.last_seq,
        head_hash=report.head_hash.hex(),
        seconds=round(time.perf_counter() - start, 3),
        incidents=tuple(health.finish()),
    )


async def _replay_checked(
    store: EventStore,
    deep: bool,
    last: int,
    progress: Progress | None,
    observe: Callable[[Record], None],
) -> tuple[int, str] | None:
    """Apply every event, checking invariants (each applied record also goes to
    ``observe``); the first (seq, problem) found, or None."""
    replay = CheckedReplay(deep=deep)
    report = None if progress is None else lambda seq: progress("invariants", seq, last)
    try:
        fault = await replay.run(store, until=last, progress=report, observe=observe)
    except LoraLedgerError as exc:  # the file changed under us between the two passes
        return exc.details.get("seq", replay.state.last_seq + 1), f"{exc.code}: {exc.message}"
    if fault is not None:
        return fault.seq, fault.describe()
    if progress is not None:
        progress("invariants", last, last)
    return None
