"""How the library logs: where the application says, and never to stdout on its own.

A library does not decide where its logs go; the program that uses it does. loraledger's
modules log structured events (``log.info("publication.committed", version=3, seq=41)``)
through :func:`get_logger`, and each event goes:

* through **structlog's configuration**, unchanged, when the application configured structlog
  (``structlog.configure`` was called). The ``loraledger`` CLI does exactly that, in
  ``tools/logconfig.py``: stderr, quiet by default, ``-v`` for decisions;
* otherwise to the **standard library logger of the same name** (``loraledger.ledger``,
  ``loraledger.publication``, ...) as one ``"event key=value ..."`` message. Until the
  application configures :mod:`logging`, info and debug go nowhere and warnings and errors
  reach stderr through Python's last-resort handler. Nothing is ever written to stdout.

Why not simply ``structlog.get_logger``: structlog's *defaults* are an application's defaults
(print every event to stdout), so a program that imports loraledger without configuring
structlog would get the ledger's info lines mixed into its own output. Why the standard library
as the fallback: it is the logging system every Python program already has, so an application
silences, filters or routes loraledger's logs with the tools it already uses
(``logging.getLogger("loraledger").setLevel(logging.INFO)``, ``logging.basicConfig``), and the
library configures nothing -- no handler, no level, no structlog processors.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["LibraryLogger", "get_logger"]


def _value(value: Any) -> str:
    """A plain word as is; any other string quoted; anything else as its ``repr``."""
    if not isinstance(value, str):
        return repr(value)
    return value if value and not any(c.isspace() or c in "=\"'" for c in value) else repr(value)


def render(event: str, fields: dict[str, Any]) -> str:
    """``event key=value ...``: the one-line message the standard library logger receives."""
    return " ".join([event, *(f"{key}={_value(value)}" for key, value in fields.items())])


class LibraryLogger:
    """A logger for one library module (see the module docstring for where events go)."""

    __slots__ = ("_stdlib", "_structlog", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._structlog = structlog.get_logger(name)  # lazy: bound to the config at each call
        self._stdlib = logging.getLogger(name)

    def _log(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        if not self._stdlib.isEnabledFor(level):
            return
        exc_info = fields.pop("exc_info", method == "exception") or None
        # stacklevel: the record names the module and line that logged, not this wrapper
        self._stdlib.log(level, "%s", render(event, fields), exc_info=exc_info, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, "error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the traceback of the exception being handled."""
        self._log(logging.ERROR, "exception", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._log(logging.CRITICAL, "critical", event, fields)


def get_logger(name: str) -> LibraryLogger:
    """The logger every library module uses: ``log = get_logger("loraledger.<module>")``."""
    return LibraryLogger(name)
