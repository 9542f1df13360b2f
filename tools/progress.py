"""Progress bars for long work, on stderr only, and only for a person watching.

A bar is drawn only when stderr is a terminal: in a pipe, a CI log or a test it would be
noise (and rich would print its final frame), and stdout, the answer, is never touched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from tools.output import stderr_console


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[..., None]]:
    """Yield ``update(done, total)`` or ``update(phase, done, total)``."""
    if not sys.stderr.isatty():
        yield lambda *args: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=stderr_console(), transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def update(*args: str | int) -> None:
            phase, done, total = (label, *args) if len(args) == 2 else args
            name = str(phase)
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=int(total))
            bar.update(tasks[name], completed=int(done), total=int(total))

        yield update
