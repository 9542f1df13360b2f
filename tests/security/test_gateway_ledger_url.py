"""``loraledger gateway --ledger URL`` never prints a password the URL holds: not in its
listening line, its log or its errors (the rule of ``evlog.locations.describe``, for any URL).

Before: the gateway's listening line, its ``gateway.listening`` log line and its "the ledger at
URL refused" / "cannot be reached" errors printed ``--ledger`` as given."""

from __future__ import annotations

from pathlib import Path

from evlog.locations import redacted
from tests.security.runs import assert_no_secret_in, command, listening

PASSWORD = "pr0xy-passw0rd"
TOKEN = "ledger-t0ken"


def test_the_rule_covers_a_service_url() -> None:
    assert redacted(f"http://u:{PASSWORD}@h:1/x?password={PASSWORD}&a=b") == (
        "http://u:***@h:1/x?password=***&a=b"
    )
    assert redacted("http://127.0.0.1:8765") == "http://127.0.0.1:8765"


def test_a_gateway_refused_by_its_ledger_does_not_print_the_urls_password(tmp_path: Path) -> None:
    """The user part of the URL makes the HTTP client send it as Basic credentials: serve
    refuses them, and the gateway's error names the ledger, its password removed."""
    db = tmp_path / "ledger.db"
    with listening(tmp_path, "serve", "serve", "--db", str(db), "--port", "0", "--json",
                   LORALEDGER_TOKEN=TOKEN) as (_, row):  # fmt: skip
        assert isinstance(row, dict)
        ledger = str(row["url"]).replace("http://", f"http://op:{PASSWORD}@")
        done = command(
            tmp_path, "gateway", "gateway", "--ledger", ledger, "--port", "0",
            LORALEDGER_TOKEN=TOKEN,
        )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "op:***@127.0.0.1" in done.stderr, done.stderr
    assert_no_secret_in(tmp_path, [PASSWORD, TOKEN])
