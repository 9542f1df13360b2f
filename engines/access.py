"""Who may call which route: bearer tokens with roles, and a policy of route -> roles.

Least privilege. In agentic RL the rollout side runs model-written code next to its
credentials; a token that can generate must not also publish, suspend an engine or release
other clients' sessions. So each token a server accepts has one **role**, and each route a
:class:`Rule` naming the roles that may call it (the table is ``tools/roles.py``'s, one data
structure the apps consult, documented in docs/operations.md, "Roles").

Decided from the headers alone, before the body is read or anything is written:

1. a route open to anyone (``/health``; the reads unless ``--private-reads``) is answered;
2. a server with no token at all answers ``403 WRITES_DISABLED`` (there is no anonymous
   write mode to forget about);
3. a missing or unknown token is ``401 UNAUTHORIZED``;
4. a known token whose role the route does not list is ``403 FORBIDDEN``, naming the roles
   needed and the caller's.

The given token is compared in constant time against **every** configured token (no early
exit), so the answer's timing does not tell which token, or how much of one, matched.

Lives beside :mod:`engines.guard` (the other checks every loraledger HTTP server shares) so
that both ``serve``'s routes (``tools/``) and the OpenAI face (``publisher/openai``) can use it.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from engines.guard import check_token, token_lines

OPERATOR = "operator"
TRAINER = "trainer"
ROLLOUT = "rollout"
GATEWAY = "gateway"
ROLES = (OPERATOR, TRAINER, ROLLOUT, GATEWAY)

UNAUTHORIZED = "UNAUTHORIZED"
FORBIDDEN = "FORBIDDEN"
WRITES_DISABLED = "WRITES_DISABLED"


class Rule(msgspec.Struct, frozen=True):
    """Who may call one route: ``roles``; with ``open``, anyone, no token needed; with
    ``read``, anyone unless the server keeps its reads private (then ``roles``)."""

    roles: frozenset[str]
    open: bool = False
    read: bool = False


class Denied(msgspec.Struct, frozen=True):
    """A refusal: the HTTP status, a machine code, a message naming the problem (never a token)
    and the details (``needed``, ``role``) each server puts in its own error shape."""

    status: int
    code: str
    message: str
    details: dict[str, Any] = {}


class TokenBook:
    """The tokens a server accepts, each with its role: the operator token (``--token``,
    ``--token-file``, ``LORALEDGER_TOKEN``) and the ``--tokens`` file's ``(role, token)``."""

    def __init__(self, operator: str | None, others: Sequence[tuple[str, str]] = ()) -> None:
        entries = [(OPERATOR, operator)] if operator else []
        entries += list(others)
        self._entries = tuple((token.encode(), role) for role, token in entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def role_of(self, authorization: str) -> str | None:
        """The role of the bearer token in an ``Authorization`` header value, None if it is
        not one of the book's. Every token is compared, in constant time, whatever matches."""
        scheme, _, given = authorization.partition(" ")
        presented = given.encode()
        found = None
        for token, role in self._entries:
            if hmac.compare_digest(presented, token):
                found = role
        return found if scheme.lower() == "bearer" else None


class Access:
    """A :class:`TokenBook` and a policy (route -> :class:`Rule`, routes named
    ``"METHOD /path/{param}"``): :meth:`check` decides a request from its headers."""

    def __init__(
        self, book: TokenBook, policy: Mapping[str, Rule], *, private_reads: bool = False
    ) -> None:
        self.book = book
        self.policy = policy
        self.private_reads = private_reads

    def check(self, route: str, authorization: str) -> Denied | None:
        """None when a request to ``route`` with this ``Authorization`` value may proceed."""
        rule = self.policy[route]  # a route missing from the policy is a bug: KeyError
        if rule.open or (rule.read and not self.private_reads):
            return None
        if not self.book:
            return Denied(
                403,
                WRITES_DISABLED,
                "this service was started without a token: its routes that need one are off "
                "(restart it with LORALEDGER_TOKEN, --token-file or --tokens)",
            )
        role = self.book.role_of(authorization)
        if role is None:
            return Denied(401, UNAUTHORIZED, "a valid bearer token is required for this route")
        if role in rule.roles:
            return None
        needed = sorted(rule.roles)
        return Denied(
            403,
            FORBIDDEN,
            f"{route} needs the {' or '.join(needed)} role; this token's role is {role}",
            {"needed": needed, "role": role},
        )


def read_tokens(path: str | Path) -> tuple[tuple[str, str], ...]:
    """The ``(role, token)`` pairs of a ``--tokens`` file: one ``ROLE TOKEN`` per line, blank
    lines and ``#`` comments skipped, fields after the second ignored (a note), read as every
    token file is (:func:`engines.guard.token_lines`).

    Refused (``ValueError`` naming the line, never showing a token): an unknown role, a line
    without a token, a token no HTTP header can carry, one token under two roles (a caller
    would hold whichever the server happened to match), a file with no token at all."""
    text = Path(path).read_text(encoding="utf-8")
    pairs: list[tuple[str, str]] = []
    seen: dict[str, tuple[int, str]] = {}
    for number, fields in token_lines(text):
        where = f"tokens file {path} line {number}"
        role = fields[0]
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role[:40]!r} (roles: {', '.join(ROLES)})")
        if len(fields) < 2:
            raise ValueError(f"{where}: role {role} has no token (expected ROLE TOKEN)")
        token = fields[1]
        check_token(token, where)
        if token in seen and seen[token][1] != role:
            first, other = seen[token]
            raise ValueError(
                f"{where}: the token of role {role} is also role {other}'s (line {first}): "
                "a token has one role"
            )
        seen.setdefault(token, (number, role))
        pairs.append((role, token))
    if not pairs:
        raise ValueError(f"tokens file {path} holds no token (only blanks or # comments)")
    return tuple(pairs)


def check_tokens(operator: str | None, others: Sequence[tuple[str, str]]) -> None:
    """The operator token must not also be another role's (``ValueError``, no token shown)."""
    for role, token in others:
        if operator is not None and role != OPERATOR and hmac.compare_digest(token, operator):
            raise ValueError(
                f"the operator token (LORALEDGER_TOKEN, --token-file) is also a {role} token in "
                "--tokens: a token has one role"
            )
