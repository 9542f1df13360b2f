"""The command surface: one console script, every subcommand documented, the exit codes
listed where a newcomer looks (``--help``)."""

from __future__ import annotations

import pytest

from tests.tools.conftest import Cli, run_script
from tools.exitcodes import Exit

COMMANDS = ("demo", "replay", "audit", "verify", "status", "serve", "bench")


def test_the_console_script_lists_every_command_and_the_exit_codes() -> None:
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert f" {command} " in result.stdout, command
    for code in Exit:
        assert f"{int(code)} " in result.stdout.replace("\n", " ")
    assert "loraledger demo" in result.stdout  # where to start


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "bench"])
def test_every_command_has_help(cli: Cli, command: str) -> None:
    result = cli(command, "--help")
    assert result.returncode == 0
    assert "--json" in result.stdout


def test_bench_lists_its_three_benchmarks(cli: Cli) -> None:
    result = cli("bench", "--help")
    assert result.returncode == 0
    for name in ("store", "ledger", "publish"):
        assert f" {name} " in result.stdout


def test_an_unknown_option_is_a_usage_error(cli: Cli) -> None:
    assert cli("verify", "--frobnicate").returncode == Exit.USAGE


def test_engine_is_listed_and_checks_its_options_before_loading_a_model(cli: Cli) -> None:
    assert " engine " in run_script("--help").stdout
    help_text = cli("engine", "--help").stdout
    assert "--json" in help_text and "--port" in help_text
    assert cli("engine", "--port", "70000").returncode == Exit.USAGE
    assert cli("engine", "--artifacts", "/no/such/dir").returncode == Exit.USAGE
