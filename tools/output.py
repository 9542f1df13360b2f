"""Where the CLI's answers go: rich tables for people, JSON lines for scripts, both on stdout.

Why one place: every command must behave the same way for a script. ``--json`` writes one JSON
object per line (a stream of rows stays a stream: ``jq`` and ``grep`` work on it as it
arrives), every object carries a ``row`` naming its sort (``state``, ``timeline``,
``incident``, ``session``, ...) when a command can emit several, and nothing
else (logs, progress bars, warnings) is ever written to stdout.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import msgspec
from rich.console import Console

_encoder = msgspec.json.Encoder()
_PIPE_WIDTH = 140  # a table piped to a file or a pager keeps its columns instead of folding


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own answer is ``SystemExit(1)``; the command's guard gives every closed pipe
        (a table or ``--json``) the same quiet exit (``Exit.BROKEN_PIPE``)."""
        self.quiet = True
        raise BrokenPipeError


def _console(stream: TextIO) -> Console:
    """``markup=False``: the strings printed carry user text (paths, names from a log) that
    rich must not read as markup (``[/x]`` raised ``MarkupError``); styles come from ``Text``
    objects, never from brackets in a string."""
    if stream.isatty():
        return _Console(file=stream, highlight=False, markup=False)
    width = int(os.environ.get("COLUMNS", _PIPE_WIDTH))
    return _Console(file=stream, highlight=False, markup=False, width=width, no_color=True)


def stdout_console() -> Console:
    """A console for the answer. Not a terminal: no colours, a fixed generous width."""
    return _console(sys.stdout)


def stderr_console() -> Console:
    """For progress bars and error messages: never mixed into the answer."""
    return _console(sys.stderr)


def to_json(obj: Any, **extra: Any) -> dict[str, Any]:
    """A struct (or dict) as plain JSON-able data, with ``extra`` fields first."""
    data = msgspec.to_builtins(obj)
    return {**extra, **data} if isinstance(data, dict) else {**extra, "value": data}


def emit(obj: Any) -> None:
    """Write one JSON line to stdout and flush it (a consumer sees rows as they come)."""
    sys.stdout.write(_encoder.encode(obj).decode() + "\n")
    sys.stdout.flush()
