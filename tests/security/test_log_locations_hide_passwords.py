"""A PostgreSQL log's password is never printed: not in ``serve``'s listening line (text and
``--json``), not in its ``serve.listening`` log line, not in any error of ``serve`` or
``verify``, whether it sits in the URL's user part or in its query string (``?password=``,
which libpq and asyncpg both read). Every place that prints a log location goes through
``evlog.locations.describe``.

Before: the listening line echoed ``--db`` as given (password and all), and ``describe`` kept
a ``?password=`` value, so the log line and the errors of both commands showed it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evlog.locations import describe, redacted, shown
from tests.security.runs import assert_no_secret_in, command, listening

USER_PASSWORD = "pg-user-part-s3cret"
QUERY_PASSWORD = "pg-query-s3cret"
SECRETS = (USER_PASSWORD, QUERY_PASSWORD)


@pytest.mark.parametrize(
    ("location", "printed"),
    [
        ("postgresql://u:pw@h:5/db", "postgresql://u:***@h:5/db"),
        (
            "postgresql://u@h/db?password=pw&sslmode=disable",
            "postgresql://u@h/db?password=***&sslmode=disable",
        ),
        (
            "postgres://u@h/db?sslmode=require&SSLPassword=pw",
            "postgres://u@h/db?sslmode=require&SSLPassword=***",
        ),
        ("postgresql://u:pw@[::1/db?password=pw", "postgresql://***@[::1/db?password=***"),
        (
            "postgresql://u@h/db?application_name=a%26b",
            "postgresql://u@h/db?application_name=a%26b",
        ),
    ],
)
def test_describe_removes_every_password_of_a_url(location: str, printed: str) -> None:
    assert describe(location) == printed
    assert shown(location) == printed


def test_redacted_removes_the_password_of_any_url_and_keeps_other_text() -> None:
    assert redacted("http://ops:pw@h:1/x?a=1") == "http://ops:***@h:1/x?a=1"
    assert redacted("https://h/?password=pw") == "https://h/?password=***"
    assert redacted("/var/ledger.db") == "/var/ledger.db"


def test_a_sqlite_location_is_shown_as_given() -> None:
    assert shown("sqlite:///var/ledger.db") == "sqlite:///var/ledger.db"
    assert describe("sqlite:///var/ledger.db") == "/var/ledger.db"


def _with_passwords(postgres_url: str, database: str | None = None) -> str:
    """``postgres_url`` (a trusting throwaway server: any password is accepted) with a password
    in its user part and another in its query string."""
    scheme, _, rest = postgres_url.partition("://")
    user, _, where = rest.partition("@")
    if database is not None:
        where = where.rsplit("/", 1)[0] + "/" + database
    return f"{scheme}://{user}:{USER_PASSWORD}@{where}?password={QUERY_PASSWORD}"


def test_serve_and_verify_never_print_the_log_password(postgres_url: str, tmp_path: Path) -> None:
    url = _with_passwords(postgres_url)
    with listening(tmp_path, "serve-json", "serve", "--db", url, "--port", "0", "--json") as (
        _,
        row,
    ):
        assert isinstance(row, dict) and row["row"] == "listening"
        assert row["db"] == describe(url)
    with listening(
        tmp_path, "serve-text", "-v", "serve", "--db", url, "--port", "0", json_row=False
    ) as (
        _,
        line,
    ):
        assert f"(log {describe(url)}," in str(line)
    assert "serve.listening" in (tmp_path / "serve-text.err").read_text()

    verified = command(tmp_path, "verify", "verify", url, "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout.splitlines()[-1])["path"] == describe(url)

    missing = _with_passwords(postgres_url, database="no_such_database")
    refused = command(tmp_path, "verify-missing", "verify", missing)
    assert refused.returncode != 0 and "no_such_database" in refused.stdout + refused.stderr
    failed = command(tmp_path, "serve-missing", "serve", "--db", missing, "--port", "0")
    assert failed.returncode != 0 and "no_such_database" in failed.stdout + failed.stderr
    assert_no_secret_in(tmp_path, SECRETS)
