"""Checks of values several commands take: a service's URL, a number of seconds.

A value that can only fail later is refused at the door, as a usage error (exit 2) naming
the option and what it takes: a URL without a scheme was "no ledger answered" (exit 10, as if
the service were down), a negative timeout an internal error from the HTTP client, a probe
timeout of 0 s a service whose every probe failed until it suspended its engines.
"""

from __future__ import annotations

import math

import httpx

from evlog.locations import redacted
from tools.exitcodes import Exit, ToolError


def service_url(option: str, value: str) -> str:
    """``value`` if it is an http(s) URL with a host and no user or password (without its
    trailing slash). A password in the URL is refused, not used: the HTTP client would send it
    as Basic credentials in place of the bearer token (every call refused 401), and every
    message quoting the URL would print it. Messages show the URL through
    :func:`evlog.locations.redacted`."""
    example = "e.g. http://127.0.0.1:8765"
    shown = redacted(value)
    try:
        url = httpx.URL(value)
        port = url.port
    except (httpx.InvalidURL, ValueError):  # its text may quote the URL: not shown
        raise ToolError(Exit.USAGE, f"{option} {shown!r} is not a URL; {example}") from None
    if url.scheme not in ("http", "https") or not url.host or value != value.strip():
        raise ToolError(Exit.USAGE, f"{option} {shown!r} is not an http(s) URL; {example}")
    if url.userinfo:
        raise ToolError(
            Exit.USAGE,
            f"{option} {shown!r}: a URL carries no user or password; the token goes in "
            "--token-file or $LORALEDGER_TOKEN",
        )
    if port is not None and not 0 < port <= 65535:
        raise ToolError(Exit.USAGE, f"{option} {shown!r}: {port} is not a TCP port")
    return value.rstrip("/")


def seconds(option: str, value: float, *, zero: str | None = None) -> float:
    """``value`` if it is a finite number of seconds > 0, or 0 where ``zero`` says what 0
    means ("never")."""
    if math.isfinite(value) and (value > 0 or (value == 0 and zero is not None)):
        return value
    wanted = f">= 0 (0: {zero})" if zero is not None else "> 0"
    raise ToolError(Exit.USAGE, f"{option} {value:g}: takes a finite number of seconds {wanted}")
