"""Version lifetimes as data for a picture: state bands over time, bound sessions over time.

People read a timeline faster than a table of transitions (``replay --plot``), so this fold
turns the log into exactly what a chart needs and nothing else: for each version, the spans it
spent in each state; for each version, the number of sessions bound to it at every moment that
number changed; and the fleet moments worth a marker (engine restarts and repairs). Pure: the
chart code (``tools/plot.py``) only draws it.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from evlog.events import EngineRepaired, EngineRestarted, SessionBound, SessionReleased
from evlog.record import Record
from projections.lifecycle import advance
from projections.registry import RegistryState


class Band(msgspec.Struct, frozen=True, kw_only=True):
    """Version ``version_id`` was in ``state`` from ``start`` to ``end`` (seconds)."""

    version_id: int
    state: str
    start: float
    end: float
    start_seq: int
    end_seq: int | None  # None: still in that state at the end of the log


class Marker(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    seq: int
    label: str


class Lifetimes(msgspec.Struct, frozen=True, kw_only=True):
    start: float
    end: float
    bands: tuple[Band, ...]
    bound: dict[int, tuple[tuple[float, int], ...]]  # version -> (time, sessions bound) steps
    markers: tuple[Marker, ...]


class LifetimeFold:
    def __init__(self) -> None:
        self.registry = RegistryState()
        self._open: dict[int, tuple[str, float, int]] = {}
        self._bands: list[Band] = []
        self._bound: dict[int, list[tuple[float, int]]] = {}
        self._markers: list[Marker] = []
        self._restarted: set[str] = set()
        self._first: float | None = None
        self._last = 0.0

    def apply(self, record: Record) -> None:
        at, seq, event = record.recorded_at, record.seq, record.event
        if self._first is None:
            self._first = at
        self._last = at
        for change in advance(self.registry, record):
            vid = change.version_id
            held = self._open.get(vid)
            if held is not None:
                state, start, start_seq = held
                self._bands.append(
                    Band(
                        version_id=vid,
                        state=state,
                        start=start,
                        end=at,
                        start_seq=start_seq,
                        end_seq=seq,
                    )
                )
            self._open[vid] = (str(change.after), at, seq)
        if isinstance(event, SessionBound | SessionReleased):
            if event.version_id is not None:
                self._step(event.version_id, at)
        elif isinstance(event, EngineRestarted):
            self._restarted.add(event.engine)
            self._markers.append(Marker(at=at, seq=seq, label=f"{event.engine} restarted"))
        elif isinstance(event, EngineRepaired) and event.engine in self._restarted:
            self._restarted.discard(event.engine)  # (a first join's repair is not news)
            self._markers.append(Marker(at=at, seq=seq, label=f"{event.engine} repaired"))

    def _step(self, version_id: int, at: float) -> None:
        count = self.registry.versions[version_id].bound
        steps = self._bound.setdefault(version_id, [])
        if steps and steps[-1][0] == at:
            steps[-1] = (at, count)  # one batch, one moment: keep its final count
        else:
            steps.append((at, count))

    def apply_all(self, records: Iterable[Record]) -> LifetimeFold:
        for record in records:
            self.apply(record)
        return self

    def finish(self) -> Lifetimes:
        """The bands (open ones closed at the last record's time) and the bound steps."""
        bands = list(self._bands)
        for vid, (state, start, start_seq) in self._open.items():
            bands.append(
                Band(
                    version_id=vid,
                    state=state,
                    start=start,
                    end=self._last,
                    start_seq=start_seq,
                    end_seq=None,
                )
            )
        bands.sort(key=lambda b: (b.version_id, b.start_seq))
        return Lifetimes(
            start=self._first if self._first is not None else 0.0,
            end=self._last,
            bands=tuple(bands),
            bound={vid: tuple(steps) for vid, steps in sorted(self._bound.items())},
            markers=tuple(self._markers),
        )
