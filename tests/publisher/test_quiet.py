"""A library is quiet: a program that imports loraledger and uses it, without configuring any
logging, gets nothing on its stdout; once it configures the standard library's ``logging``,
loraledger's events arrive there (see ``publisher/logs.py`` for the rule and why).

Run in a fresh interpreter, so no structlog configuration left by another test (the CLI tests
configure it in process) can hide a print.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import structlog

from publisher.logs import get_logger, render
from tests.support.paths import REPO

PROGRAM = textwrap.dedent(
    """
    import asyncio, logging, sys, warnings

    warnings.simplefilter("ignore")  # peft's and transformers' own chatter is not ours
    from engines import LocalEngine, SamplingParams, make_adapter
    from evlog import SQLiteStore
    from publisher import ControlPlane, Fleet, Gateway, LocalView, RolloutWorker
    from publisher import TrainerClient

    async def main(workdir):
        async with (
            LocalEngine("e0") as engine,
            SQLiteStore.open(f"{workdir}/ledger.db") as store,
            ControlPlane.open(
                store, Fleet([engine]), deployment="quiet", prefix="policy", capacity=3,
                artifact_root=f"{workdir}/artifacts",
            ) as plane,
        ):
            trainer = TrainerClient(plane)
            config, tensors = make_adapter(1)
            await trainer.publish(tensors, config, step=1)
            gateway = Gateway(plane.fleet, LocalView(plane.ledger), gateway_id="g")
            plane.add_inflight_source(gateway)
            async with RolloutWorker.open(plane.ledger, gateway, owner="w") as worker:
                session = worker.session("s1")
                await session.generate("hello", SamplingParams(max_tokens=2))
                await session.close()
            sys.stderr.write("-- the application configures logging now --\\n")
            logging.basicConfig(stream=sys.stderr, level=logging.INFO)
            config, tensors = make_adapter(2)
            await trainer.publish(tensors, config, step=2)

    asyncio.run(main(sys.argv[1]))
    """
)


def test_using_the_library_prints_nothing_until_the_application_configures_logging(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    before, _, after = done.stderr.partition("-- the application configures logging now --")
    assert "loraledger." not in before, before[-2000:]
    assert "INFO:loraledger.publication:publication." in after, after[-2000:]


def test_render_is_one_key_value_line() -> None:
    line = render("publication.committed", {"version": 3, "name": "a b", "on": "e0", "e": ["e0"]})
    assert line == "publication.committed version=3 name='a b' on=e0 e=['e0']"


@pytest.fixture
def unconfigured_structlog() -> object:
    """A process where nobody configured logging: structlog at its defaults, and the stdlib root
    logger at its default level (an in-process CLI run earlier in the session may have set it)."""
    saved = structlog.get_config()
    was_configured = structlog.is_configured()
    root = logging.getLogger()
    root_level = root.level
    structlog.reset_defaults()
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(root_level)
    if was_configured:
        structlog.configure(**saved)


@pytest.mark.usefixtures("unconfigured_structlog")
def test_unconfigured_events_go_to_the_stdlib_logger(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    log = get_logger("loraledger.test")
    log.info("dropped.below_the_level", seq=1)
    with caplog.at_level(logging.INFO, logger="loraledger.test"):
        log.info("kept", seq=2)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed", seq=3)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "kept seq=2"),
        (logging.ERROR, "failed seq=3"),
    ]
    assert caplog.records[1].exc_info is not None
    assert caplog.records[0].filename == Path(__file__).name  # the caller, not the wrapper
    assert capsys.readouterr().out == ""


LIBRARY = ("evlog", "projections", "publisher", "engines")
CONFIGURES = re.compile(r"structlog\.(get_logger|configure)\(|logging\.basicConfig\(")


def test_library_modules_log_through_publisher_logs_only() -> None:
    """structlog's own loggers print to stdout unless configured, and configuring logging is
    the application's call: library code uses ``publisher.logs.get_logger`` instead."""
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for package in LIBRARY
        for path in sorted((REPO / package).rglob("*.py"))
        if path != REPO / "publisher" / "logs.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CONFIGURES.search(line)
    ]
    assert not offenders, offenders
