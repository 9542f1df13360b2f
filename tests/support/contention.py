"""Running the tests under CPU contention: ``pytest --contend N``.

A test that passes only when the scheduler is kind (a count compared after a wait, a sleep
that "should be enough") passes on an idle machine and fails on a loaded CI runner. To find
such tests before CI does, ``--contend N`` starts N busy processes for the whole run, each
pinned to one of the cores this process may use (round-robin, ``os.sched_setaffinity`` where
the platform has it), at the same priority as the tests: with N equal to the number of cores
every test shares each core with a spinning process. They are stopped by their PIDs when the
run ends, and each also exits by itself once its parent is gone (a run killed with -9 leaves
no spinner behind on a shared machine). The header of the run names them.

Nothing else changes: the same tests, the same timeouts. RELIABILITY.md says how the suite was
run this way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import suppress

import pytest

# Spins until its parent (the test run) is gone, checking every few million iterations.
_SPIN = (
    "import os\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(2_000_000):\n"
    "        pass\n"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="run the tests next to N busy processes pinned to this run's cores (round-robin)",
    )


class Contenders:
    """The busy processes of one run, started at configure and stopped by PID at unconfigure."""

    def __init__(self, count: int) -> None:
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pinned: list[int | None] = []
        for i in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-c", _SPIN],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.procs.append(proc)
            core = self.cores[i % len(self.cores)] if self.cores else None
            if core is not None:
                os.sched_setaffinity(proc.pid, {core})
            self.pinned.append(core)

    def describe(self) -> str:
        where = ", ".join(
            f"{p.pid}" + (f" on core {core}" if core is not None else "")
            for p, core in zip(self.procs, self.pinned, strict=True)
        )
        return f"contention: {len(self.procs)} busy processes ({where})"

    def stop(self) -> None:
        for proc in self.procs:
            with suppress(ProcessLookupError):
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)


_KEY = pytest.StashKey[Contenders]()


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("--contend")
    if count < 0:
        raise pytest.UsageError(f"--contend takes a number of processes >= 0, not {count}")
    if count:
        contenders = Contenders(count)
        config.stash[_KEY] = contenders
        config.add_cleanup(contenders.stop)


def pytest_report_header(config: pytest.Config) -> str | None:
    contenders = config.stash.get(_KEY, None)
    return None if contenders is None else contenders.describe()
