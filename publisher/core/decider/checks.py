"""The checks every aggregate shares.

The first two are the common steps of ``decide``: ``_well_typed`` (every field of its declared
type) and ``_fingerprint`` (what a ``command_id`` names). The rest validate what a command
names -- names, ids, digests, times, the deployment, a known version, a fleet member at its
current incarnation -- each raising the ``LedgerError`` of its step in docs/state-machine.md's
check-order table. Handlers call them in the table's order, so the first check that fails
answers, with the same code and message whichever command asked.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import msgspec

from projections.registry import EngineMember, RegistryState, VersionRecord
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerError

_command_encoder = msgspec.msgpack.Encoder()
_command_decoders: dict[type[c.Command], msgspec.msgpack.Decoder[c.Command]] = {}


def _well_typed(command: c.Command) -> c.Command:
    """The command with every field of its declared type (tuples as tuples), or the refusal.

    Commands built in Python are not type-checked by their constructor. A field of the wrong
    type (``Forget(sessions=None)``, a list where a string belongs, an int beyond 64 bits)
    used to raise inside a handler -- which stops the ledger's writer for every caller -- or
    to be written into an event that no longer decodes, so the log could not be replayed.
    A msgpack round trip checks the declared types and the encodable ranges in ~0.3 us."""
    cls = type(command)
    decoder = _command_decoders.get(cls)
    if decoder is None:
        decoder = _command_decoders[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(_command_encoder.encode(command))
    except (msgspec.ValidationError, OverflowError, TypeError, ValueError) as exc:
        code = Code.INVALID_VERSION if "$.version_id" in str(exc) else Code.INVALID_INPUT
        raise LedgerError(code, f"{cls.__name__}: {exc}", command=cls.__name__) from None


# Optional fields a command gained after logs existed. At their default they are left out of
# the fingerprint, so a ``command_id`` recorded before the field existed still names the same
# command when it is sent again (and is not refused as COMMAND_CONFLICT).
_FIELDS_ADDED_LATER: dict[str, object] = {
    "allow_rollback": False,
    "sessions_idle_s": None,
    "expect_version": None,
}
# ``incarnation`` came later to the owner and session commands only (the engine commands
# always had theirs, and their fingerprints include it).
_OWNER_FIELDS_ADDED_LATER: dict[str, object] = {"incarnation": ""}
_GAINED_AN_INCARNATION = (c.RegisterOwner, c.ExpireOwner, c.Bind, c.Release)


def _fingerprint(command: c.Command) -> str:
    body = msgspec.to_builtins(msgspec.structs.replace(command, command_id=None))
    later = dict(_FIELDS_ADDED_LATER)
    if isinstance(command, _GAINED_AN_INCARNATION):
        later.update(_OWNER_FIELDS_ADDED_LATER)
    for name, default in later.items():
        if name in body and body[name] == default:
            del body[name]
    body.pop("secret", None)  # an owner life's secret says who asks, not what; never logged
    return hashlib.sha256(msgspec.msgpack.encode(body)).hexdigest()[:32]


_IDENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _ident(value: Any, what: str) -> str:
    """Deployment, prefix and engine names: they end up inside immutable engine-side names,
    which must never contain ':' or '/' (or '@', the separator of the name itself)."""
    if not isinstance(value, str) or not _IDENT.match(value):
        raise LedgerError(
            Code.INVALID_INPUT, f"{what} {value!r} must match {_IDENT.pattern}", field=what
        )
    return value


def _key(value: Any, what: str) -> str:
    """Session and owner ids: any printable string up to 256 characters."""
    if not isinstance(value, str) or not value or len(value) > 256 or not value.isprintable():
        raise LedgerError(
            Code.INVALID_INPUT,
            f"{what} must be a non-empty printable string of at most 256 characters",
            field=what,
        )
    return value


def _is_str(value: Any, what: str) -> None:
    """The cheap part of :func:`_key`, enough before a lookup (an unhashable id must be a
    refusal, not a TypeError)."""
    if not isinstance(value, str):
        raise LedgerError(Code.INVALID_INPUT, f"{what} must be a string", field=what)


def _version_id(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LedgerError(
            Code.INVALID_VERSION, f"version id {value!r} must be a positive int", version_id=value
        )
    return value


def _digest(value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise LedgerError(Code.INVALID_INPUT, f"digest {value!r} is not 64 lowercase hex")
    return value


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LedgerError(Code.INVALID_INPUT, f"{what} {value!r} must be a finite number")
    return float(value)


def _deployment(s: RegistryState) -> None:
    if s.deployment is None:
        raise LedgerError(Code.NOT_INITIALIZED, "no deployment: create one first")


def _version(s: RegistryState, version_id: Any) -> VersionRecord:
    v = s.versions.get(_version_id(version_id))
    if v is None:
        raise LedgerError(Code.UNKNOWN_VERSION, f"version {version_id} is not known")
    return v


def _member(s: RegistryState, engine: Any) -> EngineMember:
    member = s.engines.get(engine)
    if member is None:
        raise LedgerError(Code.UNKNOWN_ENGINE, f"engine {engine!r} is not a fleet member")
    return member


def _current_incarnation(s: RegistryState, engine: str, incarnation: str) -> None:
    member = _member(s, engine)
    if member.incarnation != incarnation:
        raise LedgerError(
            Code.ENGINE_RESTARTED,
            f"engine {engine} is at incarnation {member.incarnation}, not {incarnation}",
            engine=engine,
        )


def _members(s: RegistryState, fleet: tuple[str, ...]) -> set[str]:
    """The engines of ``fleet`` that are still fleet members."""
    return {e for e in fleet if e in s.engines}
