"""``loraledger serve`` and ``loraledger gateway`` take one option set
(``tools/service_options.py``): the same flags reach the same fields of both commands' options,
and a bad value of a shared option is refused by both, with the same exit code, naming the
option, before anything starts.

The commands run in process; what they would run (``tools.serve.serve``,
``tools.gateway.run_gateway``) is replaced by a recorder, so an option that slipped through
is a recorded start, not a server left running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

import tools.gateway
import tools.serve
from tests.tools.conftest import Cli
from tools.exitcodes import Exit
from tools.service_options import EngineSpec, ServiceOptions

TOKEN = "service-options-token"
ENGINE_TOKEN = "service-options-engine-token"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The options each command would have started with."""
    runs: list[Any] = []

    async def record(opts: Any, **kwargs: Any) -> None:
        runs.append(opts)

    monkeypatch.setattr(tools.serve, "serve", record)
    monkeypatch.setattr(tools.gateway, "run_gateway", record)
    monkeypatch.delenv("LORALEDGER_TOKEN", raising=False)
    monkeypatch.delenv("LORALEDGER_ENGINE_TOKEN", raising=False)
    return runs


def _command(name: str, tmp_path: Path) -> list[str | Path]:
    if name == "serve":
        return ["serve", "--db", tmp_path / "ledger.db"]
    return ["gateway", "--ledger", "http://127.0.0.1:9"]


def test_the_same_flags_reach_the_same_fields_of_both_commands(
    cli: Cli, tmp_path: Path, started: list[Any]
) -> None:
    token_file, engine_token_file = tmp_path / "token", tmp_path / "engine-token"
    token_file.write_text(TOKEN + "\n")
    engine_token_file.write_text(ENGINE_TOKEN + "\n")
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("# role token note\nrollout ro-1 a note\n\ntrainer tr-1\n")
    flags: list[str | Path] = [
        *("--host", "0.0.0.0", "--port", "0"),
        *("--token-file", token_file, "--engine-token-file", engine_token_file),
        *("--tokens", tokens_file),
        *("--engine", "e0=vllm:http://127.0.0.1:9", "--alias", "current"),
        *("--session-idle-s", "0", "--provenance", tmp_path / "rows.jsonl"),
        *("--max-connections", "7", "--header-timeout", "3"),
        *("--max-body-mb", "9", "--upstream-timeout-s", "11"),
    ]
    for command in ("serve", "gateway"):
        result = cli(*_command(command, tmp_path), *flags)
        assert result.returncode == 0, (command, result.stderr)
    expected = {
        "host": "0.0.0.0",
        "port": 0,
        "token": TOKEN,
        "tokens": (("rollout", "ro-1"), ("trainer", "tr-1")),
        "engine_token": ENGINE_TOKEN,
        "engines": (EngineSpec(engine_id="e0", kind="vllm", url="http://127.0.0.1:9"),),
        "alias": "current",
        "session_idle_s": 0.0,
        "provenance": str(tmp_path / "rows.jsonl"),
        "max_connections": 7,
        "header_timeout_s": 3.0,
        "max_body_mb": 9,
        "upstream_timeout_s": 11.0,
    }
    shared = {f.name for f in msgspec.structs.fields(ServiceOptions)}
    # Every shared option the command line takes is checked here; served_model and
    # artifact_root are serve's own flags (a gateway runs no in-process engine).
    assert shared - set(expected) == {"served_model", "artifact_root"}
    serve_opts, gateway_opts = started
    for name, value in expected.items():
        assert getattr(serve_opts, name) == value, ("serve", name)
        assert getattr(gateway_opts, name) == value, ("gateway", name)


def test_each_command_keeps_its_own_default_port(
    cli: Cli, tmp_path: Path, started: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORALEDGER_TOKEN", TOKEN)
    for command in ("serve", "gateway"):
        assert cli(*_command(command, tmp_path)).returncode == 0, command
    assert [opts.port for opts in started] == [8765, 8766]


@pytest.mark.parametrize("command", ["serve", "gateway"])
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--port", "70000"), "--port"),
        (("--max-connections", "0"), "--max-connections"),
        (("--session-idle-s", "-1"), "--session-idle-s"),
        (("--header-timeout", "inf"), "--header-timeout"),
        (("--max-body-mb", "0"), "--max-body-mb"),
        (("--upstream-timeout-s", "nan"), "--upstream-timeout-s"),
        (("--engine", "e0=nosuch:http://127.0.0.1:9"), "--engine"),
        (("--engine-token-file", "/nonexistent/t"), "--engine-token-file"),
    ],
)
def test_a_bad_shared_option_is_refused_by_both(
    cli: Cli,
    tmp_path: Path,
    started: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    flags: tuple[str, str],
    named: str,
) -> None:
    monkeypatch.setenv("LORALEDGER_TOKEN", TOKEN)
    result = cli(*_command(command, tmp_path), "--port", "0", *flags)
    assert result.returncode == Exit.USAGE, (result.returncode, result.stderr)
    assert named in result.stderr and "internal error" not in result.stderr
    assert started == []


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_both_refuse_to_listen_beyond_loopback_without_a_token(
    cli: Cli, tmp_path: Path, started: list[Any], command: str
) -> None:
    result = cli(*_command(command, tmp_path), "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == Exit.UNSAFE, (result.returncode, result.stderr)
    assert "without a token" in result.stderr
    assert started == []
