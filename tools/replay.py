"""``loraledger replay``: the ledger as it was at any seq or time, timelines, incidents, lifetimes.

One pass over the log feeds every fold asked for (state, version/engine timelines, incidents,
lifetimes for a plot), stopping at ``--seq N`` or at the last record recorded at or before
``--at T``. The folds are pure (``projections/``); this module only drives the pass and hands
the results to the renderer.

``--at`` reads the log in seq order and stops at the first record recorded after ``T``: the
state it shows is exactly a prefix of the log (what the ledger had decided by then), even if a
wall clock stepped back between two batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import msgspec

from evlog.errors import LoraLedgerError
from evlog.record import Record
from projections.history import Entry, History
from projections.holders import HolderFold, ReclaimCause
from projections.incidents import Incident, IncidentFold
from projections.lifetimes import LifetimeFold, Lifetimes
from projections.registry import RegistryState, evolve
from projections.stalls import Stall, explain
from tools.exitcodes import Exit, ToolError
from tools.logfile import open_log
from tools.timefmt import AtResolver, iso

Progress = Callable[[int, int], None]  # (records done, records in total)
PROGRESS_EVERY = 4096


class ReplayResult(msgspec.Struct, kw_only=True):
    state: RegistryState
    seq: int  # the last record applied
    at: float | None  # when it was recorded
    log_last_seq: int  # where the log ends (the replay may stop earlier)
    asked_at: float | None = None  # the moment --at meant, resolved against the log
    versions: dict[int, list[Entry]] = msgspec.field(default_factory=dict)
    stalls: dict[int, list[Stall]] = msgspec.field(default_factory=dict)  # per --version
    # per --version: what made each reclaim of it possible (the last binding to go)
    reclaims: dict[int, list[ReclaimCause]] = msgspec.field(default_factory=dict)
    engines: dict[str, list[Entry]] = msgspec.field(default_factory=dict)
    incidents: list[Incident] | None = None
    lifetimes: Lifetimes | None = None


async def replay(
    path: str | os.PathLike[str],
    *,
    until_seq: int | None = None,
    at: float | AtResolver | None = None,
    versions: Sequence[int] = (),
    engines: Sequence[str] = (),
    incidents: bool = False,
    stuck_after: float = 60.0,
    pinned_top: int = 5,
    lifetimes: bool = False,
    progress: Progress | None = None,
) -> ReplayResult:
    if until_seq is not None and at is not None:
        raise ToolError(Exit.USAGE, "give --seq or --at, not both")
    if until_seq is not None and until_seq < 1:
        raise ToolError(Exit.USAGE, f"--seq must be >= 1, got {until_seq}")
    async with open_log(path) as store:
        last = store.last_seq
        if until_seq is not None and until_seq > last:
            raise ToolError(Exit.USAGE, f"--seq {until_seq} is past the end of the log ({last})")
        if callable(at):
            # A time of day or a relative time: resolved against the log's last record.
            tail = await store.read(after=max(0, last - 1), limit=1)
            if not tail:
                raise ToolError(Exit.USAGE, "--at: the log is empty")
            at = at(tail[0].recorded_at)
        folds = _Folds(versions, engines, incidents, stuck_after, pinned_top, lifetimes)
        total = until_seq or last
        applied: Record | None = None
        try:
            async for record in store.iterate(until=until_seq):
                if at is not None and record.recorded_at > at:
                    break
                folds.apply(record)
                applied = record
                if progress is not None and record.seq % PROGRESS_EVERY == 0:
                    progress(record.seq, total)
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=str(path)) from None
        if applied is None:
            first = (await store.read(limit=1))[0]
            raise ToolError(
                Exit.USAGE,
                f"--at is before the first record (seq 1 was recorded at {iso(first.recorded_at)})",
            )
        if progress is not None:
            progress(applied.seq, applied.seq)
        result = folds.result(applied, last, versions, engines)
        result.asked_at = at
        return result


class _Folds:
    """The folds one replay needs, fed from one pass."""

    def __init__(
        self,
        versions: Sequence[int],
        engines: Sequence[str],
        incidents: bool,
        stuck_after: float,
        pinned_top: int,
        lifetimes: bool,
    ) -> None:
        self.history = History(sessions=()) if versions or engines else None
        self.holders = HolderFold(versions) if versions else None
        self.incidents = (
            IncidentFold(stuck_after=stuck_after, pinned_top=pinned_top) if incidents else None
        )
        self.lifetimes = LifetimeFold() if lifetimes else None
        # Reuse a fold's registry when there is one: every fold keeps the same state.
        primary = self.history or self.incidents or self.lifetimes
        self.own = None if primary is not None else RegistryState()
        self.state = primary.registry if primary is not None else self.own
        assert self.state is not None

    def apply(self, record: Record) -> None:
        if self.own is not None:
            evolve(self.own, record.event, record.seq)
        for fold in (self.history, self.holders, self.incidents, self.lifetimes):
            if fold is not None:
                fold.apply(record)

    def result(
        self, applied: Record, last: int, versions: Sequence[int], engines: Sequence[str]
    ) -> ReplayResult:
        assert self.state is not None
        history, holders = self.history, self.holders
        return ReplayResult(
            state=self.state,
            seq=applied.seq,
            at=applied.recorded_at,
            log_last_seq=last,
            versions={v: history.versions.get(v, []) for v in versions} if history else {},
            stalls={v: explain(history, v, holders) for v in versions} if history else {},
            reclaims={v: holders.reclaims.get(v, []) for v in versions} if holders else {},
            engines={e: history.engines.get(e, []) for e in engines} if history else {},
            incidents=self.incidents.finish() if self.incidents is not None else None,
            lifetimes=self.lifetimes.finish() if self.lifetimes is not None else None,
        )
