"""Times and durations as an operator types and reads them.

Times print as ISO 8601 in UTC with milliseconds (``2026-11-30T09:19:31.123Z``): one zone for
every machine and every log, and exactly what ``--at`` accepts back, so a time copied from any
output replays that moment. ``--at`` also takes unix seconds (what ``recorded_at`` stores) and
ISO with an explicit offset; an ISO time without a zone is read as UTC (never the local zone of
whoever runs the command, which would make the same command mean different moments).

A time written to some precision means all of it: ``...:53.765Z`` is the whole millisecond
that printed that way (times print truncated), ``13:06:13`` the whole second, ``13:06`` the
whole minute. So ``--at`` with a time copied from any output includes the record that printed
it. Unix seconds are exact.

Two shorter forms need the log to mean something, so :func:`parse_at` turns them into a
function of the log's last record time (:func:`resolve_at`):

* a **time of day** (``13:06``, ``13:06:13``, ``13:06:13.250``, optionally ``Z``): UTC, on the
  UTC date of the log's last record (the day an on-call engineer is looking at; for an earlier
  day give the full ISO time);
* a **relative** time (``-5m``, ``-2h``, ``-30s``, ``-1.5h``): that long before the log's last
  record, not before the wall clock now, so the same command on a copy of the log means the
  same moment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, time

from tools.exitcodes import Exit, ToolError

_FIRST_S = datetime(1, 1, 1, tzinfo=UTC).timestamp()  # what a time can be printed as
_LAST_S = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_time(text: str) -> float:
    """Unix seconds from ``1764494371.5`` or ``2026-11-30T09:19:31Z`` / ``...+01:00``."""
    raw = text.strip()
    try:
        seconds = float(raw)
    except ValueError:
        pass
    else:
        # NaN compares false with every record (a replay ran to the end and said so), and
        # infinity or 1e30 cannot be printed as a time: both are a mistake in what was typed
        if not (math.isfinite(seconds) and _FIRST_S <= seconds <= _LAST_S):
            raise ToolError(
                Exit.USAGE,
                f"cannot read time {text!r}: unix seconds must be a finite number between "
                f"{_FIRST_S:.0f} and {_LAST_S:.0f} (years 1 to 9999)",
            )
        return seconds
    iso = raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise ToolError(
            Exit.USAGE,
            f"cannot read time {text!r}: give unix seconds, ISO 8601 (e.g. "
            "2026-11-30T09:19:31Z), a time of day (13:06:13, UTC on the log's last day) or a "
            "relative time (-5m: before the log's last record)",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


_TIME_OF_DAY = re.compile(r"^\d{1,2}:\d{2}(:\d{2}(\.\d{1,6})?)?[Zz]?$")

# When --at is resolved against the log: the last record's time -> the moment meant.
AtResolver = Callable[[float], float]


def parse_at(text: str) -> AtResolver:
    """What ``--at`` means, as a function of the log's last record time: a time of day (on
    that record's UTC date), a relative ``-5m`` (before it), or an absolute time (unix seconds,
    ISO 8601: the log does not matter). Bad input is a usage error, raised here, before the
    log is opened."""
    raw = text.strip()
    if raw.startswith("-") and not _is_number(raw):
        back = parse_duration(raw[1:])
        return lambda last: last - back
    if _TIME_OF_DAY.match(raw):
        try:
            clock = time.fromisoformat(raw.rstrip("Zz"))
        except ValueError:
            raise ToolError(
                Exit.USAGE, f"cannot read time of day {text!r}: use HH:MM[:SS]"
            ) from None

        def on_the_logs_day(last: float) -> float:
            day = datetime.fromtimestamp(last, tz=UTC).date()
            return _through(datetime.combine(day, clock, tzinfo=UTC).timestamp(), raw)

        return on_the_logs_day
    moment = parse_time(raw) if _is_number(raw) else _through(parse_time(raw), raw)
    return lambda last: moment


_WRITTEN_TIME = re.compile(r"\d{1,2}:\d{2}(?::\d{2}(?:\.(\d+))?)?")


def _through(moment: float, text: str) -> float:
    """The last instant ``text`` (which parsed to ``moment``) can mean: the end of the
    minute, second or fraction it was written to (see the module docstring)."""
    written = _WRITTEN_TIME.search(text)
    if written is None:  # a date alone: its midnight
        return moment
    digits = written.group(1)
    if digits is not None:
        step = 10.0 ** -len(digits)
    else:
        step = 1.0 if written.group(0).count(":") == 2 else 60.0
    return math.nextafter(moment + step, -math.inf)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_duration(text: str) -> float:
    """Seconds from ``60``, ``60s``, ``250ms``, ``5m``, ``1.5h``, ``2d``."""
    match = _DURATION.match(text)
    if match is None:
        raise ToolError(Exit.USAGE, f"cannot read duration {text!r}: use e.g. 60s, 250ms, 5m, 1.5h")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def iso(at: float | None) -> str:
    if at is None:
        return "-"
    moment = datetime.fromtimestamp(at, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def span(seconds: float | None) -> str:
    """A short human duration: ``850ms``, ``12.3s``, ``4m05s``, ``2h10m``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        minutes, secs = divmod(round(seconds), 60)
        return f"{minutes}m{secs:02d}s"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m"
