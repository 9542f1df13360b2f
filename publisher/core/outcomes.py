"""Outcomes: what an accepted command answers. Small frozen structs, one tagged union, so an
outcome can be stored under a client ``command_id`` and returned again, byte for byte."""

from __future__ import annotations

import msgspec


class Outcome(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


class Done(Outcome, frozen=True):
    """A command whose only answer is that it took effect (or already had: ``no_op``)."""

    no_op: bool = False


class Allocated(Outcome, frozen=True):
    """``no_op``: the id is already completed (never reloads, never moves the default).
    ``resumed``: the id is LOADING and this is the same attempt."""

    version_id: int
    lora_name: str
    digest: str
    attempt: int
    fleet: tuple[str, ...]
    state: str
    no_op: bool = False
    resumed: bool = False


class Skipped(Outcome, frozen=True):
    """Refused before any byte moved, recorded, and reported to the trainer as SKIPPED."""

    version_id: int
    code: str
    message: str


class Claimed(Outcome, frozen=True):
    version_id: int
    attempt: int
    owner: str


class Published(Outcome, frozen=True):
    version_id: int
    lora_name: str
    revision: int
    retired: int | None
    no_op: bool = False


class AttemptEnded(Outcome, frozen=True):
    version_id: int
    attempt: int
    state: str


class Bound(Outcome, frozen=True):
    """``new`` is False when the session was already bound (the same binding forever)."""

    session: str
    version_id: int
    lora_name: str
    digest: str
    revision: int
    new: bool


class Released(Outcome, frozen=True):
    """``released`` tells whether a binding existed (False for a retry or close-before-bind).
    ``tombstoned``: this call wrote the session's tombstone (a release of its binding, or a
    close before any bind); False when someone else had already released it, so a relay
    knows which tombstones are its own to forget."""

    session: str
    released: bool
    version_id: int | None = None
    tombstoned: bool = False


class Forgotten(Outcome, frozen=True):
    count: int


class Expired(Outcome, frozen=True):
    owner: str
    released: int


class Deregistered(Outcome, frozen=True):
    """A clean exit: ``released`` sessions still bound were released (``owner_exited``);
    ``no_op``: this incarnation had already ended (deregistered, or its lease expired)."""

    owner: str
    released: int
    no_op: bool = False


class ReclaimGranted(Outcome, frozen=True):
    version_id: int
    lora_name: str
    engines: tuple[str, ...]


class UnloadRecorded(Outcome, frozen=True):
    version_id: int
    engine: str
    reclaimed: bool


class InventoryRecorded(Outcome, frozen=True):
    """``no_op``: the inventory matched what the ledger knew, so nothing was written."""

    engine: str
    resolved: tuple[int, ...] = ()
    reclaimed: tuple[int, ...] = ()
    strays: tuple[str, ...] = ()
    no_op: bool = False


AnyOutcome = (
    Done
    | Allocated
    | Skipped
    | Claimed
    | Published
    | AttemptEnded
    | Bound
    | Released
    | Forgotten
    | Expired
    | Deregistered
    | ReclaimGranted
    | UnloadRecorded
    | InventoryRecorded
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyOutcome)


def encode_outcome(outcome: Outcome) -> bytes:
    return _encoder.encode(outcome)


def decode_outcome(blob: bytes) -> AnyOutcome:
    return _decoder.decode(blob)
