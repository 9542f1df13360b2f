"""Progress for long work a person waits on, on stderr only, and only for a person watching.

A bar is drawn only when stderr is a terminal and the command was not asked for ``--json``:
in a pipe, a CI log or a test it would be noise (and rich would print its final frame), a
script asking for JSON wants rows, not animation, and stdout, the answer, is never touched.
Every long command goes through :func:`progress_bar` (or :func:`working`, built on it), so
that rule is kept in one place: ``replay``, ``audit``, ``verify`` (records), ``publish``
(bytes uploaded, then the wait for the engines), ``bench`` (the time a run has taken).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from tools.output import stderr_console

# ``update(done, total)`` or ``update(phase, done, total)``; a total of None: not known yet
# (a pulsing bar, a spinner).
Update = Callable[..., None]


def shows_progress(json: bool = False) -> bool:
    """Whether a bar would be drawn: a person at a terminal, and not ``--json``."""
    return not json and sys.stderr.isatty()


class _Count(ProgressColumn):
    """``3/10`` records, or ``1.2/4.0 MB`` for a task counting bytes; nothing while the
    total is unknown (the spinner and the clock say the work goes on)."""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        if task.fields.get("unit") == "bytes":
            return Text(f"{decimal(int(task.completed))}/{decimal(int(task.total))}")
        return Text(f"{int(task.completed)}/{int(task.total)}")


@contextmanager
def progress_bar(label: str, *, json: bool = False, unit: str = "") -> Iterator[Update]:
    """Yield ``update(done, total)`` or ``update(phase, done, total)``: one bar per phase,
    named ``label`` or the phase. ``unit="bytes"`` counts in bytes. Without a terminal on
    stderr, or with ``json``, ``update`` does nothing and nothing is written."""
    if not shows_progress(json):
        yield lambda *args: None
        return
    columns = (
        SpinnerColumn(finished_text=" "),
        TextColumn("{task.description}"),
        BarColumn(),
        _Count(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=stderr_console(), transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def update(*args: str | int | None) -> None:
            phase, done, total = (label, *args) if len(args) == 2 else args
            name = str(phase)
            size = None if total is None else int(total)
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=size, unit=unit)
            bar.update(tasks[name], completed=int(done or 0), total=size)

        yield update


@contextmanager
def working(label: str, *, json: bool = False) -> Iterator[None]:
    """A spinner, ``label`` and the time elapsed, for work that cannot count its steps (a
    benchmark run): the person waiting sees it is alive and for how long."""
    with progress_bar(label, json=json) as update:
        update(0, None)
        yield
