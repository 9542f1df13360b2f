"""Naming a log: one location string gives both the backend and where the log is.

* ``postgresql://user@host:5432/db`` (or ``postgres://``): a log on a PostgreSQL server that
  outlives any one node;
* ``sqlite:///abs/path.db``, ``sqlite://relative.db`` or a plain path: a SQLite file on this
  node's disk.

Anything else with a ``scheme://`` is refused (``INVALID_INPUT``) rather than taken for a file
name. Kept apart from :mod:`evlog.stores` (which opens them) so that a backend can name and
redact its own location without importing the opener.
"""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from evlog.errors import INVALID_INPUT, StoreError

SQLITE_PREFIX = "sqlite://"
POSTGRES_SCHEMES = ("postgresql", "postgres")

Backend = Literal["sqlite", "postgres"]


def backend_of(location: str | os.PathLike[str]) -> tuple[Backend, str]:
    """Which backend ``location`` names, and what that backend opens (a path or a URL)."""
    where = os.fspath(location)
    if where.startswith(SQLITE_PREFIX):
        return "sqlite", where[len(SQLITE_PREFIX) :]
    scheme, sep, _ = where.partition("://")
    if not sep:
        return "sqlite", where
    if scheme.lower() in POSTGRES_SCHEMES:
        return "postgres", where
    raise StoreError(
        INVALID_INPUT,
        f"unknown store location scheme {scheme!r}: use a file path, sqlite:// or postgresql://",
    )


def is_shared(location: str | os.PathLike[str]) -> bool:
    """True when the log lives on a server any node reaches (not on this node's disk)."""
    return backend_of(location)[0] == "postgres"


def describe(location: str | os.PathLike[str]) -> str:
    """``location`` fit for logs and messages: a URL's password removed, from its user part and
    from its query string (``?password=``, ``?sslpassword=``: the PostgreSQL client reads both).
    Every place that prints a log location goes through here, so there is one rule to keep."""
    backend, where = backend_of(location)
    if backend == "sqlite":
        return where
    return without_password(where)


def without_password(where: str) -> str:
    """A URL with its password removed from its user part and its query string (the rule of
    :func:`describe`, for any URL: also a service's, ``loraledger gateway --ledger``)."""
    try:
        parts = urlsplit(where)
        password = parts.password
    except ValueError:  # unparsable (``[::1`` unclosed): whatever precedes the last '@' goes
        scheme, _, rest = where.partition("://")
        _, at, tail = rest.rpartition("@")
        return _without_query_secrets(f"{scheme}://***@{tail}" if at else where)
    if password is not None:
        user, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    return _without_query_secrets(urlunsplit(parts))


def shown(location: str | os.PathLike[str]) -> str:
    """``location`` as the user gave it (``sqlite://`` prefix kept), its password removed: what
    a command echoes back (``serve``'s listening line)."""
    where = os.fspath(location)
    return describe(where) if is_shared(where) else where


# Query parameters libpq and asyncpg read as a password (matched case-insensitively).
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def _without_query_secrets(url: str) -> str:
    """``url`` with the value of every secret query parameter replaced by ``***``. Done on the
    raw text, parameter by parameter, so the rest of the query is left exactly as written."""
    head, mark, query = url.partition("?")
    if not mark:
        return url
    query, hash_mark, fragment = query.partition("#")
    kept = []
    for item in query.split("&"):
        name, equals, _ = item.partition("=")
        secret = unquote_plus(name).strip().lower() in _SECRET_PARAMETERS
        kept.append(f"{name}=***" if secret and equals else item)
    return f"{head}?{'&'.join(kept)}{hash_mark}{fragment}"
