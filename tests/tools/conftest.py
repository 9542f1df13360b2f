"""Fixtures for the CLI tests: two ways to run the real command (in process through typer's
runner, or the installed console script). The logs they read come from the shared fixtures
(``fault_log``, ``health_log``: tests/support/fixtures.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.paths import REPO
from tools.cli import app


class Cli:
    """``loraledger ...`` in process: exit code, stdout and stderr kept apart."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
        result = self.runner.invoke(app, [os.fspath(a) for a in args], catch_exceptions=False)
        return subprocess.CompletedProcess(
            args=list(args), returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr
        )


@pytest.fixture
def cli() -> Cli:
    return Cli()


def console_script() -> list[str]:
    """The installed ``loraledger`` entry point of this interpreter's environment."""
    script = Path(sys.executable).with_name("loraledger")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from tools.cli import main; main()"]


def script_env(**extra: str) -> dict[str, str]:
    """The environment for the console script: this tree first on the import path, so the
    code under test runs (an editable install would otherwise import its own checkout)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_script(
    *args: str | os.PathLike[str], timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*console_script(), *(os.fspath(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=script_env(),
    )
