"""Checks of values several commands take: a service's URL, a number of seconds.

A value that can only fail later is refused at the door, as a usage error (exit 2) naming
the option and what it takes: a URL without a scheme was "no ledger answered" (exit 10, as if
the service were down), a negative timeout an internal error from the HTTP client, a probe
timeout of 0 s a service whose every probe failed until it suspended its engines.
"""

from __future__ import annotations

import math

import httpx

from tools.exitcodes import Exit, ToolError


def service_url(option: str, value: str) -> str:
    """``value`` if it is an http(s) URL with a host (without its trailing slash)."""
    example = "e.g. http://127.0.0.1:8765"
    try:
        url = httpx.URL(value)
        port = url.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise ToolError(Exit.USAGE, f"{option} {value!r} is not a URL ({exc}); {example}") from None
    if url.scheme not in ("http", "https") or not url.host or value != value.strip():
        raise ToolError(Exit.USAGE, f"{option} {value!r} is not an http(s) URL; {example}")
    if port is not None and not 0 < port <= 65535:
        raise ToolError(Exit.USAGE, f"{option} {value!r}: {port} is not a TCP port")
    return value.rstrip("/")


def seconds(option: str, value: float, *, zero: str | None = None) -> float:
    """``value`` if it is a finite number of seconds > 0, or 0 where ``zero`` says what 0
    means ("never")."""
    if math.isfinite(value) and (value > 0 or (value == 0 and zero is not None)):
        return value
    wanted = f">= 0 (0: {zero})" if zero is not None else "> 0"
    raise ToolError(Exit.USAGE, f"{option} {value:g}: takes a finite number of seconds {wanted}")
