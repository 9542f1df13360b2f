"""A token file holds one token: the first whitespace-separated field of its first line that
is neither blank nor a ``#`` comment, as every ``--token-file`` help says. A token no HTTP
header can carry is refused at start with a message that does not show it. ``status`` and
``fleet`` read the token from ``--token-file`` or ``LORALEDGER_TOKEN``; ``--token`` on argv
still works, with a warning on stderr.

Before: the whole file was the token. With a note or a rotated token kept under it, every
Authorization header was illegal and the HTTP client's error quoted it: ``serve`` logged the
engine token on every probe (``reconciler.probe_failed ... Illegal header value b'Bearer
…'``) and a gateway exited printing its token. ``status`` and ``fleet`` had only ``--token``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.guard import read_token
from tests.security.runs import assert_no_secret_in, command, listening

ENGINE_TOKEN = "engine-t0ken-live"
OLD_ENGINE_TOKEN = "engine-t0ken-rotated-out"
LEDGER_TOKEN = "ledger-t0ken-live"
OLD_LEDGER_TOKEN = "ledger-t0ken-rotated-out"
SECRETS = (ENGINE_TOKEN, OLD_ENGINE_TOKEN, LEDGER_TOKEN, OLD_LEDGER_TOKEN)


def _file(where: Path, text: str) -> Path:
    where.write_text(text, encoding="utf-8")
    return where


@pytest.mark.parametrize(
    "text",
    [
        "tok-1\n",
        "tok-1",
        "  tok-1   a note\n# old: tok-0\n",
        "# the ledger's token\n\n   \ntok-1\ntok-2\n",
        "tok-1\r\n",
    ],
)
def test_the_token_is_the_first_field_of_the_first_line_that_is_not_a_comment(
    text: str, tmp_path: Path
) -> None:
    assert read_token("UNSET_FOR_THIS_TEST", _file(tmp_path / "token", text)) == "tok-1"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # another\n"])
def test_a_file_without_a_token_is_refused(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no token"):
        read_token("UNSET_FOR_THIS_TEST", _file(tmp_path / "token", text))


def test_a_token_no_header_can_carry_is_refused_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="HTTP header cannot carry") as info:
        read_token("UNSET_FOR_THIS_TEST", _file(tmp_path / "token", "s3cret-tök\n"))
    assert "s3cret" not in str(info.value)
    monkeypatch.setenv("A_TOKEN_FOR_THIS_TEST", "s3cret\n# old s3cret-0")
    with pytest.raises(ValueError, match="A_TOKEN_FOR_THIS_TEST") as info:
        read_token("A_TOKEN_FOR_THIS_TEST", None)
    assert "s3cret" not in str(info.value)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Path, str, Path]]:
    """A real ``loraledger engine`` whose control routes want ``ENGINE_TOKEN``, and a real
    ``serve`` given that token and its own in files that keep the rotated-out token on a
    comment line; yields the run folder, serve's URL and serve's token file."""
    engine_file = _file(
        tmp_path / "engine.token", f"{ENGINE_TOKEN}\n# rotated: {OLD_ENGINE_TOKEN}\n"
    )
    ledger_file = _file(
        tmp_path / "ledger.token",
        f"# the ledger\n{LEDGER_TOKEN} since-monday\n# {OLD_LEDGER_TOKEN}\n",
    )
    with listening(
        tmp_path,
        "engine",
        "engine",
        "--id",
        "e0",
        "--port",
        "0",
        "--token-file",
        str(engine_file),
        "--json",
    ) as (_, engine):
        assert isinstance(engine, dict)
        with listening(
            tmp_path,
            "serve",
            "-v",
            "serve",
            "--db",
            str(tmp_path / "ledger.db"),
            "--port",
            "0",
            "--engine",
            f"e0=local:{engine['url']}",
            "--engine-token-file",
            str(engine_file),
            "--token-file",
            str(ledger_file),
            "--json",
        ) as (_, serve):
            assert isinstance(serve, dict)
            yield tmp_path, str(serve["url"]), ledger_file


def _routable(url: str, engine: str) -> bool:
    status = httpx.get(f"{url}/status", timeout=10, trust_env=False).json()
    return any(e["engine"] == engine and e["routable"] for e in status["engines"])


def test_serve_reaches_an_engine_with_a_token_file_and_never_logs_the_token(
    fleet: tuple[Path, str, Path],
) -> None:
    run, url, _ = fleet
    deadline = time.monotonic() + 60
    while not _routable(url, "e0"):  # its probes carry the engine token the file holds
        assert time.monotonic() < deadline, (run / "serve.err").read_text()[-2000:]
        time.sleep(0.1)
    assert "probe_failed" not in (run / "serve.err").read_text()
    assert_no_secret_in(run, SECRETS)


def test_status_and_fleet_take_the_token_from_a_file_or_the_environment(
    fleet: tuple[Path, str, Path],
) -> None:
    run, url, ledger_file = fleet
    by_file = command(
        run,
        "suspend",
        "fleet",
        "suspend",
        "e0",
        "--url",
        url,
        "--token-file",
        str(ledger_file),
        "--json",
    )
    assert by_file.returncode == 0, by_file.stdout + by_file.stderr
    assert "warning" not in by_file.stderr
    by_env = command(
        run,
        "resume",
        "fleet",
        "resume",
        "e0",
        "--url",
        url,
        "--json",
        LORALEDGER_TOKEN=LEDGER_TOKEN,
    )
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    live = command(
        run, "status", "status", "--url", url, "--token-file", str(ledger_file), "--json"
    )
    assert live.returncode == 0 and json.loads(live.stdout)["row"] == "status", live.stderr
    no_token = command(run, "suspend-refused", "fleet", "suspend", "e0", "--url", url)
    assert no_token.returncode != 0
    assert_no_secret_in(run, SECRETS)


def test_a_token_on_argv_still_works_with_a_warning(fleet: tuple[Path, str, Path]) -> None:
    run, url, _ = fleet
    on_argv = command(
        run, "suspend-argv", "fleet", "suspend", "e0", "--url", url, "--token", LEDGER_TOKEN
    )
    assert on_argv.returncode == 0, on_argv.stdout + on_argv.stderr
    assert "warning: --token is visible to every user" in on_argv.stderr
    status = command(run, "status-argv", "status", "--url", url, "--token", LEDGER_TOKEN, "--json")
    assert status.returncode == 0 and "warning: --token" in status.stderr


def test_a_gateway_reads_its_token_file_and_a_bad_one_is_a_clear_error(
    fleet: tuple[Path, str, Path],
) -> None:
    run, url, ledger_file = fleet
    with listening(
        run,
        "gateway",
        "gateway",
        "--ledger",
        url,
        "--token-file",
        str(ledger_file),
        "--port",
        "0",
        "--json",
    ) as (_, row):
        assert isinstance(row, dict) and row["row"] == "listening"
    bad = _file(run / "bad.token", f"{LEDGER_TOKEN}-tök\n")
    refused = command(
        run, "gateway-bad", "gateway", "--ledger", url, "--token-file", str(bad), "--port", "0"
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "HTTP header cannot carry" in refused.stderr
    assert_no_secret_in(run, SECRETS)
