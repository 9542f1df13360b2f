"""Structured logs for the CLI, configured once, here (named so it never shadows ``logging``).

Why logs never touch stdout: stdout is the command's *answer* (a table, or JSON lines a script
parses); a log line in it would corrupt ``--json`` output. So every log line goes to stderr,
one line per decision, with its seq when there is one, and the CLI is quiet by default
(warnings and errors only); ``-v`` shows decisions (info), ``-vv`` everything (debug).

Library code (``publisher``) never configures logging: its loggers (``publisher/logs.py``)
follow structlog's configuration once this module applied one, and the standard library's
otherwise. So only the CLI decides that logs go to stderr; a program that imports loraledger
decides for itself. The tools' own loggers are the same kind (:func:`get_logger`), so a tool
run in process (a test, a notebook) is as quiet as the library.

Third-party loggers: under ``serve`` (``stdlib=True``) the standard logging tree is routed to
stderr too, but httpx and httpcore stay at WARNING unless ``-vv``: they log one INFO line per
HTTP request, and the reconciler probes every engine every second.

``configure`` may run many times in one process (tests invoke the CLI repeatedly): it replaces
the configuration and never caches loggers, and the sink looks ``sys.stderr`` up at every write,
so a stream swapped by a test runner and closed afterwards is never written to later.
"""

from __future__ import annotations

import logging
import sys

import structlog

from publisher.logs import LibraryLogger
from publisher.logs import get_logger as _library_logger

_LEVELS = {-2: logging.CRITICAL, -1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}
# Chatty per-request loggers of the HTTP stack: shown only with -vv (everything).
_PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class _Stderr:
    """A file-like sink that always writes to the *current* ``sys.stderr``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def level_for(verbosity: int) -> int:
    return _LEVELS.get(verbosity, logging.DEBUG)


def configure(verbosity: int = 0, *, json_lines: bool = False, stdlib: bool = False) -> int:
    """Route structlog to stderr at the level ``verbosity`` asks for; returns that level.

    ``json_lines`` renders each line as JSON (a service whose stderr a log shipper collects).
    ``stdlib`` also routes the standard ``logging`` tree (uvicorn's loggers) to stderr at the
    same level: only the long-running ``serve`` wants that; the one-shot commands leave the
    process-wide logging tree alone."""
    level = level_for(verbosity)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    if not stdlib:
        return level
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_loraledger", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(_Stderr())
    handler._loraledger = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    for name in _PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(level if verbosity >= 2 else max(level, logging.WARNING))
    return level


def get_logger(name: str) -> LibraryLogger:
    """A tool's logger: the library's kind (structlog once configured, else stdlib)."""
    return _library_logger(name)
