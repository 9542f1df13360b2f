"""``--at`` takes back any time the tools print: a printed time is truncated to the
millisecond, so the moment it means is the whole of what was written (millisecond, second or
minute), and the record that printed it is included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.conftest import Cli
from tools.exitcodes import Exit, ToolError
from tools.timefmt import iso, parse_at

RECORDED = 1796197733.7659123  # sub-millisecond, as records are stored
LAST = RECORDED + 3600.0


@pytest.mark.parametrize(
    ("text", "covers"),
    [
        (iso(RECORDED), 0.001),  # 2026-12-02T...:53.765Z, as every tool prints it
        (iso(RECORDED)[11:], 0.001),  # the time of day of it (on the log's last day)
        (iso(RECORDED)[11:19], 1.0),  # HH:MM:SS: the whole second
        (iso(RECORDED)[11:16], 60.0),  # HH:MM: the whole minute
        (iso(RECORDED)[:19] + "+00:00", 1.0),  # ISO with an offset, to the second
    ],
)
def test_a_written_time_means_all_of_what_it_names(text: str, covers: float) -> None:
    meant = parse_at(text)(LAST)
    start = RECORDED - RECORDED % covers
    assert RECORDED <= meant < start + covers, (text, meant)


def test_unix_seconds_are_exact() -> None:
    assert parse_at(str(RECORDED))(LAST) == RECORDED
    assert parse_at("-5s")(LAST) == LAST - 5.0


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e30", "-1e30"])
def test_unix_seconds_that_are_no_time_are_a_usage_error(text: str) -> None:
    """``replay --at nan --json`` was exit 0 with the end-of-log state (no record compares
    before NaN), and without --json an internal error; ``inf`` and ``1e30`` an internal error
    (the title could not print them)."""
    with pytest.raises(ToolError) as info:
        parse_at(text)(LAST)
    assert info.value.exit_code == Exit.USAGE
    assert repr(text) in info.value.message and "unix seconds" in info.value.message


def test_replay_at_nan_is_refused(cli: Cli, fault_log: Path) -> None:
    for extra in ((), ("--json",)):
        result = cli("replay", fault_log, "--at", "nan", *extra)
        assert result.returncode == Exit.USAGE, (result.returncode, result.stdout)
        assert result.stdout == ""
