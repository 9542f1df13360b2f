"""``--tokens FILE``: one ``ROLE TOKEN`` per line, read as every token file is (blank lines and
``#`` comments skipped, fields after the second ignored). A file that would leave a caller
with a role nobody meant is refused at start, naming the line and never the token: an unknown
role, a role without a token, one token under two roles (the operator's included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.access import TokenBook, read_tokens
from tests.security.runs import assert_no_secret_in, command

SECRET = "s3cret-t0ken"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokens"
    path.write_text(text, encoding="utf-8")
    return path


def test_each_line_is_a_role_and_its_token(tmp_path: Path) -> None:
    text = "# role token note\n\nrollout  ro-1  the workers\n   trainer tr-1\ngateway gw-1 # x\n"
    pairs = read_tokens(_file(tmp_path, text))
    assert pairs == (("rollout", "ro-1"), ("trainer", "tr-1"), ("gateway", "gw-1"))
    book = TokenBook("op-1", pairs)
    assert [book.role_of(f"Bearer {t}") for t in ("op-1", "ro-1", "tr-1", "gw-1")] == [
        "operator",
        "rollout",
        "trainer",
        "gateway",
    ]
    assert book.role_of("Bearer ro-") is None and book.role_of("Basic ro-1") is None
    assert book.role_of("") is None and not TokenBook(None)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (f"# roles\nrollout {SECRET}\nadmin {SECRET}x\n", 3, "unknown role 'admin'"),
        (f"rollout {SECRET}\ntrainer\n", 2, "role trainer has no token"),
        (f"rollout {SECRET}\n\ntrainer {SECRET}\n", 3, "also role rollout's (line 1)"),
        ("rollout caf\u00e9\n", 1, "an HTTP header cannot carry it"),
    ],
)
def test_a_bad_line_is_refused_naming_it_and_not_the_token(
    tmp_path: Path, text: str, line: int, reason: str
) -> None:
    with pytest.raises(ValueError, match=f"line {line}:") as refused:
        read_tokens(_file(tmp_path, text))
    message = str(refused.value)
    assert f"line {line}:" in message and reason in message, message
    assert SECRET not in message and "caf\u00e9" not in message


def test_a_file_without_a_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no token"):
        read_tokens(_file(tmp_path, "# nothing yet\n\n"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"operator x\nrollout {SECRET}\nwizard {SECRET}2\n", "line 3: unknown role 'wizard'"),
        (f"rollout {SECRET}\n", "the operator token (LORALEDGER_TOKEN, --token-file) is also"),
    ],
)
@pytest.mark.parametrize("cmd", ["serve", "gateway"])
def test_serve_and_gateway_refuse_to_start_on_a_bad_tokens_file(
    tmp_path: Path, text: str, expected: str, cmd: str
) -> None:
    """Exit 2 before anything exists (no log file), the line named, no token in any output.
    The second file gives the operator's token (``LORALEDGER_TOKEN``) a rollout role too."""
    tokens = _file(tmp_path, text)
    where = ["--db", str(tmp_path / "ledger.db")] if cmd == "serve" else ["--ledger", "http://h:9"]
    done = command(
        tmp_path, cmd, cmd, *where, "--port", "0", "--tokens", str(tokens),
        LORALEDGER_TOKEN=SECRET,
    )  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert expected in done.stderr, done.stderr
    assert not (tmp_path / "ledger.db").exists()
    assert_no_secret_in(tmp_path, [SECRET])
