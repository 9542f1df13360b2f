"""The Ray engine book is keyed by deployment, never by the log's URL: the key holds no
password, and a rotated password names the same book. (On Ray's real key-value store, with a
book written under the old key: tests/publisher/ray/test_engine_book.py.)

Before: the key was ``engine-book/NS/NAME/<the log location as given>``, a PostgreSQL password
in clear in the GCS, and a new password found no book."""

from __future__ import annotations

from publisher.ray.engine_book import EngineBook


def test_the_book_key_holds_no_password_and_survives_a_rotation() -> None:
    before = "postgresql://ledger:pw-before@db:5432/ledger?password=pw-before-q"
    after = "postgresql://ledger:pw-after@db:5432/ledger?password=pw-after-q"
    book = EngineBook("ledger", "prod", "default", log_location=before)
    assert "pw-before" not in book.key
    assert EngineBook("ledger", "prod", "default", log_location=after).key == book.key
    assert EngineBook("ledger", "prod", "other", log_location=before).key != book.key
