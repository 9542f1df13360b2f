"""Fixtures for the CLI tests: real logs written by the real ledger, and two ways to run the
real command (in process through typer's runner, or the installed console script)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from tests.tools.scenario import write_fault_run_sync, write_health_run
from tools.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def fault_log_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault run of ``scenario.py``, written once per test session (read-only: copy it
    with the ``fault_log`` fixture before changing it)."""
    return write_fault_run_sync(tmp_path_factory.mktemp("fault") / "fault.db")


@pytest.fixture
def fault_log(fault_log_master: Path, tmp_path: Path) -> Path:
    """A private copy of the fault run (the writer closed it, so the file is complete)."""
    copy = tmp_path / "fault.db"
    shutil.copyfile(fault_log_master, copy)
    return copy


@pytest.fixture(scope="session")
def health_log_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The health run of ``scenario.py`` (read-only: copy it with ``health_log``)."""
    return anyio.run(write_health_run, tmp_path_factory.mktemp("health") / "health.db")


@pytest.fixture
def health_log(health_log_master: Path, tmp_path: Path) -> Path:
    """A private copy of the health run."""
    copy = tmp_path / "health.db"
    shutil.copyfile(health_log_master, copy)
    return copy


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
