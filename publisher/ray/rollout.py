"""RayRollout: a rollout worker that lives as long as its Ray actor, called from any method.

A rollout actor's methods are independent calls, but what they need -- a :class:`RayLedger`
client, a :class:`~publisher.gateway.Gateway` and a :class:`~publisher.sessions.RolloutWorker`
-- each own a task group (the client's senders and renewals, the worker's renewals and its
shared bind/release tasks), so they must live inside an ``async with`` that something keeps
open between calls. ``RayRollout`` keeps it open on a private event loop
(:class:`~publisher.ray.hosting.PortalHost`) and runs each call there::

    @ray.remote(num_cpus=0, max_restarts=1)
    class Rollout:
        def __init__(self, owner: str) -> None:
            self.rollout = RayRollout(owner)  # the ledger's engines; connects on first use

        async def episode(self, session_id: str, prompt: str) -> int:
            served = await self.rollout.generate(session_id, prompt, SamplingParams())
            await self.rollout.close_session(session_id)
            return served.version_id

        async def shutdown(self) -> None:
            await self.rollout.close()  # a clean exit: deregisters (not an incident)

Why it fits Ray's restarts: every ``RayRollout`` registers its owner id under a fresh
incarnation when it connects. When Ray restarts a crashed actor (``max_restarts``), the new
process builds a new ``RayRollout`` -- a new incarnation of the same owner id -- and the ledger
releases the predecessor's sessions at once (cause ``owner_restarted``) instead of letting them
pin their versions until the predecessor's lease runs out; if the predecessor is somehow still
running, it is fenced out (``OWNER_RESTARTED``). ``connect="eager"`` connects in the
constructor (blocking, as an actor's ``__init__`` may), so a restarted actor releases its
predecessor's sessions as soon as Ray restarts it, not at its first call.

:meth:`close` is the clean exit: sessions still open are released (``owner_exited``), the owner
deregisters, nothing is left for the lease expiry to find. An actor killed without it leaves
its sessions to the lease expiry (an incident), or to its next incarnation.

Every generation's provenance row goes to the ledger actor, which keeps it beside the log
(``RayLedger.provenance_sink``), so ``loraledger audit LOG --session S`` shows its turns.

Objects of the worker (binders, its task group) live on the private loop: reach them only
through these methods, or :meth:`run` for anything else (``run(fn, *args)`` awaits
``fn(worker, *args)`` there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread

from engines.contract import SamplingParams
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound, Deregistered, Released
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway, Served
from publisher.gateway.provenance import ProvenanceRecorder
from publisher.ray.client import RayLedger
from publisher.ray.engine import RayEngine
from publisher.ray.hosting import PortalHost, exit_process
from publisher.ray.ledger_actor import DEFAULT_LEDGER_NAME
from publisher.ray.link import DEFAULT_NAMESPACE
from publisher.sessions import RolloutWorker

R = TypeVar("R")
PROVENANCE_DRAIN_S = 30.0  # on close, how long rows still held wait for the ledger actor


@asynccontextmanager
async def _serve(
    owner: str,
    engines: tuple[RayEngine, ...] | None,
    ledger: str,
    namespace: str,
    client_options: Mapping[str, Any],
    worker_options: Mapping[str, Any],
) -> AsyncIterator[RolloutWorker]:
    async with RayLedger.connect(ledger, namespace=namespace, **client_options) as client:
        # By default the fleet is the ledger's (a mirror of its engine handles, refreshed when
        # an engine is added, replaced or removed); a failed engine call is reported to the
        # ledger either way, so its reconciler probes that engine at once.
        fleet = client.fleet if engines is None else Fleet(engines)
        # Every generation's provenance row goes to the ledger actor's store, beside the log.
        async with ProvenanceRecorder(
            client.provenance_sink(), drain_timeout_s=PROVENANCE_DRAIN_S
        ) as recorder:
            gateway = Gateway(
                fleet,
                client.view,
                gateway_id=owner,
                recorder=recorder,
                on_engine_trouble=client.engine_failed,
            )
            async with RolloutWorker.open(client, gateway, owner=owner, **worker_options) as worker:
                yield worker


class RayRollout:
    """One rollout worker (owner ``owner``) for the life of the Ray actor that holds it, routing
    over the ledger's engines (``engines=None``, the default: engines added, replaced or
    removed at runtime included) or over a fixed list of engine actors. ``connect``:
    ``"lazy"`` (at the first call, the default) or ``"eager"`` (now, blocking).
    ``client_options`` go to :meth:`RayLedger.connect` (``renew_interval``,
    ``reconnect_timeout``, ...), ``worker_options`` to :meth:`RolloutWorker.open`
    (``ttl_s``, ``idle_release_s``, ...; not ``incarnation``: each ``RayRollout`` is a new
    one). ``on_dead``: what to do if the worker stops on its own (default: end the process
    so Ray restarts the actor; see :class:`PortalHost`)."""

    def __init__(
        self,
        owner: str,
        engines: Sequence[RayEngine] | None = None,
        *,
        ledger: str = DEFAULT_LEDGER_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        connect: Literal["lazy", "eager"] = "lazy",
        client_options: Mapping[str, Any] | None = None,
        worker_options: Mapping[str, Any] | None = None,
        on_dead: Callable[[str], None] | None = exit_process,
    ) -> None:
        if connect not in ("lazy", "eager"):
            raise InvalidInput(INVALID_INPUT, f"connect must be 'lazy' or 'eager', not {connect!r}")
        options = dict(worker_options or {})
        for fixed in ("incarnation", "deregister_on_exit"):
            if fixed in options:
                raise InvalidInput(
                    INVALID_INPUT, f"worker_options may not set {fixed}: a RayRollout sets it"
                )
        self.owner = owner
        self._factory = lambda: _serve(
            owner,
            None if engines is None else tuple(engines),
            ledger,
            namespace,
            dict(client_options or {}),
            options,
        )
        self._on_dead = on_dead
        self._host: PortalHost[RolloutWorker] | None = None
        self._opening: anyio.Lock | None = None
        self._closed = False
        if connect == "eager":
            self._host = self._start()

    def _start(self) -> PortalHost[RolloutWorker]:
        return PortalHost(self._factory, name=f"rollout worker {self.owner}", on_dead=self._on_dead)

    # --- the connection ----------------------------------------------------------------------

    async def open(self) -> RolloutWorker:
        """Connect (register a new incarnation) unless already connected; every method calls
        it. Concurrent first calls share one connection. Raises ``LEDGER_CLOSED`` after
        :meth:`close`, and to a call whose connection a :meth:`close` overtook (that close
        ends the connection once it is made)."""
        self._check_open()
        if self._host is None:
            async with self._opening_lock():
                self._check_open()  # a close that came first must not be undone by connecting
                if self._host is None:
                    self._host = await anyio.to_thread.run_sync(self._start)
            self._check_open()  # closed while connecting: the close ends it, nothing may use it
        return self._host.value

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(Code.LEDGER_CLOSED, f"rollout worker {self.owner} was closed")

    def _opening_lock(self) -> anyio.Lock:
        """The lock a lazy connect holds while it connects, and :meth:`close` takes before it
        reads whether there is a connection to end (made on the actor's loop, at first use)."""
        if self._opening is None:
            self._opening = anyio.Lock()
        return self._opening

    @property
    def connected(self) -> bool:
        return self._host is not None and not self._closed

    @property
    def incarnation(self) -> str | None:
        """This life's incarnation token (None until connected)."""
        return None if self._host is None else self._host.value.incarnation

    async def close(self) -> Deregistered | None:
        """The clean exit: wait for the releases under way, deregister (the sessions still
        bound are released, cause ``owner_exited``), stop the client. Idempotent. Returns the
        deregistration (None if it never connected, or the ledger could not be reached: then
        the lease expires as for a crash).

        A close during a lazy connect waits for the connect to finish, then ends it: the
        connect runs in a worker thread and cannot be stopped halfway, and a close that
        returned before it finished would leave its owner registered, renewing and binding
        with nothing left to end it."""
        if self._closed:
            return None
        self._closed = True
        async with self._opening_lock():
            host = self._host
        if host is None:
            return None
        worker = host.value
        await anyio.to_thread.run_sync(host.close)
        return worker.deregistered

    # --- calls, run on the worker's loop -----------------------------------------------------

    async def run(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await fn(worker, *args)`` on the worker's loop (for anything the methods below do
        not cover: ``bind_many``, ``close_many``, a session's ``turn``)."""
        worker = await self.open()
        assert self._host is not None
        return await self._host.call(fn, worker, *args)

    async def generate(
        self,
        session_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        turn: int | None = None,
        request_id: str | None = None,
    ) -> Served:
        """One turn of ``session_id`` (bound on its first turn, pinned after), as
        :meth:`SessionBinder.generate`."""
        return await self.run(_generate, session_id, prompt, params, turn, request_id)

    async def bind(self, session_id: str) -> Bound:
        """The session's binding (binding it now if it has none yet)."""
        return await self.run(_bind, session_id)

    async def close_session(self, session_id: str, *, cancel: bool = False) -> Released:
        """End ``session_id``: wait for (``cancel``: cancel) its turns, then release it."""
        return await self.run(_close_session, session_id, cancel)

    async def close_sessions(
        self, session_ids: Sequence[str], *, cancel: bool = False
    ) -> list[Released | LoraLedgerError]:
        """End a group in one ledger round trip; refusals come back in place."""
        return await self.run(_close_sessions, list(session_ids), cancel)


async def _generate(
    worker: RolloutWorker,
    session_id: str,
    prompt: str | Sequence[int],
    params: SamplingParams | None,
    turn: int | None,
    request_id: str | None,
) -> Served:
    return await worker.session(session_id).generate(
        prompt, params, turn=turn, request_id=request_id
    )


async def _bind(worker: RolloutWorker, session_id: str) -> Bound:
    return await worker.session(session_id).bind()


async def _close_session(worker: RolloutWorker, session_id: str, cancel: bool) -> Released:
    return await worker.session(session_id).close(cancel=cancel)


async def _close_sessions(
    worker: RolloutWorker, session_ids: list[str], cancel: bool
) -> list[Released | LoraLedgerError]:
    return await worker.close_many([worker.session(s) for s in session_ids], cancel=cancel)
