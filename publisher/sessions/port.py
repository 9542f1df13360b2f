"""What a rollout worker needs of a ledger, and how its calls are retried after a lost reply.

The in-process :class:`~publisher.core.ledger.Ledger` is a :class:`LedgerPort`; so is a remote
ledger (:class:`~publisher.remote.client.RemoteLedger`, over HTTP or Ray). Every command a
worker sends (register, bind, release, forget, deregister) is idempotent in the ledger, so a
call whose reply was lost is simply asked again, as :class:`RetryPolicy` says: asking twice
cannot act twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from evlog.errors import LoraLedgerError, StoreCode
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.outcomes import Deregistered, Done, Outcome

# Refusals that only say "the write did not happen, ask again" (idempotent commands only).
RETRYABLE_CODES = frozenset({StoreCode.STORE_FAILED})
# Refusals that end an owner: its sessions are gone, it must not act any more.
OWNER_LOST_CODES = frozenset(
    {Code.LEASE_EXPIRED, Code.UNKNOWN_OWNER, Code.OWNER_RESTARTED, Code.OWNER_DEREGISTERED}
)


class LedgerPort(Protocol):
    """What a worker needs from the ledger: four calls, the same in process and remote."""

    async def register_owner(
        self,
        owner: str,
        *,
        ttl_s: float = ...,
        incarnation: str = ...,
        sessions_idle_s: float | None = ...,
        secret: str = ...,
    ) -> Done: ...

    async def deregister_owner(
        self, owner: str, *, incarnation: str = ..., secret: str = ...
    ) -> Deregistered: ...

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = ...,
        sessions: Iterable[str] = ...,
        secret: str = ...,
    ) -> None: ...

    async def execute_many(
        self, commands: Sequence[c.Command]
    ) -> list[Outcome | LoraLedgerError]: ...


@runtime_checkable
class ConfirmsLeases(Protocol):
    """A port whose ``renew_lease`` answers from memory (a remote ledger): it also offers the
    ledger's own answer about a life, awaited, which a worker asks for before each generation
    is sent (:meth:`~publisher.remote.client.RemoteLedger.confirm_lease`). The in-process
    ledger does not need it: its ``renew_lease`` is the ledger's answer."""

    async def confirm_lease(
        self, owner: str, *, incarnation: str = ..., secret: str = ...
    ) -> None: ...


@dataclass(frozen=True)
class RetryPolicy:
    """How idempotent ledger calls (register, bind, release, forget) are retried after a
    lost reply. ``transient`` are the exception types that mean "the reply was lost" for the
    port in use (a remote ledger's own: it raises ``ConnectionError`` for a lost reply)."""

    attempts: int = 6
    first_delay: float = 0.02
    max_delay: float = 1.0
    transient: tuple[type[BaseException], ...] = (OSError,)

    def delay(self, attempt: int) -> float:
        scale: int = 2**attempt  # typeshed types int ** int as Any (a negative power is a float)
        return min(self.max_delay, self.first_delay * scale)

    def retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, LoraLedgerError):
            return exc.code in RETRYABLE_CODES
        return isinstance(exc, self.transient)
