"""ActorLink: calls to a named Ray actor that survive its restart.

A caller of the ledger actor must ride out a restart (Ray restarting it after a crash, or an
operator killing and recreating it under the same name) without giving up and without acting
twice. Every call made through a link is therefore one the ledger treats as idempotent (a
duplicate input returns the earlier outcome or a recorded refusal; docs/events.md), and the link:

* resolves the actor by name (lazily, and again after the handle died: a recreated actor is a
  new actor behind the same name);
* retries a call that failed in transport (``RayActorError``: the actor died or is restarting,
  so the call may or may not have run) with backoff, for at most ``reconnect_timeout`` seconds
  from the first failure, then raises ``LedgerError(LEDGER_CLOSED)``;
* raises an exception the actor method itself raised as what it is (a ``LoraLedgerError``
  with its class and ``code``, an ``EngineError`` with its kind), not wrapped in Ray's
  ``RayTaskError``.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.to_thread
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from evlog.errors import INVALID_INPUT, InvalidInput
from publisher.core.errors import Code, LedgerError
from publisher.logs import get_logger

log = get_logger("loraledger.ray")

DEFAULT_NAMESPACE = "loraledger"

# What "the call may not have reached a live actor" looks like from the caller's side.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (RayActorError,)


def unwrap(exc: RayTaskError) -> BaseException:
    """The exception an actor method raised, as its own type (``RayTaskError.cause``)."""
    cause = exc.cause
    return cause if isinstance(cause, BaseException) else exc


class ActorLink:
    """A restart-tolerant path to the actor ``name`` in ``namespace``."""

    def __init__(
        self,
        name: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        reconnect_timeout: float = 60.0,
        handle: ActorHandle | None = None,
    ) -> None:
        if not (reconnect_timeout >= 0 and math.isfinite(reconnect_timeout)):
            raise InvalidInput(INVALID_INPUT, "reconnect_timeout must be a finite >= 0")
        self.name = name
        self.namespace = namespace
        self.reconnect_timeout = reconnect_timeout
        self._handle = handle
        self.reconnects = 0  # transport failures ridden out (observability, tests)

    async def handle(self) -> ActorHandle:
        if self._handle is None:
            # ray.get_actor is a blocking GCS lookup: keep it off the event loop.
            self._handle = await anyio.to_thread.run_sync(
                lambda: ray.get_actor(self.name, namespace=self.namespace)
            )
        return self._handle

    async def call(self, method: str, *args: Any) -> Any:
        """``await actor.<method>.remote(*args)``, retried across restarts (see the module
        docstring). Only use it for methods whose repetition is harmless."""
        deadline: float | None = None
        delay = 0.05
        while True:
            failure: BaseException
            try:
                handle = await self.handle()
            except ValueError as exc:  # ray.get_actor: no actor by that name (yet)
                failure = exc
            else:
                try:
                    return await getattr(handle, method).remote(*args)
                except RayTaskError as exc:
                    raise unwrap(exc) from None
                except TRANSPORT_ERRORS as exc:
                    failure = exc
                    if isinstance(exc, ActorDiedError):
                        self._handle = None  # maybe recreated under this name: look it up again
            now = anyio.current_time()
            if deadline is None:
                deadline = now + self.reconnect_timeout
                log.warning("ray.link_lost", actor=self.name, method=method, error=repr(failure))
            if now >= deadline:
                raise LedgerError(
                    Code.LEDGER_CLOSED,
                    f"actor {self.namespace}/{self.name} did not answer {method} within "
                    f"{self.reconnect_timeout:g}s: {failure!r}",
                    actor=self.name,
                ) from failure
            self.reconnects += 1
            await anyio.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(1.0, delay * 2)
